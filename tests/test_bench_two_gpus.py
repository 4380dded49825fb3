"""bench/two_gpus.sh, issue 34's one device call on 2 GPUs, run whole on CPU (`DRY=cpu`: gloo,
tiny shapes, 2 processes) so that the device call cannot fail on a typo: every part writes
the JSON its reader (bench/two_gpus_table.py, gpu_targets' scaling_entry) expects. The
timings mean nothing here; the structure does. The CPU tests of the benches it runs
(fsdp_scaling.py, sharded_rollout.py, ulysses_long_sample.py, distributed_recipe.py) read
that one run's results. Plus the pieces that need no process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "two_gpus.sh"
PARTS = ("scaling", "recipe", "ulysses", "rollout", "disagg", "learn", "cells", "tests")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(output folder, the script's stdout) of one DRY=cpu run of every part. Run once per
    test session: under xdist the module's tests can land on two workers, and each would
    build this module fixture again (about 140 s of 2 processes), so the workers share one
    run in their common temporary folder, the first one running it under a file lock."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()  # under xdist, each worker's folder within the session's
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out, printed = shared / "two_gpus_dry_run", shared / "two_gpus_dry_run.stdout"
    with FileLock(str(shared / "two_gpus_dry_run.lock")):
        if not printed.is_file():
            out.mkdir(exist_ok=True)
            env = {**os.environ, "DRY": "cpu", "OUT": str(out), "OMP_NUM_THREADS": "1",
                   "TOKENIZERS_PARALLELISM": "false"}
            done = subprocess.run(["bash", str(SCRIPT), "all"], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=1500)
            assert done.returncode == 0, done.stderr[-3000:]
            printed.write_text(done.stdout)
    return out, printed.read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_part_ends_well_on_cpu(dry_run):
    out, stdout = dry_run
    for part in PARTS:
        line = next((x for x in stdout.splitlines() if x.startswith(f"{part}: rc ")), None)
        log = out / f"{part}.log"
        assert line is not None and line.startswith(f"{part}: rc 0 "), \
            (part, stdout, log.read_text()[-3000:] if log.is_file() else "no log")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_table_reads_every_part(dry_run):
    out, stdout = dry_run
    table = load_bench("two_gpus_table").rows(out)
    assert [row[0] for row in table] == ["scaling", "recipe", "ulysses", "rollout", "disagg", "learn", "cells"]
    for part, measured, _, status in table:
        assert status in ("met", "missed") and "no result" not in measured and "unreadable" not in measured, part
    assert stdout.rstrip().splitlines()[-len(table) - 1].startswith("part ")  # the table closes the output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_sharded_run_is_compared_with_the_one_process_run(dry_run):
    """bench/fsdp_scaling.py (the scaling part: a tiny model, 2 processes against 1) and
    gpu_targets' reader of its result."""
    out, _ = dry_run
    report = json.loads((out / "fsdp_scaling_gpu.json").read_text())
    one, two = report["runs"]["1"], report["runs"]["2"]
    assert (one["world_size"], one["sharded"]) == (1, False)
    assert (two["world_size"], two["sharded"]) == (2, True)
    assert one["real_tokens_per_rank"] == two["real_tokens_per_rank"] > 0  # weak scaling: the same batch per rank
    assert one["micro_batches"] == two["micro_batches"] >= 1
    expected = two["real_tokens_per_s"] / (2 * one["real_tokens_per_s"])
    assert report["efficiency"] == pytest.approx(expected) and report["efficiency"] > 0
    targets = load_bench("gpu_targets")
    entry = targets.scaling_entry(out / "fsdp_scaling_gpu.json")
    assert entry["measured"] == report["efficiency"] and entry["met"] == (report["efficiency"] >= 0.85)
    assert entry["command"].startswith("python bench/fsdp_scaling.py") and "2 processes" in entry["note"]
    assert targets.scaling_entry(out / "absent.json") is None


def test_a_target_without_a_figure_reads_not_measured():
    """The README table and the console say the same: an unmeasured target (the 2-GPU one
    while no 2-GPU machine is lent) is 'not measured', a measured miss 'missed'."""
    status_of = load_bench("gpu_targets").status_of
    assert status_of({"measured": None, "met": False}) == "not measured"
    assert status_of({"measured": 0.7, "met": False}) == "missed"
    assert status_of({"measured": 0.9, "met": True}) == "met"
    assert status_of({"measured": 2.6, "met": None}) == "info"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_recipe_runs_compare_what_they_say(dry_run):
    out, _ = dry_run
    scaling = json.loads((out / "recipe_scaling_vl3b_gpu.json").read_text())
    assert scaling["compare"] == "scaling" and set(scaling["runs"]) == {"1", "2"}
    one, two = scaling["runs"]["1"], scaling["runs"]["2"]
    assert one["steps"] == two["steps"] == 2 and one["update_tokens_per_s"] > 0
    assert scaling["efficiency"] == pytest.approx(two["update_tokens_per_s"] / one["update_tokens_per_s"])
    disaggregated = json.loads((out / "disaggregated_vl3b_gpu.json").read_text())
    assert set(disaggregated["runs"]) == {"synchronous", "disaggregated"}
    runs = disaggregated["runs"]
    assert disaggregated["speedup"] == pytest.approx(runs["synchronous"]["median_step_s"]
                                                     / runs["disaggregated"]["median_step_s"])
    assert all(run["steps"] == 2 and run["reward_last"] is not None for run in runs.values())
    learning = json.loads((out / "disaggregated_learning_gpu.json").read_text())
    assert learning["target_accuracy"] == 0.95 and all(run["eval_accuracy"] is not None
                                                       for run in learning["runs"].values())
    assert learning["reached_target"] == {"synchronous": False, "disaggregated": False}  # 2 steps: no
    assert learning["steps_ratio"] is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_long_sample_is_sized_then_runs_on_one_rank_and_on_two(dry_run):
    """The DRY run takes the sizing path (--memory-gib on CPU, at most 3 images)."""
    out, _ = dry_run
    report = json.loads((out / "ulysses_long_sample_gpu.json").read_text())
    one, two = report["runs"]["1"], report["runs"]["2"]
    assert [run["images"] for run in report["calibration"]["runs"]] == [1, 2, 4]
    assert report["calibration"]["gpu_gib"] == 1.0
    assert one["fits"] and two["fits"] and not report["trains_on_two_only"]  # nothing runs out of memory on CPU
    assert one["images"] == two["images"] == report["images"] == 3 and one["image_tokens"] > 0
    assert one["sequence_tokens"] == two["sequence_tokens"] and len(one["logp"]) == len(two["logp"]) == 8
    assert report["logp_max_gap"] is None  # the one-process side took the calibration's steps first


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_long_sample_on_two_ulysses_ranks_equals_one_process(tmp_path):
    """Not sized: both sides start from the same weights, and 2 Ulysses ranks (gloo) get one
    process's log-probs; the GPU test below is the same check on CUDA."""
    out = tmp_path / "ulysses.json"
    subprocess.run([sys.executable, "bench/ulysses_long_sample.py", "--device", "cpu", "--shape", "tiny",
                    "--images", "2", "--response", "8", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["calibration"] is None and report["images"] == 2
    assert report["logp_max_gap"] <= 1e-5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cells_and_rollout_are_recorded(dry_run):
    out, _ = dry_run
    cells = json.loads((out / "cells" / "results.json").read_text())["cells"]
    recorded = {(c["family"], c["feature"]): c["status"] for c in cells if c["feature"] in ("fsdp2", "sequence_parallel")}
    assert recorded == {(f, p): "verified" for f in ("qwen2", "qwen2_vl") for p in ("fsdp2", "sequence_parallel")}
    assert "collected" in (out / "tests.log").read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_rollout_bench_compares_both_rollouts_of_a_sharded_engine(dry_run):
    """bench/sharded_rollout.py (the rollout part: a tiny model, 2 processes): the sharded
    engine's plain `generate` against the compiled loop on each rank's inference copy, with
    the copy's gather timed."""
    out, _ = dry_run
    report = json.loads((out / "sharded_rollout_gpu_x2.json").read_text())
    assert report["world_size"] == 2 and report["sharded"] and report["fallback"] is None
    assert report["copy_dtype"] == "float32" and report["copy_kept"] and report["copy_bytes"] > 0
    rates = report["tokens_per_s_per_rank"]
    assert rates["plain"] > 0 and rates["compiled"] > 0
    assert report["speedup"] == pytest.approx(report["median_s"]["plain"] / report["median_s"]["compiled"])
    assert report["median_s"]["gather"] > 0
    # fp32 on CPU: the same greedy rows on every rank.
    assert report["greedy_rows_identical_by_rank"] == [[1.0], [1.0]]
    assert report["command"].startswith("python bench/sharded_rollout.py --device cpu")


def test_each_device_call_fits_its_limits():
    """The two calls take every part once, and each call's limits add up to at most 580 s
    (a device call's 600 s, less room for the wheels)."""
    text = SCRIPT.read_text()
    limits = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A limit=\((.*)\)", text)[1])}
    calls = dict(re.findall(r'\[(\w+)\]="([^"]+)"', re.search(r"declare -A calls=\((.*)\)", text)[1]))
    assert set(calls) == {"benches", "checks", "learning"} and set(limits) == set(PARTS)
    assert sorted(" ".join(calls.values()).split()) == sorted(PARTS)
    for parts in calls.values():
        assert sum(limits[p] for p in parts.split()) <= 580, parts


@pytest.mark.parametrize(("argument", "env", "message"), [
    ("all", {"DRY": "gpu"}, "DRY must be cpu or unset, got 'gpu'"),
    ("", {"DRY": "cpu", "PARTS": "scalling"}, "unknown part 'scalling'"),
    ("", {}, "name a call (benches, checks, learning or all) or set PARTS, got ''"),
    ("all", {}, "need 1540 s, more than one call's 580: split them"),  # refused before installing anything
    ("checks", {"LIMIT_tests": "400"}, "parts 'disagg cells tests' need 750 s"),
])
def test_a_bad_call_is_refused_before_it_runs_anything(tmp_path, argument, env, message):
    done = subprocess.run(["bash", str(SCRIPT), *([argument] if argument else [])], cwd=REPO,
                          env={**os.environ, "OUT": str(tmp_path), **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stdout and not list(tmp_path.glob("*.log"))


def test_the_table_says_no_result_for_a_part_that_wrote_nothing(tmp_path, capsys):
    table = load_bench("two_gpus_table")
    assert all(measured == "no result" and status == "-" for _, measured, _, status in table.rows(tmp_path))
    table.main(str(tmp_path), ["disagg", "cells"])  # one call's parts only
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["part", "disagg", "cells"]


def test_the_long_sample_is_sized_past_one_gpu():
    """The first update's peak (the optimizer's states appear) is left out; 2 images peak at
    70 GiB, 4 at 72: 1 GiB an image, and 1.3 x 140 GiB = 182 GiB needs 112 more than 2."""
    sized_count = load_bench("ulysses_long_sample").sized_count
    calibration = {"gpu_gib": 140.0, "runs": [{"peak_gib": 75.0}, {"peak_gib": 70.0}, {"peak_gib": 72.0}]}
    assert sized_count(calibration, 1.3, most=400) == 114
    assert sized_count(calibration, 1.3, most=100) == 100


def test_steps_to_the_target_compare_only_runs_that_reached_it():
    learning = load_bench("distributed_recipe").learning
    fast, slow, short = {"steps": 100, "eval_accuracy": 0.96}, {"steps": 120, "eval_accuracy": 0.95}, \
        {"steps": 800, "eval_accuracy": 0.5}
    assert learning(0.95, fast, slow)["steps_ratio"] == 1.2
    assert learning(0.95, fast, short) == {"target_accuracy": 0.95, "steps_ratio": None,
                                           "reached_target": {"synchronous": True, "disaggregated": False}}
    assert learning(None, fast, slow)["steps_ratio"] is None


def test_recipe_summary_leaves_the_warm_up_out():
    summary = load_bench("distributed_recipe").summary
    records = [{"step": 1, "time/step": 9.0, "time/update": 5.0, "time/rollout": 4.0, "tokens": 10, "reward/mean": 0.1},
               {"step": 2, "time/step": 2.0, "time/update": 1.0, "time/rollout": 1.0, "tokens": 20, "reward/mean": 0.5},
               {"final": True, "eval/accuracy": 0.75}]
    got = summary(records, warmup=1)
    assert got["steps"] == 2 and got["median_step_s"] == 2.0 and got["update_tokens_per_s"] == 20.0
    assert (got["reward_first"], got["reward_last"], got["eval_accuracy"]) == (0.1, 0.5, 0.75)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ulysses_gpus_equal_one_gpu_on_a_multi_image_sample(tmp_path):
    """On CUDA (nccl), a tiny Qwen2.5-VL's 4-image sample split over 2 Ulysses ranks gets
    one process's log-probs (fp32, no autocast or TF32: the sequence_parallel probe's bound)."""
    out = tmp_path / "ulysses.json"
    subprocess.run([sys.executable, "bench/ulysses_long_sample.py", "--device", "cuda", "--shape", "tiny", "--images", "4",
                    "--response", "16", "--timeout", "120", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["runs"]["1"]["fits"] and report["runs"]["2"]["fits"]
    assert report["logp_max_gap"] <= 1e-5


def test_gpu_targets_takes_the_multi_turn_call_of_median_ratio(tmp_path):
    """Plain `generate`'s time moved between device calls; the multi-turn row is the call of
    median ratio (the lower middle of an even count), and its note names every call's; calls
    of an older compiled path are listed apart and not counted."""
    targets = load_bench("gpu_targets")

    def calls(plains, compiled=1.3, tag="call"):
        paths = []
        for i, plain in enumerate(plains):
            report = {"command": "agent", "date": f"d{i}", "shape": "vl3b", "prompts": 8, "samples_per_prompt": 8,
                      "policy_turns": 2, "new_tokens_per_turn": 64, "image_replies": 1, "repeats": 2,
                      "runs": {"plain": {"median_s": plain}, "compiled": {"median_s": compiled, "warm_up_s": 5.0}}}
            paths.append(tmp_path / f"{tag}{i}.json")
            paths[-1].write_text(json.dumps(report))
        return paths

    entry = targets.multi_turn_entry(calls((6.4, 5.2, 5.5)))
    assert entry["baseline"] == 5.5 and abs(entry["ratio"] - 5.5 / 1.3) < 1e-9 and entry["met"] is False
    assert "among 3" in entry["note"] and entry["note"].count("x (1.30 against ") == 3
    assert "(1.30 against 6.40 s; call0.json, d0" in entry["note"]  # each call's seconds
    assert "not counted" not in entry["note"]
    four = targets.multi_turn_entry(calls((6.4, 5.2, 5.5, 7.0)), older=calls((2.0,), compiled=1.0, tag="old"))
    assert four["baseline"] == 5.5 and four["met"] is False  # 5.5 and 6.4 in the middle: the lower one
    assert "not counted, 1 calls of the older compiled path (median 2.00x): 2.00x (1.00 against 2.00 s; old0.json" \
        in four["note"]
    assert targets.multi_turn_entry([]) is None


def test_gpu_targets_counts_the_multi_turn_calls_from_the_present_compiled_path_on(tmp_path, monkeypatch):
    """The first call file and _callN below MULTI_TURN_FIRST_CURRENT are the older path's; the rest
    count, in N's numeric order (call10 after call9)."""
    targets = load_bench("gpu_targets")
    monkeypatch.setattr(targets, "RESULTS", tmp_path)
    first = targets.MULTI_TURN_FIRST_CURRENT
    for name in ["agent_rollout_speed_gpu.json", "agent_rollout_speed_h100_call7.json",
                 *(f"agent_rollout_speed_gpu_call{n}.json" for n in (first - 1, first, first + 4, first + 5))]:
        (tmp_path / name).write_text("{}")
    older, current = targets.multi_turn_calls()
    assert [p.name for p in older] == ["agent_rollout_speed_gpu.json", f"agent_rollout_speed_gpu_call{first - 1}.json"]
    assert [p.name for p in current] == [f"agent_rollout_speed_gpu_call{n}.json" for n in (first, first + 4, first + 5)]
