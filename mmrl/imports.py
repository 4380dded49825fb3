"""One importer for the code a recipe names: `reward.name`, `rollout.env` and tools.

    fn = import_object("./my_rewards.py:graded", what="reward", folder=recipe.folder)
    fn = import_object("my_rewards:graded", what="reward", folder=recipe.folder)
    fn = import_object("my_pkg.rewards.graded", what="reward")

A spec takes one of three forms:

- `path/to/file.py:name` (also `./file.py:name`, verl's and EasyR1's form): a Python file,
  relative to `folder` (the recipe's folder), else to the current folder, or absolute. It
  is imported as a module named after the file, with its folder on `sys.path`, so it can
  import the files beside it.
- `package.module:name` or `package.module.name`: an importable module. `folder` and the
  current folder are appended to `sys.path` first, so a module beside the recipe imports
  without `PYTHONPATH=.` (appended: an installed package of the same name wins).

An adapter's `hf_class` and `processing` ("transformers:Qwen2VLForConditionalGeneration")
and a reward's metric name go through the same spec reading (`split_spec`).

A spec that does not resolve is a ValueError of one line naming the spec, the file or
module, and what is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmrl.errors import raised


def is_file_spec(spec: str) -> bool:
    """Whether `spec` names a Python file (`dir/file.py:name`) rather than a module."""
    target = spec.rpartition(":")[0] if ":" in spec else spec
    return target.endswith(".py") or "/" in target or "\\" in target


def split_spec(spec: str) -> tuple[str, str]:
    """(the file or module, the object's name) of a spec: `dir/file.py:name` splits at its
    last colon, `package.module:name` at its colon, `package.module.name` at its last dot;
    a bare `name` is ("", name) and a file without `:name` is (file, "")."""
    if is_file_spec(spec):
        target, _, attribute = spec.rpartition(":") if ":" in spec else (spec, "", "")
        return target, attribute
    target, _, attribute = spec.partition(":") if ":" in spec else spec.rpartition(".")
    return target, attribute


def import_object(spec: str, *, what: str, folder: str | Path | None = None,
                  builtins: Mapping[str, Any] | None = None, kind: str = "") -> Any:
    """The object `spec` names (see the module docstring). `what` names it in errors
    ("reward"), `builtins` lists the names the caller resolves itself, `kind` says what
    the object is ("function"); `folder` is the recipe's folder (None: none)."""
    folder = Path(folder).expanduser().resolve() if folder is not None else None
    target, attribute = split_spec(spec)
    if is_file_spec(spec):
        if not attribute:
            raise ValueError(f"{what} {spec!r}: name the {kind or 'object'} in the file: '{target}:NAME'")
        path = _find_file(target, folder, spec, what)
        module, where = _load_file(path, spec, what), str(path)
    else:
        module_name = target
        if not module_name or not attribute:
            known = f"not a built-in ({', '.join(sorted(builtins))}) and " if builtins else ""
            raise ValueError(f"unknown {what} {spec!r}: {known}not a 'package.module:{kind or 'name'}' "
                             f"or 'path/to/file.py:{kind or 'name'}' path")
        module, where = _import_module(module_name, folder, spec, what), f"module {module_name!r}"
    value = getattr(module, attribute, None)
    if value is None:
        defined = _defined_names(module)
        hint = f" (it defines {', '.join(defined)})" if defined else ""
        raise ValueError(f"{what} {spec!r}: {where} has no {kind + ' ' if kind else ''}{attribute!r}{hint}")
    return value


def _find_file(target: str, folder: Path | None, spec: str, what: str) -> Path:
    path = Path(target).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [base / path for base in (folder, Path.cwd()) if base is not None]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    tried = " or ".join(str(c.resolve()) for c in dict.fromkeys(candidates))
    raise ValueError(f"{what} {spec!r}: no file {tried}")


def _load_file(path: Path, spec: str, what: str):
    """The module of the file at `path`, imported once: a second spec naming the same
    file (or `import stem` from elsewhere) gets the same module."""
    name = path.stem if path.stem.isidentifier() else "mmrl_user_file"
    loaded = sys.modules.get(name)
    if loaded is not None and _file_of(loaded) == path:
        return loaded
    if loaded is not None:  # another module holds the name: keep both
        name = f"{name}_{abs(hash(str(path))):x}"
        if name in sys.modules:
            return sys.modules[name]
    _append_to_path(path.parent)
    try:
        return load_module(name, path)
    except Exception as exc:
        raise ValueError(f"{what} {spec!r}: importing {path} raised {raised(exc)}") from exc


def load_module(name: str, path: Path):
    """Run the Python file at `path` as the module `name` (registered in `sys.modules`,
    taken out again when the file raises): user files named by a spec, and the files the
    add-model scaffold renders before it verifies them."""
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(module_name: str, folder: Path | None, spec: str, what: str):
    for base in (folder, Path.cwd()):
        if base is not None:
            _append_to_path(base)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            places = ", ".join(str(b) for b in dict.fromkeys(b for b in (folder, Path.cwd()) if b is not None))
            raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} (no such module in {places} "
                             "or on the Python path)") from None
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    except Exception as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({raised(exc)})") from exc


def _append_to_path(folder: Path) -> None:
    entry = str(folder)
    if entry not in sys.path:
        sys.path.append(entry)
        importlib.invalidate_caches()


def _file_of(module) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def _defined_names(module, limit: int = 8) -> list[str]:
    """The public functions and classes `module` defines itself, for a hint."""
    names = [name for name, value in vars(module).items()
             if not name.startswith("_") and callable(value) and getattr(value, "__module__", None) == module.__name__]
    return names[:limit] + (["..."] if len(names) > limit else [])


__all__ = ["import_object", "is_file_spec", "load_module", "split_spec"]
