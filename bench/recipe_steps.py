"""Step-time split and peak memory of a recipe's training steps, for variants of it in one run.

Each variant (a name and key=value overrides) builds its own trainer and runs `--steps`
steps; the JSON gives per variant the median (over the steps after the first) of the step
time and its split (rollout, old/reference log-probs, update, sync), the first step's time,
the build time and the peak GPU memory, and each variant's ratio to the first one.

`--shape-of SHAPE_RECIPE` runs a recipe that names a real checkpoint and a hub dataset at
its model's real size on random-init weights: the recipe's smoke stand-ins (its family's
tokenizer and processor, the rows bundled under recipes/data/), the model config of
SHAPE_RECIPE (`model.config_overrides`, e.g. recipes/qwen2_5_vl_3b_shape.yaml), and the
recipe's own pixel budget, samples per prompt, micro-batches and algorithm; the prompts
per step are capped by the bundled rows and the response length by `--max-new-tokens`.

    python bench/recipe_steps.py recipes/qwen2_5_vl_3b_shape.yaml --steps 8 --out $OUT/a.json \
        --variant rows --variant packed model.pack=true algo.micro_batch_tokens=8192
    python bench/recipe_steps.py recipes/qwen2_5_vl_7b_geo3k_grpo.yaml \
        --shape-of recipes/qwen2_5_vl_3b_shape.yaml --max-new-tokens 256 --steps 10 --out $OUT/b.json
    .venv/bin/python bench/recipe_steps.py recipes/tiny_vlm_count.yaml --steps 2 --device cpu \
        --variant rows --variant tokens algo.micro_batch_tokens=64   # smoke run on CPU

Against an older commit, in the same call: `git archive <commit> mmrl recipes | tar -x -C old`
and `PYTHONPATH=old python bench/recipe_steps.py old/recipes/... --out $OUT/old.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SPLIT = ("step", "rollout", "logprob", "update", "sync")


def recipe_values(path: Path, shape_of: Path | None, max_new_tokens: int | None) -> dict:
    """The recipe's values, or with `shape_of` its real-shape random-init stand-in."""
    from mmrl.config import load_recipe

    recipe = load_recipe(path)
    values = recipe.model_dump(mode="json")
    if shape_of is not None:
        from mmrl.data import load_prompts
        from mmrl.smoke import smoke_values

        shape = load_recipe(shape_of)
        values = smoke_values(recipe, path)
        values["model"].update(config_overrides=shape.model.config_overrides, min_pixels=recipe.model.min_pixels,
                               max_pixels=recipe.model.max_pixels)
        rows = len(load_prompts(values["data"]["train"]))
        values["data"]["prompts_per_step"] = min(recipe.data.prompts_per_step, rows)
        values["rollout"]["samples_per_prompt"] = recipe.rollout.samples_per_prompt
        values["rollout"]["max_new_tokens"] = recipe.rollout.max_new_tokens
        values["algo"]["micro_batch_size"] = recipe.algo.micro_batch_size
        values["data"]["eval"] = values["data"]["validation"] = None
    if max_new_tokens is not None:
        values["rollout"]["max_new_tokens"] = min(values["rollout"]["max_new_tokens"], max_new_tokens)
    return values


def run_variant(values: dict, overrides: list[str], steps: int, device: str, out_dir: Path) -> dict:
    from mmrl.config import Recipe, TrainerConfig, apply_overrides
    from mmrl.trainer import Trainer

    # `overwrite` is newer than some commits this runs against (PYTHONPATH=<old tree>).
    fresh = ["trainer.overwrite=true"] if "overwrite" in TrainerConfig.model_fields else []
    values = apply_overrides(values, [*overrides, f"trainer.steps={steps}", "trainer.export=false",
                                      "trainer.progress=false", "trainer.eval_every=0", "trainer.save_every=0",
                                      f"trainer.output_dir={out_dir}", *fresh])
    values["data"]["eval"] = None
    recipe = Recipe.model_validate(values)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer = Trainer(recipe)
    built = time.perf_counter() - start
    trainer.fit()
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if not r.get("final")]
    later = records[1:] or records
    report = {
        "overrides": overrides, "build_s": built, "steps": len(records),
        "median_s": {key: statistics.median(r.get(f"time/{key}", 0.0) for r in later) for key in SPLIT},
        "first_step_s": records[0]["time/step"],
        "micro_batches": records[-1].get("update/micro_batches"),
        "optimizer_steps": records[-1].get("update/optimizer_steps"),
        "tokens": statistics.median(r.get("tokens", 0.0) for r in records),
        "response_length": statistics.median(r["response/length"] for r in records),
        "reward_mean_step1": records[0]["reward/mean"],
        "packed": getattr(trainer.actor, "pack", False), "varlen": getattr(trainer.actor, "varlen", False),
        "parameters": sum(p.numel() for p in trainer.actor.model.parameters()),
    }
    if device == "cuda":
        report["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del trainer
    gc.collect()
    return report


def write_report(args, results: dict, errors: dict) -> dict:
    import transformers

    first = next(iter(results.values()), None)
    ratios = {name: first["median_s"]["step"] / r["median_s"]["step"] for name, r in results.items()} if first else {}
    report = {
        "command": " ".join(sys.argv), "recipe": str(args.recipe), "shape_of": str(args.shape_of or ""),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__.split("+")[0],
                     "transformers": transformers.__version__},
        "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
        "variants": results, "errors": errors,
        "speedup_vs_first": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--shape-of", type=Path, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
                        help="a name and the overrides of one variant (default: the recipe as it is)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    values = recipe_values(args.recipe, args.shape_of, args.max_new_tokens)
    variants = args.variant or [["recipe"]]
    results, errors = {}, {}
    for name, *overrides in variants:
        with tempfile.TemporaryDirectory() as folder:
            try:
                results[name] = run_variant(values, overrides, args.steps, args.device, Path(folder) / "run")
            except Exception as exc:  # a variant that fails (out of memory, say) is recorded as such
                errors[name] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"{name}: {errors[name]}", file=sys.stderr, flush=True)
                gc.collect()
        write_report(args, results, errors)  # after each variant: a later one may run out of time
        if name in results:
            r = results[name]
            split = " ".join(f"{k} {v:.2f}" for k, v in r["median_s"].items())
            print(f"{name}: median {split} s; first {r['first_step_s']:.2f} s; build {r['build_s']:.0f} s; "
                  f"peak {r.get('peak_allocated_gib', 0):.1f} GiB", flush=True)
    ratios = write_report(args, results, errors)
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x the step of {next(iter(results))}")


if __name__ == "__main__":
    main()
