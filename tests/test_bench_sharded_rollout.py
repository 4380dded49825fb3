"""bench/sharded_rollout.py on CPU (gloo, a tiny model, 2 processes): the sharded engine's
plain `generate` against the compiled loop on each rank's inference copy, with the copy's
gather timed. The timings mean nothing on a shared CPU; the structure does."""

import json
import sys

import pytest

from cpu_processes import run


pytestmark = pytest.mark.multiprocess


def test_the_bench_compares_both_rollouts_of_a_sharded_engine(tmp_path):
    out = tmp_path / "sharded_rollout.json"
    run([sys.executable, "bench/sharded_rollout.py", "--device", "cpu", "--shape", "tiny", "--nproc", "2",
                    "--batch", "4", "--prompt", "16", "--new-tokens", "8", "--repeats", "1", "--out", str(out)], timeout=600)
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["sharded"] and report["fallback"] is None
    assert report["copy_dtype"] == "float32" and report["copy_kept"] and report["copy_bytes"] > 0
    rates = report["tokens_per_s_per_rank"]
    assert rates["plain"] > 0 and rates["compiled"] > 0
    assert report["speedup"] == pytest.approx(report["median_s"]["plain"] / report["median_s"]["compiled"])
    assert report["median_s"]["gather"] > 0
    # fp32 on CPU: the same greedy rows on every rank.
    assert report["greedy_rows_identical_by_rank"] == [[1.0], [1.0]]
    assert report["command"].startswith("python bench/sharded_rollout.py --device cpu")
