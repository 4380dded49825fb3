"""bench/prefill_once.py on CPU with the tiny VLM recipe (its smoke run, fewer samples):
both modes run on the compiled rollout, the shared one prefills one row per prompt, the
greedy tokens agree, and the report holds what the lead's GPU A/B reads.

    .venv/bin/python -m pytest -q tests/test_bench_prefill_once.py
"""

import json
from pathlib import Path

import pytest

from bench_scripts import load_bench

pytestmark = pytest.mark.slow  # builds a trainer and runs six rollouts

REPO = Path(__file__).resolve().parents[1]


def test_the_prefill_once_bench_compares_both_modes(tmp_path):
    out = tmp_path / "prefill_once.json"
    load_bench("prefill_once").main([str(REPO / "recipes" / "tiny_vlm_count.yaml"), "--device", "cpu",
                                     "--repeats", "1", "--out", str(out), "data.prompts_per_step=4",
                                     "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3"])
    report = json.loads(out.read_text())
    assert report["fallback"] is None and report["rows"] == 16
    assert report["loop_stats"]["once"]["prefill_rows"] == 4
    assert report["loop_stats"]["every"]["prefill_rows"] == 16
    assert report["greedy_rows_identical"] == [1.0]
    assert set(report["median_s"]["once"]) == {"rollout", "prefill"}
