"""Python's garbage collections, seen from the run: the seconds each step spent in them and
how many were full (generation 2) collections. A full collection walks every object the
process tracks, and a run that compiled holds millions of them (dynamo's and inductor's
records of each graph), so one full collection can stall a step for a second or more; the
trainer writes the step's seconds as `time/gc` beside `time/compile` (the benches record the
count of full collections too: bench/trl_grpo_step.py's `gc_full`).

    from mmrl.gc_watch import watch_gc
    watch_gc().take()     # (seconds, full collections) since the last take
"""

from __future__ import annotations

import gc
import threading
import time


class GcWatch:
    """Seconds spent in the collector and the number of full collections, by a callback that
    Python runs at the start and the end of every collection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: float | None = None
        self.seconds = 0.0
        self.full = 0
        self._taken = (0.0, 0)

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        spent = time.perf_counter() - self._started
        self._started = None
        with self._lock:
            self.seconds += spent
            self.full += info.get("generation") == 2

    def take(self) -> tuple[float, int]:
        """Seconds and full collections since the previous `take`."""
        with self._lock:
            seconds, full = self.seconds - self._taken[0], self.full - self._taken[1]
            self._taken = (self.seconds, self.full)
        return seconds, full


_WATCH = GcWatch()


def watch_gc() -> GcWatch:
    """The process's one watch, installed on first use."""
    _WATCH.install()
    return _WATCH


__all__ = ["GcWatch", "watch_gc"]
