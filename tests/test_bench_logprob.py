"""bench/logprob_memory.py on CPU (a tiny model; the naive path made to run out of memory
above one row, to exercise the fallback the H200 run takes) and gpu_targets' reader of it."""

import argparse
import json

import pytest
import torch

from bench_scripts import load_bench

pytestmark = pytest.mark.slow  # its module fixture runs the bench


@pytest.fixture(scope="module")
def report():
    bench = load_bench("logprob_memory")
    naive = bench.naive_log_probs

    def naive_out_of_memory_above_one_row(model, seqs):
        if seqs.size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")
        return naive(model, seqs)

    bench.naive_log_probs = naive_out_of_memory_above_one_row
    args = argparse.Namespace(device="cpu", shape="tiny", rows=4, tokens=16, repeats=1, no_checkpointing=False)
    return {**bench.run(args), "command": "python bench/logprob_memory.py --device cpu"}


@pytest.mark.slow
def test_naive_path_falls_back_to_fewer_rows_and_is_compared_there(report):
    assert report["largest_rows_that_fit"] == {"model_only": 4, "engine": 4, "naive": 1}
    naive = report["runs"]["naive"]
    assert "simulated" in naive["4"]["out_of_memory"] and "simulated" in naive["2"]["out_of_memory"]
    assert "out_of_memory" not in naive["1"] and naive["1"]["median_s"] > 0
    assert set(report["runs"]["engine"]) == {"4", "1"}  # the full size, and the size both fit
    comparison = report["comparison"]
    assert comparison["rows"] == 1 and comparison["throughput_ratio_engine_vs_naive"] > 0
    # Both take fp32 log-softmax of the same bf16 logits.
    assert comparison["max_abs_logp_diff"] < 1e-4 and comparison["max_abs_entropy_diff"] < 1e-4
    assert report["log_prob_head_extra_peak_gib"] is None  # no memory statistics on the CPU


def test_gpu_targets_reads_the_head_memory_and_the_throughput_ratio(report, tmp_path):
    targets = load_bench("gpu_targets")
    path = tmp_path / "logprob_memory_gpu.json"
    assert targets.logprob_entry(path) is None
    report = json.loads(json.dumps(report))
    for rows in ("4", "1"):
        report["runs"]["engine"][rows]["extra_peak_gib"] = 9.0
        report["runs"]["model_only"][rows]["extra_peak_gib"] = 5.5
    report["runs"]["naive"]["1"]["extra_peak_gib"] = 30.0
    report["log_prob_head_extra_peak_gib"] = 3.5
    report["comparison"]["throughput_ratio_engine_vs_naive"] = 0.95
    path.write_text(json.dumps(report))
    entry = targets.logprob_entry(path)
    assert entry["name"] == targets.LOGPROB_TARGET and entry["measured"] == 3.5 and entry["met"]
    assert entry["baseline"] is None and "out of memory" in entry["note"] and "0.95x" in entry["note"]

    report["comparison"]["throughput_ratio_engine_vs_naive"] = 0.8  # small enough, too slow
    path.write_text(json.dumps(report))
    assert not targets.logprob_entry(path)["met"]
    report["log_prob_head_extra_peak_gib"], report["comparison"]["throughput_ratio_engine_vs_naive"] = 6.0, 1.0
    path.write_text(json.dumps(report))
    assert not targets.logprob_entry(path)["met"]
