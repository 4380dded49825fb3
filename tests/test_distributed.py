"""FSDP2 across processes (gloo on CPU, under torchrun) against one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "distributed" / "fsdp_step.py"
pytestmark = pytest.mark.multiprocess


def _run(args: list[str], timeout: int = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_two_process_fsdp2_update_equals_one_process(family, tmp_path):
    from safetensors.torch import load_file

    single, sharded = tmp_path / "single.safetensors", tmp_path / "sharded.safetensors"
    _run([sys.executable, str(SCRIPT), family, str(single)])
    _run(_torchrun(2, str(SCRIPT), family, str(sharded)))
    a, b = load_file(str(single)), load_file(str(sharded))
    assert a.keys() == b.keys()
    grads = [k for k in a if k.startswith("grad.")]
    assert grads, "no gradients recorded"
    for name in grads:
        scale = a[name].abs().max().item() + 1e-12
        gap = (a[name] - b[name]).abs().max().item()
        assert gap <= 1e-5 * max(1.0, scale) + 1e-7, f"{name}: gradients differ by {gap} (scale {scale})"
    # One AdamW step of lr 1e-2 moves each weight by about 1e-2; Adam's normalization
    # magnifies the last-bit differences of near-zero gradients, so weights get a bound
    # of a few percent of one step for the worst element and far less on average.
    weights = [k for k in a if not k.startswith("grad.")]
    worst = max((a[k] - b[k]).abs().max().item() for k in weights)
    mean = sum((a[k] - b[k]).abs().sum().item() for k in weights) / sum(a[k].numel() for k in weights)
    assert worst < 5e-4, f"FSDP2 update differs from one process by up to {worst}"
    assert mean < 1e-6, f"FSDP2 update differs from one process by {mean} on average"


def test_two_process_training_run(tmp_path):
    out = tmp_path / "run"
    _run(_torchrun(
        2, "-m", "mmrl.cli", "train", str(REPO / "recipes" / "tiny_vlm_count.yaml"),
        "trainer.steps=2", f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_every=0",
        "data.eval=synthetic:count_shapes?n=8&seed=1", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "trainer.threads=1", "trainer.save_every=2",
    ), timeout=600)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # two steps and the final summary
    assert (out / "checkpoints" / "step_000002" / "actor" / "model.safetensors").is_file()
    assert (out / "final" / "model.safetensors").is_file()
