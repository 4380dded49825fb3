"""Memory and time of per-token log-probs + entropy at 16 x 4096 tokens (152k vocabulary):
the training engine's path against a naive full-vocabulary fp32 path, in one run.

A 0.5B-shaped Qwen2 (bench/packing.py's SHAPES, random init drawn on the device, bf16
weights) and `--rows` x (1 prompt token + `--tokens` response tokens) of random ids. Each
pass is a forward, the log-probs and entropy of every response token, and the backward of
their sum. Paths:
  engine      `Engine.log_probs` (mmrl.engine.engine: logits for the response positions
              only, fp32 log-softmax over checkpointed row chunks);
  naive       `model(**batch).logits.float()`, log_softmax, gather, entropy over the full
              vocabulary;
  model_only  the same forward with logits for the last position only and the backward
              of their sum: what the transformer itself holds and recomputes, so that
              engine minus model_only is what the log-prob head adds.
Each path runs at `--rows` rows, then at half as many until it fits (a
torch.OutOfMemoryError is recorded, not raised); engine and naive then also run at the
largest size both fit, for the throughput ratio. Extra peak = max_memory_allocated during
the passes minus memory allocated before them (weights and the batch; gradients are
dropped before each pass, so they count in the extra: `gradients_gib`). Medians of
`--repeats` passes after one warm-up. The model's layers are checkpointed unless
--no-checkpointing (both paths alike). JSON to --out.

    python bench/logprob_memory.py --out $OUT/logprob_memory_gpu.json
    .venv/bin/python bench/logprob_memory.py --device cpu --shape tiny --rows 2 --tokens 64   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
PATHS = ("model_only", "engine", "naive")
GIB = 2**30


def shapes() -> dict:
    spec = importlib.util.spec_from_file_location("packing_bench", Path(__file__).with_name("packing.py"))
    packing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(packing)
    return packing.SHAPES


def naive_log_probs(model, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary fp32 logits for every position, then log-softmax, gather, entropy."""
    logits = model(**seqs.inputs, use_cache=False).logits.float()
    logits = logits[:, seqs.prompt_length - 1:-1]
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, seqs.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="0.5b", choices=("0.5b", "tiny"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096, help="response tokens per row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/logprob_memory_gpu.json (_cpu.json off CUDA)")
    args = parser.parse_args()
    from mmrl.platform_info import write_report

    report = {**run(args), "command": " ".join(["python bench/logprob_memory.py", *sys.argv[1:]])}
    kind = "gpu" if args.device.startswith("cuda") else "cpu"
    out = args.out or REPO / "bench" / "results" / f"logprob_memory_{kind}.json"
    write_report(out, report)


def run(args: argparse.Namespace) -> dict:
    """Every measurement of the module docstring, as the JSON report."""
    from mmrl import build_model
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine, join
    from mmrl.parallel import init_distributed
    from mmrl.platform_info import device_name, versions

    dist = init_distributed(args.device)
    device = dist.device
    cuda = device.type == "cuda"
    shape = shapes()[args.shape]
    # `device=` places the random init (build_model's own device context overrides a
    # caller's `with torch.device(...)`); the outer context is for anything built around it.
    with torch.device(device):
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape, dtype="bfloat16",
                            device=device)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-6), gradient_checkpointing=not args.no_checkpointing)
    model = engine.model
    misplaced = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type != device.type]
    if misplaced:
        raise SystemExit(f"{len(misplaced)} parameters/buffers are not on {device}, e.g. {misplaced[:3]}")
    vocab, pad = shape["vocab_size"], built.tokenizer.pad_token_id or 0
    generator = torch.Generator().manual_seed(0)
    # One batch at the largest size; smaller sizes take its first rows.
    ids = torch.randint(100, vocab, (args.rows, 1), generator=generator)
    responses = torch.randint(100, vocab, (args.rows, args.tokens), generator=generator)
    full = join({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, responses, torch.ones_like(responses),
                built.adapter, model, pad).to(device)

    def rows_of(count: int):
        from mmrl.engine.sequences import Sequences

        return Sequences(inputs={k: v[:count] for k, v in full.inputs.items()}, response_ids=full.response_ids[:count],
                         response_mask=full.response_mask[:count], prompt_length=full.prompt_length,
                         pad_token_id=pad)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def release() -> None:
        engine.drop_gradients()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def gradient_gib() -> float:
        """Gradients held after a pass (the model's, and the optimizer's parameters' where
        they differ: fp32 master weights), part of every path's extra peak."""
        params = {id(p): p for p in model.parameters()}
        params.update({id(p): p for group in engine.optimizer.param_groups for p in group["params"]})
        return sum(p.grad.nbytes for p in params.values() if p.grad is not None) / GIB

    def one_pass(path: str, seqs) -> tuple[torch.Tensor, torch.Tensor] | None:
        if path == "model_only":
            with engine.autocast():
                out = model(**seqs.inputs, use_cache=False, logits_to_keep=1)
            out.logits.float().sum().backward()
            return None
        if path == "engine":
            logp, entropy = engine.log_probs(seqs)
        else:
            with engine.autocast():
                logp, entropy = naive_log_probs(model, seqs)
        (logp.sum() + entropy.sum()).backward()
        return logp.detach(), entropy.detach()

    def measure(path: str, rows: int) -> dict:
        """One warm-up and `--repeats` timed passes: extra peak GiB, seconds, the last
        pass's log-probs and entropy; {"out_of_memory": ...} when it does not fit."""
        seqs = rows_of(rows)
        release()
        base = torch.cuda.memory_allocated(device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        seconds, result = [], None
        try:
            for repeat in range(args.repeats + 1):
                engine.drop_gradients()
                sync()
                start = time.perf_counter()
                result = one_pass(path, seqs)
                sync()
                if repeat:
                    seconds.append(time.perf_counter() - start)
        except torch.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0][:200]
        else:
            message = None
        peak = (torch.cuda.max_memory_allocated(device) - base) / GIB if cuda else None
        gradients = gradient_gib()
        release()
        if message is not None:
            print(f"{path:<10} {rows:>3} x {args.tokens}: out of memory ({message})")
            return {"out_of_memory": message, "extra_peak_gib_before_failure": peak}
        median = statistics.median(seconds)
        peak_text = "-" if peak is None else f"{peak:.2f}"
        print(f"{path:<10} {rows:>3} x {args.tokens}: {median:.3f} s, extra peak {peak_text} GiB")
        return {"extra_peak_gib": peak, "gradients_gib": gradients, "median_s": median, "samples_s": seconds,
                "tokens_per_s": rows * args.tokens / median, "_result": result}

    sizes = [args.rows]
    while sizes[-1] > 1:
        sizes.append(sizes[-1] // 2)
    runs: dict[str, dict[int, dict]] = {path: {} for path in PATHS}
    largest: dict[str, int | None] = {}
    for path in PATHS:  # each path at the largest size that fits
        largest[path] = None
        for rows in sizes:
            runs[path][rows] = measure(path, rows)
            if "out_of_memory" not in runs[path][rows]:
                largest[path] = rows
                break
    common = min(largest["engine"], largest["naive"]) if largest["engine"] and largest["naive"] else None
    if common:
        for path in PATHS:
            if common not in runs[path]:
                runs[path][common] = measure(path, common)
    comparison = None
    if common and all("out_of_memory" not in runs[p][common] for p in ("engine", "naive")):
        engine_run, naive_run = runs["engine"][common], runs["naive"][common]
        (logp_e, ent_e), (logp_n, ent_n) = engine_run["_result"], naive_run["_result"]
        comparison = {
            "rows": common,
            "throughput_ratio_engine_vs_naive": naive_run["median_s"] / engine_run["median_s"],
            "max_abs_logp_diff": (logp_e - logp_n).abs().max().item(),
            "max_abs_entropy_diff": (ent_e - ent_n).abs().max().item(),
        }
        print(f"engine vs naive at {common} x {args.tokens}: throughput "
              f"{comparison['throughput_ratio_engine_vs_naive']:.2f}x, max |log-prob diff| "
              f"{comparison['max_abs_logp_diff']:.2e}, max |entropy diff| {comparison['max_abs_entropy_diff']:.2e}")
    head = None
    full_engine, full_model = runs["engine"].get(args.rows, {}), runs["model_only"].get(args.rows, {})
    if full_engine.get("extra_peak_gib") is not None and full_model.get("extra_peak_gib") is not None:
        head = full_engine["extra_peak_gib"] - full_model["extra_peak_gib"]
        print(f"log-prob head at {args.rows} x {args.tokens}: engine extra peak {full_engine['extra_peak_gib']:.2f} "
              f"GiB - model_only {full_model['extra_peak_gib']:.2f} GiB = {head:.2f} GiB")
    for path_runs in runs.values():
        for measured in path_runs.values():
            measured.pop("_result", None)
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "bench": "bench/logprob_memory.py", "device": device_name(str(device)), "versions": versions(),
        "shape": args.shape, "vocab_size": vocab, "parameters": parameters,
        "precision": "bf16 weights",
        "gradient_checkpointing": not args.no_checkpointing, "rows": args.rows, "response_tokens": args.tokens,
        "prompt_tokens": full.prompt_length, "repeats": args.repeats,
        "runs": {path: {str(rows): run for rows, run in path_runs.items()} for path, path_runs in runs.items()},
        "largest_rows_that_fit": largest, "comparison": comparison,
        "log_prob_head_extra_peak_gib": head,
    }


if __name__ == "__main__":
    main()
