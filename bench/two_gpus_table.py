"""The closing table of bench/two_gpus.sh: one row per part, read from the JSON each part
left in the folder (issue 34's figure, its target, met or not); a part without its JSON
reads "no result" (its log in the same folder says why). Parts named after the folder
limit the table to them (the parts of one device call).

    python bench/two_gpus_table.py $OUT [PART ...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def _read(folder: Path, name: str) -> dict | None:
    path = folder / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows(folder: Path) -> list[tuple[str, str, str, str]]:
    """(part, measured, target, status) per part of bench/two_gpus.sh."""
    def row(part, name, measure, target, met):
        report = _read(folder, name)
        if report is None:
            return part, "no result", target, "-"
        try:
            return part, measure(report), target, ("met" if met(report) else "missed")
        except (KeyError, TypeError, ZeroDivisionError) as error:
            return part, f"unreadable ({type(error).__name__}: {error})", target, "-"

    def cells(_):
        results = _read(folder, "cells/results.json")
        if results is None:
            return "cells", "no result", "all verified", "-"
        count = Counter(c["status"] for c in results["cells"] if c["feature"] in ("fsdp2", "sequence_parallel"))
        summary = ", ".join(f"{n} {status}" for status, n in sorted(count.items())) or "no cell"
        return "cells", summary, "all verified", "met" if count and set(count) <= {"verified", "not applicable"} \
            else "missed"

    ulysses_target = "1 GPU out of memory, 2 GPUs train"
    return [
        row("scaling", "fsdp_scaling_gpu.json", lambda r: f"efficiency {r['efficiency']:.2f}", ">= 0.85",
            lambda r: r["efficiency"] >= 0.85),
        row("recipe", "recipe_scaling_vl3b_gpu.json", lambda r: f"efficiency {r['efficiency']:.2f}", ">= 0.85",
            lambda r: r["efficiency"] >= 0.85),
        row("ulysses", "ulysses_long_sample_gpu.json",
            lambda r: f"{r['images']} images: 1 rank {'fits' if r['runs']['1']['fits'] else 'OOM'}, "
                      f"2 ranks {'fit' if r['runs']['2']['fits'] else 'OOM'}",
            ulysses_target, lambda r: r["trains_on_two_only"]),
        row("rollout", "sharded_rollout_gpu_x2.json", lambda r: f"compiled {r['speedup']:.2f}x plain", ">= 5x",
            lambda r: r["speedup"] >= 5.0),
        row("disagg", "disaggregated_vl3b_gpu.json",
            lambda r: f"{r['speedup']:.2f}x steps/s ({r['runs']['disaggregated']['steps_per_s']:.2f} vs "
                      f"{r['runs']['synchronous']['steps_per_s']:.2f})", "> 1x", lambda r: r["speedup"] > 1.0),
        row("learn", "disaggregated_learning_gpu.json",
            lambda r: (f"steps to {r['target_accuracy']}: {r['runs']['synchronous']['steps']} synchronous, "
                       f"{r['runs']['disaggregated']['steps']} disaggregated" if r["steps_ratio"] is not None
                       else f"target not reached by both ({r['reached_target']})"),
            "<= 1.25x the steps", lambda r: r["steps_ratio"] is not None and r["steps_ratio"] <= 1.25),
        cells(None),
    ]


def main(folder: str, parts: list[str]) -> None:
    table = [("part", "measured", "target", "status"), *(r for r in rows(Path(folder)) if not parts or r[0] in parts)]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for line in table:
        print("  ".join(value.ljust(width) for value, width in zip(line, widths)).rstrip())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".", sys.argv[2:])
