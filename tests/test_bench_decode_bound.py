"""bench/decode_bound.py on CPU: a tiny shape, 3 decode steps without compiling. The
timings mean nothing here; the report's fields and the bound's arithmetic do.

    .venv/bin/python -m pytest -q tests/test_bench_decode_bound.py
"""

import pytest

from bench_scripts import bench_report

BENCH_SCRIPT = "decode_bound"


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    return bench_report(bench, tmp_path_factory, [
        "--device", "cpu", "--shapes", "tiny", "tiny_vl", "--batch", "4", "--cache-length", "256", "--steps", "3",
        "--no-compile", "--bandwidth-gbs", "1000", "--rollout-options", "check_every=4"])


def test_the_report_holds_each_shapes_step_time_and_bound(report):
    assert report["errors"] == {} and sorted(report["shapes"]) == ["tiny", "tiny_vl"]
    assert report["rollout_options"] == {"check_every": 4} and report["compile"] is False
    assert report["command"].startswith("python bench/decode_bound.py --device cpu")
    for run in report["shapes"].values():
        assert run["fallback"] is None  # the compiled rollout's own loop ran, not plain generate
        assert run["steps_timed"] == run["steps_run"] == 3 and len(run["step_ms"]) == 3
        assert run["prompt_tokens"] == 256 - 4 and run["cache_length"] == 256
        assert run["ms_per_step"] > 0 and run["tokens_per_s"] == pytest.approx(4 / (run["ms_per_step"] / 1e3))
        assert run["ratio"] == pytest.approx(run["ms_per_step"] / run["bound_ms"])
        assert run["cache_dtype"] == "torch.bfloat16"


def test_the_bound_is_the_weights_and_cache_bytes_over_the_bandwidth(report):
    """By hand, for the tiny text shapes (hidden 64, MLP 128, 2 layers, 4 query heads and 2
    key/value heads of 16, 1,000-row vocabulary, bf16): a layer holds q (64x64 + 64), k and
    v (64x32 + 32 each), o (64x64), the MLP (3 x 64x128) and two norms (2 x 64)."""
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    decoder = 2 * layer + 64  # the layers and the final norm
    head = 1000 * 64
    # Tied (qwen2 tiny): the output embedding is the input one, read once. Untied (tiny_vl):
    # the input embedding is not read (rows gathered), nor the vision tower.
    weights = 2 * (decoder + head)
    cache = 2 * 2 * 4 * 2 * 16 * 256 * 2  # keys+values x layers x batch x kv heads x head dim x positions x bytes
    for name in ("tiny", "tiny_vl"):
        run = report["shapes"][name]
        assert run["weight_bytes_read"] == weights == 276_608
        assert run["kv_cache_bytes"] == cache == 262_144
        assert run["bound_ms"] == pytest.approx((weights + cache) / 1000e9 * 1e3)
    # The VL model holds more than its decoder reads: its vision tower and its input embedding.
    assert report["shapes"]["tiny_vl"]["parameters"] * 2 > weights
    assert report["shapes"]["tiny"]["parameters"] * 2 == weights


def test_bad_options_fail_in_one_line(bench, tmp_path):
    for argv, words in ((["--rollout-options", "warp=9"], "'warp' is not a CompiledHFRollout option"),
                        (["--rollout-options", "check_every"], "is not key=value"),
                        (["--cache-length", "300"], "must be a multiple of 256")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--device", "cpu", "--shapes", "tiny", "--batch", "2", "--steps", "3", "--no-compile",
                        "--out", str(tmp_path / "x.json"), *argv])
        assert str(exit_.value).startswith("error: ") and words in str(exit_.value)
        assert "\n" not in str(exit_.value)


def test_profile_steps_add_a_kernel_table_of_the_decode_step(bench, tmp_path):
    """--profile-steps runs one more rollout with that many decode steps under the profiler
    (on CPU its table counts aten operators); too many for --steps fails in one line."""
    out = tmp_path / "profiled.json"
    report = bench.main(["--device", "cpu", "--shapes", "tiny", "--batch", "2", "--cache-length", "256",
                         "--steps", "11", "--no-compile", "--profile-steps", "3", "--profile-top", "4",
                         "--out", str(out)])
    profile = report["shapes"]["tiny"]["profile"]
    assert profile["profiled_steps"] == 3 and len(profile["top"]) == 4
    assert profile["kernels_per_step"] > 0 and "matmul" in profile["groups"]
    assert report["shapes"]["tiny"]["steps_timed"] == 11  # the timed rollout is not the profiled one
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", "--shapes", "tiny", "--steps", "9", "--profile-steps", "2",
                    "--out", str(out)])
    assert "at most --steps - 8 (1)" in str(exit_.value)
