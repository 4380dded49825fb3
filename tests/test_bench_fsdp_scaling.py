"""bench/fsdp_scaling.py on CPU (gloo, a tiny model, 2 processes against 1) and gpu_targets'
reader of its result. The timings mean nothing on a shared CPU; the structure does."""

import json
import sys

import pytest

from cpu_processes import run

from bench_scripts import load_bench

pytestmark = pytest.mark.slow  # its module fixture runs the bench under torchrun



@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling") / "fsdp_scaling.json"
    run([sys.executable, "bench/fsdp_scaling.py", "--device", "cpu", "--shape", "tiny", "--nproc", "2",
                    "--sequences", "4", "--repeats", "1", "--micro-batch-tokens", "512", "--out", str(out)], timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_sharded_run_is_compared_with_the_one_process_run(report):
    one, two = report["runs"]["1"], report["runs"]["2"]
    assert (one["world_size"], one["sharded"]) == (1, False)
    assert (two["world_size"], two["sharded"]) == (2, True)
    assert one["real_tokens_per_rank"] == two["real_tokens_per_rank"] > 0  # weak scaling: the same batch per rank
    assert one["micro_batches"] == two["micro_batches"] >= 1
    expected = two["real_tokens_per_s"] / (2 * one["real_tokens_per_s"])
    assert report["efficiency"] == pytest.approx(expected) and report["efficiency"] > 0


def test_gpu_targets_reads_the_efficiency(report, tmp_path):
    targets = load_bench("gpu_targets")
    path = tmp_path / "fsdp_scaling_gpu.json"
    path.write_text(json.dumps(report))
    entry = targets.scaling_entry(path)
    assert entry["measured"] == report["efficiency"] and entry["met"] == (report["efficiency"] >= 0.85)
    assert entry["command"].startswith("python bench/fsdp_scaling.py") and "2 processes" in entry["note"]
    assert targets.scaling_entry(tmp_path / "absent.json") is None


def test_a_target_without_a_figure_reads_not_measured():
    """The README table and the console say the same: an unmeasured target (the 2-GPU one
    while no 2-GPU machine is lent) is 'not measured', a measured miss 'missed'."""
    status_of = load_bench("gpu_targets").status_of
    assert status_of({"measured": None, "met": False}) == "not measured"
    assert status_of({"measured": 0.7, "met": False}) == "missed"
    assert status_of({"measured": 0.9, "met": True}) == "met"
    assert status_of({"measured": 2.6, "met": None}) == "info"
