"""Python's garbage collections, seen from the run: the seconds each step spent in them and
how many were full (generation 2) collections. A full collection walks every object the
process tracks, and a run that compiled holds millions of them (dynamo's and inductor's
records of each graph), so one full collection can stall a step for a second or more; the
trainer writes the step's seconds as `time/gc` beside `time/compile` (the benches record the
count of full collections too: bench/trl_grpo_step.py's `gc_full`).

After a step that compiled, the trainer collects once and moves what the process still
holds out of the collector's reach (`GcWatch.freeze_after`, `gc.collect()` then
`gc.freeze()`; `trainer.gc_freeze`), as serving engines do once their graphs are captured:
the compiles' records live as long as the run, and later full collections walk only what
the run made since, where each would otherwise walk all of them again. A run that compiles
in its first step freezes once before it too (`GcWatch.freeze_now`, at the end of the
trainer's start): what the imports and the build made (the model, the libraries' modules)
then stays out of the first step's full collections, which walk only what the compiles
make. The collection comes first because tracing leaves garbage in reference cycles that
holds live objects, such as the decode step's static caches: frozen, it would keep them,
and their device memory, after the rollout lets them go. Objects frozen are still freed when nothing refers to them; only a
reference cycle made among them later outlives the run's collections.

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
        self._frozen_at = 0  # the compile count at the last freeze
        self.frozen = 0  # objects moved out of the collector's reach, in all
        # Each full collection's seconds, the latest last (the benches read the first step's).
        self.full_seconds: list[float] = []

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
            if info.get("generation") == 2:
                self.full += 1
                self.full_seconds = [*self.full_seconds[-63:], spent]

    def take(self) -> tuple[float, int]:
        """Seconds and full collections since the previous `take`."""
        with self._lock:
            seconds, full = self.seconds - self._taken[0], self.full - self._taken[1]
            self._taken = (self.seconds, self.full)
        return seconds, full

    def freeze_after(self, compiles: int) -> bool:
        """Freeze what the process holds where `compiles` (the process's count of compiled
        graphs, `CompileWatch.graphs`) grew since the last freeze; True where it froze."""
        if compiles <= self._frozen_at:
            return False
        self._frozen_at = compiles
        self.freeze_now()
        return True

    def freeze_now(self) -> int:
        """Collect, then move what the process holds out of later collections' walk; returns
        how many objects moved."""
        gc.collect()  # the garbage first: frozen, its cycles would keep what they refer to
        before = gc.get_freeze_count()
        gc.freeze()
        moved = gc.get_freeze_count() - before
        self.frozen += moved
        return moved


_WATCH = GcWatch()


def watch_gc() -> GcWatch:
    """The process's one watch, installed on first use."""
    _WATCH.install()
    return _WATCH


__all__ = ["GcWatch", "watch_gc"]
