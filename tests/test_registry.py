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
