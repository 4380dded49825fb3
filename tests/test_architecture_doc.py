"""docs/architecture.md stays true: every module under mmrl/ (package-level .py files and
subpackages) has a row, every path the page names exists, and each module's top-level
mmrl imports stay in its layer or a lower one (the page's "Layers" table, lowest first).

A module added to mmrl/ fails `test_every_module_has_a_row` until the page gives it a
row: one line in the "Modules" table, naming its layer.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
MMRL = REPO / "mmrl"

# Modules other branches add at the same time as this page (issue 29): named on the page
# before they land. Empty this set once they are merged; until then each may be missing.
ARRIVING: set[str] = set()  # paths the page names before they land


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _table_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]  # the header


def layers() -> list[str]:
    return [row[0] for row in _table_rows(_section("Layers"))]


def rows() -> dict[str, str]:
    """`mmrl/x.py` or `mmrl/pkg/` -> its layer, from the Modules table."""
    out = {}
    for cells in _table_rows(_section("Modules")):
        path = cells[0].strip("`")
        assert path not in out, f"{path} has two rows"
        out[path] = cells[1]
    return out


def units() -> list[str]:
    """Every module of mmrl/ as the page names it: package-level files and subpackages."""
    files = [f"mmrl/{p.name}" for p in MMRL.glob("*.py")]
    packages = [f"mmrl/{p.parent.name}/" for p in MMRL.glob("*/__init__.py")]
    return sorted(files + packages)


def test_every_module_has_a_row():
    missing = [u for u in units() if u not in rows()]
    assert not missing, f"docs/architecture.md has no row for {missing}: add one to its Modules table"


def test_every_path_the_page_names_exists():
    named = set(re.findall(r"`((?:mmrl|models|processors|docs|tests|bench)/\w[\w/.]*)`", PAGE.read_text()))
    named |= set(rows())
    gone = sorted(p for p in named if not (REPO / p).exists() and p not in ARRIVING)
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"


def test_every_row_names_a_layer():
    known = layers()
    assert known[0] == "base" and known[-1] == "tools"
    wrong = {path: layer for path, layer in rows().items() if layer not in known}
    assert not wrong, f"rows with a layer the Layers table lacks: {wrong}"


def _top_level_imports(files: list[Path]) -> set[str]:
    """The mmrl modules (package-level names) these files import at module level."""
    found = set()
    for file in files:
        for node in ast.parse(file.read_text()).body:
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "mmrl":
                    names = [f"mmrl.{alias.name}" for alias in node.names]
                else:
                    names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            found |= {name.split(".")[1] for name in names if name.startswith("mmrl.")}
    return found


def _unit_of(name: str) -> str | None:
    if (MMRL / name / "__init__.py").exists():
        return f"mmrl/{name}/"
    if (MMRL / f"{name}.py").exists():
        return f"mmrl/{name}.py"
    return None  # models, processors: outside mmrl/, the families' layer


@pytest.mark.parametrize("unit", units())
def test_top_level_imports_stay_in_the_layer_or_below(unit):
    order, layer_of = layers(), rows()
    if unit not in layer_of:
        pytest.fail(f"{unit} has no row in docs/architecture.md")
    files = sorted((MMRL / unit).rglob("*.py")) if unit.endswith("/") else [MMRL / unit.removeprefix("mmrl/")]
    own = order.index(layer_of[unit])
    above = {}
    for name in _top_level_imports(files):
        target = _unit_of(name)
        if target is not None and target != unit and target in layer_of and order.index(layer_of[target]) > own:
            above[target] = layer_of[target]
    assert not above, (f"{unit} ({layer_of[unit]}) imports at module level from a higher layer: {above}; "
                       "import inside the function that needs it, or move the row (docs/architecture.md)")


def test_the_rl_math_imports_nothing_else_from_mmrl():
    assert _top_level_imports(sorted((MMRL / "algos").rglob("*.py"))) <= {"algos"}
