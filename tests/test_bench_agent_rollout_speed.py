"""bench/agent_rollout_speed.py on CPU: the zoom agent's tiny recipe, two prompts x two
samples, 4 tokens a turn, the compiled backend's loop run eagerly. The timings mean
nothing here; the trajectories' shape (two policy turns around one image reply, the same
on both backends) and the report do.

    .venv/bin/python -m pytest -q tests/test_bench_agent_rollout_speed.py
"""

import pytest

from bench_scripts import bench_report

BENCH_SCRIPT = "agent_rollout_speed"


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    return bench_report(bench, tmp_path_factory, [
        "--shape", "tiny", "--prompts", "2", "--samples", "2", "--new-tokens", "4", "--rollout-options",
        "compile=false", "--agent-options", "max_tokens=400", "--repeats", "1", "--profile-prefill", "--profile-host",
        "--no-gc-freeze", "rollout.temperature=1.0"])  # no gc.freeze in the test process


@pytest.mark.slow
def test_both_backends_roll_out_three_turns_with_an_image_reply(report):
    assert report["failed"] == {} and report["same_trajectory_shape"] is True
    assert report["rollout_options"] == {"compile": False} and report["agent_options"] == {"max_tokens": 400}
    assert "rollout.temperature=1.0" in report["recipe_overrides"]
    for name in ("plain", "compiled"):
        run = report["runs"][name]
        shape = run["trajectories"]
        # 4 trajectories, each: prompt, policy turn, image reply, policy turn (the answer).
        assert shape["trajectories"] == 4 and shape["turns"] == [2] and shape["image_replies"] == [1]
        assert shape["finish"] == ["done"]  # no drift: only the digits are sampled
        assert run["policy_tokens"] == 4 * 2 * 4  # every turn runs to its 4 tokens
        assert run["tokens_per_s"] == pytest.approx(run["policy_tokens"] / run["median_s"])
        # The collector's seconds and full collections of each timed rollout.
        assert len(run["gc_s"]) == len(run["gc_full"]) == len(run["seconds"]) == 1
        assert run["gc_s"][0] >= 0 and isinstance(run["gc_full"][0], int)
    assert report["runs"]["compiled"]["fallback"] is None  # the compiled backend's own loop ran
    # One timed rollout per agent after the medians: a line per policy turn; the compiled
    # side's with the session's phases, the first turn prefilled once per distinct opening.
    for name in ("plain", "compiled"):
        turns = report["runs"][name]["phases"]
        assert [t["turn"] for t in turns] == [1, 2] and all(t["generate_s"] > 0 and t["rows"] == 4 for t in turns)
    first, second = (t["session"] for t in report["runs"]["compiled"]["phases"])
    assert all(p["prefill_s"] > 0 and p["decode_s"] > 0 and p["process_s"] > 0 for p in (first, second))
    assert first["prefill_rows"] < 4 and second["prefill_rows"] == 4
    # Checked in the earlier rounds, the timed round's later turn puts its ids together from
    # each row's last prompt and the new text (mmrl/rollout/text_suffix.py).
    assert first["batch"] == "first" and second["batch"] == "text"
    assert report["runs"]["compiled"]["kept_cache"]["text_turns"] == 1
    assert report["runs"]["compiled"]["kept_cache"]["shared_openings"] > 0
    assert report["speedup"] == pytest.approx(report["runs"]["plain"]["median_s"]
                                              / report["runs"]["compiled"]["median_s"])
    # --profile-prefill: one more compiled rollout, each turn's prefill forward profiled (on
    # CPU its aten operators), the first turn's of the distinct openings, the second's of every row.
    profiles = report["runs"]["compiled"]["prefill_profiles"]
    assert [p["rows"] for p in profiles] == [first["prefill_rows"], 4]
    assert all(p["ms"] > 0 and p["kernels_per_step"] > 0 and "matmul" in p["groups"] for p in profiles)
    # --profile-host: one more compiled rollout, the later turn's search for its new media under cProfile.
    host = report["runs"]["compiled"]["host_profile"]
    assert host["calls"] == 1 and host["seconds"] > 0
    assert any("_suffix_media" in row["function"] for row in host["top"])


def test_every_policy_turn_within_the_budget_calls_zoom(bench):
    from mmrl.data.synthetic import count_shapes

    env = bench.CallsZoom(tools=["zoom"], max_calls=1, hide_images=True, reply_role="user")
    env.reset(count_shapes(1, seed=0, image_size=56)[0])
    replies, done, _ = env.step([{"role": "assistant", "content": "3412"}])
    assert not done and replies[0]["role"] == "user"
    assert any(part.get("type") == "image" for part in replies[0]["content"])
    replies, done, _ = env.step([{"role": "assistant", "content": "2"}])
    assert done and replies == []


def test_a_misspelt_option_fails_in_one_line(bench, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bench.key_values(["nokey"], "--agent-options")
    assert "is not key=value" in str(exit_.value)
    with pytest.raises(SystemExit) as exit_:
        bench.set_options(bench.CallsZoom(tools=["zoom"]), {"incremental_prefil": True}, "--agent-options")
    assert "has no option 'incremental_prefil'" in str(exit_.value) and "\n" not in str(exit_.value)


@pytest.mark.slow
def test_the_last_turns_decode_steps_are_profiled_from_their_eighth(bench, tmp_path_factory):
    """--profile-decode: the decode step wrapped in decode_profile.py's StepProbe for one more
    rollout: the steps before the last turn's 8th timed (turn 1's 11 and turn 2's first 7), then
    2 under the profiler (on CPU its aten operators)."""
    report = bench_report(bench, tmp_path_factory, [
        "--shape", "tiny", "--prompts", "2", "--samples", "2", "--new-tokens", "12", "--rollout-options",
        "compile=false", "--agent-options", "max_tokens=400", "--repeats", "1", "--profile-decode", "2"])
    decode = report["runs"]["compiled"]["decode_profile"]
    assert decode["profiled_steps"] == 2 and decode["steps_timed"] == 11 + 7
    assert decode["step_ms"] > 0 and decode["kernels_per_step"] > 0 and "matmul" in decode["groups"]
    with pytest.raises(SystemExit, match="--profile-decode 4: at most --new-tokens - 9 \\(3\\)"):
        bench.main(["--shape", "tiny", "--new-tokens", "12", "--profile-decode", "4", "--out", "/dev/null"])


def test_a_variant_of_the_compiled_backend_runs_in_the_same_rounds(bench, tmp_path_factory):
    """--variant: a third agent over the compiled backend built again with the given
    attributes, timed in the same rounds as the other two, its trajectories of the same
    shape."""
    report = bench_report(bench, tmp_path_factory, [
        "--shape", "tiny", "--prompts", "2", "--samples", "2", "--new-tokens", "4", "--rollout-options",
        "compile=false", "--agent-options", "max_tokens=400", "--repeats", "1", "--no-gc-freeze",
        "--variant", "prefill_layers=false"])
    assert report["variant_options"] == {"prefill_layers": False} and report["same_trajectory_shape"] is True
    variant, compiled = report["runs"]["variant"], report["runs"]["compiled"]
    assert len(variant["seconds"]) == 1 and variant["policy_tokens"] == compiled["policy_tokens"] == 4 * 2 * 4
    assert report["variant_vs_compiled"] == pytest.approx(variant["median_s"] / compiled["median_s"])
    assert [t["session"]["batch"] for t in variant["phases"]] == ["first", "text"]  # its own kept cache
