"""bench/timing.py's idle-time attribution (`kernel_profile(..., gaps=True)` on a GPU), on
a trace written by hand: which idle stretches count and where they are put."""

import json
from pathlib import Path

from bench_scripts import load_bench


class _Trace:
    """Stands for a torch profiler: writes `events` as its Chrome trace."""

    def __init__(self, events):
        self.events = events

    def export_chrome_trace(self, path):
        Path(path).write_text(json.dumps({"traceEvents": self.events}))


def _kernel(ts, dur):
    return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur}


def _frame(name, ts, dur):
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur}


def test_idle_gaps_are_summed_by_the_innermost_frames_of_ours_when_they_begin():
    timing = load_bench("timing")
    events = [
        _kernel(0, 10), _kernel(20, 10),  # 10 us apart: under the threshold, not counted
        _kernel(100, 10),  # 70 us idle from 30, while the CPU packs
        _kernel(300, 10),  # 190 us idle from 110, inside the same frames
        _kernel(400, 10),  # 90 us idle from 310, in torch code alone
        _frame("mmrl/engine/engine.py(401): log_probs", 25, 200),
        _frame("mmrl/engine/packing.py(75): pack_sequences", 28, 190),
        _frame("torch/nn/modules/module.py(1): _call_impl", 305, 50),
    ]
    gaps = timing._idle_gaps(_Trace(events), top=5)
    where = "engine.py(401): log_probs > packing.py(75): pack_sequences"
    assert gaps == [
        {"where": where, "ms": (70 + 190) / 1e3, "count": 2},
        {"where": "(no frame of ours)", "ms": 90 / 1e3, "count": 1},
    ]
