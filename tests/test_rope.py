"""RopeSpec normalization over every config layout transformers has written.

Table-driven: each row is a config (raw config.json dict, as different transformers
versions wrote them) and the fields the normalized spec must carry.
"""

import json
import shutil
from pathlib import Path

import pytest

from mmrl.rope import RopeSpec

REAL = Path(__file__).resolve().parent / "data" / "real_configs"
TEXT = dict(hidden_size=256, num_attention_heads=4)  # head_dim 64

CASES = {
    "bare theta": ({**TEXT, "rope_theta": 1e6}, dict(theta=1e6, scaling="default", factor=None, rotary_dim=64)),
    "no rope keys": ({**TEXT}, dict(theta=10000.0, scaling="default")),
    "legacy linear (type)": (
        {**TEXT, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
        dict(scaling="linear", factor=2.0),
    ),
    "legacy dynamic": (
        {**TEXT, "rope_scaling": {"rope_type": "dynamic", "factor": 4}}, dict(scaling="dynamic", factor=4.0)
    ),
    "yarn with extras": (
        {**TEXT, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                  "beta_fast": 32, "beta_slow": 1}},
        dict(scaling="yarn", factor=4.0, original_max_position_embeddings=32768,
             extra=(("beta_fast", 32), ("beta_slow", 1))),
    ),
    "llama3 (rope_parameters, v5)": (
        {**TEXT, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}},
        dict(theta=5e5, scaling="llama3", factor=8.0, original_max_position_embeddings=8192,
             extra=(("high_freq_factor", 4.0), ("low_freq_factor", 1.0))),
    ),
    "partial rotary (config)": (
        {**TEXT, "partial_rotary_factor": 0.5}, dict(partial_rotary_factor=0.5, rotary_dim=32)
    ),
    "partial rotary (rotary_pct)": ({**TEXT, "rotary_pct": 0.25}, dict(rotary_dim=16)),
    "partial rotary (in rope_parameters)": (
        {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        dict(rotary_dim=32),
    ),
    "legacy mrope pseudo-type, nested": (
        {"model_type": "x_vl", "text_config": {**TEXT, "rope_theta": 1e6,
                                               "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}},
        dict(scaling="default", theta=1e6, mrope_section=(8, 12, 12), mrope_interleaved=False),
    ),
    "interleaved mrope (v5, nested)": (
        {"text_config": {**TEXT, "head_dim": 128, "rope_parameters": {
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}}},
        dict(theta=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True, head_dim=128),
    ),
    "per layer type": (
        {**TEXT, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        dict(scaling="linear", factor=8.0, theta=1e6),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_normalized_fields(name):
    config, expected = CASES[name]
    spec = RopeSpec.from_config(config)
    for field, value in expected.items():
        assert getattr(spec, field) == value, f"{name}: {field}"
    assert spec.problems() == []


def test_per_layer_type_specs():
    spec = RopeSpec.from_config(CASES["per layer type"][0])
    assert spec.for_layer_type("sliding_attention").theta == 1e4
    assert spec.for_layer_type("sliding_attention").scaling == "default"
    assert spec.for_layer_type("full_attention").factor == 8.0


def test_legacy_and_current_layouts_agree():
    legacy = {**TEXT, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    current = {**TEXT, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
    assert RopeSpec.from_config(legacy) == RopeSpec.from_config(current)


@pytest.mark.parametrize("name", CASES)
def test_round_trip_through_rope_parameters(name):
    spec = RopeSpec.from_config(CASES[name][0])
    text = {"head_dim": spec.head_dim, "max_position_embeddings": spec.max_position_embeddings,
            "rope_parameters": spec.to_rope_parameters()}
    again = RopeSpec.from_config(text)
    assert again.with_(partial_rotary_factor=spec.partial_rotary_factor) == spec


def test_problems_are_reported():
    bad_sections = RopeSpec.from_config(
        {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [16, 24, 24]}}
    )
    assert "sums to 64" in bad_sections.problems()[0]
    assert RopeSpec(scaling="warp").problems() == ["unknown rope scaling type 'warp'", "rope scaling 'warp' needs a factor"]


REAL_EXPECTED = {
    "Qwen__Qwen2.5-7B-Instruct": dict(theta=1e6, scaling="default", head_dim=128, mrope_section=None),
    "Qwen__Qwen2-VL-2B-Instruct": dict(theta=1e6, mrope_section=(16, 24, 24), head_dim=128),
    "Qwen__Qwen2.5-VL-3B-Instruct": dict(theta=1e6, mrope_section=(16, 24, 24), head_dim=128),
    "Qwen__Qwen2.5-VL-7B-Instruct": dict(theta=1e6, mrope_section=(16, 24, 24), head_dim=128),
    "Qwen__Qwen3-8B": dict(theta=1e6, head_dim=128, scaling="default"),
    "meta-llama__Llama-3.1-8B-Instruct": dict(theta=5e5, scaling="llama3", factor=8.0,
                                              original_max_position_embeddings=8192),
    "meta-llama__Llama-3.2-1B-Instruct": dict(theta=5e5, scaling="llama3", factor=32.0, head_dim=64),
    "mistralai__Mistral-7B-Instruct-v0.3": dict(theta=1e6, scaling="default", head_dim=128),
}


@pytest.mark.parametrize("name", sorted(REAL_EXPECTED))
def test_real_configs_raw_and_loaded_agree(name, tmp_path):
    from transformers import AutoConfig

    config_file = next((REAL / name).glob("config*.json"))
    raw = json.loads(config_file.read_text())
    spec = RopeSpec.from_config(raw)
    for field, value in REAL_EXPECTED[name].items():
        assert getattr(spec, field) == value, field
    assert spec.problems() == []
    shutil.copy(config_file, tmp_path / "config.json")
    assert RopeSpec.from_config(AutoConfig.from_pretrained(tmp_path)) == spec
