"""Where a run's start goes: `Trainer(recipe)` under cProfile, then a few steps with their
garbage-collection seconds (`mmrl.gc_watch`), for the run itself or for its compile helper
(`--helper`: the one-layer, random-weight recipe `mmrl.compile_helper` builds). Issue 28:
on one H200 the helper took 32.6 s to build its one-layer model (its log in
bench/results/decode_ab_vl3b_prewarm2_gpu.json), as long as the run's whole start.

    python bench/trainer_start_profile.py recipes/qwen2_5_vl_3b_shape.yaml --helper --out $OUT/start_helper.json
    python bench/trainer_start_profile.py recipes/qwen2_5_vl_3b_shape.yaml --steps 3 --out $OUT/start_run.json
    python bench/trainer_start_profile.py recipes/qwen2_5_vl_3b_shape.yaml --steps 2 --profile-first-step \
        --out $OUT/first_step_profile.json   # where step 1's media check and compiles go
    python bench/trainer_start_profile.py recipes/tiny_vlm_count.yaml --steps 1 --out /tmp/start.json   # CPU

Writes JSON: the start's seconds, the functions with the most cumulative time (mmrl's,
transformers', torch's), and per step its seconds, `time/gc` and full collections, and the
time one full collection takes after the start and after the steps.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def top_functions(profile: cProfile.Profile, count: int) -> list[dict]:
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{file}:{line}({name})", "calls": calls, "own_s": round(own, 3),
                     "cumulative_s": round(cumulative, 3)})
    rows.sort(key=lambda row: row["cumulative_s"], reverse=True)
    return rows[:count]


def full_collection() -> dict:
    objects = len(gc.get_objects())
    began = time.perf_counter()
    gc.collect()
    return {"objects": objects, "full_collection_s": round(time.perf_counter() - began, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    parser.add_argument("--helper", action="store_true", help="profile the compile helper's start instead")
    parser.add_argument("--steps", type=int, default=0, help="steps to run after the start")
    parser.add_argument("--profile-first-step", action="store_true",
                        help="step 1 under cProfile too (its media check, compiles, rollout and update): "
                             "its functions with the most cumulative time in the report's `first_step_top`")
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from mmrl.config import load_recipe
    from mmrl.gc_watch import watch_gc
    from mmrl.platform_info import write_report
    from mmrl.trainer import Trainer

    output = Path(tempfile.mkdtemp(prefix="start-profile-run-"))
    recipe = load_recipe(args.recipe, [f"trainer.output_dir={output}", "trainer.progress=false",
                                       "model.compile_prewarm=false", *args.overrides])
    if args.helper:  # as `mmrl.compile_helper` makes it from the payload the run writes
        from mmrl import prewarm

        work = Path(tempfile.mkdtemp(prefix="start-profile-"))
        recipe = prewarm.helper_recipe(prewarm.helper_values(recipe, work / "run"), recipe.folder)
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    trainer = Trainer(recipe)
    profile.disable()
    report = {"command": " ".join(["python bench/trainer_start_profile.py", *(argv or sys.argv[1:])]),
              "which": "compile helper" if args.helper else "run", "start_s": round(time.perf_counter() - began, 2),
              "device": str(trainer.dist.device), "top": top_functions(profile, args.top),
              "after_start": full_collection(), "steps": []}
    watch = watch_gc()
    watch.take()
    for step in range(args.steps):
        stepped = cProfile.Profile() if args.profile_first_step and step == 0 else None
        began = time.perf_counter()
        if stepped is not None:
            stepped.enable()
        trainer.train_step()
        if trainer.dist.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        if stepped is not None:
            stepped.disable()
            report["first_step_top"] = top_functions(stepped, args.top)
        seconds, full = watch.take()
        report["steps"].append({"step_s": round(time.perf_counter() - began, 2), "gc_s": round(seconds, 3),
                                "gc_full": full, **{k: round(v, 2) for k, v in trainer.timings.items()}})
        trainer.timings.clear()
    if args.steps:
        report["after_steps"] = full_collection()
    trainer.log.close()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
