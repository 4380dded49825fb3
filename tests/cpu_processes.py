"""Running the tests' CPU subprocesses, plain or under torchrun (gloo), and what the
torchrun scripts that compare 2 ranks with one process share.

    run(torchrun(2, "-m", "mmrl.cli", "train", RECIPE, ...), timeout=300)

Each process gets one thread, no GPUs (so the processes use gloo on CPU even on a GPU
machine with fewer GPUs than processes) and this interpreter's import path, plugins and
test scripts written to tmp folders included.

A torchrun script (tests/ on its import path) checks a split forward against one process:

    rank, size = join_gloo_group()
    ids, mask = padded_rows()
    weights = token_weights(mask)
    reference, expected = one_process_reference(model, ids, mask, weights)
    ...  # the split forward and the backward of (its log-probs * weights).sum()
    gaps = summed_gradient_gaps(model, expected)
    leave_gloo_group(results, out)
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from mmrl.parallel.mesh import exit_cleanly

REPO = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, *args) -> list[str]:
    """The torchrun command line for `nproc` processes on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *map(str, args)]


def environment() -> dict[str, str]:
    """The environment of the tests' CPU subprocesses."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(REPO), *(p for p in sys.path if p)])}


# What a rank prints when the C++ runtime aborts it (SIGABRT) because a thread object was
# destroyed while still running: gloo's worker threads at interpreter teardown (torch
# issue 190489, pull request 179291). Seen once in CI on a 2-core machine (2026-12-04, a
# rank of test_two_process_fsdp2_bf16_update_equals_one_process), not in 4 reruns.
TEARDOWN_ABORT = "terminate called without an active exception"


def run(command: list[str], timeout: int = 300) -> None:
    """Run `command` from the repository root; fail the test with its stderr tail. A run
    whose only failure is a rank's teardown abort (`TEARDOWN_ABORT`) runs once more, with a
    warning; a second failure of any kind fails the test."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment())
    if result.returncode != 0 and TEARDOWN_ABORT in result.stderr and "Traceback" not in _rank_output(result.stderr):
        script = next((Path(part).name for part in command if str(part).endswith(".py")), command[0])
        warnings.warn(f"a rank aborted ({TEARDOWN_ABORT}); running {script} once more", stacklevel=2)
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment())
    assert result.returncode == 0, result.stderr[-3000:]


def _rank_output(stderr: str) -> str:
    """The ranks' own output in torchrun's stderr: without the launcher's report of the
    failure (which holds a traceback of its own)."""
    return stderr.split("Traceback (most recent call last):\n  File \"<frozen runpy>\"")[0]


# -- inside a torchrun script that compares the ranks with one process -----------------------------
def padded_rows(length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of token ids below 64 and their attention mask: an odd length (padded to
    split over 2 ranks), the second row left-padded by 3."""
    ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask


def token_weights(mask: torch.Tensor) -> torch.Tensor:
    """A random weight per real token: the loss, (log-probs * weights).sum(), whose
    gradients the ranks compare with one process's."""
    return torch.randn(*mask.shape, generator=torch.Generator().manual_seed(2)) * mask


def join_gloo_group() -> tuple[int, int]:
    """One torch thread and the torchrun group joined over gloo: (rank, world size)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def one_process_reference(model, ids, mask, weights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The token log-probs of one process's forward and each parameter's gradient of the
    weighted loss; the model's gradients are cleared for the split run."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    reference = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    (reference * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return reference, expected


def summed_gradient_gaps(model, expected: dict[str, torch.Tensor]) -> list[float]:
    """After the split backward: for each parameter with a gradient, the largest gap
    between its sum over the group (each rank holds a partial sum) and one process's."""
    gaps = []
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        grad = parameter.grad.clone()
        dist.all_reduce(grad)
        gaps.append((grad - expected[name]).abs().max().item())
    return gaps


def leave_gloo_group(results: dict, out: str) -> None:
    """Rank 0 writes `results` to `out` as JSON; every rank leaves the group and exits
    without interpreter teardown, where gloo's threads can abort a finished process
    (exit -6, `exit_cleanly`)."""
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()
    exit_cleanly()
