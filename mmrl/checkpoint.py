"""A trainer's checkpoints (the exported policy: `mmrl.export`).

    save_checkpoint(path, dist, engines, {"step": 3, "data_position": [0, 12]})
    found = load_checkpoint(output_dir / "checkpoints", dist, engines)  # (path, state) or None

A checkpoint holds each engine's state under its name (`actor`, `critic`: weights,
optimizer, schedule; a LoRA run on a base checkpoint saves its trainable weights only),
the trainer's state (`STATE_FILE`: step, data position) and every rank's RNG state;
`mmrl export` turns one into a HF folder (`mmrl.export`). It is written aside and renamed into place whole (`mmrl.runs`), so an
interrupted save never leaves a checkpoint that loading would take; loading takes the
newest one whose manifest verifies and names the newer ones it skipped.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from mmrl.runs import begin_checkpoint, commit_checkpoint, newest_checkpoint, prune_checkpoints, temporary_for

STATE_FILE = "trainer_state.json"


def save_checkpoint(path: Path, dist, engines: dict[str, Any], state: dict[str, Any],
                    keep: int | None = None) -> Path:
    """Every rank calls it: the engines' states (name -> engine, None skipped), `state`
    (written by the main rank) and this rank's RNG state, renamed into `path` whole; then,
    with `keep`, older checkpoints beyond the newest `keep` are removed."""
    temp = temporary_for(path)
    # Each write's failure (a full disk) reaches every rank: none waits for a rank that gave up.
    with dist.together():
        if dist.is_main:
            begin_checkpoint(path)
    try:
        for name, engine in engines.items():
            if engine is not None:
                engine.save_checkpoint(temp / name)
        with dist.together():
            torch.save(_rng_state_tensors(), temp / f"rng_rank{dist.rank}.pt")
            if dist.is_main:
                (temp / STATE_FILE).write_text(json.dumps(state))
        with dist.together():
            if dist.is_main:
                commit_checkpoint(temp, path)
                if keep is not None:
                    prune_checkpoints(path.parent, path, keep)
    except BaseException:
        # A write that failed (a full disk) leaves no half-written folder taking the space.
        if dist.is_main:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    return path


def load_checkpoint(root: Path, dist, engines: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint under `root` whose manifest verifies (newer broken ones are
    named with why they were skipped), loaded into the engines with this rank's RNG
    state: its path and trainer state, or None when there is none."""
    found = None
    if dist.is_main:
        path, skipped = newest_checkpoint(root)
        for bad, why in skipped:
            print(f"skipped checkpoint {bad}: {why}", flush=True)
        found = str(path) if path is not None else None
    found = dist.all_gather_objects(found)[0]
    if found is None:
        return None
    path = Path(found)
    state = json.loads((path / STATE_FILE).read_text())
    for name, engine in engines.items():
        if engine is not None:
            engine.load_checkpoint(path / name)
    rng_file = path / f"rng_rank{dist.rank}.pt"
    if rng_file.is_file():
        _set_rng_tensors(torch.load(rng_file, weights_only=True))
    return path, state


def record_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """Name `dtype` as the checkpoint's: sharded half-precision training holds fp32
    parameters (its masters), which `save_pretrained` records, though the weights written
    are `dtype`'s."""
    name = str(dtype).removeprefix("torch.")

    def rename(values: dict) -> None:
        for key, value in values.items():
            if key in ("dtype", "torch_dtype") and value == "float32":
                values[key] = name
            elif isinstance(value, dict):
                rename(value)

    config = json.loads(config_file.read_text())
    rename(config)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _rng_state_tensors() -> dict[str, torch.Tensor]:
    py = random.getstate()
    return {"torch": torch.get_rng_state(), "python": torch.tensor(py[1], dtype=torch.int64),
            "python_pos": torch.tensor([py[0], py[2] if py[2] is not None else -1], dtype=torch.float64)}


def _set_rng_tensors(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    version, gauss = state["python_pos"].tolist()
    random.setstate((int(version), tuple(int(x) for x in state["python"].tolist()), None if gauss == -1 else gauss))
