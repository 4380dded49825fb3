"""The `mmrl` command line.

    mmrl models                      # registered families, modalities, declared capabilities
    mmrl models --json
    mmrl models --for Qwen/Qwen2.5-VL-7B-Instruct   # the family a checkpoint (hub id or folder) maps to
    mmrl --version
    mmrl --plugin my_pkg.models models   # also load an out-of-tree family module
    mmrl --verbose doctor qwen2_vl       # keep vLLM/torch/transformers logs (quiet by default: mmrl/logs.py)
    mmrl --debug train RECIPE ...        # an error shows its traceback instead of one line
    mmrl train recipes/tiny_vlm_count.yaml [key=value ...]
    torchrun --nproc_per_node 2 -m mmrl.cli train RECIPE [key=value ...]
    mmrl eval RECIPE --checkpoint runs/X/final [--split validation] [--out FILE] [key=value ...]
    mmrl support-matrix [--check] [--gpu-results FILE]   # probe every family, write support_matrix/
    mmrl doctor PATH_OR_FAMILY [--json]                  # the same probes on a checkpoint or a family
    mmrl export CHECKPOINT OUT [--adapter-only]          # a step checkpoint as a HF (or PEFT) folder
    mmrl add-model MODEL_TYPE [--family NAME] [--out DIR] [--dry-run] [--force]   # scaffold a family
    mmrl buffer show RUN                                 # a run's trajectory buffer (mmrl/buffer)
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click
import typer
from rich.console import Console
from rich.table import Table

class _Bounded(typer.Typer):
    """A Typer app whose every command runs inside the one error boundary, `_boundary`."""

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)
        return lambda function: register(_boundary(function))


def _boundary(command):
    """A failure the user can act on (mmrl/failures.py: bad input, a full or read-only disk,
    memory, unreadable weights, an unreachable source, known torch errors) becomes one line
    and exit 2; anything else is a bug and keeps its traceback. `--debug` shows them all."""

    @functools.wraps(command)
    def bounded(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            from mmrl.failures import explain

            message = explain(exc)
            if message is None:
                raise
            code = None  # with --debug, `fail` raises `exc` again, for its traceback
            try:
                fail(message)
            except click.exceptions.Exit as said:
                code = said.exit_code
                raise
            finally:
                if getattr(exc, "on_every_rank", False):  # under torchrun: no rank leaves before all said it
                    from mmrl.parallel.mesh import leave_together

                    leave_together(exc, code)

    return bounded


_BOOLEAN_WORDS = {"true": True, "1": True, "yes": True, "on": True,
                  "false": False, "0": False, "no": False, "off": False}


class _Group(typer.core.TyperGroup):
    """The root command: `--debug` is a flag, and `--debug true` / `--debug=false` (recipes
    write `key=true`) set it rather than reading `true` as a command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        shown: list[str] = []
        rest = list(args)
        while rest and rest[0].startswith("-"):  # the root's own options, before the command
            arg = rest.pop(0)
            name, _, value = arg.partition("=")
            if name == "--debug" and value.lower() in _BOOLEAN_WORDS:
                shown += ["--debug"] if _BOOLEAN_WORDS[value.lower()] else []
            elif arg == "--debug" and rest and rest[0].lower() in _BOOLEAN_WORDS:
                shown += ["--debug"] if _BOOLEAN_WORDS[rest.pop(0).lower()] else []
            else:
                shown.append(arg)
                if arg == "--plugin" and rest:  # its MODULE
                    shown.append(rest.pop(0))
        return super().parse_args(ctx, shown + rest)


app = _Bounded(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    help="RL training for HuggingFace text and vision-language models.",
)
console = Console()


_DEBUG = {"on": False}  # `mmrl --debug`: errors raise with their traceback


def fail(message: str) -> None:
    """Print a one-line error and exit non-zero (with `--debug`, re-raise the exception
    being handled, traceback and all)."""
    from rich.markup import escape

    if _DEBUG["on"] and sys.exc_info()[1] is not None:
        raise  # noqa: PLE0704 - called from an except block: the error being handled

    # Escaped: a message may hold brackets ("images[0]", a dict key's "[key]") that rich
    # would otherwise read as markup and drop.
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _print_version(shown: bool) -> None:
    """`mmrl --version`: read from the installed packages' metadata (nothing imported)."""
    if not shown:
        return
    from importlib.metadata import PackageNotFoundError, version

    import mmrl

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    typer.echo(f"mmrl {mmrl.__version__} (torch {installed('torch')}, transformers {installed('transformers')})")
    raise typer.Exit()


@app.callback()
def main(
    plugin: list[str] = typer.Option(
        [], "--plugin", help="Import MODULE first; its @register_model adapters join the registry.",
        metavar="MODULE",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Show third-party logs (vLLM, torch, transformers) instead of keeping them "
        "at ERROR; probe workers print to the terminal instead of a log file.",
    ),
    debug: bool = typer.Option(False, "--debug", help="On an error, show the traceback instead of one line."),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=lambda shown: _print_version(shown),
                                 help="Print mmrl's version (and torch's, transformers') and exit."),
) -> None:
    from mmrl.logs import quiet, share_cpu

    _DEBUG["on"] = debug
    share_cpu()  # before anything imports torch
    quiet(is_verbose=verbose)  # before anything imports vLLM or torch
    from mmrl.registry import RegistryError, load_plugin

    for module in plugin:
        try:
            load_plugin(module)
        except RegistryError as exc:
            fail(str(exc))


@app.command()
def models(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    target: str = typer.Option(None, "--for", help="Name the family a checkpoint (hub id, local folder) maps to, "
                               "and what the support matrix verified for it.", metavar="ID_OR_PATH"),
) -> None:
    """List registered model families with their modalities and declared capabilities."""
    from mmrl.probes import declared_not_applicable
    from mmrl.registry import RegistryError, families

    if target is not None:
        from mmrl.lookup import describe_checkpoint, format_description

        try:
            described = describe_checkpoint(target)
        except RegistryError as exc:
            fail(str(exc))
        typer.echo(json.dumps(described, indent=2) if as_json else format_description(described))
        return

    rows = [
        {
            "family": a.family,
            "model_types": list(a.model_types),
            "hf_class": a.hf_class,
            "modalities": list(a.modalities),
            "capabilities": a.capabilities.declared(),
            "declared_not_applicable": declared_not_applicable(a),
            "vllm_architecture": a.rollout.vllm_architecture,
            "module": type(a).__module__,
        }
        for a in families()
    ]
    if as_json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(title=f"{len(rows)} registered model families")
    # Capability names are never cut: the other columns give way first (80-column terminals).
    longest = max((len(name) + 1 for row in rows for name in row["capabilities"]), default=10)
    table.add_column("family", no_wrap=True)
    table.add_column("model types", overflow="fold")
    table.add_column("modalities", max_width=12)  # "text, image," above "video"
    table.add_column("declared capabilities", min_width=longest)
    for row in rows:
        apart = row["declared_not_applicable"]
        applies = ", ".join(c for c in row["capabilities"] if c not in apart)
        table.add_row(
            row["family"], ", ".join(row["model_types"]), ", ".join(row["modalities"]),
            applies + (f"\n[dim](declared, n/a here: {', '.join(apart)})[/]" if apart else ""),
        )
    console.print(table)


@app.command()
def train(
    recipe: str = typer.Argument(..., help="A YAML recipe (see recipes/)."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. optim.lr=1e-4"),
    smoke: bool = typer.Option(False, "--smoke", help="2 steps with the family's tiny random-init model and the "
                               "recipe's bundled rows (its smoke: section; mmrl/smoke.py)."),
) -> None:
    """Train with a recipe; the same command runs one process or, under torchrun, several."""
    from mmrl.config import RecipeError, load_recipe

    try:
        if smoke:
            from mmrl.smoke import load_smoke_recipe

            config = load_smoke_recipe(recipe, overrides or [])
        else:
            config = load_recipe(recipe, overrides or [])
    except RecipeError as exc:
        fail(str(exc))
    from mmrl.logs import hf_progress_bars

    hf_progress_bars(config.trainer.progress)  # "Writing model shards" and the like
    from mmrl.trainer import train as run

    summary = run(config)  # its failures become one line in `_boundary`
    if summary is not None and int(os.environ.get("RANK", "0")) == 0:
        console.print_json(json.dumps(summary))
    _leave_torchrun()


def _leave_torchrun() -> None:
    """Under torchrun, every output written and the process group destroyed: skip the
    interpreter's teardown, where gloo's threads aborted a rank of a finished run under
    load (`exit_cleanly`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from mmrl.parallel.mesh import exit_cleanly

        exit_cleanly()


@app.command("eval")
def evaluate(
    recipe: str = typer.Argument(..., help="A YAML recipe: its data, reward, rollout and eval sections are used."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. eval.samples=8"),
    checkpoint: str = typer.Option(..., "--checkpoint", help="An exported folder (runs/X/final) or a step "
                                   "checkpoint (runs/X/checkpoints/step_N).", metavar="DIR"),
    split: str = typer.Option("eval", "--split", help="eval (data.eval; test also names it) or validation "
                              "(data.validation)."),
    out: str = typer.Option(None, "--out", help="Also write the metrics to this JSON file.", metavar="FILE"),
) -> None:
    """Evaluate a saved policy on the recipe's eval split; nothing is trained or written to its run folder."""
    from mmrl.config import RecipeError, load_recipe

    try:
        config = load_recipe(recipe, overrides or [])
    except RecipeError as exc:
        fail(str(exc))
    if out is not None:
        _check_out_file(out)
    from mmrl.logs import hf_progress_bars

    hf_progress_bars(config.trainer.progress)
    from mmrl.eval_checkpoint import evaluate_checkpoint

    try:
        metrics = evaluate_checkpoint(config, checkpoint, split={"test": "eval"}.get(split, split))
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    if int(os.environ.get("RANK", "0")) == 0:
        if out is not None:
            from mmrl.atomic import atomic_write_text

            atomic_write_text(Path(out).expanduser(), json.dumps(metrics, indent=2) + "\n")
        console.print_json(json.dumps(metrics))
    _leave_torchrun()


def _check_out_file(out: str) -> None:
    """Refuse, before the evaluation runs, an --out file that cannot be written there."""
    path = Path(out).expanduser()
    if path.is_dir():
        fail(f"--out: {out} is a folder; give a file name")
    above = next((folder for folder in path.parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        fail(f"--out: {out} is inside {above}, which is a file; give a file in a folder")
    if above is not None and not os.access(above, os.W_OK):
        fail(f"--out: {above} is not writable; give a file in a folder you may write to")


@app.command("support-matrix")
def support_matrix(
    output: str = typer.Option("support_matrix", "--output", "-o",
                               help="Folder for results.json, README.md, index.html."),
    check: bool = typer.Option(False, "--check", help="Regenerate into a temporary folder; exit 1 if OUTPUT is stale "
                               "or a declared capability fails its probe (CI)."),
    gpu_results: str = typer.Option(None, "--gpu-results", help="Merge GPU cells from this results file (written by "
                                    "`mmrl support-matrix --device cuda` on a GPU machine).", metavar="FILE"),
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda to record GPU cells on a GPU machine."),
    family: list[str] = typer.Option([], "--family", help="Probe only this family (repeatable); other cells keep "
                                     "what OUTPUT/results.json recorded.", metavar="NAME"),
    feature: list[str] = typer.Option([], "--feature", help="Probe only this feature (repeatable); other cells keep "
                                      "what OUTPUT/results.json recorded.", metavar="NAME"),
    workers: int = typer.Option(None, "--workers",
                                help="Worker processes (default: 2, or 1 on one core; 0: in process)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    render_only: bool = typer.Option(False, "--render-only", help="Run no probe: re-render README.md and index.html "
                                     "from OUTPUT/results.json (after a change to mmrl/probes/render.py)."),
    log_dir: str = typer.Option(None, "--log-dir", help="Write the probe workers' log (third-party output, the "
                                "whole traceback of each failing probe) into DIR and keep it; default: $TMPDIR.",
                                metavar="DIR"),
) -> None:
    """Run every probe on every registered family and write the support matrix."""
    import time

    from mmrl.probes import FEATURES
    from mmrl.probes import matrix as sm
    from mmrl.registry import RegistryError, get_adapter

    start = time.perf_counter()
    if check and (family or feature or gpu_results or device != "cpu"):
        fail("--check regenerates every CPU cell; it takes no --family, --feature, --gpu-results or --device")
    if check and not (Path(output) / sm.RESULTS_FILE).is_file():
        # Before minutes of probes: there is nothing to compare them with.
        fail(f"{Path(output) / sm.RESULTS_FILE} not found: --check compares with a committed support matrix "
             "(run it in the repository, or give --output)")
    if render_only:
        if check or family or feature or gpu_results or device != "cpu" or log_dir:
            fail("--render-only runs no probe; it takes no --check, --family, --feature, --gpu-results, --device or "
                 "--log-dir")
        document = sm.load(Path(output) / sm.RESULTS_FILE)
        if document is None:
            fail(f"{Path(output) / sm.RESULTS_FILE} not found: run `mmrl support-matrix` first")
        written = sm.write(document, Path(output))
        console.print(f"re-rendered {', '.join(str(p) for p in written)} from {len(document['cells'])} recorded cells",
                      highlight=False)
        return
    workers = sm.default_workers(workers)
    if log_dir and workers == 0:
        fail("--log-dir holds the worker processes' log; with --workers 0 the probes run in this process, which "
             "writes no log")
    log = sm.WorkerLog("support-matrix", workers, Path(log_dir) if log_dir else None)
    if check:
        with log:
            problems, document, fresh = sm.check(Path(output), workers=workers, progress=progress)
        elapsed = time.perf_counter() - start
        kept = log.close(failed=bool(problems))  # a check that passed leaves no log behind
        if problems:
            Console(stderr=True).print(
                f"[bold red]support matrix check failed[/] ({elapsed:.0f} s; fresh output in {fresh}): "
                + "; ".join(problems) + f". Regenerate with `mmrl support-matrix --output {output}` and commit it."
                + (f" Third-party logs of the probe workers: {kept}." if kept else ""),
                highlight=False, soft_wrap=True)
            raise typer.Exit(code=1)
        console.print(f"support matrix is up to date: {len(document['cells'])} cells, no declared capability "
                      f"fails on CPU ({elapsed:.0f} s)" + (f" (worker logs in {kept})" if kept else ""),
                      highlight=False, soft_wrap=True)
        _report_gpu_failures(document)
        return
    unknown = [f for f in feature if f not in FEATURES]
    if unknown:
        fail(f"unknown feature {unknown[0]!r}; features are {', '.join(FEATURES)}")
    try:
        chosen = [get_adapter(name) for name in family]
        document, gpu_cells = sm.regenerate(
            Path(output), families=chosen, features=feature, gpu_results=Path(gpu_results) if gpu_results else None,
            device=device, workers=workers, progress=progress)
    except (RegistryError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    written = sm.write(document, Path(output), gpu_cells)
    counts: dict[str, int] = {}
    for cell in document["cells"]:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    console.print(f"wrote {', '.join(str(p) for p in written)} in {time.perf_counter() - start:.0f} s: "
                  + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                  + (f" (worker logs in {log.path})" if log.path else ""), highlight=False, soft_wrap=True)
    for cell in sm.gating_failures(document):
        console.print(f"[red]declared capability fails:[/] {cell['family']}/{cell['feature']}: {cell['reason']}",
                      highlight=False)
    _report_gpu_failures(document)


def _report_gpu_failures(document: dict) -> None:
    from mmrl.probes import matrix as sm

    for cell in sm.gating_failures(document, platform="gpu"):
        console.print(f"[yellow]recorded on GPU ({cell['device']}, {cell['date']}), declared capability fails:[/] "
                      f"{cell['family']}/{cell['feature']}: {cell['reason']}", highlight=False)


@app.command()
def doctor(
    target: str = typer.Argument(..., help="A local checkpoint directory, a hub id (org/name[@revision], through "
                                 "the HF cache), or a registered family / model type.", metavar="PATH_OR_FAMILY"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    workers: int = typer.Option(None, "--workers",
                                help="Worker processes (default: 2, or 1 on one core; 0: in process)."),
    progress: bool = typer.Option(None, "--progress/--no-progress",
                                  help="Show a progress bar on stderr (default: when stderr is a terminal)."),
) -> None:
    """Run every probe on a checkpoint or a family's tiny model (exit 1 when a declared capability fails)."""
    from mmrl.probes import PROBES
    from mmrl.probes.doctor import DoctorTargetError, doctor_subject
    from mmrl.probes.matrix import WorkerLog, default_workers, progress_bar, run_probes

    try:
        subject = doctor_subject(target, device)
    except DoctorTargetError as exc:
        fail(str(exc))
    adapter = subject.adapter
    workers = default_workers(workers)
    if progress is None:
        progress = sys.stderr.isatty()
    with WorkerLog("doctor", workers) as worker_log, progress_bar(progress, len(PROBES), transient=True) as advance:
        results = run_probes([subject], PROBES, workers=workers, on_result=advance)
    rows = [(p, results[(subject.label, p.feature)]) for p in PROBES]
    gating = [p.feature for p, r in rows if r.gates]
    log = worker_log.close(failed=bool(gating))  # named below only when kept
    if as_json:
        json.dump({"subject": subject.label, "family": adapter.family,
                   "results": [{"feature": p.feature, "capability": p.capability, **r.to_dict()} for p, r in rows]},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        if log:
            Console(stderr=True).print(f"third-party logs of the probe workers: {log}", highlight=False,
                                       soft_wrap=True)
    else:
        _doctor_table(subject, adapter, rows, gating, log)
    if gating:
        raise typer.Exit(code=1)


def _doctor_table(subject, adapter, rows, gating: list[str], log: Path | None) -> None:
    """One line per feature (a screenful); the reasons of what did not verify in full below."""
    from rich.cells import cell_len

    from mmrl.probes.render import SYMBOLS

    colour = {"verified": "green", "failed": "red", "n/a": "dim", "not run here": "blue"}
    cells, notes = [], []
    for p, r in rows:
        declared = {True: "yes", False: "no", None: "required"}[r.declared]
        sym = SYMBOLS.get((r.status.value, r.declared is not False or r.status.value in ("n/a", "not run here")),
                          SYMBOLS[(r.status.value, True)])[0]
        cells.append((p.title, f"{sym} {r.status.value}", declared, f"{r.seconds:.1f}", r.reason,
                      colour[r.status.value]))
        if r.status.value in ("failed", "not run here"):
            notes.append(f"[{colour[r.status.value]}]{p.title}[/] ({r.status.value}): {r.reason}")
    table = Table(title=f"mmrl doctor: {subject.label} (family {adapter.family}, {subject.device})")
    widths = [max(cell_len(header), *(cell_len(c[i]) for c in cells))
              for i, header in enumerate(("feature", "status", "declared", "s"))]
    for header, width in zip(("feature", "status", "declared", "s"), widths):
        table.add_column(header, no_wrap=True, width=width, justify="right" if header == "s" else "left")
    # The reason takes what is left of the line (3 columns of border and padding per column).
    table.add_column("reason", no_wrap=True, overflow="ellipsis",
                     width=max(20, console.width - sum(widths) - 3 * 5 - 1))
    for title, status, declared, seconds, reason, hue in cells:
        table.add_row(title, f"[{hue}]{status}[/]", declared, seconds, reason)
    console.print(table)
    for note in notes:
        console.print(note, highlight=False)
    verdict = (f"[red]{len(gating)} declared or required feature(s) fail: {', '.join(gating)}[/]" if gating
               else "[green]every declared capability that ran is verified[/]")
    console.print(verdict, highlight=False)
    tail = f"; third-party logs of the probe workers: {log}" if log else ""
    console.print(f"[dim]full reasons and evidence: --json{tail}[/]", highlight=False)


@app.command("export")
def export(
    checkpoint: str = typer.Argument(..., help="A step checkpoint (RUN/checkpoints/step_N) or a run folder (its "
                                               "newest checkpoint that verifies).", metavar="CHECKPOINT"),
    out: str = typer.Argument(..., help="The HF folder to write (replaced whole at the end).", metavar="OUT"),
    adapter_only: bool = typer.Option(False, "--adapter-only",
                                      help="A LoRA run's adapter alone, for PEFT (default: merged weights)."),
) -> None:
    """Convert a step checkpoint to a HF folder that loads in transformers (or PEFT) and decodes as trained."""
    from mmrl.config import RecipeError
    from mmrl.export import ExportError, export_checkpoint

    try:
        written = export_checkpoint(Path(checkpoint), Path(out), adapter_only=adapter_only)
    except (ExportError, RecipeError, FileNotFoundError) as exc:
        fail(str(exc))
    console.print(f"wrote {written}" + (" (LoRA adapter)" if adapter_only else ""), highlight=False, soft_wrap=True)


@app.command("add-model")
def add_model(
    model_type: str = typer.Argument(None, help="A transformers model type (config.json's model_type)."),
    family: str = typer.Option(None, "--family", help="Family name (default: the model type).", metavar="NAME"),
    out: str = typer.Option(None, "--out", help="Write an out-of-tree plugin package into DIR instead of this "
                            "checkout's models/, processors/, tests/ and docs/.", metavar="DIR"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be written; write nothing."),
    force: bool = typer.Option(False, "--force", help="Overwrite files that exist."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Run the quick checks on the tiny model and "
                                "declare only the capabilities that pass (default)."),
    depth: bool = typer.Option(True, "--depth/--no-depth", help="With --verify: also run the video, Ulysses "
                               "(2 processes), multi-turn and vLLM probes and declare what passes (minutes)."),
    sweep: bool = typer.Option(False, "--sweep", help="Instead of one type, run the coverage sweep over every "
                               "causal-LM and image-text-to-text type (resumable) and write COVERAGE."),
    types: str = typer.Option(None, "--types", help="With --sweep: only these comma-separated types.", metavar="LIST"),
    fresh: bool = typer.Option(False, "--fresh", help="With --sweep: forget the rows already recorded."),
    coverage: Path = typer.Option(Path("support_matrix/coverage.json"), "--coverage", metavar="COVERAGE",
                                  help="With --sweep: the JSON to write (a Markdown page is written beside it)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="With --sweep: show a progress bar."),
    workers: int = typer.Option(1, "--workers", min=1, help="With --sweep: types scaffolded at a time."),
    depth_only: bool = typer.Option(False, "--depth-only", help="With --sweep: re-sweep types recorded green "
                                    "(default: those lacking a column) without re-running their generated tests."),
    columns: str = typer.Option(None, "--columns", metavar="LIST", help="Of the depth probes (video, "
                                "sequence_parallel, multi_turn, vllm), only these comma-separated ones; with --sweep "
                                "--depth-only, merged into the green rows (default: those lacking one)."),
) -> None:
    """Scaffold a model family (adapter, processing, zoo test, docs) from transformers' own classes."""
    if sweep:
        from mmrl.scaffold.sweep import run_sweep

        if model_type is not None:
            fail(f"--sweep takes no MODEL_TYPE (got {model_type!r}); name the types with --types "
                 f"{model_type},OTHER_TYPE")
        if depth_only and fresh:
            fail("--depth-only re-sweeps the green rows recorded; --fresh forgets them: give one of the two")
        if types is not None and types.startswith("-"):
            fail(f"--types: {types!r} is not a type list; give comma-separated types, e.g. --types TYPE_A,TYPE_B")
        try:
            document = run_sweep(coverage, types=types.split(",") if types else None, fresh=fresh, progress=progress,
                                 workers=workers, depth_only=depth_only,
                                 columns=tuple(columns.split(",")) if columns else None)
        except ValueError as exc:
            fail(str(exc))
        for mapping, summary in document["summary"].items():
            console.print(f"{mapping}: {summary['green']} of {summary['in_scope']} in-scope types green", highlight=False)
        console.print(f"wrote {coverage} and {coverage.with_suffix('.md')}", highlight=False)
        return
    if model_type is None:
        fail("give a MODEL_TYPE to scaffold, or --sweep")
    if columns and not (verify and depth):
        fail("--columns picks which depth probes run; it does not go with --no-depth or --no-verify")
    from mmrl.scaffold import COLUMNS, ScaffoldError, scaffold

    try:
        result = scaffold(model_type, family=family, out=out, dry_run=dry_run, force=force, check=verify,
                          depth=depth, depth_columns=tuple(columns.split(",")) if columns else None)
    except ScaffoldError as exc:
        fail(str(exc))
    if dry_run:
        for path, text in result.contents.items():
            typer.echo(f"--- {path}")
            typer.echo(text)
        console.print(f"dry run: would write {len(result.contents)} files for family {result.family!r}",
                      highlight=False)
    else:
        console.print(f"wrote family {result.family!r}:", highlight=False)
        for path in result.written:
            console.print(f"  {path}", highlight=False)
    if result.capabilities is not None:
        passed = [name for name in COLUMNS if getattr(result.capabilities, name)]
        console.print("verified on the tiny model: " + ", ".join(passed), highlight=False)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(f"next: {result.next_command}", highlight=False)


# -- `mmrl data check`: how a recipe's rows render (mmrl/smoke.py) ------------------------------
data_app = _Bounded(no_args_is_help=True, help="Look at a recipe's data as the model will see it.")
app.add_typer(data_app, name="data")


@data_app.command("check")
def data_check(
    recipe: str = typer.Argument(..., help="A YAML recipe (see recipes/)."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. data.train.split=test"),
    rows: int = typer.Option(2, "--rows", min=1, help="How many rows to show."),
    split: str = typer.Option("train", "--split", help="train, validation or eval (data.eval; test also names it)."),
    smoke: bool = typer.Option(False, "--smoke", help="Use the recipe's smoke model and bundled rows."),
) -> None:
    """Print the first rows of a recipe's data rendered by the model's processor, with token counts."""
    from mmrl.config import RecipeError, load_recipe
    from mmrl.smoke import describe_rows, format_rows, load_smoke_recipe

    split = {"eval": "test"}.get(split, split)  # the recipe's field names, as `mmrl eval --split` takes them
    if split not in ("train", "validation", "test"):
        fail(f"--split: expected train, validation or eval, got {split!r}")
    try:
        config = load_smoke_recipe(recipe, overrides or []) if smoke else load_recipe(recipe, overrides or [])
        typer.echo(format_rows(describe_rows(config, rows, split)))
    except (RecipeError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))


# -- `mmrl buffer show`: a run's trajectory buffer (mmrl/buffer/show.py) ------------------------
buffer_app = _Bounded(no_args_is_help=True, help="Look at a run's trajectory buffer.")
app.add_typer(buffer_app, name="buffer")


@buffer_app.command("show")
def buffer_show(run: str = typer.Argument(..., help="A run folder (trainer.output_dir).", metavar="RUN")) -> None:
    """Print what a run's buffer holds: trajectories by weights version, trained, waiting, dropped, rewards."""
    from mmrl.buffer.show import render, summarize
    from mmrl.buffer.store import BufferError

    try:
        summary = summarize(Path(run))
    except BufferError as exc:
        fail(str(exc))
    # Piped (no terminal), rich would squeeze the table into 80 columns: give it room instead.
    out = console if console.is_terminal else Console(width=max(console.width, 160))
    for part in render(summary):
        out.print(part, highlight=False)


if __name__ == "__main__":
    app()
