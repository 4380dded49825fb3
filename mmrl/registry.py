"""The model registry: `@register_model`, lookup by family, model_type or architecture.

Families register by decorating their adapter class. The in-tree zoo (`mmrl.models.*`)
and out-of-tree packages (entry point group `mmrl.models`, or `--plugin module` on the
CLI, or `load_plugin("module")`) are imported the first time a lookup needs them, so
`import mmrl` stays cheap. An installed plugin that fails to load (its import raises, or
its adapter fails validation) is skipped with one `PluginWarning` naming the package, the
entry point and the cause; every other family still registers. A plugin named explicitly
(`--plugin`, `load_plugin`) that fails is a `RegistryError` instead: it was asked for.

    from mmrl import get_adapter
    get_adapter("qwen2_vl")            # by HF model_type
    get_adapter("/ckpt/dir")           # by the checkpoint's config.json
    get_adapter("Qwen/Qwen2-VL-2B-Instruct")  # by a hub id's config.json (mmrl/hub.py)
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import warnings
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TypeVar

from mmrl.adapter import ModelAdapter
from mmrl.errors import whole_cause
from mmrl.hub import HubError, checkpoint_folder

ENTRY_POINT_GROUP = "mmrl.models"

_BY_FAMILY: dict[str, ModelAdapter] = {}
_BY_MODEL_TYPE: dict[str, ModelAdapter] = {}
_BY_ARCHITECTURE: dict[str, ModelAdapter] = {}
_discovered = False

A = TypeVar("A", bound=type[ModelAdapter])


class RegistryError(ValueError):
    """A registration conflicts, or a lookup names nothing registered."""


class PluginWarning(UserWarning):
    """An installed plugin (entry point group `mmrl.models`) failed to load and was skipped.

    A category of its own, so that code can make it fatal
    (`warnings.simplefilter("error", PluginWarning)`); on the command line, where `-W`
    cannot name a category outside the standard library, filter by the message:
    `PYTHONWARNINGS="error:skipped plugin package" mmrl models`."""


def hidden_families() -> set[str]:
    """Families named in `MMRL_HIDE_FAMILIES` (comma-separated) are not registered: the
    add-model sweep hides a zoo family so that a scaffold of the same type can stand in
    its place."""
    import os

    return {name.strip() for name in os.environ.get("MMRL_HIDE_FAMILIES", "").split(",") if name.strip()}


def register_model(cls: A) -> A:
    """Class decorator: validate the adapter and add it to the registry."""
    if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
        raise TypeError(f"@register_model expects a ModelAdapter subclass, got {cls!r}")
    cls.validate()
    adapter = cls()
    if adapter.family in hidden_families():
        return cls
    where = f"{cls.__module__}.{cls.__qualname__}"
    if adapter.family in _BY_FAMILY:
        other = type(_BY_FAMILY[adapter.family])
        raise RegistryError(
            f"{where}: family {adapter.family!r} is already registered by {other.__module__}.{other.__qualname__}"
        )
    for key, table in ((adapter.model_types, _BY_MODEL_TYPE), (adapter.hf_architectures, _BY_ARCHITECTURE)):
        for name in key:
            if name in table:
                raise RegistryError(f"{where}: {name!r} is already registered by family {table[name].family!r}")
    _BY_FAMILY[adapter.family] = adapter
    for name in adapter.model_types:
        _BY_MODEL_TYPE[name] = adapter
    for name in adapter.hf_architectures:
        _BY_ARCHITECTURE[name] = adapter
    return cls


def unregister(family: str) -> None:
    """Remove a family (tests and plugin reloads use this)."""
    adapter = _BY_FAMILY.pop(family)
    for table in (_BY_MODEL_TYPE, _BY_ARCHITECTURE):
        for key in [k for k, v in table.items() if v is adapter]:
            del table[key]


def _load_whole(load: Callable[[], object]) -> None:
    """Run `load`, an import that registers adapters. If it raises, families registered by
    modules whose import failed are removed again, so a plugin whose module registers two
    adapters and then fails does not leave one behind: a spawned probe worker could not
    import its module. Families of modules that did import (a zoo module or a base module
    the plugin imported first) stay."""
    before = set(_BY_FAMILY)
    try:
        load()
    except BaseException:
        for family in set(_BY_FAMILY) - before:
            if type(_BY_FAMILY[family]).__module__ not in sys.modules:
                unregister(family)
        raise


def load_plugin(module: str) -> None:
    """Import a module whose import registers adapters (`--plugin module`).

    The module was asked for by name, so any failure (not found, raises on import, an
    adapter that fails validation or is registered twice) is a `RegistryError` with the
    cause on one line, chained to the original exception; the CLI prints it and exits 2."""
    try:
        _load_whole(lambda: importlib.import_module(module))
    except Exception as exc:
        raise RegistryError(f"plugin module {module!r} failed to load: {whole_cause(exc)}") from exc


def _skip_plugin(ep: EntryPoint, exc: Exception) -> None:
    package = ep.dist.name if getattr(ep, "dist", None) is not None else "(unknown package)"
    # warn_explicit with a location that is no source file, so the warning prints as one
    # line (no source line under it) and never points into this module. A warning rather
    # than a log record: spawned probe workers discover again, and they silence warnings.
    warnings.warn_explicit(
        f"skipped plugin package {package!r}: entry point '{ep.name} = {ep.value}' in group "
        f"{ENTRY_POINT_GROUP} failed to load: {whole_cause(exc)}",
        PluginWarning, filename="mmrl", lineno=0,
    )


def discover() -> None:
    """Import the in-tree zoo and every entry-point plugin, once.

    A plugin that fails to load is skipped with one `PluginWarning`; the zoo is not
    guarded: a zoo module that fails to import is a bug of this repository, for its tests
    to catch."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import mmrl.models as zoo

    for info in pkgutil.iter_modules(zoo.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{zoo.__name__}.{info.name}")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            _load_whole(ep.load)
        except Exception as exc:
            _skip_plugin(ep, exc)


def families() -> list[ModelAdapter]:
    """Every registered adapter, sorted by family name."""
    discover()
    return [_BY_FAMILY[name] for name in sorted(_BY_FAMILY)]


def read_config(path: Path) -> dict:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise RegistryError(f"{path}: no config.json found")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{config_file}: not valid JSON ({exc})") from exc


def get_adapter(name_or_path: str | Path, *, source: str | None = None) -> ModelAdapter:
    """Find the adapter for a family name, HF model_type, architecture, checkpoint dir or
    hub id (its config only is fetched; the order is mmrl/hub.py's). `source` names the
    checkpoint in messages (the hub id whose snapshot folder is `name_or_path`)."""
    discover()
    key = str(name_or_path)
    if not Path(key).expanduser().exists():
        for table in (_BY_FAMILY, _BY_MODEL_TYPE, _BY_ARCHITECTURE):
            if key in table:
                return table[key]
    try:
        path = checkpoint_folder(key, weights=False)
    except HubError as exc:  # callers handle one error type of a lookup
        raise RegistryError(str(exc)) from None
    if path is not None:
        config = read_config(path)
        return adapter_for_config(config, source=source or key)
    raise RegistryError(
        f"no registered model family for {key!r}; known families: {', '.join(sorted(_BY_FAMILY))}"
    )


def adapter_for_config(config, source: str = "config") -> ModelAdapter:
    """The adapter for a config (a dict from config.json or a PretrainedConfig)."""
    discover()
    as_dict = config if isinstance(config, dict) else config.to_dict()
    model_type = as_dict.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    for arch in as_dict.get("architectures") or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    raise RegistryError(
        f"{source}: model_type {model_type!r} is not registered with mmrl; add it with "
        f"`mmrl add-model {model_type or 'MODEL_TYPE'}` (docs/adding_a_model.md)"
    )
