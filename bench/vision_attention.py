"""Vision-tower attention in one call per layer against one call per chunk, in one run.

The vision tower of a recipe's model (default: the Qwen2.5-VL-3B shape of
recipes/qwen2_5_vl_3b_shape.yaml: 32 blocks of width 1280, 16 heads, 112-pixel windows,
full attention in blocks 7/15/23/31; random init, bf16 weights) encodes a batch like the
recipe's (64 images of 448x448 = 64 x 1024 patches), forward and backward. Modes:
  plain   transformers' SDPA path: one SDPA call per image or window, per layer;
  varlen  `mmrl.engine.vision_attention` installed: torch's varlen kernel, one per layer;
  padded  the same, with the padded single-SDPA call (the CPU path) instead of varlen.
Before timing, each mode's output and gradients are compared with plain's on the same
weights (on the first 8 images). Medians of `--repeats` alternating runs, peak memory, JSON to --out.

    python bench/vision_attention.py --out $OUT/vision_attention_gpu.json
    python bench/vision_attention.py --checkpointing --out $OUT/vision_attention_gpu_checkpointing.json
    .venv/bin/python bench/vision_attention.py --device cpu --tiny --repeats 2   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    from timing import alternate  # bench/timing.py (bench/ is on the path of a bench script)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "qwen2_5_vl_3b_shape.yaml")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the family's tiny tower and small images (smoke run)")
    parser.add_argument("--images", type=int, default=None, help="default 64 (4 with --tiny)")
    parser.add_argument("--image-size", type=int, default=None, help="pixels per side; default 448 (112 with --tiny)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="weights; float32 runs under bf16 autocast on CUDA")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the blocks")
    parser.add_argument("--modes", nargs="+", default=None, help="default: plain varlen padded (CPU: plain padded)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vision_attention_gpu.json")
    args = parser.parse_args()

    from mmrl import build_model
    from mmrl.config import load_recipe
    from mmrl.engine import vision_attention
    from mmrl.platform_info import device_name, versions, write_report

    device = torch.device(args.device)
    images = args.images or (4 if args.tiny else 64)
    side = args.image_size or (112 if args.tiny else 448)
    modes = args.modes or (["plain", "varlen", "padded"] if device.type == "cuda" else ["plain", "padded"])
    recipe = load_recipe(str(args.recipe), [])
    overrides = {} if args.tiny else {"vision_config": recipe.model.config_overrides.get("vision_config", {})}
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    # Random init where it runs. `device=` is what places it: build_model draws the weights
    # under its own device context (the CPU when none is given), which overrides a caller's
    # `with torch.device(...)` (the H200 run failed so: CPU conv weights, CUDA pixels).
    built = build_model(recipe.model.path, random_init=True, seed=0, dtype=dtype, config_overrides=overrides,
                        device=device)
    model = built.model
    misplaced = [name for name, t in (*model.named_parameters(), *model.named_buffers())
                 if t.device.type != device.type]
    if misplaced:
        raise SystemExit(f"{len(misplaced)} parameters/buffers are not on {device}, e.g. {misplaced[:3]}")
    if not vision_attention.install(model):
        raise SystemExit(f"{recipe.model.path}: its vision tower does not take the one-call path")
    tower = model.get_submodule(built.adapter.parts.vision[0])
    config = tower.config
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tower.train()

    patch, temporal = config.patch_size, getattr(config, "temporal_patch_size", 1)
    grid = side // patch
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(images * grid * grid, config.in_channels * temporal * patch * patch, generator=generator)
    pixels = pixels.to(device, dtype)
    grid_thw = torch.tensor([[1, grid, grid]] * images, device=device)
    autocasting = dtype == torch.float32 and device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocasting)

    def use(mode: str) -> None:
        if mode == "plain":
            config._attn_implementation = vision_attention.BASE
        else:
            vision_attention.install(model, use_varlen=mode == "varlen")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(mode: str, count: int = images) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward over the first `count` images: seconds, output, gradients."""
        use(mode)
        tower.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        with autocast:
            out = tower(pixels[:count * grid * grid], grid_thw=grid_thw[:count])
            merged = out.pooler_output if hasattr(out, "pooler_output") else out
            loss = merged.float().square().mean()
        loss.backward()
        sync()
        seconds = time.perf_counter() - start
        return seconds, merged.detach().float(), {n: p.grad for n, p in tower.named_parameters() if p.grad is not None}

    if "varlen" in modes and not (device.type == "cuda" and vision_attention.varlen_available()):
        raise SystemExit("the varlen kernel needs CUDA and torch.nn.attention.varlen")
    # Same weights: each mode's output and gradients against plain's (relative to plain's
    # largest), on a few of the images (the check holds two sets of gradients).
    checked = min(images, 8)
    _, reference, reference_grads = step("plain", checked)
    reference_grads = {n: g.float().clone() for n, g in reference_grads.items()}
    gaps = {}
    for mode in modes:
        _, output, grads = step(mode, checked)
        gaps[mode] = {
            "output": ((output - reference).abs().max() / reference.abs().max()).item(),
            "grads": max(((grads[n].float() - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                         for n, g in reference_grads.items()),
        }
        print(f"{mode}: max relative difference to plain: output {gaps[mode]['output']:.2e}, "
              f"gradients {gaps[mode]['grads']:.2e}")
    del reference, reference_grads
    before = {}
    samples, medians, peaks, failed = alternate(modes, lambda mode: step(mode)[0], args.repeats, device,
                                                free=lambda: tower.zero_grad(set_to_none=True),
                                                after_warm_up=lambda: before.update(vision_attention.calls()))
    calls = {k: v - before[k] for k, v in vision_attention.calls().items()}
    plain = medians.get("plain")
    print(f"{'mode':<8} {'median s':>9} {'vs plain':>9} {'peak GiB':>9}")
    for m, t in medians.items():
        print(f"{m:<8} {t:>9.3f} {plain / t if plain else float('nan'):>9.2f} {peaks.get(m, 0.0):>9.1f}")
    for m, reason in failed.items():
        print(f"{m:<8} failed: {reason}")
    report = {
        "bench": "bench/vision_attention.py", "device": device_name(str(device)), "versions": versions(),
        "recipe": str(args.recipe.relative_to(REPO)) if args.recipe.is_relative_to(REPO) else str(args.recipe),
        "tiny": args.tiny, "family": recipe.model.path,
        "tower": {k: getattr(config, k, None) for k in ("depth", "hidden_size", "num_heads", "intermediate_size",
                                                         "window_size", "fullatt_block_indexes", "patch_size")},
        "tower_parameters": sum(p.numel() for p in tower.parameters()),
        "images": images, "image_side": side, "patches": images * grid * grid,
        "precision": f"{args.dtype} weights" + (", bf16 autocast" if autocasting else ""),
        "gradient_checkpointing": args.checkpointing, "repeats": args.repeats,
        "max_relative_diff_vs_plain": gaps, "images_checked": checked,
        "median_step_s": medians, "samples_s": samples, "peak_gib": peaks,
        "speedup_vs_plain": {m: plain / t for m, t in medians.items()} if plain else None,
        "attention_calls_while_timed": calls, "out_of_memory": failed,
        "command": " ".join(["python bench/vision_attention.py", *sys.argv[1:]]),
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
