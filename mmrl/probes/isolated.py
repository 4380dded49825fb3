"""One probe on one subject in a fresh process under a time limit: for a probe whose
engine and memory should go with its process (vLLM's engine, its KV cache and its
worker processes) and whose hang must not hang the caller.

    result = run_isolated("vllm", subject, seconds=300)   # a ProbeResult, whatever happens

The child is `python -m mmrl.probes.isolated NAME SPEC` (SPEC: `Subject.spec()` as JSON):
it imports the subject's adapter module (the caller's `sys.path` is its PYTHONPATH, so a
scaffold's scratch modules and plugins resolve), runs the probe and prints its result as
one marked JSON line. The child runs in a session of its own, so a time limit ends it
with every process it started; it exits by itself once its parent is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from mmrl.probes.base import ProbeResult, Status, Subject
from mmrl.probes.launcher import crash_line

# The line of the child's stdout that carries the result (vLLM and others print there too).
MARK = "mmrl-isolated-probe-result: "


def run_isolated(name: str, subject: Subject, seconds: float) -> ProbeResult:
    """`probe(name).run(subject)` in a fresh process; a child that runs past `seconds`
    or dies without a result is a failed result saying so in one line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", "mmrl.probes.isolated", name, json.dumps(subject.spec())]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        return ProbeResult(Status.FAILED, f"the {name} probe ran past its {seconds:.0f} s limit", seconds)
    finally:  # the child's session: vLLM's engine processes go with it (also when the caller is interrupted)
        _end_session(child)
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return ProbeResult.from_dict(json.loads(line[len(MARK):]))
    return ProbeResult(Status.FAILED, f"the {name} probe's process ended (exit {child.returncode}) without a result: "
                       f"{crash_line(stderr) or 'no error output'}")


def _end_session(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone, with everything it started
        pass
    child.wait()


def end_with_parent() -> None:
    """Exit once the parent is gone (killed past its own time limit, say): the child's
    own session keeps it out of the parent's process group, so nothing else would end it."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main(name: str, spec: str) -> None:
    from mmrl.probes import probe

    end_with_parent()
    result = probe(name).run(Subject.from_spec(json.loads(spec)))
    print(MARK + json.dumps(result.to_dict(), default=str), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m mmrl.probes.isolated PROBE_NAME SUBJECT_SPEC_JSON")
    main(*sys.argv[1:])
