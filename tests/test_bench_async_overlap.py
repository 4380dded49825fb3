"""bench/async_overlap.py on CPU: the tiny shape, 2 steps, the synchronous and concurrent
recipes in one call, and the JSON the GPU run is read from."""

import json

BENCH_SCRIPT = "async_overlap"


def test_async_overlap_bench_runs_both_recipes_and_writes_their_ratio(bench, tmp_path):
    out = tmp_path / "async_overlap.json"
    report = bench.main(["--device", "cpu", "--shape", "tiny", "--steps", "2", "--new-tokens", "4", "--prompts", "2",
                         "--samples", "2", "--prompt-words", "5", "10", "--runs", "sync", "concurrent", "--set",
                         "model.dtype=float32", "--run-timeout", "600", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    runs = report["runs"]
    assert set(runs) == {"sync", "concurrent"}
    assert all(run.get("steps_done") == 2 and "error" not in run for run in runs.values()), runs
    assert runs["sync"]["type"] == "BufferedSteps" and runs["concurrent"]["type"] == "ConcurrentSteps"
    assert "overlap/waited_for_rollout_s" in runs["concurrent"]["median_phase_s"]
    assert "rollout_s" in runs["sync"]["median_phase_s"] and "update_s" in runs["sync"]["median_phase_s"]
    assert set(report["ratio"]) == {"sync", "concurrent"}
    assert report["ratio"]["sync"] == {"median_step": 1.0, "whole_run": 1.0}
    assert [step["staleness"] for step in runs["concurrent"]["per_step"]] == [0.0, 1.0]
