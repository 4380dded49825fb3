"""A recipe's training run on several processes against its baseline run, from the run
folders' metrics.jsonl (`mmrl train`, one process per GPU under torchrun), in one call.

  --compare scaling        FSDP2 update scaling of a whole recipe (the VL-3B-shaped one on
                           GPUs): one process against `--nproc` processes with
                           data.prompts_per_step x nproc (weak scaling: every rank gets the
                           one-process batch). Efficiency = rank 0's update tokens per
                           update second on nproc processes / on one process (1.0: perfect).
  --compare disaggregated  `--nproc` processes, all training synchronously (data parallel,
                           algo.max_staleness 0), against the same processes with
                           parallel.rollout_ranks=1 algo.max_staleness=1 (docs/async.md,
                           "Disaggregated ranks": the last rank only rolls out). Speed-up =
                           the synchronous run's median step / the disaggregated run's; each
                           run's reward (first and last steps' mean) and final eval accuracy
                           (when the recipe evaluates) are the learning check, and with a
                           recipe that stops at `trainer.target_accuracy` (the CPU demo,
                           recipes/tiny_vlm_count.yaml) `steps_ratio` is the disaggregated
                           run's steps to the target over the synchronous run's (issue 33's
                           bound for one step off: 1.25).

Medians over the steps after `--warmup`; the runs go one after the other, same seed. JSON
to --out.

    python bench/distributed_recipe.py --compare scaling recipes/qwen2_5_vl_3b_shape.yaml \
        --steps 6 --out $OUT/recipe_scaling_vl3b_gpu.json
    python bench/distributed_recipe.py --compare disaggregated recipes/qwen2_5_vl_3b_shape.yaml \
        --steps 8 --out $OUT/disaggregated_vl3b_gpu.json
    python bench/distributed_recipe.py --compare disaggregated recipes/tiny_vlm_count.yaml \
        --steps 800 --run-timeout 195 --out $OUT/disaggregated_learning_gpu.json         # steps to 0.95
    .venv/bin/python bench/distributed_recipe.py --compare disaggregated recipes/tiny_vlm_count.yaml \
        --device cpu --steps 2 --warmup 0 --set data.prompts_per_step=2 rollout.samples_per_prompt=2 \
        --out /tmp/disaggregated.json                                                  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Quiet, short runs that leave nothing behind but metrics.jsonl.
RUN_SETTINGS = ["trainer.progress=false", "trainer.export=false", "trainer.summary=false", "trainer.save_every=0"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", type=Path)
    p.add_argument("--compare", required=True, choices=("scaling", "disaggregated"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides for every run")
    p.add_argument("--run-timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def train(args, name: str, processes: int, overrides: list[str], scratch: Path) -> list[dict]:
    """One `mmrl train` run: its per-step records (the final summary record left out)."""
    out = scratch / name
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
                if processes > 1 else [sys.executable])
    command = [*launcher, "-m", "mmrl.cli", "train", str(args.recipe.resolve()), f"trainer.output_dir={out}",
               f"trainer.steps={args.steps}", *RUN_SETTINGS, *args.set, *overrides]
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout, cwd=REPO, env=env)
    metrics = out / "metrics.jsonl"
    if done.returncode != 0 or not metrics.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"distributed_recipe: the {name} run failed (exit {done.returncode}): {tail[0]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records


def summary(records: list[dict], warmup: int) -> dict:
    """Medians of a run's timed steps, and its learning figures."""
    steps = [r for r in records if not r.get("final")]
    timed = steps[warmup:] or steps
    final = next((r for r in records if r.get("final")), {})
    median = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    return {
        "steps": len(steps), "median_step_s": median("time/step"), "median_update_s": median("time/update"),
        "median_rollout_s": median("time/rollout"), "median_tokens": median("tokens"),
        "steps_per_s": 1.0 / max(median("time/step"), 1e-9),
        "update_tokens_per_s": median("tokens") / max(median("time/update"), 1e-9),
        "reward_first": steps[0].get("reward/mean") if steps else None,
        "reward_last": steps[-1].get("reward/mean") if steps else None,
        "eval_accuracy": final.get("eval/accuracy"),
    }


def recipe_of(args):
    from mmrl.config import load_recipe

    return load_recipe(args.recipe, list(args.set))


def learning(target: float | None, synchronous: dict, disaggregated: dict) -> dict:
    """Steps to the recipe's target accuracy, disaggregated over synchronous, where both
    runs reached it (a run stops at its target); None otherwise."""
    reached = {name: target is not None and (run["eval_accuracy"] or 0.0) >= target
               for name, run in (("synchronous", synchronous), ("disaggregated", disaggregated))}
    ratio = disaggregated["steps"] / synchronous["steps"] if target is not None and all(reached.values()) else None
    return {"target_accuracy": target, "reached_target": reached, "steps_ratio": ratio}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.nproc < 2:
        raise SystemExit("distributed_recipe: --nproc must be at least 2")
    if not args.recipe.is_file():
        raise SystemExit(f"distributed_recipe: no recipe at {args.recipe}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.nproc:
            raise SystemExit(f"distributed_recipe: --nproc {args.nproc} needs as many GPUs, "
                             f"{torch.cuda.device_count()} visible")
    from mmrl.platform_info import device_name, versions, write_report

    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        if args.compare == "scaling":
            per_rank = recipe_of(args).data.prompts_per_step
            baseline = summary(train(args, "one_process", 1, [], scratch), args.warmup)
            other = summary(train(args, "sharded", args.nproc, [f"data.prompts_per_step={per_rank * args.nproc}"],
                                  scratch), args.warmup)
            runs = {"1": baseline, str(args.nproc): other}
            figure = {"efficiency": other["update_tokens_per_s"] / max(baseline["update_tokens_per_s"], 1e-9)}
        else:
            baseline = summary(train(args, "synchronous", args.nproc, ["algo.max_staleness=0"], scratch), args.warmup)
            other = summary(train(args, "disaggregated", args.nproc,
                                  ["parallel.rollout_ranks=1", "algo.max_staleness=1"], scratch), args.warmup)
            runs = {"synchronous": baseline, "disaggregated": other}
            figure = {"speedup": baseline["median_step_s"] / max(other["median_step_s"], 1e-9),
                      **learning(recipe_of(args).trainer.target_accuracy, baseline, other)}
    for name, run in runs.items():
        print(f"{name:>14}: {run['median_step_s']:.3f} s a step (update {run['median_update_s']:.3f} s, rollout "
              f"{run['median_rollout_s']:.3f} s), reward {run['reward_first']} -> {run['reward_last']}")
    print(", ".join(f"{key} {value:.2f}" for key, value in figure.items() if isinstance(value, float)))
    write_report(args.out, {
        "bench": "bench/distributed_recipe.py",
        "command": "python bench/distributed_recipe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device_name(args.device), "versions": versions(), "compare": args.compare,
        "recipe": str(args.recipe), "processes": args.nproc, "steps": args.steps, "warmup": args.warmup,
        "overrides": args.set, "runs": runs, **figure,
    })


if __name__ == "__main__":
    main()
