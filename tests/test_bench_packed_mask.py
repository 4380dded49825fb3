"""bench/packed_mask.py on CPU: every mode builds the plain path's mask and segments."""

import json
import sys

from bench_scripts import BENCH, load_bench


def test_the_smoke_run_builds_the_same_mask_and_segments_in_every_mode(tmp_path, monkeypatch):
    out = tmp_path / "packed_mask.json"
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports bench/packing.py's lengths
    monkeypatch.setattr(sys, "argv", ["packed_mask.py", "--device", "cpu", "--tiny", "--repeats", "1",
                                      "--micro-batch-tokens", "300", "--out", str(out)])
    load_bench("packed_mask").main()
    report = json.loads(out.read_text())
    assert len(report["micro_batches"]) > 1 and report["all_equal"]
    for batch in report["micro_batches"]:
        assert set(batch["modes"]) == {"plain", "segments", "packed"}
        assert all(mode["equal_to_plain"] and mode["median_ms"] > 0 for mode in batch["modes"].values())
