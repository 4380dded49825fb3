"""bench/gpu_checks.sh asks the support matrix for its worker logs under $OUT (a device call
returns only the files there), and FAMILIES narrows its cells. A stand-in interpreter
records the calls; nothing runs.

    .venv/bin/python -m pytest -q tests/test_bench_gpu_checks.py
"""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# python3 on the PATH: every import works (no install); any other call is written to $CALLS.
INTERPRETER = '''#!/usr/bin/env bash
if [[ $1 == -c ]]; then exit 0; fi
echo "$*" >> "$CALLS"
'''


def _gpu_checks(folder: Path, **env: str) -> list[str]:
    (folder / "bin").mkdir()
    python = folder / "bin" / "python3"
    python.write_text(INTERPRETER)
    python.chmod(0o755)
    (folder / "out").mkdir()
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_checks.sh")], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{folder / 'bin'}:/usr/bin:/bin", "CALLS": str(folder / "calls.txt"),
                               "OUT": str(folder / "out"), "TESTS": " ", **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return (folder / "calls.txt").read_text().splitlines()


def test_the_matrix_writes_its_worker_logs_under_out(tmp_path):
    cells = tmp_path / "out" / "gpu_cells"
    calls = _gpu_checks(tmp_path)
    assert calls == [
        f"-m mmrl.cli support-matrix --device cuda --feature reads_media --feature rollout_agreement --output {cells} "
        f"--log-dir {cells / 'logs'} --no-progress",
        f"-m mmrl.cli support-matrix --device cuda --feature multi_turn --family idefics3 --family smolvlm --family "
        f"llava_onevision --output {cells} --log-dir {cells / 'logs'} --no-progress"]


def test_families_narrow_the_cells(tmp_path):
    cells = tmp_path / "out" / "gpu_cells"
    calls = _gpu_checks(tmp_path, FEATURES="rollout_agreement", FAMILIES="idefics3 internvl", MULTI_TURN_FAMILIES=" ")
    assert calls == [f"-m mmrl.cli support-matrix --device cuda --feature rollout_agreement --family idefics3 "
                     f"--family internvl --output {cells} --log-dir {cells / 'logs'} --no-progress"]
