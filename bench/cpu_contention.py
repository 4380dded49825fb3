"""How the tiny recipe's training step slows down when the CPU is shared (issue 9), and what
OpenMP's wait policy and torch's thread count do about it.

    .venv/bin/python bench/cpu_contention.py [--busy 4] [--steps 8] [--variants default OMP_WAIT_POLICY=PASSIVE]
        [--out bench/results/cpu_contention.json]

For each variant of OpenMP's waiting (`default`: libgomp spins 300,000 times at every
barrier before it sleeps; `OMP_WAIT_POLICY=PASSIVE`: it sleeps at once; `GOMP_SPINCOUNT=N`:
N spins, then sleep; any `NAME=VALUE` list joined by commas) a fresh process builds the tiny recipe's
Trainer (`recipes/tiny_vlm_count.yaml`, no evaluation) and times `train_step()` with 2
threads and with 1 thread, in alternating blocks, first on the machine as it is and then
with `--busy` extra processes spinning in a Python loop. Prints the medians and writes
JSON. It is kept short (about two minutes) because the busy loops take CPU from everyone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mmrl.platform_info import write_report

REPO = Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True: pass"


def child(steps: int) -> None:
    """In a fresh process: median train_step seconds for 2 and 1 threads, as JSON."""
    import tempfile

    import torch

    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        recipe = load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [
            f"trainer.output_dir={out}", "trainer.progress=false", "trainer.export=false", "trainer.eval_every=0",
            "data.eval=null", "data.validation=null", "trainer.threads=2"])
        trainer = Trainer(recipe)
        times: dict[int, list[float]] = {2: [], 1: []}
        trainer.train_step()  # warm-up: first-call costs
        for block in range(steps // 2):
            for threads in (2, 1) if block % 2 == 0 else (1, 2):
                torch.set_num_threads(threads)
                for _ in range(2):
                    start = time.perf_counter()
                    trainer.train_step()
                    times[threads].append(time.perf_counter() - start)
        trainer.folder.release()
    print(json.dumps({str(t): round(statistics.median(v), 4) for t, v in times.items()}))


WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def variant_environment(variant: str) -> dict[str, str]:
    """`default` -> {}; `A=1,B=2` -> {"A": "1", "B": "2"}."""
    if variant == "default":
        return {}
    pairs = [item.split("=", 1) for item in variant.split(",")]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise SystemExit(f"cpu_contention.py: a variant is `default` or NAME=VALUE[,NAME=VALUE], got {variant!r}")
    return dict(pairs)


def measure(variant: str, busy: int, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_SETTINGS}
    env.update(variant_environment(variant))
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
    try:
        start = time.perf_counter()
        result = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps)], cwd=REPO, env=env,
                                capture_output=True, text=True, check=True)
        wall = time.perf_counter() - start
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    medians = json.loads(result.stdout.strip().splitlines()[-1])
    return {"variant": variant, "busy_processes": busy, "wall_s": round(wall, 1),
            "median_step_s": {"2_threads": medians["2"], "1_thread": medians["1"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=4, help="busy-loop processes competing for the CPU")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per thread count")
    parser.add_argument("--variants", nargs="+", default=["default", "OMP_WAIT_POLICY=PASSIVE"],
                        help="`default` or NAME=VALUE[,NAME=VALUE] environment settings, one process each")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu_contention.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps)
        return
    for variant in args.variants:  # a typo fails before any process starts
        variant_environment(variant)
    load_before = os.getloadavg()[0]
    rows = []
    for busy in (0, args.busy):
        for variant in args.variants:
            row = measure(variant, busy, args.steps)
            rows.append(row)
            step = row["median_step_s"]
            print(f"busy {busy}  {variant:24s}  median step: "
                  f"2 threads {step['2_threads']:.3f} s, 1 thread {step['1_thread']:.3f} s  ({row['wall_s']} s)",
                  flush=True)
    document = {"machine": platform.platform(), "cpus": len(os.sched_getaffinity(0)),
                "load_average_before": load_before, "steps_per_median": args.steps, "rows": rows}
    write_report(args.out, document)


if __name__ == "__main__":
    main()
