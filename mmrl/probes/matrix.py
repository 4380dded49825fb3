"""The support matrix: every probe on every registered family, as JSON, Markdown and HTML.

    mmrl support-matrix                         # run on CPU, write support_matrix/
    mmrl support-matrix --check                 # CI: regenerate, compare, gate on failures
    mmrl support-matrix --gpu-results FILE      # merge cells recorded on a GPU machine
    mmrl support-matrix --device cuda --output DIR   # on a GPU machine: record GPU cells

Probes run in worker processes (spawned, one torch thread each), one task per
(family, probe), so a crash in one never takes the others down; batched probes (FSDP2)
run one task for all families. `results.json` keeps, per cell, the status, the reason,
the evidence, the time taken, and the device, versions and date it ran on. Comparisons
between runs (`stable_view`) use only what does not vary between machines: family,
feature, platform, status, whether declared, and the reason with its numbers masked.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from mmrl.logs import PROBE_FAILURES, close_worker_log, log_probe_failures, new_worker_log
from mmrl.probes.base import Probe, ProbeResult, Status, Subject

SCHEMA_VERSION = 1
RESULTS_FILE = "results.json"
GPU_RESULTS_FILE = "gpu_results.json"
MARKDOWN_FILE = "README.md"
HTML_FILE = "index.html"
DEFAULT_OUTPUT = "support_matrix"


def platform_of(device: str) -> str:
    return "gpu" if device.startswith("cuda") else "cpu"


# -- running -----------------------------------------------------------------------------
def _init_worker(modules: list[str]) -> None:
    """Spawned workers: one torch thread (the pool is the parallelism), third-party logs
    and progress bars, and the tracebacks of failing probes, into the command's log file
    (`mmrl.logs`), and the modules that registered the families being probed."""
    import importlib

    from mmrl.logs import quiet_probe_worker

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet_probe_worker()
    log_probe_failures()
    import torch

    torch.set_num_threads(1)
    for module in modules:
        if module != "__main__":
            importlib.import_module(module)


def _run_task(feature: str, specs: list[dict]) -> list[dict]:
    """In a worker: run one probe on the given subjects; results as dicts. What escapes
    the probe (a subject that cannot be rebuilt here) is logged before the parent records
    it in one line."""
    from mmrl.probes import probe

    try:
        subjects = [Subject.from_spec(spec) for spec in specs]
        return [r.to_dict() for r in probe(feature).run_many(subjects)]
    except Exception:
        logging.getLogger(PROBE_FAILURES).exception("%s on %s: the task failed", feature,
                                                    ", ".join(spec["source"] for spec in specs))
        raise


def _tasks(subjects: list[Subject], probes: Iterable[Probe]) -> list[tuple[Probe, list[Subject]]]:
    tasks = []
    for p in probes:
        if p.check_many is not None:
            tasks.append((p, subjects))
        else:
            tasks.extend((p, [s]) for s in subjects)
    # The slowest first, so the pool is not left waiting on one long task at the end.
    return sorted(tasks, key=lambda t: -t[0].cost * len(t[1]))


def run_probes(
    subjects: list[Subject],
    probes: Iterable[Probe],
    *,
    workers: int = 2,
    on_result: Callable[[Subject, Probe, ProbeResult], None] | None = None,
) -> dict[tuple[str, str], ProbeResult]:
    """Every probe on every subject: {(subject label, feature): result}.

    `workers=0` runs in this process (for debugging); otherwise a spawned process pool.
    A worker that dies fails the tasks it had in flight; those are tried once more in a
    fresh pool, and a second death records the failure."""
    results: dict[tuple[str, str], ProbeResult] = {}

    def record(p: Probe, group: list[Subject], dicts: list[dict]) -> None:
        for subject, values in zip(group, dicts):
            result = ProbeResult.from_dict(values)
            results[(subject.label, p.feature)] = result
            if on_result:
                on_result(subject, p, result)

    tasks = _tasks(subjects, probes)
    if workers <= 0:
        for p, group in tasks:
            record(p, group, [r.to_dict() for r in p.run_many(group)])
        return results

    import multiprocessing

    modules = sorted({type(s.adapter).__module__ for s in subjects})
    for attempt in (1, 2):
        pending = []
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker,
                                 initargs=(modules,)) as pool:
            futures = {pool.submit(_run_task, p.feature, [s.spec() for s in group]): (p, group) for p, group in tasks}
            for future in as_completed(futures):
                p, group = futures[future]
                try:
                    record(p, group, future.result())
                except BrokenProcessPool as exc:
                    pending.append((p, group, exc))
                except Exception as exc:  # noqa: BLE001 - e.g. the subject cannot be rebuilt there
                    record(p, group, [_failed(p, s, exc).to_dict() for s in group])
        if not pending:
            break
        if attempt == 2:
            for p, group, exc in pending:
                died = RuntimeError(f"a worker process died ({exc})")
                record(p, group, [_failed(p, s, died).to_dict() for s in group])
        tasks = [(p, group) for p, group, _ in pending]
    return results


def _failed(p: Probe, subject: Subject, exc: BaseException) -> ProbeResult:
    from mmrl.probes.base import one_line

    return p.decide(subject, Status.FAILED, one_line(exc), 0.0, {})


# -- the document ------------------------------------------------------------------------
def family_row(adapter) -> dict[str, Any]:
    return {
        "family": adapter.family,
        "model_types": list(adapter.model_types),
        "modalities": list(adapter.modalities),
        "declared": adapter.capabilities.declared(),
        "module": type(adapter).__module__,
    }


def feature_row(p: Probe) -> dict[str, Any]:
    return {"feature": p.feature, "title": p.title, "capability": p.capability, "description": p.description}


def cell(family: str, feature: str, platform: str, result: ProbeResult) -> dict[str, Any]:
    return {"family": family, "feature": feature, "platform": platform, **result.to_dict()}


def make_document(adapters, probes, cells: list[dict]) -> dict[str, Any]:
    """The results document: features (columns), families with cells (rows) and cells."""
    order = {p.feature: i for i, p in enumerate(probes)}
    names = {a.family for a in adapters}
    cells = [c for c in cells if c["family"] in names and c["feature"] in order]
    cells.sort(key=lambda c: (c["family"], order[c["feature"]], c["platform"]))
    rows = {c["family"] for c in cells}
    return {
        "schema": SCHEMA_VERSION,
        "generator": "mmrl support-matrix",
        "features": [feature_row(p) for p in probes],
        "families": [family_row(a) for a in sorted(adapters, key=lambda a: a.family) if a.family in rows],
        "cells": cells,
    }


def probe_cells(adapters, probes, *, device: str = "cpu", workers: int = 2, progress: bool = True) -> list[dict]:
    """Run the probes on the families' tiny models; one cell per (family, probe)."""
    subjects = [Subject(adapter=a, source=a.family, device=device) for a in adapters]
    platform = platform_of(device)
    with progress_bar(progress, len(subjects) * len(probes)) as advance:
        results = run_probes(subjects, probes, workers=workers, on_result=advance)
    return [cell(label, feature, platform, result) for (label, feature), result in results.items()]


def regenerate(
    output: Path,
    *,
    families: list | None = None,
    features: list[str] | None = None,
    gpu_results: Path | None = None,
    device: str = "cpu",
    workers: int = 2,
    progress: bool = True,
) -> tuple[dict[str, Any], list[dict]]:
    """(document, GPU cells) for OUTPUT: probe the chosen families and features here;
    keep OUTPUT's other CPU cells (a partial run) and its recorded GPU cells, plus the
    GPU cells of `gpu_results`. On a GPU (`device="cuda..."`) the document holds this
    machine's cells only: that file is what `--gpu-results` later merges."""
    from mmrl.probes import PROBES, probe
    from mmrl.registry import families as registered

    adapters = registered()
    chosen = families or adapters
    probes = [probe(f) for f in features] if features else list(PROBES)
    fresh = probe_cells(chosen, probes, device=device, workers=workers, progress=progress)
    if platform_of(device) == "gpu":
        return make_document(adapters, PROBES, fresh), []
    gpu_cells = (load(Path(output) / GPU_RESULTS_FILE) or {}).get("cells", [])
    if gpu_results:
        gpu_cells = merge_gpu_cells(gpu_cells, load_gpu_cells(Path(gpu_results)))
    kept = []
    existing = load(Path(output) / RESULTS_FILE)
    if (families or features) and existing:
        probed = {(c["family"], c["feature"]) for c in fresh}
        kept = [c for c in existing["cells"] if c["platform"] == "cpu" and (c["family"], c["feature"]) not in probed]
    return make_document(adapters, PROBES, kept + fresh + gpu_cells), gpu_cells


def check(output: Path, *, workers: int = 2, progress: bool = True) -> tuple[list[str], dict[str, Any], Path]:
    """Regenerate every CPU cell into a temporary folder and compare with OUTPUT:
    (problems, fresh document, temporary folder). No problems: OUTPUT is up to date
    and no declared capability fails."""
    import tempfile

    from mmrl.probes.render import render_html, render_markdown

    output = Path(output)
    document, gpu_cells = regenerate(output, workers=workers, progress=progress)
    fresh = Path(tempfile.mkdtemp(prefix="mmrl-support-matrix-"))
    write(document, fresh, gpu_cells)
    problems = []
    committed = load(output / RESULTS_FILE)
    if committed is None:
        problems.append(f"{output / RESULTS_FILE} is missing")
    else:
        problems += differences(committed, document)
        for name, render in ((MARKDOWN_FILE, render_markdown), (HTML_FILE, render_html)):
            page = output / name
            if not page.is_file() or page.read_text() != render(committed):
                problems.append(f"{page} was not generated from its {RESULTS_FILE}")
    for c in gating_failures(document):
        problems.append(f"declared capability fails its probe: {c['family']}/{c['feature']}: {c['reason']}")
    return problems, document, fresh


class progress_bar:
    """A rich progress bar over (family, probe) cells, on stderr; a no-op when disabled.

        with progress_bar(True, total) as advance:
            run_probes(..., on_result=advance)
    """

    def __init__(self, enabled: bool, total: int, *, transient: bool = False):
        self.enabled, self.total, self.transient = enabled, total, transient

    def __enter__(self):
        if not self.enabled:
            return lambda *a: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold]probing[/]"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.description}"), transient=self.transient,
                            console=Console(stderr=True))
        self.bar.__enter__()
        task = self.bar.add_task("", total=self.total)

        def advance(subject, p, result):
            mark = " [red]failed[/]" if result.status is Status.FAILED else ""
            self.bar.update(task, advance=1, description=f"{subject.label} / {p.feature}{mark}")

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False


def default_workers(workers: int | None) -> int:
    """Worker processes for a probe command: as given (0: in process), else 2, or 1 on one core."""
    if workers is not None and workers < 0:
        raise ValueError(f"--workers {workers}: give 0 (probes in this process) or more")
    return workers if workers is not None else max(1, min(2, os.cpu_count() or 1))


class WorkerLog:
    """The log of a probe command's worker processes (mmrl/logs.py: third-party output and
    the tracebacks of failing probes): none when the probes run in process. Leaving the
    `with` on an exception names the log on stderr (it is kept); `close(failed=...)` keeps
    it and returns its path only for a command that failed, so passing runs leave no
    `mmrl-*.log` behind in $TMPDIR. A log in `folder` (`--log-dir`) is always kept.

        with WorkerLog("doctor", workers) as log:
            results = run_probes(...)
        kept = log.close(failed=bool(failures))   # None when removed
    """

    def __init__(self, command: str, workers: int, folder: Path | None = None):
        self.path = new_worker_log(command, folder) if workers > 0 else None
        self.keep = folder is not None

    def __enter__(self) -> WorkerLog:
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is not None and self.path is not None:
            from rich.console import Console

            Console(stderr=True).print(f"the probe workers' logs are kept in {self.path}", highlight=False,
                                       soft_wrap=True)
        return False

    def close(self, *, failed: bool) -> Path | None:
        self.path = close_worker_log(self.path, failed=failed or self.keep)
        return self.path


# -- files -------------------------------------------------------------------------------
def dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def load(path: Path) -> dict[str, Any] | None:
    path = Path(path)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def load_gpu_cells(path: Path) -> list[dict]:
    """GPU cells from a results file written on a GPU machine (same schema)."""
    document = load(path)
    if document is None:
        raise FileNotFoundError(f"{path}: no such GPU results file")
    if document.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {document.get('schema')!r}, expected {SCHEMA_VERSION}")
    cells = [c for c in document.get("cells", []) if c.get("platform") == "gpu"]
    if not cells:
        raise ValueError(f"{path}: no GPU cells (record them with `mmrl support-matrix --device cuda`)")
    return cells


def merge_gpu_cells(old: list[dict], new: list[dict]) -> list[dict]:
    """New GPU cells replace old ones of the same family and feature, except that a cell
    the new machine could not run (one GPU where the probe needs two) keeps the result an
    earlier machine recorded; the kept cell still names its own device and date."""
    merged = {(c["family"], c["feature"]): c for c in old}
    for cell in new:
        key = (cell["family"], cell["feature"])
        if cell["status"] == Status.NOT_RUN and merged.get(key, cell)["status"] != Status.NOT_RUN:
            continue
        merged[key] = cell
    return [merged[k] for k in sorted(merged)]


def write(document: dict[str, Any], output: Path, gpu_cells: list[dict] | None = None) -> list[Path]:
    """results.json, README.md and index.html (and gpu_results.json when there are GPU cells)."""
    from mmrl.probes.render import render_html, render_markdown

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    # Render what the file will hold (key order, lists), so the pages are a function of it.
    document = json.loads(dumps(document))
    files = {RESULTS_FILE: dumps(document), MARKDOWN_FILE: render_markdown(document), HTML_FILE: render_html(document)}
    if gpu_cells:
        files[GPU_RESULTS_FILE] = dumps({"schema": SCHEMA_VERSION, "generator": "mmrl support-matrix --device cuda",
                                         "cells": gpu_cells})
    for name, text in files.items():
        (output / name).write_text(text)
    return [output / name for name in files]


# -- comparing ---------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def stable_reason(reason: str) -> str:
    """The reason with its numbers masked (measured differences vary between machines)."""
    return _NUMBER.sub("#", reason or "")


def stable_view(document: dict[str, Any]) -> dict[str, Any]:
    """What must be equal between two runs on different machines."""
    return {
        "features": [(f["feature"], f["title"], f["capability"]) for f in document["features"]],
        "families": [(f["family"], tuple(f["modalities"]), tuple(f["declared"])) for f in document["families"]],
        "cells": {
            (c["family"], c["feature"], c["platform"]): (c["status"], c["declared"], stable_reason(c["reason"]))
            for c in document["cells"]
        },
    }


def differences(committed: dict[str, Any], fresh: dict[str, Any], limit: int = 5) -> list[str]:
    """Human-readable differences between two documents' stable views (empty: same)."""
    a, b = stable_view(committed), stable_view(fresh)
    found = []
    if a["features"] != b["features"]:
        old, new = {f[0] for f in a["features"]}, {f[0] for f in b["features"]}
        found.append(f"features changed (+{sorted(new - old)} -{sorted(old - new)})" if old != new
                     else "feature titles or capabilities changed")
    if a["families"] != b["families"]:
        old, new = {f[0] for f in a["families"]}, {f[0] for f in b["families"]}
        found.append(f"families changed (+{sorted(new - old)} -{sorted(old - new)})" if old != new
                     else "a family's modalities or declared capabilities changed")
    changed = []
    for key in sorted(set(a["cells"]) | set(b["cells"])):
        before, after = a["cells"].get(key), b["cells"].get(key)
        if before != after:
            family, feature, platform = key
            where = f"{family}/{feature}" + ("" if platform == "cpu" else f" ({platform})")
            if before is None or after is None:
                changed.append(f"{where}: {'added' if before is None else 'removed'}")
            elif before[0] != after[0]:
                changed.append(f"{where}: {before[0]} -> {after[0]}")
            else:
                changed.append(f"{where}: reason changed")
    if changed:
        shown = ", ".join(changed[:limit]) + (f", and {len(changed) - limit} more" if len(changed) > limit else "")
        found.append(f"{len(changed)} cell(s) differ: {shown}")
    return found


def gating_failures(document: dict[str, Any], platform: str = "cpu") -> list[dict]:
    """Cells where a declared (or required) feature failed on `platform`. CI stops on
    the CPU ones, which it regenerates; recorded GPU cells cannot be re-checked there,
    so their failures are reported, not gated on."""
    return [c for c in document["cells"]
            if c["platform"] == platform and c["status"] == Status.FAILED.value and c["declared"] is not False]
