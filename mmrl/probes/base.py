"""What a probe is, what it returns, and the rules that turn a check into a status.

A probe verifies one feature on one subject (a family's tiny random-init model, or a
local checkpoint). Its check either returns `Verified(reason, evidence)`, raises
`NotRunHere` (hardware, a package or an mmrl component is missing), or raises anything
else, which is a failure. `Probe.run` applies the status rules, times the check, and
records the device and versions, so one probe's crash never stops the others:

    result = probe.run(subject)      # ProbeResult(status, reason, seconds, evidence, ...)

Status rules (the support matrix and `mmrl doctor` show these; CI gates on `gates`):
- verified: the check passed. If the feature is a capability the adapter does not
  declare, the evidence says "works, not declared".
- failed: the check failed. A failure of a declared capability, or of a feature every
  adapter must support (capability None), fails CI; an undeclared one is shown only.
- n/a: the feature does not apply to the family (e.g. images for a text model).
- not run here: this machine lacks what the check needs (a GPU, vLLM, an mmrl component
  not implemented yet); the reason says what. A declared capability whose mmrl component
  does not exist yet is a failure instead.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from mmrl import errors
from mmrl.logs import PROBE_FAILURES
from mmrl.platform_info import device_name, today, versions

if TYPE_CHECKING:
    from mmrl.adapter import ModelAdapter
    from mmrl.build import BuiltModel

# fp32 logits, max absolute difference: the zoo tests' tolerance (tests/test_zoo.py).
TOLERANCE = 2e-4


class Status(str, Enum):
    VERIFIED = "verified"
    FAILED = "failed"
    NOT_APPLICABLE = "n/a"
    NOT_RUN = "not run here"

    def __str__(self) -> str:
        return self.value


class NotRunHere(Exception):
    """The check cannot run on this machine; the message says what is missing.

    `unimplemented=True` means mmrl itself lacks the component: a family that declares
    the capability then fails instead of being skipped."""

    def __init__(self, reason: str, unimplemented: bool = False):
        super().__init__(reason)
        self.unimplemented = unimplemented


class CheckFailed(AssertionError):
    """A check ran and its result is wrong; the message is the one-line reason, and
    `evidence` the measurements behind it (kept in the failed cell)."""

    def __init__(self, reason: str = "", evidence: dict[str, Any] | None = None):
        super().__init__(reason)
        self.evidence = evidence or {}


def require(condition: bool, reason: str) -> None:
    """Raise `CheckFailed(reason)` unless `condition` holds (an assert that survives -O)."""
    if not condition:
        raise CheckFailed(reason)


@dataclass
class Verified:
    """What a passing check returns: a one-line reason and the measurements behind it."""

    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProbeResult:
    """One cell of the support matrix."""

    status: Status
    reason: str
    seconds: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    # True / False: the capability is / is not declared; None: every adapter must pass.
    declared: bool | None = None
    device: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    date: str = ""

    @property
    def gates(self) -> bool:
        """A failure CI must stop on: a declared or required feature failed."""
        return self.status is Status.FAILED and self.declared is not False

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ProbeResult:
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        known["status"] = Status(known["status"])
        return cls(**known)


@dataclass
class Subject:
    """What the probes run on: a family's tiny random-init model or a local checkpoint.

    `build()` returns a fresh model each call, so probes that change weights (LoRA
    merge, optimizer steps) never leak into the next one. `source` and `random_init`
    are what a subprocess (torchrun) needs to build the same model again."""

    adapter: ModelAdapter
    source: str
    random_init: bool = True
    device: str = "cpu"

    @property
    def label(self) -> str:
        return self.adapter.family if self.random_init else self.source

    def build(self, seed: int = 0) -> BuiltModel:
        from mmrl.build import build_model

        with _on_cpu():
            built = build_model(self.source, random_init=self.random_init, seed=seed)
        if self.random_init and built.adapter is not self.adapter:
            built = self._as_declared(built)
        return self.place(built)

    def load(self, path) -> BuiltModel:
        """A saved checkpoint loaded back (on CPU first, like `build`), on the device."""
        from mmrl.build import load_model

        with _on_cpu():
            return self.place(load_model(path))

    def _as_declared(self, built: BuiltModel) -> BuiltModel:
        """`build_model` resolves a random-init model's adapter from its config's
        model_type; a family whose tiny config uses another family's model type would
        then be probed as that family. Probe the family as declared instead (its hooks
        and processing); the save/reload probe shows where its checkpoints would go."""
        from mmrl.build import BuiltModel

        eos = getattr(built.model.generation_config, "eos_token_id", None)
        stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
        options = {"stop_token_ids": stop_ids, **self.adapter.processing_options}
        processing = self.adapter.processing_class()(built.processing.processor, **options)
        return BuiltModel(model=built.model, processing=processing, adapter=self.adapter)

    def place(self, built: BuiltModel) -> BuiltModel:
        """Move a built model to the subject's device (batches follow it there)."""
        if self.device != "cpu":
            built.model = built.model.to(self.device)
            built.processing = OnDevice(built.processing, self.device)
        return built

    def spec(self) -> dict[str, Any]:
        """What another process needs to rebuild this subject (JSON-able)."""
        return {"source": self.source, "random_init": self.random_init, "device": self.device,
                "module": type(self.adapter).__module__}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Subject:
        """The subject of `spec()`, in a fresh process: the adapter's module is imported
        first, so families from `--plugin` modules resolve there too."""
        import importlib

        from mmrl.registry import get_adapter

        module = spec.get("module")
        if module and module != "__main__":
            importlib.import_module(module)
        return cls(adapter=get_adapter(spec["source"]), source=spec["source"],
                   random_init=spec.get("random_init", True), device=spec.get("device", "cpu"))


class OnDevice:
    """A processing object whose batches land on `device` (for probes run on a GPU).

    Calling it, and calling any of its methods (`collate_rows`, `collate`, `decode`, ...),
    runs the wrapped processing as a run runs it: on CPU tensors, under the CPU default
    device, whatever default device the probe runs under. Processors convert tensors to
    numpy, and under a CUDA default `torch.tensor` puts part of a batch on the GPU: a
    method that reached the processing past this wrapper (`collate_rows`, through the HF
    rollout's `SharedMedia.rows` when prompts repeat) compared GPU rows with a half-CPU
    batch, or handed numpy a CUDA tensor. Tensors the calls return, alone or in a batch,
    move to `device`; other attributes (the tokenizer, the processor, settings) are the
    wrapped processing's own."""

    def __init__(self, processing, device: str):
        self._processing = processing
        self._device = device

    def __call__(self, *args, **kwargs):
        return self._run_on_cpu(self._processing, args, kwargs)

    def __getattr__(self, name):
        value = getattr(self._processing, name)
        if not inspect.ismethod(value):
            return value

        @functools.wraps(value)
        def on_cpu(*args, **kwargs):
            return self._run_on_cpu(value, args, kwargs)

        return on_cpu

    def _run_on_cpu(self, call, args: tuple, kwargs: dict):
        with _on_cpu():
            out = call(*_moved(args, "cpu"), **_moved(kwargs, "cpu"))
        return _moved(out, self._device)


def _moved(value, device):
    """`value` with every tensor in it (alone, or in a mapping, list or tuple) on `device`;
    a mapping that is not a plain dict (a processor's `BatchFeature`) becomes one, and a
    container without tensors is returned as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        moved = {key: _moved(item, device) for key, item in value.items()}
        unchanged = type(value) is dict and all(moved[key] is value[key] for key in moved)
        return value if unchanged else moved
    if type(value) in (list, tuple):
        items = [_moved(item, device) for item in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    return value


def missing_package(exc: Exception) -> str | None:
    """What `exc` says this machine lacks, when it is a package (a dependency that is not
    installed, or a library asking for an optional package of its own), else None."""
    if isinstance(exc, ModuleNotFoundError) and not (exc.name or "mmrl").startswith("mmrl"):
        return f"package {exc.name!r} not installed"
    if isinstance(exc, ImportError) and "pip install" in str(exc):
        return one_line(exc)
    return None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message` (a CheckFailed's own sentence untyped), short
    enough for a table cell's evidence."""
    return errors.one_line(exc, limit, typed=not isinstance(exc, CheckFailed), empty="")


@dataclass(frozen=True)
class Probe:
    """One feature's probe.

    `capability` names the `Capabilities` field this probe verifies, or is None for a
    feature every adapter must support. `inapplicable(adapter)` returns why the feature
    does not apply to a family (None when it does). `check(subject)` returns `Verified`
    or raises (see the module docstring). A `batched` probe also offers `check_many`,
    which checks several subjects in one launch (torchrun) and returns, per subject,
    the `Verified` or the exception that the single check would have raised, and the
    seconds it took."""

    feature: str
    title: str
    description: str
    check: Callable[[Subject], Verified]
    capability: str | None = None
    inapplicable: Callable[[ModelAdapter], str | None] = lambda adapter: None
    check_many: Callable[[list[Subject]], list[tuple[Verified | BaseException, float]]] | None = None
    # Rough relative cost, so the slowest probes start first in the pool.
    cost: float = 1.0

    def declared(self, adapter: ModelAdapter) -> bool | None:
        if self.capability is None:
            return None
        return bool(getattr(adapter.capabilities, self.capability))

    def applies(self, adapter: ModelAdapter) -> bool:
        return self.inapplicable(adapter) is None

    def run(self, subject: Subject) -> ProbeResult:
        """Run the check in isolation and turn its outcome into a ProbeResult."""
        reason = self.inapplicable(subject.adapter)
        if reason is not None:
            return self.decide(subject, Status.NOT_APPLICABLE, reason, 0.0)
        start = time.perf_counter()
        try:
            with _default_device(subject.device):
                outcome: Verified | BaseException = self.check(subject)
        except Exception as exc:  # noqa: BLE001 - a probe's failure is data, not a crash
            outcome = exc
        return self.outcome(subject, outcome, time.perf_counter() - start)

    def run_many(self, subjects: list[Subject]) -> list[ProbeResult]:
        """`run` for several subjects; a batched probe checks them all in one launch."""
        if self.check_many is None:
            return [self.run(s) for s in subjects]
        results: dict[int, ProbeResult] = {}
        todo = []
        for i, subject in enumerate(subjects):
            reason = self.inapplicable(subject.adapter)
            if reason is not None:
                results[i] = self.decide(subject, Status.NOT_APPLICABLE, reason, 0.0)
            else:
                todo.append(i)
        if todo:
            start = time.perf_counter()
            try:
                outcomes = self.check_many([subjects[i] for i in todo])
            except Exception as exc:  # noqa: BLE001 - recorded per subject below
                share = (time.perf_counter() - start) / len(todo)
                outcomes = [(exc, share)] * len(todo)
            for i, (outcome, seconds) in zip(todo, outcomes):
                results[i] = self.outcome(subjects[i], outcome, seconds)
        return [results[i] for i in range(len(subjects))]

    def outcome(self, subject: Subject, outcome: Verified | BaseException, seconds: float) -> ProbeResult:
        declared = self.declared(subject.adapter)
        if isinstance(outcome, Verified):
            evidence = dict(outcome.evidence)
            if declared is False:
                evidence["note"] = "works, not declared"
            return self.decide(subject, Status.VERIFIED, outcome.reason, seconds, evidence)
        if isinstance(outcome, Exception) and (lacking := missing_package(outcome)) is not None:
            outcome = NotRunHere(lacking)  # not a bug of the family: like a missing GPU
        if isinstance(outcome, NotRunHere):
            if outcome.unimplemented and declared:
                return self.decide(subject, Status.FAILED, f"declared, but {outcome}", seconds)
            return self.decide(subject, Status.NOT_RUN, str(outcome), seconds)
        # The whole traceback goes to the worker log (the evidence keeps the last frames).
        logging.getLogger(PROBE_FAILURES).info("%s / %s failed: %s", subject.label, self.feature, one_line(outcome),
                                               exc_info=outcome)
        evidence = {**getattr(outcome, "evidence", {}), "traceback": _short_traceback(outcome)}
        if declared is False:
            evidence["note"] = "fails, not declared: not a CI failure"
        return self.decide(subject, Status.FAILED, one_line(outcome), seconds, evidence)

    def decide(self, subject: Subject, status: Status, reason: str, seconds: float,
               evidence: dict[str, Any] | None = None) -> ProbeResult:
        return ProbeResult(
            status=status, reason=reason, seconds=round(seconds, 3), evidence=evidence or {},
            declared=self.declared(subject.adapter), device=device_name(subject.device),
            versions=versions(), date=today(),
        )


def _on_cpu():
    """Models are built and loaded, and inputs processed, on CPU, whatever the default
    device the probe runs under; `Subject.place` then moves them."""
    import torch

    return torch.device("cpu")


def _default_device(device: str):
    """Tensors the shared checks create (token id lists and the like) land on the
    subject's device; on CPU nothing changes."""
    import contextlib

    if device == "cpu":
        return contextlib.nullcontext()
    import torch

    return torch.device(device)


def _short_traceback(exc: BaseException, frames: int = 3) -> str:
    """The innermost frames, file names relative to site-packages or the repository."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(lines[-(2 * frames + 1):])
    for marker in ("site-packages" + os.sep, os.getcwd() + os.sep):
        tail = tail.replace(marker, "")
    return tail[-1500:]
