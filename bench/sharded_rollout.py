"""HF rollout speed under FSDP2: plain `generate` of the sharded engine (every rank steps
together, `synced_gpus`) against the compiled decode loop on each rank's inference copy of
the full weights (`rollout.backend: hf_compiled`, mmrl/rollout/inference_copy.py).

`torchrun --nproc_per_node N` of this script's worker; the engine shards with FSDP2 even for
N = 1 (a mesh of one rank: the sharded code paths on a one-GPU machine). A 0.5B-shaped Qwen2
(random init, 152k vocabulary) in bf16 compute (fp32 weights under FSDP2's mixed precision;
fp32 on CPU), per rank a batch of `--batch` rows of `--prompt` random tokens (other tokens on
each rank) and `--new-tokens` greedy tokens per row. Plain `generate` is warmed up on a short
run; the compiled loop on one full run (gathering the copy, compiling, capturing: warm_up_s).
Then `--repeats` alternating timed runs, each compiled one after the copy is marked stale and
gathered again, as after an update (gather_s); tokens/s per rank = rows x new tokens /
seconds, medians by rank 0's clock. Greedy rows of both are compared on every run. JSON to
--out.

    python bench/sharded_rollout.py --nproc 1 --out $OUT/sharded_rollout_gpu.json
    python bench/sharded_rollout.py --nproc 2 --out $OUT/sharded_rollout_gpu_x2.json
    .venv/bin/python bench/sharded_rollout.py --device cpu --shape tiny --nproc 2 --batch 4 --prompt 16 \
        --new-tokens 8 --repeats 1 --out /tmp/sharded_rollout.json   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mmrl.platform_info import write_report

REPO = Path(__file__).resolve().parents[1]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
parser.add_argument("--shape", default="0.5b", choices=("0.5b", "tiny"))
parser.add_argument("--nproc", type=int, default=1, help="processes (one GPU each); the engine shards even for 1")
parser.add_argument("--batch", type=int, default=64, help="rows per rank")
parser.add_argument("--prompt", type=int, default=256)
parser.add_argument("--new-tokens", type=int, default=256)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--inference-copy", default="auto", choices=("auto", "keep", "free"))
parser.add_argument("--timeout", type=int, default=900, help="seconds for the torchrun run")
parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sharded_rollout_gpu.json")
parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def sharded_dist(device_type: str):
    """torchrun's process group as a `Dist` whose engine shards even with one rank."""
    import torch.distributed as torch_dist
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.parallel import Dist
    from mmrl.parallel.mesh import backend

    class Sharded(Dist):
        @property
        def distributed(self) -> bool:
            return True

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch_dist.init_process_group(backend(device_type))
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    return Sharded(rank=rank, world_size=world, local_rank=local, device=device, mesh=mesh)


def worker(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from packing import SHAPES

    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.parallel.mesh import exit_cleanly
    from mmrl.platform_info import device_name, versions
    from mmrl.rollout import SamplingParams
    from mmrl.rollout.compiled import CompiledHFRollout
    from mmrl.rollout.hf import HFRollout
    from mmrl.rollout.inference_copy import describe

    dist = sharded_dist(args.device)
    device = dist.device
    shape = SHAPES[args.shape]
    with torch.device(device):
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape)
    engine = Engine(built, dist)
    engine.model.eval()
    plain = HFRollout(engine, built.processing)
    fast = CompiledHFRollout(engine, built.processing, compile=device.type == "cuda",
                             inference_copy=args.inference_copy)
    generator = torch.Generator().manual_seed(dist.rank)  # each rank its own prompts
    ids = torch.randint(shape["vocab_size"] // 4, shape["vocab_size"], (args.batch, args.prompt), generator=generator)
    batch = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)

    def timed(step):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - start

    with torch.no_grad():
        timed(lambda: plain._sample(batch, None, SamplingParams(max_new_tokens=4, temperature=0)))
        _, warm_up = timed(lambda: fast._sample(batch, None, params))
        seconds = {"plain": [], "compiled": [], "gather": []}
        identical = []
        for _ in range(args.repeats):
            (theirs, _), t_plain = timed(lambda: plain._sample(batch, None, params))
            fast.copy.stale()  # as after an update: the copy is gathered again
            _, t_gather = timed(lambda: fast.copy.refresh(engine))
            (ours, _), t_fast = timed(lambda: fast._sample(batch, None, params))
            seconds["plain"].append(t_plain)
            seconds["compiled"].append(t_fast)
            seconds["gather"].append(t_gather)
            width = min(theirs.shape[1], ours.shape[1])
            identical.append(float((theirs[:, :width] == ours[:, :width]).all(-1).float().mean()))
    identical = dist.all_gather_objects(identical)
    if dist.is_main:
        tokens = args.batch * args.new_tokens
        median = {k: statistics.median(v) for k, v in seconds.items()}
        report = {
            "device": device_name(str(device)), "versions": versions(), "world_size": dist.world_size,
            "sharded": engine.sharded, "shape": args.shape, "batch_per_rank": args.batch,
            "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "tokens_per_s_per_rank": {k: tokens / median[k] for k in ("plain", "compiled")},
            "median_s": median, "seconds": seconds, "speedup": median["plain"] / median["compiled"],
            "warm_up_s": warm_up, "fallback": fast.fallback_reason, "inference_copy": describe(fast.copy),
            "copy_bytes": fast.copy.bytes, "copy_dtype": str(fast.copy.dtype).removeprefix("torch."),
            "copy_kept": fast.copy.keep, "greedy_rows_identical_by_rank": identical,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        }
        write_report(args.out, report)
    dist.barrier()
    torch.distributed.destroy_process_group()
    exit_cleanly()


def main(args) -> None:
    options = ["--device", args.device, "--shape", args.shape, "--batch", str(args.batch), "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--inference-copy", args.inference_copy, "--out", str(args.out)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, *options, "--worker"]
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO, env=env)
    if done.returncode != 0:
        raise SystemExit(f"sharded_rollout: the {args.nproc}-process run failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout)[-3000:]}")
    report = json.loads(args.out.read_text())
    report["command"] = "python bench/sharded_rollout.py " + " ".join(options[:-2] + ["--nproc", str(args.nproc)])
    write_report(args.out, report)
    rate = report["tokens_per_s_per_rank"]
    print(f"{report['world_size']} rank(s), FSDP2: plain generate {rate['plain']:.0f} tok/s/rank, compiled on the "
          f"copy {rate['compiled']:.0f} tok/s/rank ({report['speedup']:.2f}x); gather {report['median_s']['gather']:.2f}"
          f" s; warm-up {report['warm_up_s']:.1f} s; {report['inference_copy']}; fallback {report['fallback']}")


if __name__ == "__main__":
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
