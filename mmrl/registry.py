"""The model registry: `@register_model`, lookup by family, model_type or architecture.

Families register by decorating their adapter class. The in-tree zoo (`mmrl.models.*`)
and out-of-tree packages (entry point group `mmrl.models`, or `--plugin module` on the
CLI, or `load_plugin("module")`) are imported the first time a lookup needs them, so
`import mmrl` stays cheap.

    from mmrl import get_adapter
    get_adapter("qwen2_vl")            # by HF model_type
    get_adapter("/ckpt/dir")           # by the checkpoint's config.json
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from importlib.metadata import entry_points
from pathlib import Path
from typing import TypeVar

from mmrl.adapter import ModelAdapter

ENTRY_POINT_GROUP = "mmrl.models"

_BY_FAMILY: dict[str, ModelAdapter] = {}
_BY_MODEL_TYPE: dict[str, ModelAdapter] = {}
_BY_ARCHITECTURE: dict[str, ModelAdapter] = {}
_discovered = False

A = TypeVar("A", bound=type[ModelAdapter])


class RegistryError(ValueError):
    """A registration conflicts, or a lookup names nothing registered."""


def register_model(cls: A) -> A:
    """Class decorator: validate the adapter and add it to the registry."""
    if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
        raise TypeError(f"@register_model expects a ModelAdapter subclass, got {cls!r}")
    cls.validate()
    adapter = cls()
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


def load_plugin(module: str) -> None:
    """Import a module whose import registers adapters (`--plugin module`)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise RegistryError(f"plugin module {module!r} cannot be imported: {exc}") from exc


def discover() -> None:
    """Import the in-tree zoo and every entry-point plugin, once."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import mmrl.models as zoo

    for info in pkgutil.iter_modules(zoo.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{zoo.__name__}.{info.name}")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def families() -> list[ModelAdapter]:
    """Every registered adapter, sorted by family name."""
    discover()
    return [_BY_FAMILY[name] for name in sorted(_BY_FAMILY)]


def _config_dict(path: Path) -> dict:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise RegistryError(f"{path}: no config.json found")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{config_file}: not valid JSON ({exc})") from exc


def get_adapter(name_or_path: str | Path) -> ModelAdapter:
    """Find the adapter for a family name, HF model_type, architecture or checkpoint dir."""
    discover()
    key = str(name_or_path)
    for table in (_BY_FAMILY, _BY_MODEL_TYPE, _BY_ARCHITECTURE):
        if key in table:
            return table[key]
    path = Path(key)
    if path.exists():
        config = _config_dict(path)
        return adapter_for_config(config, source=str(path))
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
        f"{source}: model_type {model_type!r} is not registered; "
        "docs/adding_a_model.md says how to add a family"
    )
