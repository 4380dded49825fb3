"""A packed batch's attention mask and its segments: transformers' mask read back by a full
comparison (the plain path) against mmrl's (`mmrl.engine.varlen.packed_mask`, segments
remembered; and `document_segments` on transformers' mask), on the micro-batches of
bench/packing.py (64 sequences, prompts 128-512, responses 32-2048, 32768-token
micro-batches). Each mode's mask and segments are compared with the plain path's.

    python bench/packed_mask.py --out $OUT/packed_mask_gpu.json
    .venv/bin/python bench/packed_mask.py --device cpu --tiny --out /tmp/packed_mask.json   # smoke run

Modes, per micro-batch (each synchronized, median of `--repeats`):
  plain      transformers' SDPA mask (`create_causal_mask` with the packed position ids),
             segments by comparing it with the whole expected document-causal mask
  segments   transformers' SDPA mask, segments by `document_segments` (banded check)
  packed     mmrl's mask function for "mmrl_varlen": the mask written band by band, its
             segments remembered
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def full_comparison(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Segments of a (K, 1, T, T) mask by comparing it with the whole expected mask."""
    rows, _, length, _ = mask.shape
    square = mask[:, 0]
    before = torch.diagonal(square, offset=-1, dim1=1, dim2=2)
    starts = torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=mask.device), ~before], dim=1)
    document = starts.cumsum(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    if not torch.equal(square, (document[:, :, None] == document[:, None, :]) & causal):
        return None
    flat = starts.flatten().nonzero().flatten()
    ends = torch.cat([flat, flat.new_tensor([rows * length])])
    return ends.to(torch.int32), int((ends[1:] - ends[:-1]).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="8 short sequences (smoke run)")
    parser.add_argument("--micro-batch-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "packed_mask_gpu.json")
    args = parser.parse_args()

    from transformers import Qwen2Config
    from transformers.masking_utils import AttentionMaskInterface, create_causal_mask, sdpa_mask

    from mmrl.engine import varlen
    from mmrl.engine.packing import bins_by_tokens
    from mmrl.platform_info import device_name, versions, write_report
    from packing import lengths as rl_lengths  # bench/packing.py's RL lengths

    device = torch.device(args.device)
    prompts, responses = rl_lengths(8 if args.tiny else 64, torch.Generator().manual_seed(0), short=args.tiny)
    lengths = [p + r for p, r in zip(prompts, responses)]
    micro_batches = [[lengths[i] for i in rows] for rows in bins_by_tokens(lengths, args.micro_batch_tokens)]
    config = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                         num_hidden_layers=1)
    plain_name = "mmrl_bench_sdpa"  # transformers' mask under a name of its own, beside ours
    AttentionMaskInterface.register(plain_name, sdpa_mask)
    AttentionMaskInterface.register(varlen.NAME, varlen.packed_mask)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def mask_for(implementation: str, positions: torch.Tensor) -> torch.Tensor:
        config._attn_implementation = implementation
        embeds = torch.zeros(1, positions.shape[1], 8, device=device)
        return create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                                  position_ids=positions)

    modes = {
        "plain": lambda positions: (lambda mask: (mask, full_comparison(mask)))(mask_for(plain_name, positions)),
        "segments": lambda positions: (lambda mask: (mask, varlen.document_segments(mask)))(
            mask_for(plain_name, positions)),
        "packed": lambda positions: (lambda mask: (mask, varlen._segments(mask)))(mask_for(varlen.NAME, positions)),
    }
    report_batches = []
    for sizes in micro_batches:
        positions = torch.cat([torch.arange(n) for n in sizes]).to(device)[None]
        row = {"tokens": sum(sizes), "sequences": len(sizes), "longest": max(sizes), "modes": {}}
        expected = None
        for name, run in modes.items():
            mask, segments = run(positions)  # warm-up, and what to compare
            if expected is None:
                expected = (mask, segments)
            same = torch.equal(mask, expected[0]) and segments is not None and \
                torch.equal(segments[0], expected[1][0]) and segments[1] == expected[1][1]
            del mask, segments
            samples = []
            for _ in range(args.repeats):
                synchronize()
                start = time.perf_counter()
                out = run(positions)
                synchronize()
                samples.append(time.perf_counter() - start)
                del out
            row["modes"][name] = {"median_ms": statistics.median(samples) * 1e3,
                                  "samples_ms": [s * 1e3 for s in samples], "equal_to_plain": same}
        del expected
        report_batches.append(row)
        print(f"{row['tokens']:>6} tokens: " + ", ".join(
            f"{name} {mode['median_ms']:.2f} ms{'' if mode['equal_to_plain'] else ' (DIFFERS)'}"
            for name, mode in row["modes"].items()))
    totals = {name: sum(b["modes"][name]["median_ms"] for b in report_batches) for name in modes}
    report = {"bench": "bench/packed_mask.py", "device": device_name(str(device)), "versions": versions(),
              "micro_batch_tokens": args.micro_batch_tokens, "repeats": args.repeats,
              "micro_batches": report_batches, "total_ms_per_step": totals,
              "speedup_vs_plain": {name: totals["plain"] / totals[name] for name in modes},
              "all_equal": all(m["equal_to_plain"] for b in report_batches for m in b["modes"].values())}
    print("per step: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in totals.items()))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
