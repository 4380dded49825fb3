"""FSDP2 actor-update scaling: the packed update of bench/packing.py's batch on N processes
against one process, in one run (weak scaling: every rank gets the same batch).

Each run is `torchrun --nproc_per_node n` of this script's worker: a 0.5B-shaped Qwen2 (random
init on the device, bf16 weights; fp32 on CPU), `--sequences` sequences at RL lengths
(bench/packing.py's `lengths`, the same on every rank), micro-batches of up to
`--micro-batch-tokens` tokens packed one row each, and per step a log-prob forward, a
policy-gradient backward per micro-batch and one optimizer step. With one process the
engine is the one-process engine (fp32 masters, fused AdamW, compiled layers on a GPU);
with n it shards with FSDP2. Efficiency = (n-process real tokens/s) / (n x one-process
real tokens/s): 1.0 is perfect scaling. Medians of `--repeats` steps after one warm-up
step, per rank 0's clock. JSON to --out.

    python bench/fsdp_scaling.py --nproc 2 --out $OUT/fsdp_scaling_gpu.json
    .venv/bin/python bench/fsdp_scaling.py --device cpu --shape tiny --nproc 2 --sequences 4 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
parser.add_argument("--shape", default="0.5b", choices=("0.5b", "tiny"))
parser.add_argument("--nproc", type=int, default=2, help="processes of the sharded run (one GPU each)")
parser.add_argument("--sequences", type=int, default=64, help="sequences per rank")
parser.add_argument("--micro-batch-tokens", type=int, default=32768)
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--timeout", type=int, default=900, help="seconds per torchrun run")
parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fsdp_scaling_gpu.json")
parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # a run's JSON, rank 0 writes


def worker(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from packing import SHAPES, lengths

    from mmrl import build_model
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine, join
    from mmrl.engine.packing import bins_by_tokens
    from mmrl.parallel import init_distributed
    from mmrl.parallel.mesh import exit_cleanly

    dist = init_distributed(args.device)
    device = dist.device
    shape = SHAPES[args.shape]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    with torch.device(device):
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape, dtype=dtype)
    pad = built.tokenizer.pad_token_id or 0
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    prompts, responses = lengths(args.sequences, generator, short=args.shape == "tiny")
    vocab = shape["vocab_size"]

    def micro_batch(rows: list[int]):
        width_p, width_r = max(prompts[i] for i in rows), max(responses[i] for i in rows)
        ids = torch.full((len(rows), width_p), pad)
        attention = torch.zeros(len(rows), width_p, dtype=torch.long)
        answer = torch.full((len(rows), width_r), pad)
        mask = torch.zeros(len(rows), width_r, dtype=torch.long)
        for j, i in enumerate(rows):
            ids[j, width_p - prompts[i]:] = torch.randint(100, vocab, (prompts[i],), generator=generator)
            attention[j, width_p - prompts[i]:] = 1
            answer[j, :responses[i]] = torch.randint(100, vocab, (responses[i],), generator=generator)
            mask[j, :responses[i]] = 1
        seqs = join({"input_ids": ids, "attention_mask": attention}, answer, mask, built.adapter, built.model, pad)
        return seqs.to(device), torch.randn(len(rows), 1, generator=generator).to(device)

    groups = bins_by_tokens([p + r for p, r in zip(prompts, responses)], args.micro_batch_tokens)
    batches = [micro_batch(rows) for rows in groups]
    response_tokens = sum(responses)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-6), pack=True,
                    pack_tokens=max(args.micro_batch_tokens, max(p + r for p, r in zip(prompts, responses))))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist.distributed:
            torch.distributed.barrier()

    def step() -> float:
        sync()
        start = time.perf_counter()
        for seqs, advantage in batches:
            logp, _ = engine.log_probs(seqs)
            (-(logp * advantage * seqs.response_mask).sum() / response_tokens).backward()
        engine.step()
        sync()
        return time.perf_counter() - start

    step()  # warm-up (and compiles, in one GPU process)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    samples = [step() for _ in range(args.repeats)]
    if dist.rank == 0:
        median = statistics.median(samples)
        real = sum(prompts) + sum(responses)
        args.worker.write_text(json.dumps({
            "world_size": dist.world_size, "sharded": engine.sharded, "median_step_s": median, "samples_s": samples,
            "real_tokens_per_rank": real, "micro_batches": len(batches),
            "real_tokens_per_s": dist.world_size * real / median,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "compiled_layers": engine.compiled_layers is not None and engine.compiled_layers.enabled,
        }))
    if dist.distributed:
        torch.distributed.destroy_process_group()
        exit_cleanly()


def run(args, processes: int) -> dict:
    """One torchrun run of the worker with `processes` processes: rank 0's record."""
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "run.json"
        options = ["--device", args.device, "--shape", args.shape, "--sequences", str(args.sequences),
                   "--micro-batch-tokens", str(args.micro_batch_tokens), "--repeats", str(args.repeats)]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   __file__, *options, "--worker", str(result)]
        env = dict(os.environ)
        if args.device == "cpu":
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO, env=env)
        if done.returncode != 0 or not result.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"fsdp_scaling: the {processes}-process run failed (exit {done.returncode}): {tail[0]}")
        return json.loads(result.read_text())


def main() -> None:
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    if args.nproc < 2:
        raise SystemExit("fsdp_scaling: --nproc must be at least 2")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"fsdp_scaling: --nproc {args.nproc} needs as many GPUs, {torch.cuda.device_count()} visible")
    from mmrl.platform_info import device_name, versions, write_report

    one = run(args, 1)
    print(f"1 process: {one['median_step_s']:.3f} s a step, {one['real_tokens_per_s']:.0f} real tok/s")
    many = run(args, args.nproc)
    efficiency = many["real_tokens_per_s"] / (args.nproc * one["real_tokens_per_s"])
    print(f"{args.nproc} processes: {many['median_step_s']:.3f} s a step, {many['real_tokens_per_s']:.0f} real tok/s, "
          f"efficiency {efficiency:.2f}")
    report = {
        "bench": "bench/fsdp_scaling.py", "command": "python bench/fsdp_scaling.py " + " ".join(sys.argv[1:]),
        "device": device_name(args.device), "versions": versions(), "shape": args.shape,
        "sequences_per_rank": args.sequences, "micro_batch_tokens": args.micro_batch_tokens, "repeats": args.repeats,
        "runs": {"1": one, str(args.nproc): many}, "processes": args.nproc, "efficiency": efficiency,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
