"""Time the agent demo (recipes/agent_zoom_count.yaml) against itself with the tool disabled.

    .venv/bin/python bench/agent_zoom_count.py [--repeats 3] [--disabled-repeats 1] \
        [--out bench/results/agent_zoom_count.json] [key=value ...]

Each repeat runs `mmrl train recipes/agent_zoom_count.yaml trainer.seed=S` in a fresh
process (start-up included in the wall time), with the recipe's own stop rule (validation
accuracy at `trainer.target_accuracy`, or `trainer.time_budget_s`); the control runs the
same command with `rollout.env_options.max_calls=0`. Per run it records the seconds and
steps until validation accuracy first reached 0.9, the final held-out (eval) accuracy,
and the tool-call rate (`agent/samples_calling_tools`) at the start, at the first
validation >= 0.9 and at the end. The machine is shared: the load average before and
after each run goes into the JSON. Prints a table and writes JSON with medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmrl.platform_info import write_report

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/agent_zoom_count.yaml"
GOAL = 0.9


def _rate(records: list[dict], first: int, last: int) -> float:
    window = [r["agent/samples_calling_tools"] for r in records if first <= r["step"] <= last
              and "agent/samples_calling_tools" in r]
    return round(sum(window) / max(len(window), 1), 3)


def run(seed: int, tool: bool, extra: list[str]) -> dict:
    overrides = [f"trainer.seed={seed}", "trainer.progress=false", "trainer.export=false", *extra]
    if not tool:
        overrides.append("rollout.env_options.max_calls=0")
    with tempfile.TemporaryDirectory() as out:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "mmrl.cli", "train", RECIPE, f"trainer.output_dir={out}", *overrides],
                       cwd=REPO, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    final = records[-1]
    elapsed, reached = 0.0, None
    for r in steps:
        elapsed += r.get("time/step", 0.0)
        if r.get("validation/accuracy", 0.0) >= GOAL:
            reached = {"step": r["step"], "train_seconds": round(elapsed, 1)}
            break
    last = steps[-1]["step"] if steps else 0
    return {
        "seed": seed, "tool": tool, "wall_s": round(wall, 1), "steps": final.get("steps"),
        "train_seconds": final.get("train_seconds"), "eval_accuracy": final.get("eval/accuracy"),
        "majority_baseline": final.get("eval/majority_baseline"),
        "validation": [(r["step"], r["validation/accuracy"]) for r in steps if "validation/accuracy" in r],
        "reached_goal": reached,
        "tool_call_rate": {"steps_1_10": _rate(steps, 1, 10),
                           "at_goal": _rate(steps, reached["step"] - 9, reached["step"]) if reached else None,
                           "last_10": _rate(steps, last - 9, last)},
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disabled-repeats", type=int, default=1)
    parser.add_argument("--out", default="bench/results/agent_zoom_count.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = parser.parse_args()
    runs = [run(seed, True, args.overrides) for seed in range(args.repeats)]
    runs += [run(seed, False, args.overrides) for seed in range(args.disabled_repeats)]
    with_tool = [r for r in runs if r["tool"]]
    seconds = [r["reached_goal"]["train_seconds"] if r["reached_goal"] else float("inf") for r in with_tool]
    summary = {
        "median_train_seconds_to_0.9": statistics.median(seconds),
        "runs_reaching_0.9": sum(r["reached_goal"] is not None for r in with_tool),
        "median_eval_accuracy_tool": statistics.median(r["eval_accuracy"] for r in with_tool),
        "median_eval_accuracy_tool_disabled": statistics.median(
            [r["eval_accuracy"] for r in runs if not r["tool"]] or [float("nan")]),
    }
    result = {"recipe": RECIPE, "overrides": args.overrides, "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
              "summary": summary, "runs": runs}
    write_report(args.out, result)
    print(f"{'seed':>4} {'tool':>5} {'to 0.9 (s)':>10} {'steps':>6} {'eval':>5} {'calls start/goal/end':>22} {'load':>11}")
    for r in runs:
        goal = r["reached_goal"]["train_seconds"] if r["reached_goal"] else "-"
        rates = "/".join(str(r["tool_call_rate"][k]) for k in ("steps_1_10", "at_goal", "last_10"))
        print(f"{r['seed']:>4} {str(r['tool']):>5} {goal!s:>10} {r['steps']!s:>6} {r['eval_accuracy']!s:>5} "
              f"{rates:>22} {r['load_average_1min']!s:>11}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
