"""The summary file of one bench/decode_ab.sh call at the VL-3B shape (decode_ab_*_gpu.json,
the README's 50-step rows through bench/gpu_targets.py) from that call's raw run files.

    python bench/decode_ab_summary.py $OUT/decode_graphs_vl3b.json $OUT/decode_lazypool_vl3b.json \
        --command 'MODES="graphs lazypool" SHAPE=vl3b bash bench/decode_ab.sh' --main-at cd23974 \
        --shape "vl3b VLM (compile workers A/B)" --note "..." --out bench/results/decode_ab_vl3b_pool_gpu.json

Each run's whole 50 steps against TRL's logged 12.4 s a step (issue 28's measurement on the
same checkpoint and rows), its first step split into its phases, its slow steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmrl.platform_info import write_report  # noqa: E402

TRL_STEP_S = 12.4
TRL_SOURCE = ("issue 28's measurement of TRL 1.16 on the same VL-3B-shaped checkpoint and rows (12.4 s a step); "
              "TRL was not re-run in this call (50 steps would take ~620 s)")
TARGET = 4.5
FIRST_STEP_PHASES = ("step_s", "rollout_s", "logprob_s", "update_s", "sync_s", "media_check_s",
                     "media_check_rollout_s", "media_check_training_s", "compile_s")


def run_summary(run: dict, fresh: bool) -> dict:
    steps = run["per_step"]
    median = statistics.median(step["step_s"] for step in steps[1:]) if len(steps) > 1 else steps[0]["step_s"]
    return {
        "whole_run_s": run["whole_run_s"],
        "first_step_s": round(run["first_step_s"], 2),
        "compile_or_record_s": run["compile_total_s"],
        "graphs": run["compile_graphs_total"],
        "median_step_s": round(median, 3),
        "tokens_per_s": round(run.get("tokens_per_s", 0)),
        "vs_trl_50_steps_estimate": round(50 * TRL_STEP_S / run["whole_run_s"], 2),
        "fresh_machine": fresh,
        "steps_done": run["steps_done"],
        "slow_steps": [[i + 1, round(step["step_s"], 2)] for i, step in enumerate(steps)
                       if step["step_s"] > 1.5 * median],
        "first_step_split_s": {key: round(steps[0][key], 2) for key in FIRST_STEP_PHASES if key in steps[0]},
        "median_split_s": {key: round(statistics.median(step[key] for step in steps[1:]), 3)
                           for key in ("rollout_s", "update_s") if len(steps) > 1},
        "gc_s_per_step": [[i + 1, round(step.get("gc_s", 0.0), 3), step.get("gc_full", 0)]
                          for i, step in enumerate(steps) if step.get("gc_s", 0.0) > 0.05],
        "peak_allocated_gib": run.get("peak_allocated_gib"),
        "alloc_retries": run.get("alloc_retries"),
        "startup_s": run.get("startup_s"),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="+", help="decode_<mode>_vl3b.json files of one call, in the call's order")
    parser.add_argument("--command", required=True)
    parser.add_argument("--main-at", required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--note", default="")
    parser.add_argument("--warm", nargs="*", default=[], help="run names on a warm compile cache (not fresh)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    summary = {}
    for path in args.raw:
        (name, run), = json.loads(Path(path).read_text())["runs"].items()
        summary[name] = run_summary(run, fresh=name not in args.warm)
    report = {"command": args.command, "date": datetime.date.today().isoformat(), "main_at": args.main_at,
              "shape": args.shape, "trl_step_s": TRL_STEP_S, "trl_step_source": TRL_SOURCE,
              "target_vs_trl": TARGET, "note": args.note, "summary": summary}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
