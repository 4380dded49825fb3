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

Against an older commit, in the same call: `git archive <commit> mmrl recipes | tar -x -C old`,
its zoo beside its package (`git archive <commit> models processors | tar -x -C old/mmrl`:
otherwise the editable install's `mmrl.models` is this tree's zoo, which need not fit the old
package), and `PYTHONPATH=old python bench/recipe_steps.py old/recipes/... --out $OUT/old.json`.

`--same-start DIR` makes runs (two trees, or two variants) learn from the same start, so
that their first steps can be compared (`bench/same_learning.py`): the first variant to
run saves its actor's initial weights to DIR/actor.safetensors, every later one loads
them into its actor (and its reference and critic models), and each reseeds the RNGs
with the recipe's seed before `fit()`. A random-init recipe otherwise starts each tree
from different weights and samples different rollouts. Each variant's report holds
`first_step` (the first metrics record), and with `--same-start` also `first_rollout`
(the first rollout's response tokens). The first run also writes its first rollout to
DIR/first_rollout.json and later runs replay it (their first rollout returns those
responses): bf16 rounding otherwise parts sampled rollouts at the first token drawn
differently, and the two first updates would not see the same sequences. Both sides must sample alike: the plain `hf`
rollout backend (the old tree has no `hf_compiled`) and the same sampling settings
(temperature, top-p, samples, response length). A file already in DIR is loaded, not
replaced, so start from an empty DIR; it holds the full weights (15 GB for the 3B shape
in fp32), so keep it off $OUT:

    python bench/recipe_steps.py recipes/qwen2_5_vl_3b_shape.yaml --steps 5 --out $OUT/new.json \
        --same-start /tmp/start --variant new rollout.backend=hf
    PYTHONPATH=old_2446380 python bench/recipe_steps.py old_2446380/recipes/qwen2_5_vl_3b_shape.yaml \
        --steps 5 --out $OUT/old.json --same-start /tmp/start --variant old rollout.backend=hf
    python bench/same_learning.py $OUT/old.json $OUT/new.json --out $OUT/same_learning.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmrl.runs import replacing

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


def variant_recipe(values: dict, overrides: list[str], steps: int, out_dir: Path):
    """The recipe of one variant: `values` with its overrides, `steps` steps, no export,
    evaluation or checkpoints, written to `out_dir`."""
    from mmrl.config import Recipe, TrainerConfig, apply_overrides

    # `overwrite` is newer than some commits this runs against (PYTHONPATH=<old tree>).
    fresh = ["trainer.overwrite=true"] if "overwrite" in TrainerConfig.model_fields else []
    values = apply_overrides(values, [*overrides, f"trainer.steps={steps}", "trainer.export=false",
                                      "trainer.progress=false", "trainer.eval_every=0", "trainer.save_every=0",
                                      f"trainer.output_dir={out_dir}", *fresh])
    values["data"]["eval"] = None
    return Recipe.model_validate(values)


def _start_models(trainer) -> list[tuple[str, object]]:
    """(name, engine) of each engine the trainer builds from the initial weights: the
    actor, and the reference and critic where the recipe has them (`trainer.ref` and
    `trainer.critic` in this tree and in 2446380)."""
    engines = [("actor", trainer.actor)]
    for name in ("ref", "critic"):
        if getattr(trainer, name, None) is not None:
            engines.append((name, getattr(trainer, name)))
    return engines


def save_start(trainer, path: Path) -> None:
    """The actor's HF module's weights to `path` (safetensors), through a temporary name so
    that a run killed while writing leaves no half-written file to load."""
    from safetensors.torch import save_file

    if getattr(trainer.actor, "sharded", False):
        raise ValueError("--same-start needs one process; this actor is sharded")
    # Copies: tied weights share storage, which safetensors refuses.
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in trainer.actor.model.state_dict().items()}
    with replacing(path) as temporary:
        save_file(tensors, str(temporary))


def _name_keys(keys, limit: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


@torch.no_grad()
def load_start(trainer, path: Path) -> None:
    """The weights of `path` into every engine built from the initial weights (actor,
    reference, critic's model), and into their fp32 master weights where an engine keeps
    them (this tree; 2446380 has none). Keys must match exactly."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    for name, engine in _start_models(trainer):
        if getattr(engine, "sharded", False):
            raise ValueError(f"--same-start needs one process; the {name} model is sharded")
        module = engine.model
        own = module.state_dict()
        missing, unexpected = set(own) - set(state), set(state) - set(own)
        if missing or unexpected:
            parts = ([f"missing {_name_keys(missing)}"] if missing else []) + (
                [f"unexpected {_name_keys(unexpected)}"] if unexpected else [])
            raise ValueError(f"{path} does not fit the {name} model: {'; '.join(parts)}")
        shapes = [k for k in own if own[k].shape != state[k].shape]
        if shapes:
            k = shapes[0]
            raise ValueError(f"{path} does not fit the {name} model: {k} is {tuple(state[k].shape)} in the file, "
                             f"{tuple(own[k].shape)} in the model ({len(shapes)} tensors differ in shape)")
        cast = sum(own[k].dtype != state[k].dtype for k in own)
        if cast:
            print(f"--same-start: {cast} tensors of {path} cast to the {name} model's dtype", file=sys.stderr)
        module.load_state_dict(state)
        # This tree's engines step fp32 masters of half-precision weights; without a copy
        # the first update would step from the start the model was built with. As when an
        # engine is built, the masters are the model's (loaded) weights upcast.
        if hasattr(engine, "master_state_dict"):
            prefix = "model." if getattr(engine, "value_head", None) is not None else ""
            for key, master in engine.master_state_dict().items():
                if key.startswith(prefix) and key[len(prefix):] in own:
                    master.copy_(own[key[len(prefix):]])


def same_start(trainer, folder: Path) -> dict:
    """Save the initial weights to `folder` (the first run) or load them (later runs),
    then reseed as the trainer does, so that `fit()` starts from the same weights and the
    same random state in every run that shares `folder`."""
    path = folder / "actor.safetensors"
    action = "loaded" if path.exists() else "saved"
    if action == "loaded":
        load_start(trainer, path)
    else:
        save_start(trainer, path)
    seed = trainer.recipe.trainer.seed
    torch.manual_seed(seed)  # every device's generator, CUDA's included
    random.seed(seed)
    return {"same_start": str(path), "same_start_action": action}


def record_first_rollout(trainer, folder: Path | None = None) -> dict:
    """A dict that the trainer's first rollout fills with its response tokens (each
    response's masked ids), for `bench/same_learning.py` to compare between runs.

    With `folder` (the same-start folder): the run that finds no `first_rollout.json`
    there writes its first rollout to it; a run that finds one replays it, its first
    rollout returning those responses instead of its own samples. Sampled rollouts part
    ways at the first token that bf16 rounding draws differently (on the VL-3B shape 39%
    of responses came out identical between commits), so the replay is what lets the two
    runs' first updates be compared on the same sequences."""
    import dataclasses

    record: dict = {}
    source = getattr(trainer, "agent", None) or trainer.rollout
    generate = source.generate
    stored = None if folder is None else folder / "first_rollout.json"
    replay = json.loads(stored.read_text())["ids"] if stored is not None and stored.exists() else None

    def recording_generate(*args, **kwargs):
        result = generate(*args, **kwargs)
        if record:
            return result
        if replay is not None:
            result = replayed(result, replay, trainer.processing.tokenizer.pad_token_id or 0)
            record["replayed"] = str(stored)
        ids, mask = result.response_ids.cpu(), result.response_mask.cpu() > 0
        record["ids"] = [row[keep].tolist() for row, keep in zip(ids, mask)]
        record["responses"], record["tokens"] = len(record["ids"]), int(mask.sum())
        if stored is not None and replay is None:
            with replacing(stored) as partial:
                partial.write_text(json.dumps({"ids": record["ids"]}))
        return result

    def replayed(result, rows: list[list[int]], pad: int):
        if len(rows) != result.response_ids.shape[0]:
            raise ValueError(f"{stored}: {len(rows)} responses, this rollout has {result.response_ids.shape[0]}")
        width = max(1, max(map(len, rows)))
        ids = result.response_ids.new_full((len(rows), width), pad)
        mask = result.response_mask.new_zeros((len(rows), width))
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=ids.dtype)
            mask[i, :len(row)] = 1
        # Where a replayed response is as long as this run's own, it ended the same way.
        own = result.lengths.tolist()
        reasons = [reason if len(row) == int(n) else ("length" if len(row) == width else "stop")
                   for reason, row, n in zip(result.finish_reasons, rows, own)]
        # The sampler's log-probs were of this run's own tokens.
        return dataclasses.replace(result, response_ids=ids, response_mask=mask, finish_reasons=reasons,
                                   logprobs=None)

    source.generate = recording_generate
    return record


def run_variant(values: dict, overrides: list[str], steps: int, device: str, out_dir: Path,
                start_folder: Path | None = None) -> dict:
    from mmrl.trainer import Trainer

    recipe = variant_recipe(values, overrides, steps, out_dir)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer = Trainer(recipe)
    built = time.perf_counter() - start
    started, first_rollout = {}, None
    if start_folder is not None:
        started = same_start(trainer, start_folder)
        first_rollout = record_first_rollout(trainer, start_folder)
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
    # The whole first record: with `--same-start`, what bench/same_learning.py compares;
    # without, it shows how far apart two starts are.
    report["first_step"] = {k: v for k, v in records[0].items() if isinstance(v, (int, float))
                            and not isinstance(v, bool)}
    if start_folder is not None:
        report.update(started, first_rollout=first_rollout)
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
        "command": " ".join(args.argv), "recipe": str(args.recipe), "shape_of": str(args.shape_of or ""),
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--shape-of", type=Path, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
                        help="a name and the overrides of one variant (default: the recipe as it is)")
    parser.add_argument("--same-start", type=Path, default=None, metavar="DIR",
                        help="save the initial weights to DIR (first run) or load them from there, and reseed")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.argv = sys.argv if argv is None else ["bench/recipe_steps.py", *argv]
    values = recipe_values(args.recipe, args.shape_of, args.max_new_tokens)
    variants = args.variant or [["recipe"]]
    results, errors = {}, {}
    for name, *overrides in variants:
        with tempfile.TemporaryDirectory() as folder:
            try:
                results[name] = run_variant(values, overrides, args.steps, args.device, Path(folder) / "run",
                                            args.same_start)
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
