"""HF rollout speed: plain `generate` against the static-cache compiled decode loop
(`rollout.backend: hf_compiled`, mmrl/rollout/compiled.py), in one process.

A 0.5B-shaped Qwen2 (random init, 152k vocabulary), a batch of `--batch` prompts of
`--prompt` random tokens, `--new-tokens` greedy tokens per row (a random model rarely
stops, so every row runs to the end). Both backends sample from the same engine and the
same prompt batch through their sampling step (`_sample`: generation only, no prompt
processing). Plain `generate` is warmed up on a short run; the compiled loop on one full
run (compiling and capturing its CUDA graph: reported as warm_up_s). Then `--repeats`
alternating timed runs; tokens/s = rows x new tokens / seconds, medians. Greedy tokens of
both are compared row by row on every run.

    python bench/rollout_speed.py --out $OUT/rollout_speed_gpu.json
    .venv/bin/python bench/rollout_speed.py --device cpu --shape tiny --batch 4 --prompt 16 \
        --new-tokens 8 --repeats 1 --no-compile --out /tmp/rollout_speed.json   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from packing import SHAPES  # the model shapes the packing bench measures (bench/ is on the path)

REPO = Path(__file__).resolve().parents[1]


def timed(rollout, batch, params, device) -> tuple[torch.Tensor, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens, _ = rollout._sample(batch, None, params)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"],
                        help="weight dtypes to run (float32 runs under the engine's bf16 autocast on a GPU)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="the static-cache loop without torch.compile")
    parser.add_argument("--half-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="fp32 weights: cast the linear layers once per rollout (default), "
                             "or at every step (--no-half-weights)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rollout_speed_gpu.json")
    args = parser.parse_args()

    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed
    from mmrl.platform_info import device_name, versions, write_report
    from mmrl.rollout import SamplingParams
    from mmrl.rollout.compiled import CompiledHFRollout
    from mmrl.rollout.hf import HFRollout

    dist = init_distributed(args.device)
    device = dist.device
    shape = SHAPES[args.shape]
    report = {
        "device": device_name(str(device)), "versions": versions(), "shape": args.shape,
        "batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "compile": not args.no_compile, "half_weights": args.half_weights,
        "command": "python bench/rollout_speed.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k not in ("out", "no_compile", "half_weights") and v is not None)
        + (" --no-compile" if args.no_compile else "") + ("" if args.half_weights else " --no-half-weights"),
        "runs": {},
    }
    for dtype in args.dtypes:
        with torch.device(device):
            built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape, dtype=dtype)
        engine = Engine(built, dist)
        plain = HFRollout(engine, built.processing)
        fast = CompiledHFRollout(engine, built.processing, compile=not args.no_compile, half_weights=args.half_weights)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(shape["vocab_size"] // 4, shape["vocab_size"], (args.batch, args.prompt), generator=generator)
        batch = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)
        with torch.no_grad():
            engine.model.eval()
            timed(plain, batch, SamplingParams(max_new_tokens=4, temperature=0), device)
            _, warm_up = timed(fast, batch, params, device)
            seconds = {"plain": [], "compiled": []}
            identical = []
            for _ in range(args.repeats):
                theirs, t_plain = timed(plain, batch, params, device)
                ours, t_fast = timed(fast, batch, params, device)
                seconds["plain"].append(t_plain)
                seconds["compiled"].append(t_fast)
                width = min(theirs.shape[1], ours.shape[1])
                identical.append(float((theirs[:, :width] == ours[:, :width]).all(-1).float().mean()))
        tokens = args.batch * args.new_tokens
        median = {k: statistics.median(v) for k, v in seconds.items()}
        run = {
            "tokens_per_s": {k: tokens / v for k, v in median.items()},
            "median_s": median, "seconds": seconds, "speedup": median["plain"] / median["compiled"],
            "warm_up_s": warm_up, "fallback": fast.fallback_reason, "loop_stats": fast.stats,
            "greedy_rows_identical": identical,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        }
        report["runs"][dtype] = run
        print(f"{dtype}: plain {run['tokens_per_s']['plain']:.0f} tok/s, compiled "
              f"{run['tokens_per_s']['compiled']:.0f} tok/s ({run['speedup']:.2f}x), warm-up {warm_up:.1f} s, "
              f"identical greedy rows {identical}, fallback {fast.fallback_reason}", flush=True)
        write_report(args.out, report)
        del engine, built, plain, fast
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
