"""The compiled rollout's decode step against its memory-bandwidth bound (issue 28).

A decode step reads every weight the text decoder uses once (its layers, final norm and
output embedding; not the input embedding, of which it gathers one row per sequence, nor
the vision tower) and the whole static KV cache (`mmrl.rollout.compiled` attends over
all `cache length` positions of every row, masked). At best it takes those bytes over
the GPU's memory bandwidth:

    bound_s = (weight_bytes + kv_cache_bytes) / (bandwidth_gbs * 1e9)
    kv_cache_bytes = 2 (keys, values) x layers x batch x kv_heads x head_dim x cache_length x bytes per value

Per shape (`--shapes`, random-init bf16 weights drawn on the device) this drives
`mmrl.rollout.compiled.CompiledHFRollout` as bench/rollout_speed.py does (its `_sample`,
a batch of `--batch` random prompts whose length fills the cache of `--cache-length`
with `--steps` + 1 new tokens, temperature 1 with log-probs, as a training rollout
samples): one call to warm up (compiling and capturing the CUDA graph: `warm_up_s`),
then one timed call whose decode steps are each timed with CUDA events (wall clock on the
CPU); the median over the steps run at the full batch width is `ms_per_step`. `ratio` is
ms_per_step / bound_ms (1.0 would be the bound), `tokens_per_s` is batch / step time.

Shapes: `0.5b` (Qwen2.5-0.5B, bench/packing.py's SHAPES), `vl3b` (the text tower of
recipes/qwen2_5_vl_3b_shape.yaml) and `vl7b` (Qwen2.5-VL-7B's text tower, as its public
config.json), the VL ones as Qwen2.5-VL models with a one-block vision tower (its bytes
are not read by a decode step and not counted), so the decode runs the VL family's own
path (mrope positions); `tiny` and `tiny_vl` for CPU checks.

    python bench/decode_bound.py --out $OUT/decode_bound_gpu.json
    python bench/decode_bound.py --shapes vl7b --cache-length 4096 --rollout-options \
        'compile_options={mode: max-autotune, fullgraph: true}' --out $OUT/decode_bound_autotune.json
    python bench/decode_bound.py --shapes vl3b --profile-steps 20 --out $OUT/decode_bound_vl3b_profile.json
    .venv/bin/python bench/decode_bound.py --device cpu --shapes tiny --batch 4 --cache-length 256 \
        --steps 3 --no-compile --out /tmp/decode_bound.json   # smoke run on CPU
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml
from packing import SHAPES as TEXT_SHAPES  # the model shapes the other GPU benches use (bench/ is on the path)

REPO = Path(__file__).resolve().parents[1]
H200_BANDWIDTH_GBS = 4800  # HBM3e, the H200's specification (4.8 TB/s)
VL_SHAPE_RECIPE = REPO / "recipes" / "qwen2_5_vl_3b_shape.yaml"
# The vision tower of the VL shapes: one block of the real widths. A decode step never
# runs it, so its depth changes nothing measured here and saves building 600M parameters.
ONE_BLOCK_VISION = dict(depth=1, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                        fullatt_block_indexes=[0])
# Qwen2.5-VL-7B-Instruct's text config (its public config.json).
VL7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, head_dim=128, vocab_size=152064,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
TINY_VL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=1000,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})


def shape_spec(name: str) -> tuple[str, dict]:
    """(family, config_overrides) of a shape."""
    if name in ("0.5b", "tiny"):
        return "qwen2", {**TEXT_SHAPES[name], "tie_word_embeddings": True}  # Qwen2.5-0.5B ties them
    if name == "vl3b":
        text = yaml.safe_load(VL_SHAPE_RECIPE.read_text())["model"]["config_overrides"]["text_config"]
        # Qwen2.5-VL-3B ties its embeddings, as Qwen2.5-3B does.
        return "qwen2_5_vl", {"text_config": text, "tie_word_embeddings": True,
                              "vision_config": {**ONE_BLOCK_VISION, "out_hidden_size": text["hidden_size"]}}
    if name == "vl7b":
        return "qwen2_5_vl", {"text_config": VL7B_TEXT, "tie_word_embeddings": False,
                              "vision_config": {**ONE_BLOCK_VISION, "out_hidden_size": VL7B_TEXT["hidden_size"]}}
    if name == "tiny_vl":
        return "qwen2_5_vl", {"text_config": TINY_VL_TEXT, "tie_word_embeddings": False,
                              "vision_config": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                    window_size=56, fullatt_block_indexes=[0], out_hidden_size=64)}
    raise ValueError(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPE_NAMES)})")


SHAPE_NAMES = ("0.5b", "vl3b", "vl7b", "tiny", "tiny_vl")


def rollout_options(pairs: list[str]) -> dict:
    """`key=value` pairs as CompiledHFRollout keyword arguments, each value read as YAML
    (`check_every=16`, `compile_options={mode: max-autotune}`); an unknown key is an error."""
    from mmrl.rollout.compiled import CompiledHFRollout

    known = set(inspect.signature(CompiledHFRollout.__init__).parameters) - {"self", "engine", "processing",
                                                                              "compile"}
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--rollout-options: {pair!r} is not key=value")
        if key not in known:
            raise ValueError(f"--rollout-options: {key!r} is not a CompiledHFRollout option "
                             f"(known: {', '.join(sorted(known))}; compiling is --compile/--no-compile)")
        options[key] = yaml.safe_load(value)
    return options


def weight_bytes_read(model, adapter) -> int:
    """Bytes of the weights one decode step reads: the language model's parts and the
    output embedding, each tensor once (tied embeddings are one tensor), without the
    input embedding, whose rows are gathered, unless it is the output embedding."""
    from mmrl.parts import part_of

    head = model.get_output_embeddings().weight
    total = 0
    for name, parameter in model.named_parameters():  # tied tensors are listed once
        part = part_of(name, adapter)
        if part in ("language", "lm_head") or (part == "embed" and parameter is head):
            total += parameter.numel() * parameter.element_size()
    return total


def kv_cache_bytes(cache) -> int:
    """Bytes of a static cache's keys and values (all of them are read every step)."""
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


# The first profiled decode step (--profile-steps): the earlier ones are the rollout's first.
PROFILE_FROM = 8


def bound(weight_bytes: int, cache_bytes: int, bandwidth_gbs: float) -> float:
    """Milliseconds to move `weight_bytes` + `cache_bytes` at `bandwidth_gbs` (1e9 bytes/s)."""
    return (weight_bytes + cache_bytes) / (bandwidth_gbs * 1e9) * 1e3


class StepTimer:
    """Wraps the rollout's decode step: times each call (CUDA events on a GPU, wall clock
    elsewhere) and records the batch width it ran at."""

    def __init__(self, step, device: torch.device):
        self.step, self.device = step, device
        self.events: list = []
        self.widths: list[int] = []

    def __call__(self, model, input_ids, *args, **kwargs):
        self.widths.append(int(input_ids.shape[0]))
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.step(model, input_ids, *args, **kwargs)
            end.record()
            self.events.append((start, end))
        else:
            began = time.perf_counter()
            out = self.step(model, input_ids, *args, **kwargs)
            self.events.append((began, time.perf_counter()))
        return out

    def milliseconds(self) -> list[float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) for start, end in self.events]
        return [(end - start) * 1e3 for start, end in self.events]


def measure(name: str, args, dist, options: dict) -> dict:
    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.rollout import SamplingParams
    from mmrl.rollout.compiled import CACHE_LENGTH_STEP, CompiledHFRollout

    device = dist.device
    new_tokens = args.steps + 1  # the first token comes from the prompt's forward
    prompt = args.cache_length - new_tokens
    if args.cache_length % CACHE_LENGTH_STEP or prompt < 1:
        raise ValueError(f"--cache-length {args.cache_length}: must be a multiple of {CACHE_LENGTH_STEP} "
                         f"longer than --steps + 1 ({new_tokens})")
    family, overrides = shape_spec(name)
    began = time.perf_counter()
    built = build_model(family, random_init=True, seed=0, config_overrides=overrides, dtype="bfloat16", device=device)
    build_s = time.perf_counter() - began
    engine = Engine(built, dist)
    rollout = CompiledHFRollout(engine, built.processing, compile=args.compile, **options)
    text = built.model.config.get_text_config()
    generator = torch.Generator().manual_seed(0)
    # Token ids from the upper three quarters of the vocabulary: no special tokens (images).
    ids = torch.randint(text.vocab_size // 4, text.vocab_size, (args.batch, prompt), generator=generator)
    batch = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, logprobs=True)
    engine.model.eval()
    with torch.no_grad():
        began = time.perf_counter()
        rollout._sample(batch, None, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        warm_up_s = time.perf_counter() - began
        timer = StepTimer(rollout._compiled_step(), device)
        rollout._step = timer  # what `_compiled_step` hands the loop from now on
        rollout._sample(batch, None, params)
    milliseconds = timer.milliseconds()
    profile = None
    if args.profile_steps:  # a third rollout, its decode steps from the 8th on under torch.profiler
        from decode_profile import StepProbe, kernel_table

        probe = StepProbe(timer.step, device, profile_from=PROFILE_FROM, profile_steps=args.profile_steps)
        rollout._step = probe
        with torch.no_grad():
            rollout._sample(batch, None, params)
        probe.finish()
        profile = {"profiled_steps": probe.profiled_steps, **probe.timings(),
                   **kernel_table(probe.profiler, device, probe.profiled_steps, top=args.profile_top)}
    full = [ms for ms, width in zip(milliseconds, timer.widths) if width == args.batch]
    cache = next((c for (rows, length, _), c in rollout.caches.items()
                  if rows == args.batch and length == args.cache_length), None)
    if cache is None:
        raise RuntimeError(f"{name}: no cache of {args.batch} rows x {args.cache_length} positions after the run "
                           f"(caches: {sorted(k[:2] for k in rollout.caches)})")
    weights, kv = weight_bytes_read(engine.model, engine.adapter), kv_cache_bytes(cache)
    bound_ms = bound(weights, kv, args.bandwidth_gbs)
    ms_per_step = statistics.median(full)
    result = {
        "family": family, "parameters": sum(p.numel() for p in engine.model.parameters()),
        "layers": text.num_hidden_layers, "kv_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "prompt_tokens": prompt, "cache_length": args.cache_length, "cache_dtype": str(cache.layers[0].keys.dtype),
        "weight_bytes_read": weights, "kv_cache_bytes": kv, "bound_ms": bound_ms,
        "ms_per_step": ms_per_step, "ratio": ms_per_step / bound_ms,
        "achieved_gbs": (weights + kv) / (ms_per_step / 1e3) / 1e9, "tokens_per_s": args.batch / (ms_per_step / 1e3),
        "steps_timed": len(full), "steps_run": len(milliseconds), "step_ms": milliseconds,
        "warm_up_s": warm_up_s, "build_s": build_s, "fallback": rollout.fallback_reason,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        **({"profile": profile} if profile is not None else {}),
    }
    del rollout, engine, built, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "vl3b", "vl7b"], choices=SHAPE_NAMES)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cache-length", type=int, default=2048,
                        help="static cache positions (a multiple of 256); the prompt fills it but --steps + 1")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed (after one warm-up call)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="then one more rollout with this many of its decode steps (from the "
                             f"{PROFILE_FROM}th) under torch.profiler: kernels per step, their time by "
                             "group and the top ones (bench/decode_profile.py's table)")
    parser.add_argument("--profile-top", type=int, default=25, help="kernels listed in the profile")
    parser.add_argument("--bandwidth-gbs", type=float, default=H200_BANDWIDTH_GBS,
                        help="memory bandwidth in GB/s (1e9 bytes; H200: 4800)")
    parser.add_argument("--rollout-options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="CompiledHFRollout keyword arguments (values read as YAML)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "decode_bound_gpu.json")
    args = parser.parse_args(argv)
    if args.profile_steps and args.profile_steps + PROFILE_FROM > args.steps:
        raise SystemExit(f"error: --profile-steps {args.profile_steps}: at most --steps - {PROFILE_FROM} "
                         f"({args.steps - PROFILE_FROM})")

    from mmrl.parallel import init_distributed
    from mmrl.platform_info import device_name, today, versions, write_report

    try:
        options = rollout_options(args.rollout_options)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    dist = init_distributed(args.device)
    report = {
        "command": "python bench/decode_bound.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device_name(str(dist.device)), "versions": versions(), "date": today(),
        "batch": args.batch, "cache_length": args.cache_length, "steps": args.steps, "compile": args.compile,
        "bandwidth_gbs": args.bandwidth_gbs, "rollout_options": options, "dtype": "bfloat16",
        "shapes": {}, "errors": {},
    }
    for name in args.shapes:
        try:
            report["shapes"][name] = run = measure(name, args, dist, options)
            print(f"{name}: {run['ms_per_step']:.4g} ms/step against a bound of {run['bound_ms']:.4g} ms "
                  f"({run['ratio']:.2f}x; {run['achieved_gbs']:.0f} GB/s), {run['tokens_per_s']:.0f} tokens/s, "
                  f"warm-up {run['warm_up_s']:.1f} s, fallback {run['fallback']}", flush=True)
        except Exception as exc:  # a shape that fails (out of memory, say) is recorded, the others still run
            if isinstance(exc, ValueError) and "--cache-length" in str(exc):
                raise SystemExit(f"error: {exc}") from None
            report["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name}: {report['errors'][name]}", file=sys.stderr, flush=True)
        write_report(args.out, report)  # after each shape: a later one may run out of time
    return report


if __name__ == "__main__":
    main()
