"""Time README's main job over several seeds and report medians.

    .venv/bin/python bench/tiny_vlm_recipe.py [--seeds 0 1 2] [--out bench/results/tiny_vlm_recipe.json]

Each seed runs `mmrl train recipes/tiny_vlm_count.yaml trainer.seed=S` in a fresh process
(start-up included in the wall time) and records the steps taken, the training seconds and
the three final figures. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmrl.platform_info import write_report

REPO = Path(__file__).resolve().parents[1]


def run_seed(seed: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "mmrl.cli", "train", "recipes/tiny_vlm_count.yaml", f"trainer.seed={seed}",
             f"trainer.output_dir={out}", "trainer.progress=false", "trainer.export=false"],
            cwd=REPO, check=True, capture_output=True, text=True,
        )
        wall = time.perf_counter() - start
        final = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])
    return {"seed": seed, "wall_s": round(wall, 1), **{k: final[k] for k in (
        "steps", "train_seconds", "eval/accuracy", "eval/majority_baseline", "eval/shuffled_images_accuracy")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tiny_vlm_recipe.json")
    args = parser.parse_args()
    runs = [run_seed(seed) for seed in args.seeds]
    summary = {
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "median_accuracy": statistics.median(r["eval/accuracy"] for r in runs),
        "max_shuffled_accuracy": max(r["eval/shuffled_images_accuracy"] for r in runs),
    }
    print(f"{'seed':>4} {'wall s':>7} {'steps':>6} {'acc':>6} {'majority':>9} {'shuffled':>9}")
    for r in runs:
        print(f"{r['seed']:>4} {r['wall_s']:>7} {r['steps']:>6} {r['eval/accuracy']:>6.3f} "
              f"{r['eval/majority_baseline']:>9.3f} {r['eval/shuffled_images_accuracy']:>9.3f}")
    print(summary)
    write_report(args.out, {"machine": platform.platform(), "processor": platform.processor(),
                            "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
