"""A long multi-image sample under Ulysses sequence parallelism: one GRPO-style update of one
sample with many images, in one process against 2 processes that split its sequence
(`init_distributed(sequence_parallel=2)`, FSDP2 over the same 2 ranks), in one run.

The model is a random-init Qwen2.5-VL: `--shape vl3b` the VL-3B shape of
recipes/qwen2_5_vl_3b_shape.yaml (bf16 weights, fp32 masters; 448x448 images, 256 image
tokens each), `--shape tiny` the family's tiny config (fp32, 56x56 images). The sample is one
prompt with `--images` noise images and a `--response`-token random response. With
`--images 0` (the GPU default) the count is sized from free memory: a one-process calibration
launch updates 1, 2 and 4 images and reads the peak memory, then tries the count whose
predicted peak is `--oversize` x the GPU's memory (at most `--max-images`), which should run
out of memory, while the 2-process launch trains it. On CPU `--memory-gib` stands for the
GPU's memory and the peaks are the process's max RSS (a dry run of the sizing path). Rank 0
of each torchrun launch writes what it saw per image count (`fits`, image and sequence tokens, peak GiB, seconds,
the response's log-probs); where both fit from the same weights (`--images N`, not sized),
`logp_max_gap` is the largest gap between the 2-rank and the one-process log-probs (`--shape tiny` runs in fp32 without autocast or TF32,
as the sequence_parallel probe: a CUDA check that 2 Ulysses ranks equal one process). JSON
to --out.

    python bench/ulysses_long_sample.py --out $OUT/ulysses_long_sample_gpu.json     # 2 GPUs
    .venv/bin/python bench/ulysses_long_sample.py --device cpu --shape tiny --memory-gib 1 --max-images 3 \
        --response 8 --out /tmp/ulysses_long_sample.json                            # smoke run, sizing path
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHAPE_RECIPE = REPO / "recipes" / "qwen2_5_vl_3b_shape.yaml"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
parser.add_argument("--shape", default="vl3b", choices=("vl3b", "tiny"))
parser.add_argument("--images", type=int, default=0, help="images in the sample (0: sized from free GPU memory)")
parser.add_argument("--response", type=int, default=256, help="response tokens")
parser.add_argument("--max-images", type=int, default=400, help="the most images sizing may choose")
parser.add_argument("--oversize", type=float, default=1.3, help="predicted one-GPU peak / GPU memory when sizing")
parser.add_argument("--timeout", type=int, default=300, help="seconds per torchrun launch")
parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ulysses_long_sample_gpu.json")
parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # rank 0's JSON
parser.add_argument("--memory-gib", type=float, default=None,
                    help="CPU only: the memory to size the sample against (peaks are then the process's max RSS)")
parser.add_argument("--counts", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
parser.add_argument("--size", action="store_true", help=argparse.SUPPRESS)  # then one update of the sized count


def build(args, device):
    """(built, image side in pixels) for the shape, random init on `device`."""
    from mmrl import build_model
    from mmrl.config import load_recipe

    if args.shape == "tiny":
        return build_model("qwen2_5_vl", random_init=True, seed=0, dtype="float32", device=device,
                           processing_options={"min_pixels": 56 * 56, "max_pixels": 56 * 56}), 56
    model = load_recipe(SHAPE_RECIPE).model
    overrides = model.config_overrides
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return build_model("qwen2_5_vl", random_init=True, seed=0, dtype=dtype, device=device, config_overrides=overrides,
                       processing_options={"min_pixels": model.min_pixels, "max_pixels": model.max_pixels}), 448


def one_update(built, engine, dist, images: int, side: int, response: int) -> dict:
    """Forward, backward and optimizer step of one sample with `images` images."""
    from PIL import Image

    from mmrl.engine import join

    noise = torch.Generator().manual_seed(images)
    pictures = [Image.fromarray(torch.randint(0, 256, (side, side, 3), generator=noise, dtype=torch.uint8).numpy())
                for _ in range(images)]
    conversation = [{"role": "user", "content": [*({"type": "image", "image": p} for p in pictures),
                                                 {"type": "text", "text": "How many shapes are there in all?"}]}]
    prompt = dict(built.processing([conversation]))
    vocab = built.model.config.get_text_config().vocab_size
    answer = torch.randint(100, vocab, (1, response), generator=noise)
    mask = torch.ones_like(answer)
    seqs = join(prompt, answer, mask, built.adapter, engine.model, built.tokenizer.pad_token_id).to(dist.device)
    if dist.device.type == "cuda":
        torch.cuda.synchronize(dist.device)
        torch.cuda.reset_peak_memory_stats(dist.device)
    start = time.perf_counter()
    logp, _ = engine.log_probs(seqs)
    (-(logp * seqs.response_mask).sum() / response * dist.dp_size).backward()
    engine.step()
    if dist.device.type == "cuda":
        torch.cuda.synchronize(dist.device)
    image_tokens = int((prompt["input_ids"] == built.model.config.image_token_id).sum())
    return {"images": images, "fits": True, "image_tokens": image_tokens,
            "sequence_tokens": int(prompt["input_ids"].shape[1]) + response, "seconds": time.perf_counter() - start,
            "logp_sum": float(logp.detach().float().sum()), "logp": logp.detach().float()[0].tolist(),
            "peak_gib": peak_gib(dist.device)}


def peak_gib(device: torch.device) -> float:
    """The update's peak memory on a GPU; on CPU the process's max RSS so far (what lets the
    CPU dry run take the sizing path)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def worker(args) -> None:
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed
    from mmrl.parallel.mesh import exit_cleanly
    from mmrl.probes.launcher import exact_numerics

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist = init_distributed(args.device, sequence_parallel=world)
    built, side = build(args, dist.device)
    if args.shape == "tiny":  # fp32 end to end, no TF32: 2 ranks must equal one process to fp32 rounding
        exact_numerics()
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-6), mixed_precision=args.shape != "tiny")
    total = (torch.cuda.get_device_properties(dist.device).total_memory / 2**30 if dist.device.type == "cuda"
             else args.memory_gib)
    runs, sized = [], None

    def attempt_update(images: int) -> None:
        try:
            runs.append(one_update(built, engine, dist, images, side, args.response))
        except torch.OutOfMemoryError as error:  # one process only: 2 ranks would hang in a collective
            engine.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            runs.append({"images": images, "fits": False, "error": str(error).splitlines()[0][:200]})

    for images in args.counts:
        attempt_update(images)
    if args.size:  # in the same process: the calibration's model and optimizer are built already
        sized = sized_count({"gpu_gib": total, "runs": runs[-3:]}, args.oversize, args.max_images)
        attempt_update(sized)
    if dist.rank == 0:
        args.worker.write_text(json.dumps({"world_size": dist.world_size, "sequence_parallel": world,
                                           "gpu_gib": total, "sized_images": sized, "runs": runs}))
    if dist.distributed:
        torch.distributed.destroy_process_group()
        exit_cleanly()


def launch(args, processes: int, counts: list[int], size: bool = False) -> dict:
    """One torchrun launch of the worker: rank 0's record."""
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "run.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   __file__, "--device", args.device, "--shape", args.shape, "--response", str(args.response),
                   "--oversize", str(args.oversize), "--max-images", str(args.max_images),
                   *(["--memory-gib", str(args.memory_gib)] if args.memory_gib else []),
                   *(["--size"] if size else []), "--worker", str(result), "--counts", *map(str, counts)]
        env = dict(os.environ)
        if args.device == "cpu":
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO, env=env)
        if done.returncode != 0 or not result.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"ulysses_long_sample: the {processes}-process launch failed "
                             f"(exit {done.returncode}): {tail[0]}")
        return json.loads(result.read_text())


def attempt(args, processes: int, images: int) -> dict:
    """The update of `images` images on `processes` processes; a launch that failed (2 ranks
    out of memory hang in a collective until the launch's timeout) is recorded as not
    fitting, so the report keeps the other run."""
    try:
        return launch(args, processes, [images])["runs"][0]
    except (SystemExit, subprocess.TimeoutExpired) as failure:
        return {"images": images, "fits": False, "error": str(failure)[:300]}


def sized_count(calibration: dict, oversize: float, most: int) -> int:
    """The image count (at most `most`) whose one-process peak, extrapolated linearly from
    the 2- and 4-image updates, is `oversize` x the GPU's memory. The 1-image update before
    them allocates the optimizer's states, whose first step would otherwise weigh in the
    slope."""
    _, two, four = calibration["runs"]
    per_image = max((four["peak_gib"] - two["peak_gib"]) / 2, 1e-3)
    return max(1, min(most, 2 + math.ceil((oversize * calibration["gpu_gib"] - two["peak_gib"]) / per_image)))


def main() -> None:
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"ulysses_long_sample: needs 2 GPUs, {torch.cuda.device_count()} visible")
    if args.device == "cpu" and args.images < 1 and not args.memory_gib:
        raise SystemExit("ulysses_long_sample: on CPU, give --images N or --memory-gib to size the sample against")
    from mmrl.platform_info import device_name, versions, write_report

    calibration = None
    images = args.images
    if images < 1:  # one launch calibrates, sizes and tries the sized sample in one process
        sizing = launch(args, 1, [1, 2, 4], size=True)
        images, one = sizing["sized_images"], sizing["runs"][-1]
        calibration = {"gpu_gib": sizing["gpu_gib"], "runs": sizing["runs"][:-1]}
    else:
        one = attempt(args, 1, images)
    two = attempt(args, 2, images)
    for name, run in (("1 process", one), ("2 processes", two)):
        print(f"{name}: {images} images, " + (f"{run['sequence_tokens']} tokens, {run['seconds']:.2f} s, peak "
                                               f"{run['peak_gib']} GiB" if run["fits"] else f"did not fit: {run['error']}"))
    report = {
        "bench": "bench/ulysses_long_sample.py", "command": "python bench/ulysses_long_sample.py " + " ".join(sys.argv[1:]),
        "device": device_name(args.device), "versions": versions(), "shape": args.shape, "images": images,
        "response_tokens": args.response, "calibration": calibration, "runs": {"1": one, "2": two},
        "trains_on_two_only": two["fits"] and not one["fits"],
        # Sized, the one-process side has taken the calibration's steps first: other weights.
        "logp_max_gap": max(abs(a - b) for a, b in zip(one["logp"], two["logp"]))
        if one["fits"] and two["fits"] and calibration is None else None,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
