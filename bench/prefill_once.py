"""The compiled rollout with each distinct prompt prefilled once against every row prefilled
(`rollout.prefill_once`, mmrl/rollout/prefix.py), on one recipe's model and prompts, in one process.

Builds the recipe's trainer (random init at the recipe's shape; recipes/qwen2_5_vl_3b_shape.yaml
is Qwen2.5-VL-3B's: 448x448 images of 256 image tokens, 8 prompts x 8 samples, 64 new
tokens), takes its first step's prompts and calls its rollout's `generate` on them with
`prefill_once` on and off: one warm-up call each (compiling or recording the decode step),
then `--repeats` alternating timed calls of the whole rollout (greedy, the recipe's
response length) and of the prefill alone (one new token). Reports the medians, the rows
each prefill ran (`rollout.stats`), and whether the greedy tokens of both agree row by row
(in bf16 a batch of other width may round differently, so a random model's near-tied
choices can part; fp32 equality is tests/test_rollout_prefix.py's).

    python bench/prefill_once.py recipes/qwen2_5_vl_3b_shape.yaml --out $OUT/prefill_once_vl3b_gpu.json
    .venv/bin/python bench/prefill_once.py recipes/tiny_vlm_count.yaml --device cpu --repeats 1 \
        --out /tmp/prefill_once.json   # smoke run on CPU

The same A/B over whole training steps: bench/recipe_steps.py's `--variant every
rollout.prefill_once=false`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = {"once": True, "every": False}


def timed(rollout, conversations, params, once: bool, device: str):
    """One `generate` call with the prefill shared or not: its result, seconds and loop stats."""
    rollout.prefill_once = once
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = rollout.generate(conversations, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start, dict(rollout.stats)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = parser.parse_intermixed_args(argv)  # overrides after the options too

    from mmrl.config import load_recipe
    from mmrl.evaluation import conversations_of
    from mmrl.platform_info import device_name, versions, write_report
    from mmrl.rollout import SamplingParams
    from mmrl.rollout.compiled import CompiledHFRollout
    from mmrl.trainer import Trainer

    folder = tempfile.TemporaryDirectory()
    recipe = load_recipe(args.recipe, ["rollout.backend=hf_compiled", *args.overrides, "trainer.export=false",
                                       "trainer.progress=false", "trainer.eval_every=0", "trainer.save_every=0",
                                       "trainer.overwrite=true", f"trainer.output_dir={folder.name}/run"])
    start = time.perf_counter()
    trainer = Trainer(recipe)
    build_s = time.perf_counter() - start
    rollout = trainer.rollout
    if not isinstance(rollout, CompiledHFRollout):
        raise SystemExit(f"error: the recipe's rollout is {type(rollout).__name__}, not the compiled one")
    if args.device == "cpu":
        rollout.compile = False  # the decode loop eagerly: compiling on the CPU costs more than it saves
    samples, rows = trainer.next_prompts()
    conversations = conversations_of(samples, rows, trainer.train_set, "bench", max_pixels=recipe.model.max_pixels)
    r = recipe.rollout
    whole = SamplingParams(n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens, temperature=0, logprobs=True)
    prefill = SamplingParams(n=r.samples_per_prompt, max_new_tokens=1, temperature=0)
    warm_up, seconds, stats, tokens = {}, {}, {}, {}
    for name, once in MODES.items():
        _, warm_up[name], _ = timed(rollout, conversations, whole, once, args.device)
        seconds[name] = {"rollout": [], "prefill": []}
    agree = []
    for _ in range(args.repeats):
        for name, once in MODES.items():
            result, spent, stats[name] = timed(rollout, conversations, whole, once, args.device)
            tokens[name] = result.response_ids
            seconds[name]["rollout"].append(spent)
            seconds[name]["prefill"].append(timed(rollout, conversations, prefill, once, args.device)[1])
        a, b = tokens["once"], tokens["every"]
        width = min(a.shape[1], b.shape[1])
        agree.append(float((a[:, :width] == b[:, :width]).all(-1).float().mean()))
    median = {name: {k: statistics.median(v) for k, v in per.items()} for name, per in seconds.items()}
    report = {
        "command": " ".join(["python bench/prefill_once.py", *(sys.argv[1:] if argv is None else argv)]),
        "device": device_name(args.device), "versions": versions(), "recipe": str(args.recipe),
        "prompts": len(conversations), "rows": len(conversations) * r.samples_per_prompt,
        "new_tokens": r.max_new_tokens, "repeats": args.repeats, "build_s": build_s, "warm_up_s": warm_up,
        "median_s": median, "seconds": seconds, "loop_stats": stats,
        "saved_s": {k: median["every"][k] - median["once"][k] for k in ("rollout", "prefill")},
        "greedy_rows_identical": agree, "fallback": rollout.fallback_reason,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
    }
    write_report(args.out, report)
    for name in MODES:
        print(f"{name}: rollout {median[name]['rollout']:.3f} s, prefill alone {median[name]['prefill']:.3f} s, "
              f"prefill rows {stats[name].get('prefill_rows')}", flush=True)
    print(f"identical greedy rows {agree}, fallback {rollout.fallback_reason}", flush=True)
    folder.cleanup()
    return report


if __name__ == "__main__":
    main()
