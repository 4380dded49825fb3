"""`mmrl buffer show RUN`: what a run's trajectory buffer holds, by weights version.

    mmrl buffer show runs/tiny_vlm_count

One row per weights version that sampled trajectories (per range of versions when there
are more than 25): batches and trajectories, how many were trained on, dropped for being
too stale or still waiting, the staleness they were trained at, and their rewards; with
partial rollouts, the samples still generating after the last batch.
`summarize` gives the same figures as data.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from mmrl.buffer.schedule import BUFFER_FOLDER
from mmrl.buffer.store import BufferError, batch_name, read_batch, read_in_flight, read_state


def summarize(run: Path, rows: int = 25) -> dict[str, Any]:
    """The buffer of run folder `run` as figures: totals and one entry per weights version,
    or per range of consecutive versions where there are more than `rows` of them."""
    run = Path(run)
    folder = run / BUFFER_FOLDER
    if not folder.is_dir():
        problem = "is not a folder" if run.exists() and not run.is_dir() else (
            "does not exist" if not run.exists() else f"has no {BUFFER_FOLDER}/ (a run from before the buffer, or "
            "one that stopped before its first step)")
        raise BufferError(f"{run}: {problem}")
    state = read_state(folder)
    fates = {entry["batch"]: entry for entry in state.get("log", [])}
    files = sorted(p for p in folder.glob("batch_*.parquet") if batch_name(p) is not None)
    batches = []
    for path in files:
        table, metadata = read_batch(path)
        batches.append((metadata["version"], metadata["batch"], table.column("reward").to_pylist()))
    versions = [version for version, _, _ in batches]
    first = min(versions, default=0)
    width = max(1, -(-(max(versions, default=0) - first + 1) // rows))
    groups: dict[int, dict[str, Any]] = defaultdict(lambda: {"batches": set(), "trajectories": 0, "trained": 0,
                                                              "dropped": 0, "waiting": 0, "staleness": [],
                                                              "rewards": []})
    for version, number, rewards in batches:
        entry = groups[(version - first) // width]
        entry["batches"].add(number)
        entry["trajectories"] += len(rewards)
        entry["rewards"].extend(rewards)
        fate = fates.get(number)
        if fate is None:
            entry["waiting"] += len(rewards)
        elif fate["dropped"]:
            entry["dropped"] += len(rewards)
        else:
            entry["trained"] += len(rewards)
            entry["staleness"].extend([fate["staleness"]] * len(rewards))
    out = []
    for group in sorted(groups):
        entry = groups[group]
        low = first + group * width
        high = min(low + width - 1, max(versions))  # the last group ends at the last version
        rewards, staleness = entry["rewards"], entry["staleness"]
        out.append({"version": str(low) if high == low else f"{low}-{high}",
                    "batches": len(entry["batches"]), "trajectories": entry["trajectories"],
                    "trained": entry["trained"], "dropped": entry["dropped"], "waiting": entry["waiting"],
                    "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
                    "staleness_max": max(staleness) if staleness else None,
                    "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                    "reward_max": max(rewards) if rewards else None})
    totals = {key: sum(r[key] for r in out) for key in ("trajectories", "trained", "dropped", "waiting")}
    produced = state.get("produced", 0)
    in_flight = None
    # Partial rollouts: the groups in flight after the last batch (one rank's file: rank 0's).
    path = next(iter(sorted(folder.glob(f"in_flight_{produced:06d}*.parquet"))), None)
    if path is not None:
        groups = read_in_flight(path)
        in_flight = {"groups": len(groups),
                     "generating": sum(r.finish is None for g in groups for r in g.responses),
                     "tokens": sum(len(r.tokens) for g in groups for r in g.responses)}
    return {"run": str(run), "files": len(files), "produced": produced,
            "taken": state.get("taken", 0), **totals, "versions": out, "in_flight": in_flight}


def render(summary: dict[str, Any]):
    """The summary as rich renderables: a headline and the table by version."""
    from rich.table import Table
    from rich.text import Text

    def number(value, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    head = Text(f"{summary['run']}: {summary['files']} batch files, {summary['trajectories']} trajectories; "
                f"trained {summary['trained']}, waiting {summary['waiting']}, dropped as too stale "
                f"{summary['dropped']}" + ("" if not summary.get("in_flight") else
                                           "; in flight (partial rollouts): {groups} prompts, {generating} responses "
                                           "still generating, {tokens} tokens".format(**summary["in_flight"])))
    table = Table(title="trajectories by the weights version that sampled them")
    for name in ("version", "batches", "trajectories", "trained", "waiting", "dropped", "staleness mean/max",
                 "reward mean/max"):
        # Folded, never cut short: a narrow or piped console (80 columns) wraps a value within its cell.
        table.add_column(name, justify="right", overflow="fold")
    for row in summary["versions"]:
        staleness = "-" if row["staleness_max"] is None else f"{number(row['staleness_mean'])}/{row['staleness_max']}"
        reward = "-" if row["reward_mean"] is None else \
            f"{number(row['reward_mean'], 3)}/{number(row['reward_max'], 3)}"
        table.add_row(row["version"], str(row["batches"]), str(row["trajectories"]), str(row["trained"]),
                      str(row["waiting"]), str(row["dropped"]), staleness, reward)
    return head, table
