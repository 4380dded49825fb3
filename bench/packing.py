"""Padding-free (packed) actor updates against padded ones, in one run.

A 0.5B-shaped Qwen2 (random init, 152k vocabulary) and RL-like lengths: 64 sequences,
prompts of 128-512 tokens, responses long-tailed from 32 to 2048 tokens. Both modes run
the same micro-batches of `--micro-batch` rows (packed modes: with `--micro-batch-tokens`,
consecutive sequences up to that many tokens) through the training engine (bf16
autocast over fp32 weights, or with `--dtype bfloat16` bf16 weights stepping fp32 masters):
forward, chunked log-probs, backward and an AdamW step. The
padded mode is the engine's plain path (left-padded prompts, right-padded responses,
logits for every response column, SDPA); the packed modes are `Engine(pack=True)`
(`mmrl.engine.packing`) with SDPA over the packed-sequence mask (packed_N), the flash
varlen kernel (varlen_N, `mmrl.engine.varlen`), or that kernel with the decoder layers
compiled (compiled_N, `mmrl.engine.compiled_layers`; the engine's default on a GPU). A
mode that runs out of memory is recorded as such. Before timing, the two modes' log-probs are compared on the same
weights. Medians of `--repeats` alternating runs; tokens/s counts real tokens only.

    python bench/packing.py --checkpointing --out $OUT/packing_gpu.json
    python bench/packing.py --dtype bfloat16 --modes padded varlen_16384 compiled_16384 --out $OUT/packing_gpu_bf16.json
    python bench/packing.py --dtype bfloat16 --micro-batch-tokens 32768 --modes padded compiled_32768 \
        --out $OUT/packing_gpu_bf16_tokens.json
    python bench/packing.py --dtype bfloat16 --micro-batch-tokens 32768 --modes compiled_32768 --profile \
        --out $OUT/packing_profile.json   # + GPU time by kernel kind, and where the GPU sat idle
    .venv/bin/python bench/packing.py --device cpu --shape tiny --sequences 8 --repeats 1 \
        --modes padded packed_400 compiled_400   # smoke run (compiled: inductor's C++ kernels)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    # Qwen2.5-0.5B's shape.
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936, max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=4096),
}


PRECISION = {"float32": "fp32 weights, bf16 autocast", "bfloat16": "bf16 weights, fp32 master weights"}


def lengths(count: int, generator: torch.Generator, short: bool) -> tuple[list[int], list[int]]:
    """Prompt lengths uniform in [128, 512]; response lengths log-uniform in [32, 2048]."""
    scale = 8 if short else 1
    prompts = torch.randint(128 // scale, 512 // scale + 1, (count,), generator=generator)
    log = torch.rand(count, generator=generator) * (torch.tensor(2048.0).log() - torch.tensor(32.0).log())
    responses = (torch.tensor(32.0).log() + log).exp().round().long() // scale
    return prompts.tolist(), responses.clamp(min=1).tolist()


def main() -> None:
    from timing import alternate, kernel_profile, print_profile  # bench/timing.py (bench/ is on the path of a bench script)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["padded", "packed_16384", "varlen_16384", "compiled_16384"],
                        help="padded, packed_N (rows of N tokens, SDPA with the packed mask), varlen_N "
                             "(the same rows through the flash varlen kernel, mmrl.engine.varlen) or compiled_N "
                             "(varlen_N with the decoder layers compiled, mmrl.engine.compiled_layers); "
                             "padded_compiled: the padded rows with the layers compiled")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="packed modes: micro-batches of consecutive sequences up to this many tokens "
                             "(default: --micro-batch rows, as the padded mode)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--attn", default=None, help="attention implementation (default: SDPA)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights: float32 under bf16 autocast (the default), or bfloat16 with fp32 masters")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="after timing, CUDA kernel time of one step of each mode by kernel kind")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "packing_gpu.json")
    args = parser.parse_args()

    from mmrl import build_model
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine, join, varlen
    from torch._dynamo.utils import counters

    from mmrl.engine.packing import bins_by_tokens, pack_sequences
    from mmrl.parallel import init_distributed
    from mmrl.platform_info import device_name, versions, write_report

    dist = init_distributed(args.device)
    device = dist.device
    shape = SHAPES[args.shape]
    with torch.device(device):  # random init where it runs
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape, attn_implementation=args.attn,
                            dtype=args.dtype)
    attention = built.model.config.get_text_config()._attn_implementation
    pad = built.tokenizer.pad_token_id or 0
    generator = torch.Generator().manual_seed(0)
    prompt_lengths, response_lengths = lengths(args.sequences, generator, short=args.shape == "tiny")
    vocab = shape["vocab_size"]

    prompt_ids = [torch.randint(100, vocab, (p,), generator=generator) for p in prompt_lengths]
    response_ids = [torch.randint(100, vocab, (r,), generator=generator) for r in response_lengths]
    sequence_advantages = torch.randn(args.sequences, 1, generator=generator)

    def micro_batch(rows: list[int]):
        width_p = max(prompt_lengths[i] for i in rows)
        width_r = max(response_lengths[i] for i in rows)
        ids = torch.full((len(rows), width_p), pad)
        attention = torch.zeros(len(rows), width_p, dtype=torch.long)
        responses = torch.full((len(rows), width_r), pad)
        mask = torch.zeros(len(rows), width_r, dtype=torch.long)
        for j, i in enumerate(rows):
            p, r = prompt_lengths[i], response_lengths[i]
            ids[j, width_p - p:] = prompt_ids[i]
            attention[j, width_p - p:] = 1
            responses[j, :r] = response_ids[i]
            mask[j, :r] = 1
        seqs = join({"input_ids": ids, "attention_mask": attention}, responses, mask, built.adapter, built.model, pad)
        return seqs.to(device), sequence_advantages[rows].to(device)

    # Padded modes: micro-batches of --micro-batch rows; packed modes: the same, or with
    # --micro-batch-tokens consecutive sequences up to that many tokens (the trainer's
    # algo.micro_batch_tokens). Either way every sequence once, in order.
    padded_groups = [list(range(i, min(i + args.micro_batch, args.sequences)))
                     for i in range(0, args.sequences, args.micro_batch)]
    packed_groups = (bins_by_tokens([p + r for p, r in zip(prompt_lengths, response_lengths)], args.micro_batch_tokens)
                     if args.micro_batch_tokens else padded_groups)
    padded_batches = [micro_batch(rows) for rows in padded_groups]
    packed_batches = [micro_batch(rows) for rows in packed_groups] if args.micro_batch_tokens else padded_batches
    real_tokens = sum(prompt_lengths) + sum(response_lengths)
    padded_tokens = sum(s.inputs["input_ids"].numel() for s, _ in padded_batches)
    response_tokens = sum(response_lengths)
    compiles = any("compiled" in mode for mode in args.modes)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-6), gradient_checkpointing=args.checkpointing, pack=True,
                    compile_layers=compiles)
    text_config = built.model.config.get_text_config()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def use(mode: str) -> None:
        kind, _, tokens = mode.partition("_")
        if mode == "padded_compiled":  # the padded rows with the decoder layers compiled
            kind, tokens = "padded", ""
        engine.pack = kind != "padded"
        engine.pack_tokens = int(tokens or 0)
        if kind == "varlen" and not engine.varlen:
            raise SystemExit("the varlen kernel is not available here")
        text_config._attn_implementation = varlen.NAME if kind in ("varlen", "compiled") and engine.varlen else attention
        if engine.compiled_layers is not None:
            engine.compiled_layers.enabled = kind == "compiled" or mode == "padded_compiled"

    def chosen(mode: str) -> list:
        return padded_batches if mode.startswith("padded") else packed_batches

    def step(mode: str) -> tuple[float, list[torch.Tensor]]:
        use(mode)
        sync()
        start = time.perf_counter()
        logps = []
        for seqs, advantage in chosen(mode):
            logp, _ = engine.log_probs(seqs)
            (-(logp * advantage * seqs.response_mask).sum() / response_tokens).backward()
            logps.append(logp.detach())
        engine.step()
        sync()
        return time.perf_counter() - start, logps

    modes = list(args.modes)
    # Same weights for the check: log-probs only, no step.
    gaps = {}
    def response_log_probs(mode: str) -> torch.Tensor:
        """Every response token's log-prob, in sequence order."""
        use(mode)
        return torch.cat([engine.log_probs(s, with_entropy=False)[0][s.response_mask.bool()] for s, _ in chosen(mode)])

    with torch.no_grad():
        padded = response_log_probs("padded")
        for mode in modes:
            gaps[mode] = (response_log_probs(mode) - padded).abs().max().item()
            print(f"{mode}: max |log-prob difference| to padded (bf16 autocast): {gaps[mode]:.3e}")
    del padded
    rows = {mode: [len(pack_sequences(s.inputs, s.response_mask, int(mode.split("_")[1])).rows)
                   for s, _ in packed_batches]
            for mode in modes if not mode.startswith("padded")}
    samples, medians, peaks, failed = alternate(
        modes, lambda mode: step(mode)[0], args.repeats, device,
        free=lambda: engine.optimizer.zero_grad(set_to_none=True))
    modes = list(medians)
    reference = medians.get("padded")
    params = sum(p.numel() for p in built.model.parameters())
    print(f"{'mode':<14} {'median s':>9} {'real tok/s':>11} {'vs padded':>10} {'peak GiB':>9}")
    for m in modes:
        ratio = reference / medians[m] if reference else float("nan")
        print(f"{m:<14} {medians[m]:>9.3f} {real_tokens / medians[m]:>11.0f} {ratio:>10.2f} {peaks.get(m, 0.0):>9.1f}")
    for m, reason in failed.items():
        print(f"{m:<14} failed: {reason}")
    profiles = {}
    if args.profile and device.type == "cuda":
        for m in modes:
            profiles[m] = kernel_profile(lambda: step(m), gaps=True)
            print_profile(m, profiles[m])
    report = {
        "bench": "bench/packing.py", "device": device_name(str(device)), "versions": versions(),
        "shape": args.shape, "parameters": params, "sequences": args.sequences, "micro_batch_rows": args.micro_batch,
        "packed_micro_batch_tokens": args.micro_batch_tokens, "packed_micro_batches": len(packed_batches),
        "gradient_checkpointing": args.checkpointing,
        "attention": built.model.config._attn_implementation, "precision": PRECISION[args.dtype],
        "real_tokens": real_tokens, "padded_tokens": padded_tokens, "response_tokens": response_tokens,
        "prompt_lengths": prompt_lengths, "response_lengths": response_lengths,
        "packed_rows_per_micro_batch": rows, "max_logp_diff_vs_padded": gaps, "repeats": args.repeats,
        "median_step_s": medians, "samples_s": samples, "peak_gib": peaks,
        "real_tokens_per_s": {m: real_tokens / t for m, t in medians.items()},
        "speedup_vs_padded": {m: reference / t for m, t in medians.items()} if reference else None,
        "out_of_memory": failed, "attention_calls": varlen.varlen_calls(),
        "compiled_layer_calls": engine.compiled_layers.compiled_calls if engine.compiled_layers else 0,
        "compile_failed": engine.compiled_layers.failed if engine.compiled_layers else None,
        "dynamo_graphs": dict(counters["stats"]),  # unique_graphs: the compiled layers' graphs over all modes
        "profiles": profiles,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
