"""bench/decode_ab_summary.py: a call's raw VL-3B runs summed up as the README's 50-step rows read them."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import decode_ab_summary  # noqa: E402


def test_the_summary_reads_each_raw_run(tmp_path):
    raw = ROOT / "bench" / "results" / "decode_graphs_vl3b_freeze_gpu_raw.json"
    out = tmp_path / "decode_ab_x_gpu.json"
    report = decode_ab_summary.main([str(raw), "--command", "c", "--main-at", "m", "--shape", "s", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    (name, run), = json.loads(raw.read_text())["runs"].items()
    summary = report["summary"][name]
    assert summary["whole_run_s"] == run["whole_run_s"] and summary["steps_done"] == run["steps_done"]
    assert summary["first_step_split_s"]["step_s"] == round(run["per_step"][0]["step_s"], 2)
    assert summary["slow_steps"][0][0] == 1  # the compiling step
    assert summary["vs_trl_50_steps_estimate"] == round(50 * 12.4 / run["whole_run_s"], 2)
    # the README's reader (bench/gpu_targets.py) takes it as it takes the earlier summaries
    import gpu_targets

    entries = [e for e in gpu_targets.whole_run_entries() if "gc freeze" in e["name"]]
    assert entries and all(e["target"] == report["target_vs_trl"] for e in entries)
