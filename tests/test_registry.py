"""The registry: lookup, registration errors, out-of-tree plugins (module and entry point)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mmrl.adapter import DECODER_PARTS, ModelAdapter, TinyModel
from mmrl.registry import RegistryError, adapter_for_config, families, get_adapter, register_model, unregister

REPO = Path(__file__).resolve().parents[1]


def test_lookup_by_family_model_type_architecture_and_checkpoint(tmp_path):
    adapter = get_adapter("qwen2")
    assert get_adapter("Qwen2ForCausalLM") is adapter
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert get_adapter(tmp_path) is adapter
    assert adapter_for_config({"model_type": "unknown", "architectures": ["Qwen2ForCausalLM"]}) is adapter


def test_unknown_names_and_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(RegistryError, match="no registered model family for 'nonesuch'"):
        get_adapter("nonesuch")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "brand_new_lm"}))
    with pytest.raises(RegistryError, match="model_type 'brand_new_lm' is not registered"):
        get_adapter(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RegistryError, match="not valid JSON"):
        get_adapter(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RegistryError, match="no config.json"):
        get_adapter(empty)


def _adapter(**overrides):
    body = dict(
        family="scratch", model_types=("scratch_lm",), architectures=("ScratchForCausalLM",), hf_class="transformers:Qwen2ForCausalLM",
        parts=DECODER_PARTS, shard_layers=("Qwen2DecoderLayer",), tiny=lambda self: TinyModel(None, None),
    )
    body.update(overrides)
    return type("Scratch", (ModelAdapter,), body)


def test_registration_validates_declarations():
    for missing in ("family", "model_types", "hf_class", "parts", "shard_layers"):
        cls = _adapter()
        delattr(cls, missing)
        with pytest.raises(TypeError, match=f"missing required field '{missing}'"):
            register_model(cls)
    with pytest.raises(TypeError, match="'model_types' must be a tuple"):
        register_model(_adapter(model_types="scratch_lm"))
    with pytest.raises(TypeError, match="'hf_class' must read 'module:ClassName'"):
        register_model(_adapter(hf_class="Qwen2ForCausalLM"))
    with pytest.raises(TypeError, match="must implement tiny"):
        register_model(_adapter(tiny=ModelAdapter.tiny))
    assert "scratch" not in {a.family for a in families()}


def test_registering_twice_is_an_error():
    with pytest.raises(RegistryError, match="family 'qwen2' is already registered"):
        register_model(_adapter(family="qwen2"))
    with pytest.raises(RegistryError, match="'qwen2' is already registered by family 'qwen2'"):
        register_model(_adapter(model_types=("qwen2",)))
    register_model(_adapter())
    try:
        with pytest.raises(RegistryError, match="family 'scratch' is already registered"):
            register_model(_adapter())
    finally:
        unregister("scratch")


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO / "tests"), **env}, timeout=120,
    )


@pytest.mark.slow
def test_plugin_module_on_the_cli_registers_a_family():
    result = subprocess.run(
        [sys.executable, "-m", "mmrl.cli", "--plugin", "plugins.toy_family", "models", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO / "tests")},
    )
    assert result.returncode == 0, result.stderr
    rows = {row["family"]: row for row in json.loads(result.stdout)}
    assert rows["toy"]["model_types"] == ["toy_decoder"]
    assert "qwen2" in rows


def test_missing_plugin_module_exits_non_zero_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "mmrl.cli", "--plugin", "no_such_module_xyz", "models"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "no_such_module_xyz" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_entry_point_plugins_are_discovered(tmp_path):
    # A fake installed distribution whose entry point names the toy family module.
    dist = tmp_path / "toy_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[mmrl.models]\ntoy = plugins.toy_family\n")
    result = _run(
        """
        from mmrl.registry import get_adapter
        from mmrl import build_model
        adapter = get_adapter("toy_decoder")
        built = build_model("toy", random_init=True)
        print(adapter.family, type(built.model).__name__)
        """,
        PYTHONPATH=f"{tmp_path}:{REPO / 'tests'}",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["toy", "Qwen2ForCausalLM"]


# -- plugins that fail to load ------------------------------------------------------------
# Each broken plugin is a fake installed distribution (a dist-info folder with an
# entry_points.txt, as in the test above) plus its module, both written into tmp_path.
_SCRATCH_ADAPTER = """
from mmrl.adapter import DECODER_PARTS, ModelAdapter, TinyModel
from mmrl.registry import register_model

def adapter(name, **fields):
    body = dict(family=name, model_types=(name + "_lm",), architectures=(name.title() + "ForCausalLM",),
                hf_class="transformers:Qwen2ForCausalLM",
                parts=DECODER_PARTS, shard_layers=("Qwen2DecoderLayer",), tiny=lambda self: TinyModel(None, None))
    body.update(fields)
    return type(name.title(), (ModelAdapter,), {k: v for k, v in body.items() if v is not None})
"""
_BROKEN_PLUGINS = {
    # package: (module source, what the warning must name besides the package)
    "raises-on-import": ("raise RuntimeError('plugin needs a driver this machine lacks')",
                         "RuntimeError: plugin needs a driver this machine lacks"),
    "bad-syntax": ("def broken(:\n    pass\n", "SyntaxError"),
    "missing-field": (_SCRATCH_ADAPTER + "register_model(adapter('nofield', parts=None))\n",
                      "missing required field 'parts'"),
    # Registers one family, then fails: the first must not stay registered.
    "half-registered": (_SCRATCH_ADAPTER + "register_model(adapter('halfdone'))\n"
                        "register_model(adapter('halfbad', hf_class='NoColon'))\n", "'hf_class' must read"),
}


def _module_name(package: str) -> str:
    return "mmrl_test_plugin_" + package.replace("-", "_")


def _install_fake_plugins(site: Path, plugins: dict[str, str], duplicate_of: str | None = None) -> None:
    """Write each {package: module source} as an installed distribution in `site` whose
    `mmrl.models` entry point names that module; with `duplicate_of`, also a package that
    registers that (already registered) family again."""
    if duplicate_of is not None:
        plugins = {**plugins, "duplicate-family": _SCRATCH_ADAPTER + f"register_model(adapter({duplicate_of!r}))\n"}
    for package, source in plugins.items():
        _fake_dist(site, package, _module_name(package))
        (site / f"{_module_name(package)}.py").write_text(source)


def _fake_dist(site: Path, package: str, module: str) -> None:
    """An installed distribution `package` whose entry point `package = module` is in the
    `mmrl.models` group."""
    dist = site / f"{package.replace('-', '_')}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[mmrl.models]\n{package} = {module}\n")


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry about to discover again, in copies of its tables that the test's
    registrations cannot leak out of. Returns the zoo's families."""
    from mmrl import registry

    zoo = [a.family for a in families()]
    for table in ("_BY_FAMILY", "_BY_MODEL_TYPE", "_BY_ARCHITECTURE"):
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
    monkeypatch.setattr(registry, "_discovered", False)
    return zoo


@pytest.fixture
def broken_plugins_installed(fresh_registry, tmp_path, monkeypatch):
    """Every broken plugin installed (and one registering a zoo family again)."""
    _install_fake_plugins(tmp_path, {p: source for p, (source, _) in _BROKEN_PLUGINS.items()},
                          duplicate_of=fresh_registry[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    return fresh_registry


def _assert_one_warning_per_broken_plugin(messages: list[str], zoo: list[str]) -> None:
    expected = {p: cause for p, (_, cause) in _BROKEN_PLUGINS.items()}
    expected["duplicate-family"] = f"family {zoo[0]!r} is already registered"
    for package, cause in expected.items():
        hits = [m for m in messages if f"package {package!r}" in m]
        assert len(hits) == 1, (package, messages)
        assert f"'{package} = {_module_name(package)}'" in hits[0] and cause in hits[0], hits[0]
    assert len(messages) == len(expected), messages


def test_broken_entry_point_plugins_warn_once_each_and_every_other_family_registers(broken_plugins_installed):
    from mmrl.registry import PluginWarning

    zoo = broken_plugins_installed
    with pytest.warns(PluginWarning) as record:
        listed = [a.family for a in families()]
    _assert_one_warning_per_broken_plugin([str(w.message) for w in record if w.category is PluginWarning], zoo)
    assert listed == zoo  # the zoo whole; nothing from the broken plugins, not even 'halfdone'
    assert "halfdone_lm" not in " ".join(m for a in families() for m in a.model_types)


@pytest.mark.parametrize("command", [["models", "--json"], ["doctor", "FAMILY", "--json", "--workers", "0"]])
def test_cli_commands_work_with_a_broken_plugin_installed(broken_plugins_installed, command, monkeypatch):
    from typer.testing import CliRunner

    from mmrl.cli import app
    from mmrl.registry import PluginWarning

    zoo = broken_plugins_installed
    # doctor's probes are the probes' own tests' business; here it only has to find the family.
    monkeypatch.setattr("mmrl.probes.PROBES", [])
    command = [zoo[0] if word == "FAMILY" else word for word in command]
    with pytest.warns(PluginWarning) as record:
        result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert result.exception is None and "Traceback" not in result.output
    _assert_one_warning_per_broken_plugin([str(w.message) for w in record if w.category is PluginWarning], zoo)
    if command[0] == "models":
        assert [row["family"] for row in json.loads(result.stdout)] == zoo
    else:
        assert json.loads(result.stdout)["family"] == zoo[0]


@pytest.mark.slow
def test_broken_plugin_is_one_stderr_line_in_the_cli(tmp_path):
    # In a real process (pytest records warnings instead of printing them): one line on
    # stderr per broken plugin, no traceback, and a working plugin next to them still loads.
    _install_fake_plugins(tmp_path, {"raises-on-import": _BROKEN_PLUGINS["raises-on-import"][0],
                                     "missing-field": _BROKEN_PLUGINS["missing-field"][0]})
    _fake_dist(tmp_path, "toy-plugin", "plugins.toy_family")
    result = subprocess.run(
        [sys.executable, "-m", "mmrl.cli", "models", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{REPO / 'tests'}"},
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    warned = sorted(line for line in result.stderr.splitlines() if "PluginWarning" in line)
    assert len(warned) == 2, result.stderr
    assert "'missing-field'" in warned[0] and "missing required field 'parts'" in warned[0]
    assert "'raises-on-import'" in warned[1] and "plugin needs a driver" in warned[1]
    lines = result.stderr.splitlines()
    for i, line in enumerate(lines):  # no source line (indented) printed under a warning
        assert "PluginWarning" not in line or i + 1 == len(lines) or not lines[i + 1].startswith(" "), result.stderr
    families_listed = {row["family"] for row in json.loads(result.stdout)}
    assert "toy" in families_listed and {a.family for a in families()} <= families_listed


def test_explicit_plugin_that_fails_is_a_one_line_error(fresh_registry, tmp_path, monkeypatch):
    # Asked for by name with --plugin, a failing module is an error (exit 2), not a warning.
    from typer.testing import CliRunner

    from mmrl.cli import app

    for package, (source, _) in _BROKEN_PLUGINS.items():
        (tmp_path / f"{_module_name(package)}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for package, (_, cause) in _BROKEN_PLUGINS.items():
        module = _module_name(package)
        result = CliRunner().invoke(app, ["--plugin", module, "models"])
        assert result.exit_code == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
        assert f"plugin module {module!r} failed to load" in result.stderr and cause in result.stderr
    assert [a.family for a in families()] == fresh_registry  # 'halfdone' was removed again
