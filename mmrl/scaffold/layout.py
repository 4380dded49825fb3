"""Stage 6, write: where a scaffolded family's files go (in this checkout, or an
out-of-tree plugin package) and the all-or-nothing write that puts them there."""

from __future__ import annotations

import shutil
import tempfile
import textwrap
from pathlib import Path

from mmrl.scaffold.base import Discovery, Layout, ScaffoldError


def repo_root() -> Path:
    """The source checkout the zoo lives in (an installed mmrl has none)."""
    import mmrl.models

    root = Path(next(iter(mmrl.models.__path__))).resolve().parent
    if not all((root / name).is_dir() for name in ("models", "processors", "tests", "docs")):
        raise ScaffoldError(f"{root} is not an mmrl source checkout; write an out-of-tree package with --out DIR")
    return root


def layout_for(d: Discovery, out: Path | None) -> Layout:
    family, vlm = d.family, d.resolved.is_vision_language
    if out is None:
        root = repo_root()
        line = (f"- `{family}` ({'vision-language' if vlm else 'text'}): transformers "
                f"`{d.resolved.model_class}`, [models/{family}.py](../models/{family}.py), "
                f"scaffolded by `mmrl add-model {d.resolved.model_type}`\n")
        return Layout(
            root=root, adapter=root / "models" / f"{family}.py",
            processing=root / "processors" / f"{family}.py" if vlm else None,
            test=root / "tests" / f"test_family_{family}.py", extra={},
            appends={root / "docs" / "families.md": line},
            adapter_module=f"mmrl.models.{family}",
            processing_module=f"mmrl.processors.{family}" if vlm else None, in_tree=True,
        )
    root = Path(out).resolve()
    package = f"mmrl_{family}"
    pyproject = textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "mmrl-{family.replace('_', '-')}"
        version = "0.1.0"
        description = "The {family} model family for mmrl (scaffolded by mmrl add-model)"
        dependencies = ["mmrl"]

        [project.entry-points."mmrl.models"]
        {family} = "{package}.{family}"

        [tool.setuptools]
        packages = ["{package}"]
        """)
    readme = textwrap.dedent(f"""\
        # {package}

        The `{family}` family (transformers `{d.resolved.model_class}`) for mmrl, scaffolded by
        `mmrl add-model {d.resolved.model_type} --out`. Install it next to mmrl and the family
        registers itself through the `mmrl.models` entry point:

            pip install -e .
            mmrl models
            python -m pytest -q tests/test_family_{family}.py
        """)
    return Layout(
        root=root, adapter=root / package / f"{family}.py",
        processing=root / package / "processing.py" if vlm else None,
        test=root / "tests" / f"test_family_{family}.py",
        extra={root / "pyproject.toml": pyproject, root / "README.md": readme,
               root / package / "__init__.py": (f'"""The {family} model family for mmrl."""\n\n'
                                                 f"from . import {family}  # noqa: F401 - registers the family "
                                                 f"(`mmrl --plugin {package}`)\n")},
        appends={}, adapter_module=f"{package}.{family}",
        processing_module=f"{package}.processing" if vlm else None, in_tree=False,
    )


def write_all(contents: dict[Path, str]) -> list[Path]:
    """Stage every file in a temporary folder beside its target, then move them all
    into place; if a move fails, the files already moved are put back."""
    staged: list[tuple[Path, Path, Path | None]] = []
    stage_root = Path(tempfile.mkdtemp(prefix=".mmrl-add-model-", dir=_existing_parent(_common_root(contents))))
    try:
        for i, (path, text) in enumerate(contents.items()):
            temp = stage_root / f"{i}.tmp"
            temp.write_text(text)
            staged.append((path, temp, None))
        moved: list[tuple[Path, Path | None]] = []
        try:
            for path, temp, _ in staged:
                path.parent.mkdir(parents=True, exist_ok=True)
                backup = None
                if path.exists():
                    backup = stage_root / f"{len(moved)}.bak"
                    shutil.copy2(path, backup)
                shutil.move(str(temp), str(path))
                moved.append((path, backup))
        except BaseException:
            for path, backup in reversed(moved):
                if backup is not None:
                    shutil.move(str(backup), str(path))
                else:
                    path.unlink(missing_ok=True)
            raise
    finally:
        shutil.rmtree(stage_root, ignore_errors=True)
    return [path for path, _, _ in staged]


def _common_root(contents: dict[Path, str]) -> Path:
    import os

    return Path(os.path.commonpath([str(p.parent) for p in contents]))


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


FAMILIES_HEADER = """# Model families

Every family mmrl registers in this repository, one line each. `mmrl models` lists what
is registered at run time (plugins included); the support matrix
([support_matrix.md](support_matrix.md)) says what each one verifiably supports.
`mmrl add-model MODEL_TYPE` appends a line here when it scaffolds a family.

"""
