"""`mmrl add-model`: scaffold a model family from what transformers already knows.

The scaffold resolves an HF `model_type` through transformers' auto tables (no remote
code, no network), shrinks the type's own config through its own sub-config classes,
assembles a tiny tokenizer and processor from the type's processor classes, builds the
tiny random-init model on CPU, reads the layout off the instantiated modules (decoder
stack, embeddings, lm_head, vision tower, projector, block classes, linear leaves for
LoRA, rope) and writes an adapter that declares exactly that. It then imports the
written adapter, runs the zoo's quick numerical checks on it, then the probes a zoo family
passes beyond them (video, Ulysses sequence parallelism over 2 processes, an image
arriving in turn 3 of the agent loop, vLLM rollout log-probs against the trainer's where
vLLM serves the architecture), and declares only the capabilities that passed;
each one left out is named with why and what to write by hand.

    mmrl add-model olmo2                       # models/olmo2.py, tests/test_family_olmo2.py, docs
    mmrl add-model olmo2 --out ../my_families  # an out-of-tree plugin package instead
    mmrl add-model olmo2 --dry-run             # print what would be written
    mmrl add-model olmo2 --columns vllm        # of the depth probes, only vllm's
    mmrl add-model --sweep                     # the coverage sweep (sweep.py)

One module per stage: `resolve` (the type's classes), `shrink` (the tiny config), `media`
(the tiny tokenizer and processor, with `media_plan`, `placeholders` and `image_size`),
`discover` (parts, blocks, LoRA leaves), `verify` (the quick checks), `depth` (the
probes beyond them), `render` (the
files' text), `layout` (where they go, and the atomic write). Nothing here knows a family
by name: everything comes from transformers' tables, classes and configs and from the
modules of the tiny model.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from mmrl.errors import whole_cause
from mmrl.scaffold.base import (
    CHECKED, COLUMNS, DEPTH, TOLERANCE, VISION_ONLY, Discovery, Gap, Layout, Resolved, Result, ScaffoldError,
)
from mmrl.scaffold.depth import Depth, verify_depth
from mmrl.scaffold.discover import inspect_family
from mmrl.scaffold.layout import FAMILIES_HEADER, layout_for, write_all
from mmrl.scaffold.render import render_adapter, render_processing, render_test
from mmrl.scaffold.resolve import check_unregistered, family_name, resolve
from mmrl.scaffold.tiny_inputs import tiny_model_inputs
from mmrl.scaffold.verify import verify

__all__ = ["CHECKED", "COLUMNS", "DEPTH", "TOLERANCE", "VISION_ONLY", "Discovery", "Gap", "Layout", "Resolved",
           "Result", "ScaffoldError", "STAGE_SECONDS", "scaffold"]

# Each stage's own time limit in seconds: a stage that runs past it ends the scaffold
# with a one-line error naming the stage (never a silent hang).
STAGE_SECONDS = {"resolve": 60, "config": 60, "processor": 60, "model": 120, "verify": 300, "depth": 840,
                 "write": 60}


@contextlib.contextmanager
def stage_limit(name: str, on_stage: Callable[[str], None] | None = None) -> Iterator[None]:
    """Run a stage under its time limit (SIGALRM, where this is the main thread)."""
    if on_stage is not None:
        on_stage(name)
    seconds = STAGE_SECONDS[name]
    usable = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")

    def expire(signum, frame):
        raise ScaffoldError(f"stage {name!r} ran past its {seconds} s limit", category="timeout")

    previous = signal.signal(signal.SIGALRM, expire) if usable else None
    if usable:
        signal.alarm(seconds)
    try:
        yield
    except ScaffoldError:
        raise
    except Exception as exc:  # no traceback for the user: one line naming the stage and the cause
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ScaffoldError(f"stage {name!r} failed: {whole_cause(exc, 240)} (at {Path(where.filename).name}:"
                            f"{where.lineno}); write this part of the adapter by hand", category=name) from exc
    finally:
        if usable:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def scaffold(model_type: str, *, family: str | None = None, out: str | Path | None = None,
             dry_run: bool = False, force: bool = False, check: bool = True,
             on_stage: Callable[[str], None] | None = None, replace_registered: bool = False,
             depth: bool = True, depth_columns: tuple[str, ...] | None = None) -> Result:
    """Resolve, shrink, inspect, verify, render and write a family; see the module
    docstring. `replace_registered` scaffolds a type the registry already holds (its
    family is unregistered in this process first; the coverage sweep uses it);
    `depth=False` stops after the quick checks (the depth probes take minutes);
    `depth_columns` runs only those of the depth probes (`DEPTH`; None: all)."""
    unknown = sorted(set(depth_columns or ()) - set(DEPTH))
    if unknown:
        raise ScaffoldError(f"not a depth column: {', '.join(unknown)} (the depth columns: {', '.join(DEPTH)})")
    with quiet_transformers():
        return _scaffold(model_type, family, out, dry_run, force, check and depth, check, on_stage,
                         replace_registered, depth_columns)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings about the shrunk configs (token ids outside the tiny
    vocabulary, rope lengths) say nothing to the user: errors only while scaffolding."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _scaffold(model_type, family, out, dry_run, force, run_depth, check, on_stage, replace_registered,
              depth_columns=None) -> Result:
    with stage_limit("resolve", on_stage):
        resolved = resolve(model_type)
        name = family_name(model_type, family)
        replaced = check_unregistered(resolved, name, replace=replace_registered)
    with stage_limit("config", on_stage):
        tiny = tiny_model_inputs(resolved)
    with stage_limit("model", on_stage):
        discovery = inspect_family(resolved, name, tiny)
    layout = layout_for(discovery, Path(out) if out is not None else None)
    contents: dict[Path, str] = {}
    planned = [layout.adapter, layout.test, *layout.extra] + ([layout.processing] if layout.processing else [])
    existing = [p for p in planned if p.exists()]
    if existing and not force:
        raise ScaffoldError(f"{existing[0]} exists; pass --force to overwrite (nothing was written)")
    notes: list[str] = []
    gaps: list[Gap] = []
    verified, depth = None, None
    if check:
        with stage_limit("verify", on_stage):
            verified = verify(discovery, layout, notes, gaps)
    if verified is not None and run_depth:
        depth = Depth(verified)
        try:
            with stage_limit("depth", on_stage):
                verify_depth(discovery, layout, depth, hidden=replaced, columns=depth_columns)
        except ScaffoldError as exc:  # the quick checks' claims stand; the probe running is not declared
            if depth.running is None:
                raise
            depth.decide(depth.running, False, str(exc))
        verified = depth.capabilities
        gaps += depth.gaps
        notes += [f"{gap.column} not declared: {gap.cause}" for gap in depth.gaps]
    with stage_limit("write", on_stage):
        processing_ref = None
        if layout.processing is not None:
            contents[layout.processing] = render_processing(discovery)
            processing_ref = f"{layout.processing_module}:{discovery.class_name}Processing"
        contents[layout.adapter] = render_adapter(discovery, layout, verified, processing_ref, checked=check,
                                                  gaps=gaps)
        contents[layout.test] = render_test(discovery, layout)
        contents.update(layout.extra)
        for path, line in layout.appends.items():
            current = path.read_text() if path.exists() else FAMILIES_HEADER
            if line.strip() not in current:
                contents[path] = current.rstrip("\n") + "\n" + line
        if layout.in_tree:
            command = f".venv/bin/python -m pytest -q {layout.test.relative_to(layout.root)}"
        else:
            command = f"cd {layout.root} && python -m pytest -q {layout.test.relative_to(layout.root)}"
        written = list(contents) if dry_run else write_all(contents)
    vlm = discovery.resolved.is_vision_language
    decided = [c for c in COLUMNS if (c in CHECKED and (vlm or c not in VISION_ONLY))
               or (depth is not None and c in depth.decided)]
    return Result(family=name, written=written, next_command=command,
                  capabilities=verified, notes=notes + [f"fill in: {item}" for item in discovery.fill_in],
                  dry_run=dry_run, contents=contents, gaps=gaps, decided=decided if verified is not None else [],
                  sequence_parallel_mode=sequence_parallel_mode(discovery, verified))


def sequence_parallel_mode(discovery: Discovery, verified) -> str:
    """The mode the written adapter runs sequence parallelism in, where it declares it:
    "gathered" where its spec gathers mixers, else "ulysses"; "" where not declared."""
    if verified is None or not verified.sequence_parallel:
        return ""
    spec = discovery.sequence_parallel
    return "gathered" if spec is not None and spec.gather_mixers else "ulysses"
