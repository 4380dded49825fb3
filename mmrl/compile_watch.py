"""What `torch.compile` costs a run, seen from the run: every graph compiled in this process
(the rollout's decode step, the engine's compiled layers) is timed as it happens, each new
graph is announced in one line, and the trainer writes the seconds spent compiling during
a step as `time/compile` and their count as `compile/graphs` (issue 28).

    from mmrl.compile_watch import watch
    watch().take()        # (seconds, graphs) compiled since the last take

It also keeps compiled artefacts across runs: `persistent_cache()` points inductor's cache at
a folder under the user's cache (`$MMRL_COMPILE_CACHE`, else `$XDG_CACHE_HOME/mmrl/compile`,
else `~/.cache/mmrl/compile`), one subfolder per torch version and device, unless the user has
set `TORCHINDUCTOR_CACHE_DIR`. Inductor keys every entry by the graph, its inputs' shapes and
the compiler's settings, so a second run of the same recipe takes its kernels from there
instead of compiling them again; only dynamo's tracing runs again.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from mmrl.errors import one_line
from mmrl.platform_info import device_name


class CompileWatch:
    """Seconds spent in dynamo/inductor compiles and the number of compiles, by callbacks
    that dynamo runs around every compile of this process. `announce` prints one line per
    compile (rank 0 sets it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started: float | None = None
        self._cache_before = (0, 0)
        self.seconds = 0.0
        self.graphs = 0
        self._taken = (0.0, 0)
        self.announce = False
        self.installed = False
        self._code: str | None = None  # what the compile in progress compiles (`compiling_code`)
        # Compiles in `BackgroundCompile` threads overlap the run's own work: counted apart.
        self.background_seconds = 0.0
        self.background_graphs = 0
        self._background_threads: set[int] = set()

    def install(self) -> bool:
        """Register with dynamo (again after `torch._dynamo.reset()`, which clears every
        callback); False where this torch has no compile callbacks."""
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:
            return False
        if self._end not in getattr(callback_handler, "end_callbacks", ()):
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
        self.installed = True
        return True

    def _start(self, args=None) -> None:
        code = compiling_code()
        with self._lock:
            self._started = time.perf_counter()
            self._cache_before = cache_counts()
            self._code = code

    def _end(self, args=None) -> None:
        with self._lock:
            if self._started is None:
                return
            spent = time.perf_counter() - self._started
            self._started = None
            background = threading.get_ident() in self._background_threads
            if background:
                self.background_seconds += spent
                self.background_graphs += 1
            else:
                self.seconds += spent
                self.graphs += 1
            count, code = self.graphs + self.background_graphs, self._code
            hits, misses = (now - before for now, before in zip(cache_counts(), self._cache_before))
        if self.announce:
            compile_id = ": ".join(part for part in (getattr(args, "compile_id", ""), code) if part)
            source = (" (kernels from the compile cache)" if hits and not misses else
                      " (kernels partly from the compile cache)" if hits else "")
            where = " in the background" if background else ""
            print(f"compiled graph {count} ({compile_id}){where} in {spent:.1f} s{source}", flush=True)

    def record(self, seconds: float, what: str) -> None:
        """Count work that stands in for a compile (a CUDA graph recorded without compiling,
        `mmrl.rollout.graphs`) as one."""
        with self._lock:
            self.seconds += seconds
            self.graphs += 1
            count = self.graphs
        if self.announce:
            print(f"recorded graph {count} ({what}) in {seconds:.1f} s", flush=True)

    def waited(self, seconds: float, what: str, detail: str = "") -> None:
        """Count seconds the run waited for a background compile (`BackgroundCompile.wait`) as
        compile time, no graph; `detail` follows the line in parentheses."""
        with self._lock:
            self.seconds += seconds
        if self.announce and seconds >= 0.1:
            print(f"waited {seconds:.1f} s for {what}" + (f" ({detail})" if detail else ""), flush=True)

    def take(self) -> tuple[float, int]:
        """Seconds and compiles since the previous `take`."""
        with self._lock:
            seconds, graphs = self.seconds - self._taken[0], self.graphs - self._taken[1]
            self._taken = (self.seconds, self.graphs)
        return seconds, graphs


class BackgroundCompile:
    """`work()` in a daemon thread, started now, whose compiles overlap the caller's own work
    (the trainer's model build) and are counted apart (`CompileWatch.background_seconds`).
    `wait()` joins it before the caller needs what it compiled; the seconds it waited count
    as compile time. An error in `work` is one line on stderr: the run then compiles what it
    needs itself, as without it. Dynamo compiles one graph at a time in a process, so a graph
    the run needs while the thread compiles waits for the thread's graph first."""

    def __init__(self, work: Callable[[], object], what: str, watch: CompileWatch | None = None):
        self.what = what
        self.result: object = None
        self.error: str | None = None
        self._watch = watch or _WATCH
        # The thread's timeline, for the wait's line: seconds from the start to the caller's
        # `wait()` (the overlapped work), the thread's run, and its compiling.
        self._began = time.perf_counter()
        self.overlapped = self.ran = self.compiled = 0.0
        self._thread: threading.Thread | None = threading.Thread(target=self._run, args=(work,), daemon=True,
                                                                 name="mmrl-background-compile")
        self._thread.start()

    def _run(self, work: Callable[[], object]) -> None:
        self._watch._background_threads.add(threading.get_ident())
        compiled = self._watch.background_seconds
        try:
            self.result = work()
        except Exception as error:  # noqa: BLE001 - the run compiles it itself then
            self.error = one_line(error, typed=True)
        finally:
            self.ran = time.perf_counter() - self._began
            self.compiled = self._watch.background_seconds - compiled

    def wait(self) -> float:
        """Join the thread (once; later calls return 0.0): the seconds waited."""
        if self._thread is None:
            return 0.0
        start = time.perf_counter()
        self.overlapped = start - self._began
        self._thread.join()
        self._thread = None
        waited = time.perf_counter() - start
        self._watch.waited(waited, self.what, f"its thread ran {self.ran:.1f} s, {self.compiled:.1f} s of it "
                           f"compiling, beside {self.overlapped:.1f} s of the caller's work")
        if self.error is not None:
            print(f"compiling {self.what} ahead failed, compiled when needed instead: {self.error}"[:300],
                  file=sys.stderr, flush=True)
        return waited


def compile_workers_ready(timeout: float = 120.0) -> bool:
    """Wait (up to `timeout` s) until inductor's compile workers answer their readiness probe
    (`start_compile_workers` sent it): until then inductor compiles kernels one after another
    in this process. True where they answered; False where there is no pool or no answer."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return False
    ready = getattr(AsyncCompile, "_ready_future", None)
    if ready is None:
        return False
    try:
        ready.result(timeout=timeout)
    except Exception:  # noqa: BLE001 - a pool that does not answer: inductor compiles in the process
        return False
    return True


def compiling_code() -> str | None:
    """The function dynamo is about to compile, as `qualified name (file:line)`, read from the
    frame of its `_compile(code, ...)` below the compile-start callback; None where that frame is
    not found (another torch). The compile line names it, so a user can tell the graphs apart;
    dynamo's own id ("frame/recompile") only numbers them."""
    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back
        if frame is None:
            return None
        code = frame.f_locals.get("code") if frame.f_code.co_name in ("_compile", "compile_inner") else None
        if isinstance(code, types.CodeType):
            name = getattr(code, "co_qualname", code.co_name)
            return f"{name} ({Path(code.co_filename).name}:{code.co_firstlineno})"
    return None


def cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's and AOTAutograd's on-disk graph caches in this process so
    far (the compiled kernels a graph found, or compiled, `persistent_cache`)."""
    from torch._dynamo.utils import counters

    aot, inductor = counters["aot_autograd"], counters["inductor"]
    return (aot["autograd_cache_hit"] + inductor["fxgraph_cache_hit"],
            aot["autograd_cache_miss"] + inductor["fxgraph_cache_miss"])


_WATCH = CompileWatch()


def watch() -> CompileWatch:
    """The process's one watch, installed on first use."""
    _WATCH.install()
    return _WATCH


def cache_root() -> Path:
    explicit = os.environ.get("MMRL_COMPILE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmrl" / "compile"


def user_cache_dir() -> str | None:
    """`TORCHINDUCTOR_CACHE_DIR` where the user chose it; None where it is unset, or where it
    names inductor's default folder, which inductor writes into the variable itself at its
    first cache lookup (an import can make one before the run starts; seen on the GPU image)."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen:
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return chosen
    return None if os.path.abspath(chosen) == os.path.abspath(default_cache_dir()) else chosen


def persistent_cache(device: torch.device | str | None = None) -> Path | None:
    """Point inductor's on-disk caches at mmrl's compile cache (see the module docstring)
    and turn its graph caches on; returns the folder, or None where the user chose one
    (`TORCHINDUCTOR_CACHE_DIR`) or it cannot be created. Call before the first compile."""
    if user_cache_dir() is not None:
        return None
    device = torch.device(device) if device is not None else None
    tag = f"torch-{torch.__version__}"
    if device is not None and device.type == "cuda":
        name = device_name(str(device)).replace(" ", "_").replace("/", "_")
        tag += f"-{name}"
    folder = cache_root() / tag
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    from torch._inductor import config as inductor_config

    # Both default to on in recent torch; set them so an older default cannot turn them off.
    for name in ("fx_graph_cache", "autotune_local_cache"):
        if hasattr(inductor_config, name):
            setattr(inductor_config, name, True)
    from torch._functorch import config as functorch_config

    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    return folder


def start_compile_workers() -> bool:
    """Start inductor's pool of compile workers now, so that it is ready by the run's first
    compile; True where a pool was started. Inductor starts it itself at its first compile,
    and until the pool answers it compiles that graph's kernels one after another in this
    process: on a fresh GPU machine the whole first graph, while the workers import torch.
    Called after `persistent_cache` (the workers take the cache folder from the environment)
    and before the model build, which the workers' start then overlaps. A no-op where
    inductor compiles in this process anyway (one compile thread, no triton)."""
    try:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads, maybe_warm_pool
    except ImportError:  # a torch without these: inductor starts its pool when it compiles
        return False
    if get_compile_threads() <= 1 or os.environ.get("TORCH_WARM_POOL", "1") != "1":
        return False  # TORCH_WARM_POOL=0: the user's (inductor's) way to keep the pool lazy
    if os.environ.get("MMRL_EARLY_COMPILE_WORKERS", "1") == "0":
        return False  # inductor starts them at its first compile, as before (bench/decode_ab.sh's A/B)
    maybe_warm_pool()
    # Sends the pool its readiness probe now: inductor hands kernels to the workers only once
    # the probe has come back, and would send it at its first kernel otherwise.
    return bool(AsyncCompile.use_process_pool() or AsyncCompile._ready_future is not None)


__all__ = ["BackgroundCompile", "CompileWatch", "cache_counts", "cache_root", "compile_workers_ready", "persistent_cache",
           "start_compile_workers", "watch"]
