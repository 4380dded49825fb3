"""Families that `mmrl add-model` scaffolds out of tree, one fresh process per type: what the
benches over scaffolded types share (bench/vllm_scaffolded.py, bench/hybrid_pack_gpu.py).

    with scaffolded("lfm2", "mmrl-hybrid-pack") as (adapter, row):   # in the child
        if adapter is None:                     # it did not scaffold or load: row says why
            return
        row.update(...)                         # printed when the block ends
    row = run_child(script, "lfm2", timeout)    # in the parent: the child's JSON row, or why none came

A child runs `script --child TYPE ...` and prints its row as one JSON line starting with
`{"model_type"` (`print_row`); a child that crashes or runs past its time limit still
gives a row (stage `crash` or `timeout`, with the last stage the child announced through
`say_stage`), so one type never ends the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SCAFFOLD_TIMEOUT_S = 300
STAGE = "stage: "  # how a child's progress lines start (`say_stage`)


class ScaffoldFailed(Exception):
    """The type did not scaffold (stage `scaffold`) or its adapter did not load (`load`)."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage
        self.reason = reason


def scaffold_family(model_type: str, out: str | Path):
    """`mmrl add-model TYPE --out OUT --no-verify` (the CLI, in its own process), then the
    written plugin imported and its adapter returned. Raises ScaffoldFailed."""
    out = Path(out)
    scaffold = subprocess.run(
        [sys.executable, "-m", "mmrl.cli", "add-model", model_type, f"--out={out}", "--no-verify"],
        capture_output=True, text=True, cwd=out, timeout=SCAFFOLD_TIMEOUT_S)
    if scaffold.returncode != 0:
        lines = (scaffold.stderr or scaffold.stdout).strip().splitlines() or ["(no output)"]
        raise ScaffoldFailed("scaffold", lines[-1][:300])
    sys.path.insert(0, str(out))
    try:
        from mmrl.registry import get_adapter, load_plugin

        package = next(p.name for p in out.iterdir() if p.name.startswith("mmrl_"))
        module = next(p.stem for p in (out / package).glob("*.py") if p.stem != "__init__")
        load_plugin(f"{package}.{module}")
        return get_adapter(model_type)
    except Exception as exc:  # noqa: BLE001 - reported as the row's outcome
        raise ScaffoldFailed("load", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]) from exc


@contextlib.contextmanager
def scaffolded(model_type: str, prefix: str) -> Iterator[tuple[object | None, dict]]:
    """A child's frame: `model_type` scaffolded (`scaffold_family`, hub offline) into a temporary
    directory `prefix-TYPE-*` that lives while the block runs; yields (adapter, row). Where it
    did not scaffold or load, the adapter is None and the row already says why (status
    failed, stage scaffold or load); else the row has `scaffold_seconds`. The row is printed
    (`print_row`) when the block ends or returns; an exception in the block prints nothing
    and goes on up (the parent's `run_child` makes it a `crash` row)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    row: dict = {"model_type": model_type}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{prefix}-{model_type}-") as out:
        say_stage("scaffold")
        try:
            adapter = scaffold_family(model_type, out)
        except ScaffoldFailed as exc:
            adapter = None
            row.update(status="failed", stage=exc.stage, reason=exc.reason)
        else:
            row["scaffold_seconds"] = round(time.perf_counter() - start, 1)
        yield adapter, row
    print_row(row)


def say_stage(text: str) -> None:
    """A child's progress on stderr: where a child that runs past its limit was (`run_child`)."""
    print(f"{STAGE}{text}", file=sys.stderr, flush=True)


def print_row(row: dict) -> None:
    """A child's result, as the line `run_child` reads."""
    print(json.dumps({"model_type": row["model_type"], **row}), flush=True)


def run_child(script: str | Path, model_type: str, timeout: float, args: tuple[str, ...] = (),
              env: dict | None = None, cwd: str | Path | None = None) -> dict:
    """Run `script --child TYPE *args` under a time limit; its row with `seconds` added."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(script), "--child", model_type, *args], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        last = [line for line in said.splitlines() if line.startswith(STAGE)]
        return {"model_type": model_type, "status": "failed", "stage": "timeout",
                "reason": f"no result within {timeout:.0f}s" + (f" ({last[-1]})" if last else ""),
                "seconds": round(time.perf_counter() - start, 1)}
    rows = [line for line in proc.stdout.splitlines() if line.startswith('{"model_type"')]
    if rows:
        row = json.loads(rows[-1])
    else:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        row = {"model_type": model_type, "status": "failed", "stage": "crash",
               "reason": f"exit {proc.returncode}: {tail[:300]}"}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row
