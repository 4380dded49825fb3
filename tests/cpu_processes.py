"""Running the tests' CPU subprocesses, plain or under torchrun (gloo).

    run(torchrun(2, "-m", "mmrl.cli", "train", RECIPE, ...), timeout=300)

Each process gets one thread, no GPUs (so the processes use gloo on CPU even on a GPU
machine with fewer GPUs than processes) and this interpreter's import path, plugins and
test scripts written to tmp folders included.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, *args) -> list[str]:
    """The torchrun command line for `nproc` processes on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *map(str, args)]


def environment() -> dict[str, str]:
    """The environment of the tests' CPU subprocesses."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(REPO), *(p for p in sys.path if p)])}


def run(command: list[str], timeout: int = 300) -> None:
    """Run `command` from the repository root; fail the test with its stderr tail."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment())
    assert result.returncode == 0, result.stderr[-3000:]
