"""Alternating timed runs of a bench's modes, the loop the GPU benches share.

    samples, medians, peaks, failed = alternate(modes, step, repeats, device, free)

Each mode runs once to warm up, then `repeats` rounds run every mode once in turn, so a
slow stretch of the machine touches all of them alike. `step(mode)` returns seconds; a
mode whose step runs out of memory is recorded in `failed` (the error's first line) and
dropped, after `free()` has released what its partial run held.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def alternate(modes: list[str], step: Callable[[str], float], repeats: int, device: torch.device,
              free: Callable[[], None], after_warm_up: Callable[[], None] | None = None
              ) -> tuple[dict, dict, dict, dict]:
    """(seconds per mode, median per mode, peak GiB allocated per mode on CUDA, failures);
    `after_warm_up` runs between the warm-up and the timed rounds."""
    failed: dict[str, str] = {}

    def attempt(mode: str) -> float | None:
        try:
            return step(mode)
        except torch.OutOfMemoryError as exc:
            failed[mode] = str(exc).splitlines()[0][:200]
            free()
            torch.cuda.empty_cache()
            return None

    for mode in modes:  # warm-up
        attempt(mode)
    modes = [m for m in modes if m not in failed]
    if after_warm_up is not None:
        after_warm_up()
    samples: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, float] = {}
    for _ in range(repeats):
        for mode in modes:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = attempt(mode)
            if seconds is not None:
                samples[mode].append(seconds)
            if device.type == "cuda":
                peaks[mode] = max(peaks.get(mode, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
    medians = {m: statistics.median(v) for m, v in samples.items() if v}
    return samples, medians, peaks, failed


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), the first match wins
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("triton", ("triton",)),
    ("reduce", ("reduce", "softmax", "norm")),
    ("copy", ("copy", "cat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "foreach", "adam")),
)


def kernel_profile(run: Callable[[], None], top: int = 12, gaps: bool = False) -> dict:
    """CUDA time of one `run()` by kernel kind (KERNEL_KINDS) and its `top` kernels, with
    the wall time around it; `idle_ms` is the wall time no kernel ran (the launches are on
    one stream), i.e. what the CPU side costs. With `gaps`, also where that idle time goes:
    the Python frames (`idle_gaps`) the CPU was in when each idle stretch began."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + [ProfilerActivity.CPU] * gaps
    with profile(activities=activities, with_stack=gaps) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total / 1e3
            entry[1] += 1
    kinds: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        lower = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(s in lower for s in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    busy = sum(kinds.values())
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
    result = {"wall_ms": wall * 1e3, "kernel_ms": busy, "idle_ms": max(wall * 1e3 - busy, 0.0),
              "by_kind_ms": dict(sorted(kinds.items(), key=lambda item: -item[1])),
              "top_kernels": [{"name": name[:120], "ms": ms, "calls": calls} for name, (ms, calls) in ranked]}
    if gaps:
        result["idle_gaps"] = _idle_gaps(prof, top)
    return result


def _idle_gaps(prof, top: int, threshold_us: float = 50.0) -> list[dict]:
    """Idle stretches between kernels longer than `threshold_us`, summed by the innermost
    frames of mmrl, transformers or bench code the CPU was in when each began."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    ours = ("mmrl/", "models/", "transformers/", "bench/", "peft/")
    frames = sorted((e for e in events if e.get("cat") == "python_function"
                     and any(part in e["name"] for part in ours)), key=lambda e: e["ts"])

    def where(ts: float) -> str:
        inside = [e["name"] for e in frames if e["ts"] <= ts <= e["ts"] + e.get("dur", 0)]
        return " > ".join(name.split("/")[-1] for name in inside[-3:]) or "(no frame of ours)"

    totals: dict[str, list[float]] = {}
    for before, after in zip(kernels, kernels[1:]):
        idle = after["ts"] - (before["ts"] + before.get("dur", 0))
        if idle > threshold_us:
            entry = totals.setdefault(where(before["ts"] + before.get("dur", 0)), [0.0, 0])
            entry[0] += idle / 1e3
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [{"where": name, "ms": ms, "count": count} for name, (ms, count) in ranked]


def print_profile(label: str, profile: dict) -> None:
    print(f"profile {label}: wall {profile['wall_ms']:.1f} ms, kernels {profile['kernel_ms']:.1f} ms, "
          f"idle {profile['idle_ms']:.1f} ms")
    print("  by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in profile["by_kind_ms"].items()))
    for kernel in profile["top_kernels"]:
        print(f"  {kernel['ms']:8.2f} ms {kernel['calls']:5d}x  {kernel['name']}")
    for gap in profile.get("idle_gaps", []):
        print(f"  idle {gap['ms']:7.2f} ms {gap['count']:4d}x  {gap['where']}")
