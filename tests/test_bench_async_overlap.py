"""bench/async_overlap.py on CPU: the tiny shape, 3 steps, the synchronous and concurrent
recipes and two of the variants that isolate the thread's slowness (its batch with the
main thread idle, a shorter switch interval) in one call, and the JSON the GPU run is
read from."""

import json

BENCH_SCRIPT = "async_overlap"


def test_async_overlap_bench_runs_its_recipes_and_writes_their_ratio(bench, tmp_path):
    out = tmp_path / "async_overlap.json"
    runs_asked = ["sync", "concurrent", "concurrent_idle", "concurrent_switch"]
    report = bench.main(["--device", "cpu", "--shape", "tiny", "--steps", "3", "--new-tokens", "4",
                         "--prompts", "2", "--samples", "2", "--prompt-words", "5", "10",
                         "--runs", *runs_asked, "--set", "model.dtype=float32", "--switch-ms", "0.25",
                         "--run-timeout", "600", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    runs = report["runs"]
    assert set(runs) == set(runs_asked)
    assert all(run.get("steps_done") == 3 and "error" not in run for run in runs.values()), runs
    assert runs["sync"]["type"] == "BufferedSteps" and runs["concurrent"]["type"] == "ConcurrentSteps"
    assert "overlap/waited_for_rollout_s" in runs["concurrent"]["median_phase_s"]
    assert "rollout_s" in runs["sync"]["median_phase_s"] and "update_s" in runs["sync"]["median_phase_s"]
    assert set(report["ratio"]) == set(runs_asked)
    assert report["ratio"]["sync"] == {"median_step": 1.0, "whole_run": 1.0}
    assert [step["staleness"] for step in runs["concurrent"]["per_step"]] == [0.0, 1.0, 1.0]
    # Where the rollouts' seconds went: the main thread's loop in the sync run, the
    # thread's batch (collected at step 3) in the concurrent ones, and their decode paths.
    assert runs["sync"]["per_step"][2]["loop/decode_s"] > 0 and "loop/decode_wait_s" in runs["sync"]["median_phase_s"]
    assert runs["sync"]["decode_path"]["main"].startswith("eager step")
    for name in runs_asked[1:]:
        step = runs[name]["per_step"][2]
        assert step["overlap/decode_s"] > 0 and step["overlap/decode_steps"] >= 1, (name, step)
        assert runs[name]["decode_path"]["thread"].startswith("eager step"), runs[name]["decode_path"]
        assert "compile_s" in step
    assert runs["concurrent_switch"]["overrides"][-2:] == ["algo.overlap_switch_interval_ms=0.25",
                                                          "model.dtype=float32"]
    assert runs["concurrent_switch"]["per_step"][2]["overlap/switch_interval_ms"] == 0.25
    assert runs["concurrent"]["per_step"][2]["overlap/switch_interval_ms"] == 5.0  # Python's own
    # concurrent_idle: the thread's batch was done before the update began, so the update
    # found it done and the thread waited for the whole update.
    idle = runs["concurrent_idle"]["per_step"][2]
    assert idle["overlap/waited_for_update_s"] > 0
