"""Where the bf16 log-prob gap between shared and plain media encoding comes from.

bench/results/media_sharing_gpu.json found log-probs up to 0.137 apart between shared and
plain media encoding under bf16 autocast (the VL-3B-shaped recipe). This script takes one
micro-batch of that recipe (2 prompts x 8 samples, one 448x448 image each, random
responses), builds the model on the GPU and compares, on the same weights and tokens:

- shared vs plain in fp32 (TF32 off): the sharing itself;
- shared vs plain under bf16 autocast: what the bench measured;
- bf16 vs fp32, plain and shared: bf16's own error;
- bf16 plain over 16 rows vs the same rows in two micro-batches of 8: bf16 rounding
  that depends only on the batch's shape (cuBLAS picks other kernels), no sharing at all.

    python bench/bf16_logprob_gap.py recipes/qwen2_5_vl_3b_shape.yaml --out $OUT/bf16_logprob_gap.json

Result on one H200 (bench/results/bf16_logprob_gap_gpu.json, torch 2.11): in fp32 shared
and plain agree exactly (max 0); under bf16 they differ by at most 0.125, which is bf16's
own error (bf16 vs fp32: 0.133 plain, 0.139 shared) and the size of the gap between the
same plain rows run as 16 or as 2 x 8 (0.117). The 0.137 of media_sharing_gpu.json is
bf16 rounding that depends on batch shapes, not a sharing error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "qwen2_5_vl_3b_shape.yaml"))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "bf16_logprob_gap.json")
    args = parser.parse_args()

    from mmrl import build_model
    from mmrl.config import load_recipe
    from mmrl.data import load_prompts, to_conversation
    from mmrl.engine import Engine, join
    from mmrl.engine.media import SharedMedia
    from mmrl.parallel import init_distributed
    from mmrl.platform_info import device_name, versions, write_report

    recipe = load_recipe(args.recipe, [])
    m = recipe.model
    options = {k: v for k, v in (("min_pixels", m.min_pixels), ("max_pixels", m.max_pixels)) if v is not None}
    dist = init_distributed(args.device)
    with torch.device(dist.device):  # random init on the GPU: seconds, not minutes
        built = build_model(m.path, random_init=True, seed=0, processing_options=options,
                            config_overrides=m.config_overrides or None)
    engine = Engine(built, dist)
    samples = load_prompts(recipe.data.train).batches(args.prompts, seed=0)
    conversations = [to_conversation(s) for s in next(samples).samples]
    owners = [p for p in range(args.prompts) for _ in range(args.samples)]
    rows = [conversations[o] for o in owners]
    vocab = built.model.config.get_text_config().vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    shape = (len(rows), args.response_tokens)
    responses = torch.randint(min(1000, vocab // 2), min(vocab, 150000), shape, generator=generator)
    mask = torch.ones_like(responses)
    shared = SharedMedia.of(built.processing, rows, owners)

    def batch(chosen: list[int], share: bool):
        prompts = dict(built.processing([rows[i] for i in chosen]))
        sharing = shared.select([owners[i] for i in chosen]) if share else None
        return join(prompts, responses[chosen], mask[chosen], built.adapter, engine.model,
                    built.tokenizer.pad_token_id, shared=sharing).to(dist.device)

    everything = list(range(len(rows)))
    halves = [everything[0::2], everything[1::2]]  # each half holds both prompts

    @torch.no_grad()
    def log_probs(share: bool, bf16: bool, parts=(everything,)) -> torch.Tensor:
        engine.shares_media, engine.mixed_precision = share, bf16
        out = torch.empty(len(rows), args.response_tokens)
        for chosen in parts:
            out[chosen] = engine.log_probs(batch(chosen, share), with_entropy=False)[0].float().cpu()
        return out

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    fp32_plain, fp32_shared = log_probs(False, False), log_probs(True, False)
    bf16_plain, bf16_shared = log_probs(False, True), log_probs(True, True)
    bf16_halves = log_probs(False, True, halves)

    def gap(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
        d = (a - b).abs()
        return {"max": d.max().item(), "mean": d.mean().item(), "p99": d.flatten().quantile(0.99).item()}

    report = {
        "recipe": str(args.recipe), "device": device_name(args.device), "versions": versions(),
        "rows": len(rows), "prompts": args.prompts, "response_tokens": args.response_tokens,
        "mean_abs_logp_fp32": fp32_plain.abs().mean().item(),
        "gaps": {
            "shared_vs_plain_fp32": gap(fp32_shared, fp32_plain),
            "shared_vs_plain_bf16": gap(bf16_shared, bf16_plain),
            "bf16_vs_fp32_plain": gap(bf16_plain, fp32_plain),
            "bf16_vs_fp32_shared": gap(bf16_shared, fp32_plain),
            "bf16_plain_16_rows_vs_2x8_rows": gap(bf16_halves, bf16_plain),
        },
    }
    for name, values in report["gaps"].items():
        print(f"{name:<34} max {values['max']:.3e}  p99 {values['p99']:.3e}  mean {values['mean']:.3e}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
