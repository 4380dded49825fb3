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
