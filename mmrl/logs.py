"""What third-party libraries may print around mmrl's own output, decided in one place.

vLLM logs dozens of INFO/WARNING lines per engine start, torch warns about its own
deprecations when vLLM imports, and transformers/vLLM draw progress bars for every
checkpoint they write or read. Around a one-line result (`mmrl support-matrix --check`)
or a table (`mmrl doctor`) that is hundreds of lines of noise, so the CLI calls `quiet()`
before anything imports those libraries, and probe worker processes send their own
stdout/stderr to a log file (`redirect_to_log`), with the whole traceback of every probe
that fails there (the results keep its last frames only: `PROBE_FAILURES`); `doctor` and
`support-matrix --check` remove it when they succeed and keep and name it when they fail
(`close_worker_log`), and `support-matrix --log-dir DIR` writes it into DIR and keeps it
(a GPU machine returns only the files under the folder it is given). `mmrl --verbose COMMAND` keeps it all:

    mmrl --verbose doctor qwen2_vl

The settings travel to subprocesses (spawned probe workers, torchrun) as environment
variables; a variable the user set already is left as it is.

Two settings here are about CPU time, not output. `share_cpu()` makes torch's OpenMP
threads sleep at a barrier instead of spinning (`OMP_WAIT_POLICY=PASSIVE`), which the CLI
and the tests set before torch loads. On a machine whose cores are shared, spinning
threads take the CPU that the thread they wait for needs; bench/cpu_contention.py
measures the tiny recipe's step with and without it on a loaded machine
(bench/results/cpu_contention.json). On a quiet machine sleeping makes that step a little
slower; a bounded spin (`GOMP_SPINCOUNT`) wins some of that back there and loses more once
the cores are shared (bench/results/cpu_contention_spincount.json, `--variants`).
And `$MMRL_MAX_THREADS` caps the torch threads a recipe asks for (`trainer.threads`), in
the process and in those it starts: the test suite sets it to one per pytest-xdist
worker, so that N workers on N cores do not each start the tiny recipe's 2 threads.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

VERBOSE_ENV = "MMRL_VERBOSE"
WORKER_LOG_ENV = "MMRL_WORKER_LOG"

# Read by the libraries when they are imported (or when their subprocesses start).
QUIET_ENVIRONMENT = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's INFO/WARNING per engine start and request
    "TORCH_LOGS": "-all",  # torch's Python warnings (deprecations seen while vLLM imports) at ERROR
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # torch's C++ warnings (e.g. NUMA binding)
    "TOKENIZERS_PARALLELISM": "false",  # tokenizers' fork warning
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # "Generating train split" per data file loaded
}
# Python loggers that log before their library configures them (vLLM's Triton check).
QUIET_LOGGERS = ("vllm", "torch")


# Read by OpenMP (libgomp) when torch loads it, so it must be set before `import torch`.
CPU_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


def share_cpu() -> None:
    """Let torch's OpenMP threads sleep, not spin, while they wait (see the module
    docstring); call before torch is imported. A value the user set is kept."""
    for name, value in CPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


MAX_THREADS_ENV = "MMRL_MAX_THREADS"


def capped_threads(requested: int) -> int:
    """`requested` torch threads, at most `$MMRL_MAX_THREADS` when that is set."""
    cap = os.environ.get(MAX_THREADS_ENV, "").strip()
    if not cap:
        return requested
    if not cap.isdigit() or int(cap) < 1:
        raise ValueError(f"{MAX_THREADS_ENV}={cap!r}: give a whole number of threads, 1 or more")
    return min(requested, int(cap))


def verbose() -> bool:
    """True when the user asked for every library's output (`mmrl --verbose`)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet(*, is_verbose: bool | None = None) -> None:
    """Keep third-party logs at ERROR in this process and in the processes it starts.

    Call before vLLM or torch is imported. With `is_verbose` (or MMRL_VERBOSE=1 in the
    environment) nothing changes; `is_verbose=True` also sets MMRL_VERBOSE for subprocesses."""
    if is_verbose:
        os.environ[VERBOSE_ENV] = "1"
    if verbose():
        return
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "datasets" in sys.modules:  # imported already: it read the variable before it was set
        sys.modules["datasets"].disable_progress_bars()


# The logger of probe failures: each failed check's traceback, at INFO. Probe worker
# processes send it to their stderr (the worker log: `log_probe_failures`); elsewhere it
# has no handler and its level stays below Python's last-resort WARNING, so a probe run in
# process prints nothing more than its result.
PROBE_FAILURES = "mmrl.probes.failures"


def log_probe_failures() -> None:
    """In a probe worker: the tracebacks of failing probes, and Python's own on a fatal
    signal (a crash that kills the worker), to this process's stderr."""
    import faulthandler

    logger = logging.getLogger(PROBE_FAILURES)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    faulthandler.enable()


def quiet_probe_worker() -> None:
    """In a probe worker: `quiet()`, plus transformers' warnings and progress bars off
    and Python warnings ignored (probes build odd tiny models on purpose), and the
    worker's stdout/stderr appended to the log file its parent named."""
    if verbose():
        return
    quiet()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if log := os.environ.get(WORKER_LOG_ENV):
        redirect_to_log(Path(log))


def new_worker_log(command: str, folder: Path | None = None) -> Path | None:
    """A fresh log file for the worker processes of `command` (named in the environment,
    so spawned workers find it), in `folder` (created) when given, else in $TMPDIR; None
    when verbose (workers print to the terminal)."""
    if verbose():
        return None
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f"mmrl-{command}-", suffix=".log", dir=folder)
    os.close(handle)
    os.environ[WORKER_LOG_ENV] = name
    return Path(name)


def close_worker_log(log: Path | None, *, failed: bool) -> Path | None:
    """The worker log to name to the user: kept (and returned) when the command failed,
    removed (None) when it succeeded, so runs do not pile `mmrl-*.log` files in $TMPDIR."""
    if log is None or failed:
        return log
    log.unlink(missing_ok=True)
    return None


def redirect_to_log(path: Path) -> None:
    """Append this process's stdout and stderr, Python's and the C libraries' alike
    (file descriptors 1 and 2), to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)


def hf_progress_bars(enabled: bool) -> None:
    """Switch transformers' and huggingface_hub's progress bars ("Writing model shards",
    downloads) on or off in this process."""
    if enabled:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()
