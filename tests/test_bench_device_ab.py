"""bench/device_ab.sh on CPU (the tiny shape): each side runs bench/packing.py from its own
tree, alternating, and the medians of every side are compared with the first side's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "device_ab.sh"


def _run(tmp_path: Path, sides: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SIDES": sides, "AB_TREES": str(tmp_path / "trees"), "AB_LOGS": str(tmp_path / "logs"),
           "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_each_side_runs_its_own_tree_and_is_compared_with_the_first(tmp_path):
    base = tmp_path / "trees" / "base"
    shutil.copytree(REPO / "mmrl", base / "mmrl", ignore=shutil.ignore_patterns("__pycache__"))
    with open(base / "mmrl" / "__init__.py", "a") as init:  # marks the base tree's runs
        init.write('\nimport sys as _sys\nprint("mmrl from the base tree", file=_sys.stderr)\n')
    done = _run(tmp_path, "base main", "1", "--device", "cpu", "--shape", "tiny", "--sequences", "4",
                "--modes", "packed_256", "--micro-batch-tokens", "256", "--repeats", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    reports = {side: json.loads((tmp_path / "logs" / f"{side}_1.json").read_text()) for side in ("base", "main")}
    logs = {side: (tmp_path / "logs" / f"{side}_1.log").read_text() for side in ("base", "main")}
    assert "mmrl from the base tree" in logs["base"] and "mmrl from the base tree" not in logs["main"]
    assert "main vs base:" in done.stdout and "median step:" in done.stdout
    # One file comes back from the device: the summary, with every run's figures.
    assert [p.name for p in (tmp_path / "out" / "ab").iterdir()] == ["summary.json"]
    summary = json.loads((tmp_path / "out" / "ab" / "summary.json").read_text())
    assert summary["sides"] == ["base", "main"] and summary["rounds"] == 1
    for side, report in reports.items():
        (run,) = summary["runs"][side]
        assert run["mode"] == "packed_256" and run["median_step_s"] == report["median_step_s"]["packed_256"] > 0
        assert summary["median_step_s"][side] == run["median_step_s"]
    assert summary["speedup_vs_first"]["main"] == summary["median_step_s"]["base"] / summary["median_step_s"]["main"]
    assert summary["packing_arguments"][:2] == ["--device", "cpu"]


def test_a_side_without_a_tree_stops_before_any_run(tmp_path):
    done = _run(tmp_path, "main missing", "1")
    assert done.returncode == 2
    assert f"no {tmp_path / 'trees' / 'missing' / 'mmrl'}" in done.stdout
    assert not (tmp_path / "out" / "ab").exists() or not any((tmp_path / "out" / "ab").iterdir())
