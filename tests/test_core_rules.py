"""House rules that keep the core honest: it names no model family, imports cheaply,
and every module says what it is for."""

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAMILY_NAMES = re.compile(r"qwen|llama|mistral|gemma|phi[-_]?\d|idefics|smolvlm|llava|internvl", re.I)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def test_core_names_no_model_family():
    hits = []
    for path in sorted((REPO / "mmrl").rglob("*.py")):
        source = path.read_text()
        skip = _docstring_lines(ast.parse(source))
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT or token.start[0] in skip:
                continue
            if FAMILY_NAMES.search(token.string):
                hits.append(f"{path.relative_to(REPO)}:{token.start[0]}: {token.string[:60]}")
    assert not hits, "the core names model families:\n" + "\n".join(hits)


def _model_type_literals(paths, root: Path) -> list[str]:
    """`path:line: 'type'` for each string constant that is a transformers model type (a key
    of CONFIG_MAPPING_NAMES, 'clip' or 'siglip' say): a family named by its config's type,
    which the name pattern above does not list."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    hits = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in CONFIG_MAPPING_NAMES:
                hits.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return hits


def test_core_holds_no_transformers_model_type():
    hits = _model_type_literals(sorted((REPO / "mmrl").rglob("*.py")), REPO)
    assert not hits, "the core names transformers model types:\n" + "\n".join(hits)


def test_the_model_type_rule_sees_a_model_type_used_as_a_tag(tmp_path):
    """The rule above catches a family's type used as a plain tag, and passes other words."""
    module = tmp_path / "shapes.py"
    module.write_text('def shape(value):\n    return ("clip", len(value)) if isinstance(value, list) else ("image",)\n')
    assert _model_type_literals([module], tmp_path) == ["shapes.py:2: 'clip'"]


@pytest.mark.slow
def test_every_module_has_a_docstring():
    missing = []
    for folder in ("mmrl", "models", "processors"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if ast.get_docstring(ast.parse(path.read_text())) is None:
                missing.append(str(path.relative_to(REPO)))
    assert not missing, f"modules without a docstring: {missing}"


@pytest.mark.slow
def test_import_is_cheap_and_lazy():
    code = """
import sys, time
import torch
start = time.perf_counter()
import mmrl
from mmrl import register_model, RopeSpec
elapsed = time.perf_counter() - start
heavy = [m for m in sys.modules if m.startswith(("vllm", "transformers.models.", "mmrl.models.", "peft"))]
print(elapsed, len(heavy), heavy[:5])
"""
    times = []
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                                env={**os.environ}, timeout=120)
        assert result.returncode == 0, result.stderr
        elapsed, heavy, names = result.stdout.split(" ", 2)
        assert int(heavy) == 0, f"import mmrl pulled in {names}"
        times.append(float(elapsed))
    assert sorted(times)[1] < 1.0, f"import mmrl took {sorted(times)[1]:.2f} s on top of torch"


def test_every_package_is_listed_for_installation():
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"mmrl." + ".".join(p.parent.relative_to(REPO / "mmrl").parts) if p.parent != REPO / "mmrl" else "mmrl"
             for p in (REPO / "mmrl").rglob("__init__.py")}
    found |= {"mmrl.models", "mmrl.processors"}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_docs_list_every_family_in_this_repository():
    """docs/families.md has a line per family of models/ (mmrl add-model appends one)."""
    from mmrl.registry import families

    listed = (REPO / "docs" / "families.md").read_text()
    in_tree = [a.family for a in families() if type(a).__module__.startswith("mmrl.models.")]
    assert in_tree and all(f"- `{family}` (" in listed for family in in_tree)


# The engine's line budget: `mmrl/engine/engine.py` is a thin `Engine` over its parts
# (`mmrl/engine/`: surgery, optimizer, layouts, state); lower it as the file shrinks, never raise it.
ENGINE_LINE_BUDGET = 420


def test_the_engine_stays_under_its_line_budget():
    lines = len((REPO / "mmrl" / "engine" / "engine.py").read_text().splitlines())
    assert lines <= ENGINE_LINE_BUDGET, (f"mmrl/engine/engine.py has {lines} lines, over its budget of "
                                         f"{ENGINE_LINE_BUDGET}: give the new job a part of its own in mmrl/engine/")


def test_every_model_change_is_a_step_listed_in_surgerys_docstring_in_order():
    """`mmrl.engine.surgery` is the one list of what mmrl changes in a HF model: every
    `apply_*` step is named in its docstring and called by `apply_all`, both in one order."""
    tree = ast.parse((REPO / "mmrl" / "engine" / "surgery.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    steps = [name for name in functions if name.startswith("apply_") and name != "apply_all"]
    listed = re.findall(r"^\d+\. `(apply_\w+)`", ast.get_docstring(tree), re.M)
    calls = sorted((node.lineno, node.col_offset, node.func.id) for node in ast.walk(functions["apply_all"])
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                   and node.func.id.startswith("apply_"))
    called = [name for _, _, name in calls]
    assert steps and sorted(steps) == sorted(listed), f"apply_* steps {steps}, listed in the docstring {listed}"
    assert called == listed, f"apply_all calls {called}, the docstring lists {listed}"


def _imported_names(path: Path) -> set[str]:
    """Every `module` and `module.name` that a file imports, at the top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_rollout_to_training_batch_has_one_home():
    """`mmrl.rollout_batch` alone turns a rollout into training sequences: the update
    reaches them through it, never through the agent loop, and no rollout module joins
    prompts and responses into sequences itself."""
    update = _imported_names(REPO / "mmrl" / "update.py")
    assert "mmrl.rollout_batch" in update and not any(n.startswith("mmrl.rollout.agent") for n in update)
    joining = [str(path.relative_to(REPO)) for path in sorted((REPO / "mmrl" / "rollout").rglob("*.py"))
               if {"mmrl.engine.join", "mmrl.engine.sequences", "mmrl.engine.sequences.join"} & _imported_names(path)]
    assert not joining, f"rollout modules that build training sequences (mmrl/rollout_batch.py's job): {joining}"


# -- the import graph: no cycle, no private name across files ------------------------------------


def _mmrl_modules() -> dict[str, Path]:
    """Every module of mmrl/ by dotted name (a package by its folder's name)."""
    modules = {}
    for path in sorted((REPO / "mmrl").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _mmrl_imports(name: str, path: Path, modules: dict[str, Path], typing_too: bool = False):
    """(line, imported mmrl module, imported name or None) for each import statement of the
    file, at the top or inside functions; `if TYPE_CHECKING:` blocks import nothing at run
    time and are left out unless `typing_too`. `from mmrl.a import b` imports module
    mmrl.a.b where b is one."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    # mmrl/__init__.py's block names its lazy exports (`_LAZY`) for type checkers: it imports
    # nothing, at run time or for a hint of its own, so it is left out even with `typing_too`.
    typing_only = set() if typing_too and name != "mmrl" else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body for n in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mmrl":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mmrl":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield node.lineno, submodule if submodule in modules else target, alias.name


def _import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """Which mmrl modules each one imports (`typing_too`: counting `if TYPE_CHECKING:`
    imports). Importing mmrl.a.b runs mmrl/a/__init__.py first, so a module also imports the
    packages above its target (not its own)."""
    modules = _mmrl_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, target, _ in _mmrl_imports(name, path, modules, typing_too):
            while target and target not in modules:  # `import mmrl.a.b.attr`-style: the module holding it
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
                graph[name].update(package for package in _packages_above(target)
                                   if package != name and not name.startswith(package + "."))
    return graph


def _packages_above(module: str) -> list[str]:
    """mmrl.a.b.c -> [mmrl, mmrl.a, mmrl.a.b]."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_mmrl():
    """No two modules of mmrl/ import each other, directly or around a loop, counting
    imports inside functions: the dependency graph is a set of layers a reader can follow
    (docs/architecture.md)."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles in mmrl/:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_no_import_cycle_in_mmrl_even_for_type_hints():
    """Nor for type hints alone (`if TYPE_CHECKING:`): a module that needs another's type
    where that one imports it names what it uses in a `Protocol` (the buffer's schedules
    and `mmrl.buffer.trainer_view.TrainerView`, not `mmrl.trainer.Trainer`)."""
    cycles = _cycles(_import_graph(typing_too=True))
    assert not cycles, "import cycles through type hints in mmrl/:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_no_private_name_is_imported_across_files():
    """A `_name` is its file's own: another file that needs it gets a public name."""
    modules = _mmrl_modules()
    crossing = []
    for name, path in modules.items():
        for line, target, imported in _mmrl_imports(name, path, modules):
            if not imported or not imported.startswith("_") or imported.startswith("__"):
                continue
            if modules.get(target) != path:
                crossing.append(f"{path.relative_to(REPO)}:{line}: {imported} from {target}")
    assert not crossing, "private names imported across files:\n" + "\n".join(crossing)


def _private_mmrl_imports(paths, root: Path) -> list[str]:
    """`path:line: _name from module` for each private name a file imports from mmrl (at
    the top or inside functions)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mmrl" and not node.level:
                found += [f"{path.relative_to(root)}:{node.lineno}: {alias.name} from {node.module}"
                          for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_benches_reach_mmrl_through_public_names():
    """A bench is a script a reader runs and copies from: what it needs of mmrl is public
    (`mmrl.rollout.compiled.decode_step`, `mmrl.media_check.training_logprobs`)."""
    found = _private_mmrl_imports(sorted((REPO / "bench").rglob("*.py")), REPO)
    assert not found, "benches importing private mmrl names:\n" + "\n".join(found)


def test_the_bench_rule_sees_a_private_name_imported_inside_a_function(tmp_path):
    bench = tmp_path / "profile.py"
    bench.write_text("def twin():\n    from mmrl.rollout.compiled import _decode_step, choose_tokens\n"
                     "    return _decode_step\n")
    assert _private_mmrl_imports([bench], tmp_path) == ["profile.py:2: _decode_step from mmrl.rollout.compiled"]


def _private_members_by_file(modules: dict[str, Path]) -> dict[str, set[Path]]:
    """`_name` -> the files whose classes define it (a method, a class attribute, `self._name = ...`)."""
    defined: dict[str, set[Path]] = {}
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.append(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names += [t.id for t in targets if isinstance(t, ast.Name)]
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.append(node.attr)
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    defined.setdefault(name, set()).add(path)
    return defined


def _private_members_reached(modules: dict[str, Path], root: Path = REPO) -> list[str]:
    """`path: other._name` for each private member that a file reaches on another object
    where only another file's class defines `_name` (paths relative to `root`)."""
    defined = _private_members_by_file(modules)
    reached = set()
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in defined and path not in defined[node.attr]
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reached.add(f"{path.relative_to(root)}: {ast.unparse(node)}")
    return sorted(reached)


def test_no_private_member_is_reached_from_another_file():
    """`other._name`, where only another file's class defines `_name`: that file's own
    business. A member another file needs is public (`CompiledHFRollout.prefill`, not
    `_prefill`, for the multi-turn sessions; `Trainer.roll_out_batch`, `next_prompts`,
    `score` and `timed` for the buffer's schedules)."""
    reached = _private_members_reached(_mmrl_modules())
    assert not reached, "private members reached from another file:\n" + "\n".join(reached)


def test_the_member_rule_sees_a_private_member_reached_across_files(tmp_path):
    """The rule above fails on a schedule that drives the trainer through its private
    methods, and lets the trainer call its own."""
    trainer, schedule = tmp_path / "trainer.py", tmp_path / "schedule.py"
    trainer.write_text("class Trainer:\n    def _roll_out(self):\n        return self._timed()\n\n"
                       "    def _timed(self):\n        pass\n")
    schedule.write_text("def produce(trainer):\n    with trainer._timed():\n        return trainer._roll_out()\n")
    found = _private_members_reached({"mmrl.trainer": trainer, "mmrl.buffer.schedule": schedule}, tmp_path)
    assert found == ["schedule.py: trainer._roll_out", "schedule.py: trainer._timed"]
