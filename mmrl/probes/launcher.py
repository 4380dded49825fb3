"""Both ends of a torchrun probe: the parent launches a probe script once for all its
subjects and reads one JSON record per subject back; the script's processes run the
same loop (reference in one process on rank 0, then the update over all ranks).

Parent side (the fsdp2, sequence_parallel and multi_turn probes):

    torchrun_many("mmrl.probes.fsdp_step", subjects, "reason a passing record gets")

Worker side (a probe script's `if __name__ == "__main__"` block; the script is run as
`python -m torch.distributed.run --standalone --nproc_per_node 2 -m MODULE OUT.jsonl SPECS`):

    run_worker(update, compare)

A record is {source, passed, reason, evidence, seconds, not_run}. A subject that crashes
or hangs the launch is blamed and the rest run again in a fresh launch.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmrl.parallel import Dist, init_distributed
from mmrl.parallel.mesh import backend, exit_cleanly
from mmrl.probes.base import CheckFailed, NotRunHere, Subject, Verified, missing_package, one_line

PROCESSES = 2
TIMEOUT_BASE_S = 120  # start-up of two interpreters importing torch and transformers
TIMEOUT_PER_SUBJECT_S = 90


def single_process(device: str) -> Dist:
    """The Dist of a one-process run on `device`: the probes' unsharded side."""
    return Dist(rank=0, world_size=1, local_rank=0, device=torch.device(device), mesh=None)


def exact_numerics() -> None:
    """No TF32 in GPU matmuls and convolutions: a sharded step splits the batch, and TF32's
    10-bit mantissa would make that visible far above the fp32 bounds."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# -- parent ------------------------------------------------------------------------------
def require_processes(device: str, processes: int = PROCESSES) -> None:
    """Raise NotRunHere where `processes` torchrun processes cannot run on `device`."""
    if not torch.distributed.is_available():
        raise NotRunHere("torch.distributed is not available in this torch build")
    if device.startswith("cuda") and torch.cuda.device_count() < processes:
        raise NotRunHere(f"needs {processes} GPUs, found {torch.cuda.device_count()}")


def launch(module: str, subjects: list[Subject], out: Path, timeout: float, processes: int) -> tuple[int | None, str]:
    """Run `module` under torchrun; (exit code or None on timeout, last stderr line)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           # The subprocesses import what this process can: plugin modules included.
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", module, str(out), json.dumps([s.spec() for s in subjects])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    return done.returncode, crash_line(done.stderr)


def crash_line(stderr: str) -> str:
    """The line of a failed launch's stderr that says why: the first exception a rank
    raised (`[rank1]: RuntimeError: ...`), not torchrun's own summary (a ChildFailedError
    and its "To enable traceback see ...errors.html"), else the last line naming an error."""
    lines = [line.strip() for line in stderr.splitlines()]
    raised = [line for line in lines if re.search(r"\w(Error|Exception): \S", line) and "ChildFailedError" not in line]
    errors = [line for line in lines if "error" in line.lower()]
    return (raised[0] if raised else errors[-1] if errors else (lines or [""])[-1])[:300]


def torchrun_many(
    module: str, subjects: list[Subject], verified: str, *, processes: int = PROCESSES,
    timeout_base_s: float = TIMEOUT_BASE_S, timeout_per_subject_s: float = TIMEOUT_PER_SUBJECT_S,
) -> list[tuple[Verified | BaseException, float]]:
    """Run a torchrun probe script (`module OUT.jsonl SPECS`, one record per subject) over
    all `subjects` in one launch; a subject that crashes or hangs the launch is blamed
    and the rest run again. `verified` is the reason a passing record gets."""
    results: dict[str, tuple[Verified | BaseException, float]] = {}
    remaining = list(subjects)
    retried = False
    while remaining:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "records.jsonl"
            start = time.perf_counter()
            timeout = timeout_base_s + timeout_per_subject_s * len(remaining)
            code, last_error = launch(module, remaining, out, timeout, processes)
            elapsed = time.perf_counter() - start
            records = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
        for record in records:
            if record["passed"]:
                outcome = Verified(verified, record["evidence"])
            elif record.get("not_run"):
                outcome = NotRunHere(record["not_run"])
            else:
                outcome = CheckFailed(record["reason"])
            results[record["source"]] = (outcome, record["seconds"])
        done = {r["source"] for r in records}
        remaining = [s for s in remaining if s.source not in done]
        if code == 0 or not remaining:
            break
        if not records and not retried:
            retried = True  # a launch that produced nothing (e.g. rendezvous trouble): once more
            continue
        blamed = remaining.pop(0)  # the subject in progress when the launch died
        results[blamed.source] = (CheckFailed(f"torchrun failed (exit {code}): {last_error}"), elapsed)
    return [results.get(s.source, (CheckFailed("no result from torchrun"), 0.0)) for s in subjects]


# -- worker ------------------------------------------------------------------------------
def drive(out: str, specs: list[dict], update, compare, *, sequence_parallel: bool = False, precheck=None) -> None:
    """The loop of a torchrun probe script: for each subject, rank 0 runs
    `update(subject, one_process)` as the reference, then every rank runs
    `update(subject, dist)`, and rank 0 appends a JSON record with `compare(reference,
    result)` -> (failure or None, evidence). `precheck(subject)` may raise first."""
    torch.set_num_threads(1)
    device = specs[0].get("device", "cpu") if specs else "cpu"
    exact_numerics()
    if not torch.distributed.is_initialized():
        # A short timeout: a rank that fails alone must not leave the other waiting for
        # the default half hour; the probe then blames the subject in progress.
        torch.distributed.init_process_group(backend=backend(device), timeout=datetime.timedelta(seconds=120))
    world = torch.distributed.get_world_size()
    dist = init_distributed(device, sequence_parallel=world) if sequence_parallel else init_distributed(device)
    alone = Dist(rank=0, world_size=1, local_rank=dist.local_rank, device=dist.device, mesh=None)
    for spec in specs:
        start = time.perf_counter()
        record: dict = {"source": spec["source"], "passed": False, "evidence": {}}
        reference = error = None
        try:
            subject = Subject.from_spec(spec)
            if precheck is not None:
                precheck(subject)
            if dist.is_main:
                reference = update(subject, alone)
        except Exception as exc:  # noqa: BLE001 - recorded, the next subject still runs
            error = one_line(exc)
            record["not_run"] = missing_package(exc)
        # Rank 0 alone ran the reference: every rank learns whether to go on.
        error = dist.all_gather_objects(error)[0]
        if error is None:
            try:
                result = update(subject, dist)
                if dist.is_main:
                    error, record["evidence"] = compare(reference, result)
                    record["passed"] = error is None
            except Exception as exc:  # noqa: BLE001
                error = one_line(exc)
            # Rank 0 reports the first error of any rank.
            error = next((e for e in dist.all_gather_objects(error) if e), None)
            record["passed"] = record["passed"] and error is None
        record["reason"] = error
        record["seconds"] = round(time.perf_counter() - start, 3)
        if dist.is_main:
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
        dist.barrier()
    torch.distributed.destroy_process_group()


def run_worker(update, compare, *, sequence_parallel: bool = False, precheck=None) -> None:
    """The main of every torchrun probe script: `drive` over the command line's OUT.jsonl
    and subject specs, then `exit_cleanly`."""
    drive(sys.argv[1], json.loads(sys.argv[2]), update, compare, sequence_parallel=sequence_parallel,
          precheck=precheck)
    exit_cleanly()
