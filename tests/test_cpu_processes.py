"""tests/cpu_processes.run: a rank's teardown abort runs the command once more; any other
failure, or a second abort, fails the test."""

import sys

import pytest

from tests.cpu_processes import TEARDOWN_ABORT, run

# A stand-in for a torchrun command: fails with the abort line while COUNT (a file) says it
# has run fewer than FAILS times, then succeeds.
SCRIPT = r'''
import sys
from pathlib import Path
count, fails, traceback = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
runs = int(count.read_text()) if count.exists() else 0
count.write_text(str(runs + 1))
if runs < fails:
    if traceback:
        print('Traceback (most recent call last):\n  File "script.py", line 1, in <module>\nValueError: x',
              file=sys.stderr)
    print("ABORT", file=sys.stderr)
    sys.exit(134)
'''.replace("ABORT", TEARDOWN_ABORT)


def _command(tmp_path, fails: int, traceback: bool) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    return [sys.executable, str(script), str(tmp_path / "count"), str(fails), "1" if traceback else "0"]


def test_a_teardown_abort_runs_once_more(tmp_path):
    with pytest.warns(UserWarning, match="running rank.py once more"):
        run(_command(tmp_path, fails=1, traceback=False), timeout=60)
    assert (tmp_path / "count").read_text() == "2"


def test_a_second_abort_fails(tmp_path):
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match=TEARDOWN_ABORT):
        run(_command(tmp_path, fails=2, traceback=False), timeout=60)
    assert (tmp_path / "count").read_text() == "2"


def test_an_abort_after_a_rank_s_traceback_is_not_run_again(tmp_path):
    with pytest.raises(AssertionError, match="ValueError"):
        run(_command(tmp_path, fails=1, traceback=True), timeout=60)
    assert (tmp_path / "count").read_text() == "1"
