"""bench/hybrid_pack_gpu.py on CPU: which types it picks from a small coverage table (hybrid
types that declare padding_free, not plain-attention ones), that a crashed or hung type is a
row and not the end of the run, and one whole run over a scaffolded hybrid type (`slow`).

    .venv/bin/python -m pytest -q tests/test_bench_hybrid_pack.py
"""

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench_scripts import bench_report, load_bench
from mmrl.cli import app
from mmrl.checks import BOUNDARY_HIDDEN_TOLERANCE, BOUNDARY_TOLERANCE
from mmrl.probes.base import TOLERANCE
from mmrl.registry import get_adapter, load_plugin

BENCH_SCRIPT = "hybrid_pack_gpu"
HYBRID = "lfm2"  # the cheapest type the rule picks, by measurement (bench/hybrid_pack_gpu.py's docstring)


def _row(model_type, status="green", capabilities=("generation", "padding_free"), in_scope=True):
    return {"model_type": model_type, "status": status, "capabilities": list(capabilities), "in_scope": in_scope}


def test_the_rule_picks_hybrid_types_that_declare_padding_free(bench):
    coverage = {"types": [
        _row("lfm2"),  # short convolutions in its tiny config (its default config is all attention)
        _row("bamba"),  # Mamba-2 mixers
        _row("llama"),  # plain attention: declared, but nothing runs per sequence
        _row("olmo3"),  # sliding and full attention: layer kinds, none stateful
        _row("zamba2", capabilities=("generation",)),  # hybrid, padding_free not declared
        _row("jamba", status="red"),  # hybrid, not green
        _row("qwen3_next", in_scope=False),
        _row("no_such_type"),
    ]}
    selection = bench.select(coverage)
    assert selection["declared"] == 5
    assert {t["model_type"]: t["kinds"] for t in selection["picked"]} == {"bamba": ["linear_attention"],
                                                                          "lfm2": ["conv"]}
    assert selection["attention_only"] == ["llama", "olmo3"]
    assert [s["model_type"] for s in selection["skipped"]] == ["no_such_type"]
    assert "has no model type 'no_such_type'" in selection["skipped"][0]["reason"]

    named = bench.select(coverage, types=["lfm2", "zamba2"])
    assert [t["model_type"] for t in named["picked"]] == ["lfm2"]
    assert named["skipped"][0]["model_type"] == "zamba2" and "declares padding_free" in named["skipped"][0]["reason"]


def test_a_crashed_or_hung_type_is_a_row(tmp_path):
    scaffolded = load_bench("scaffolded")
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.exit('no adapter for ' + sys.argv[2])\n")
    hang = tmp_path / "hang.py"
    hang.write_text("import sys, time\nprint('stage: probe', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    done = tmp_path / "done.py"
    done.write_text("import json, sys\nprint('noise')\nprint(json.dumps({'model_type': sys.argv[2], 'status': 'verified'}))\n")
    row = scaffolded.run_child(crash, "lfm2", timeout=60)
    assert (row["status"], row["stage"], row["reason"]) == ("failed", "crash", "exit 1: no adapter for lfm2")
    row = scaffolded.run_child(hang, "lfm2", timeout=1)
    assert (row["status"], row["stage"], row["reason"]) == ("failed", "timeout", "no result within 1s (stage: probe)")
    assert row["seconds"] < 30
    row = scaffolded.run_child(done, "lfm2", timeout=60)
    assert row["status"] == "verified" and row["seconds"] >= 0


def test_a_child_prints_its_row_whether_or_not_the_type_scaffolds(tmp_path, monkeypatch, capsys):
    """bench/scaffolded.py's `scaffolded`, the frame of both benches' children: a type that
    does not scaffold is a failed row and no adapter; one that does is the block's to fill,
    in a temporary directory that goes when the block ends, and printed when it returns."""
    scaffolded = load_bench("scaffolded")

    def refused(model_type, out):
        raise scaffolded.ScaffoldFailed("scaffold", f"no such type {model_type}")

    monkeypatch.setattr(scaffolded, "scaffold_family", refused)
    with scaffolded.scaffolded("nope", "mmrl-test") as (adapter, row):
        assert adapter is None
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"model_type": "nope", "status": "failed", "stage": "scaffold", "reason": "no such type nope"}

    folders = []
    monkeypatch.setattr(scaffolded, "scaffold_family", lambda model_type, out: folders.append(Path(out)) or "adapter")

    def child():
        with scaffolded.scaffolded("lfm2", "mmrl-test") as (adapter, row):
            assert adapter == "adapter" and folders[0].is_dir() and folders[0].name.startswith("mmrl-test-lfm2-")
            row["status"] = "verified"
            return
        pytest.fail("the block returned")

    child()
    printed = json.loads(capsys.readouterr().out)
    assert printed["status"] == "verified" and printed["scaffold_seconds"] >= 0
    assert not folders[0].exists()


def test_a_spent_time_budget_starts_no_type(bench, tmp_path_factory):
    report = bench_report(bench, tmp_path_factory, ["--device", "cpu", "--types", "lfm2,bamba", "--jobs", "1",
                                                    "--time-budget", "0.001"])
    assert report["types"] == [] and report["not_started"] == ["bamba", "lfm2"]
    assert report["summary"]["not_started"] == 2 and report["summary"]["tried"] == 0


def _assert_measured(row: dict, sequences: int) -> None:
    assert row["status"] == "verified", row.get("reason")
    assert row["stateful_mixers"] >= 1
    assert row["fp32"]["boundary_logprob"] < BOUNDARY_TOLERANCE
    assert row["fp32"]["boundary_hidden"] < BOUNDARY_HIDDEN_TOLERANCE
    assert row["fp32"]["packed_vs_padded"] < TOLERANCE
    assert all(math.isfinite(row["bf16"][k]) for k in ("boundary_logprob", "boundary_hidden", "packed_vs_padded"))
    assert row["bf16"]["packed_vs_padded"] > row["fp32"]["packed_vs_padded"]  # bf16 rounding shows
    timing = row["timing"]
    assert timing["sequences"] == sequences and timing["packed_positions"] == timing["tokens"]  # one row, no filler
    assert timing["stateful_positions"] == sequences * timing["longest"] > timing["tokens"]
    assert timing["padded_positions"] >= timing["stateful_positions"]
    assert timing["padded_ms"] > 0 and timing["packed_ms"] > 0
    assert timing["packed_over_padded"] == pytest.approx(timing["packed_ms"] / timing["padded_ms"], rel=0.01)


def test_a_scaffolded_hybrid_family_is_measured(bench, plugin_path):
    """The child's measurements in this process, on a family scaffolded here (the slow test
    below runs the whole bench: selection, the CLI scaffold and a child process)."""
    scaffold = CliRunner().invoke(app, ["add-model", HYBRID, "--out", str(plugin_path), "--no-verify"])
    assert scaffold.exit_code == 0, scaffold.output
    load_plugin(f"mmrl_{HYBRID}.{HYBRID}")
    row = bench.measure(get_adapter(HYBRID), "cpu", [48, 24], repeats=1)
    _assert_measured(row, sequences=2)


@pytest.mark.slow
def test_one_hybrid_type_runs_the_probe_and_takes_the_figures(bench, tmp_path_factory):
    report = bench_report(bench, tmp_path_factory, [
        "--device", "cpu", "--types", HYBRID, "--lengths", "96,48,24", "--repeats", "1", "--jobs", "1"])
    assert report["command"].startswith(f"python bench/hybrid_pack_gpu.py --device cpu --types {HYBRID}")
    assert report["summary"]["tried"] == report["summary"]["verified"] == 1
    (row,) = report["types"]
    assert row["model_type"] == HYBRID and row["status"] == "verified", row.get("reason")
    assert row["kinds"] == ["conv"]
    _assert_measured(row, sequences=3)
    assert row["scaffold_seconds"] > 0 and row["seconds"] > row["scaffold_seconds"]
