"""RopeSpec normalization over every config layout transformers has written.

Table-driven: each row is a config (raw config.json dict, as different transformers
versions wrote them) and the fields the normalized spec must carry.
"""

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mmrl import rope as rope_module
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


# -- defaults transformers fills in -----------------------------------------------------------
# Each row: a sparse config and one that states transformers' defaults; both must give one
# spec, and transformers itself must compute the same rope from both (checked below).
LONG = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096)
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024}
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 32, "long_factor": [1.5] * 32}


def _yarn_mscale(scale, mscale=1.0):  # the YaRN paper's attention scale, as transformers computes it
    return 0.1 * mscale * math.log(scale) + 1.0


SAME_ROPE = {
    "yarn: beta_fast, beta_slow, attention_factor": (
        {**LONG, "rope_parameters": dict(YARN)},
        {**LONG, "rope_parameters": {**YARN, "beta_fast": 32, "beta_slow": 1, "attention_factor": _yarn_mscale(4.0)}},
    ),
    "yarn: attention_factor from mscale and mscale_all_dim": (
        {**LONG, "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}},
        {**LONG, "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5,
                                     "attention_factor": _yarn_mscale(4.0, 1.0) / _yarn_mscale(4.0, 0.5)}},
    ),
    "yarn: truncate on": ({**LONG, "rope_parameters": dict(YARN)}, {**LONG, "rope_parameters": {**YARN, "truncate": True}}),
    "yarn: factor None from the context lengths": (
        {**LONG, "rope_parameters": {**YARN, "factor": None}}, {**LONG, "rope_parameters": dict(YARN)}
    ),
    "yarn: original context defaults to max_position_embeddings": (
        {**LONG, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
        {**LONG, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                     "original_max_position_embeddings": 4096}},
    ),
    "longrope: factor and attention_factor from the context lengths": (
        {**LONG, "max_position_embeddings": 131072,
         "rope_parameters": {**LONGROPE, "original_max_position_embeddings": 4096}},
        {**LONG, "max_position_embeddings": 131072,
         "rope_parameters": {**LONGROPE, "original_max_position_embeddings": 4096, "factor": 32.0,
                             "attention_factor": math.sqrt(1 + math.log(32) / math.log(4096))}},
    ),
    "longrope: original context at the top level": (
        {**LONG, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
         "rope_parameters": dict(LONGROPE)},
        {**LONG, "max_position_embeddings": 131072,
         "rope_parameters": {**LONGROPE, "original_max_position_embeddings": 4096, "factor": 32.0}},
    ),
    "proportional: factor 1": (
        {**LONG, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
        {**LONG, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                                     "factor": 1.0}},
    ),
    "llama3: original context defaults to max_position_embeddings": (
        {**LONG, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        {**LONG, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 4096}},
    ),
}

OTHER_ROPE = {
    "yarn: another beta_fast": ({**LONG, "rope_parameters": dict(YARN)},
                                {**LONG, "rope_parameters": {**YARN, "beta_fast": 16}}),
    "yarn: mscale changes the attention factor": (
        {**LONG, "rope_parameters": dict(YARN)},
        {**LONG, "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}},
    ),
    "yarn: truncate off": ({**LONG, "rope_parameters": dict(YARN)},
                           {**LONG, "rope_parameters": {**YARN, "truncate": False}}),
    "longrope: a factor other than the context ratio": (
        {**LONG, "max_position_embeddings": 131072,
         "rope_parameters": {**LONGROPE, "original_max_position_embeddings": 4096}},
        {**LONG, "max_position_embeddings": 131072,
         "rope_parameters": {**LONGROPE, "original_max_position_embeddings": 4096, "factor": 16.0}},
    ),
}


def _transformers_rope(config: dict):
    """What transformers computes for a config: (inverse frequencies, attention factor)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    loaded = LlamaConfig(**copy.deepcopy(config))
    return ROPE_INIT_FUNCTIONS[loaded.rope_parameters["rope_type"]](loaded)


@pytest.mark.parametrize("name", SAME_ROPE)
def test_filled_defaults_compare_equal(name):
    sparse, explicit = SAME_ROPE[name]
    spec = RopeSpec.from_config(sparse)
    assert spec == RopeSpec.from_config(explicit)
    assert spec.problems() == []
    inv_freq, attention = _transformers_rope(sparse)
    inv_freq_explicit, attention_explicit = _transformers_rope(explicit)
    assert torch.equal(inv_freq, inv_freq_explicit) and attention == attention_explicit, "not the same rope"
    assert spec.attention_factor == (None if attention == 1.0 else attention)


@pytest.mark.parametrize("name", OTHER_ROPE)
def test_different_ropes_stay_different(name):
    first, second = OTHER_ROPE[name]
    assert RopeSpec.from_config(first) != RopeSpec.from_config(second)


def test_filled_defaults_are_visible():
    yarn = RopeSpec.from_config(SAME_ROPE["yarn: beta_fast, beta_slow, attention_factor"][0])
    assert dict(yarn.extra) == {"beta_fast": 32.0, "beta_slow": 1.0}
    assert yarn.attention_factor == pytest.approx(1 + 0.1 * math.log(4))
    longrope = RopeSpec.from_config(SAME_ROPE["longrope: original context at the top level"][0])
    assert (longrope.factor, longrope.original_max_position_embeddings) == (32.0, 4096)
    again = RopeSpec.from_config({**LONG, "max_position_embeddings": 131072,
                                  "rope_parameters": longrope.to_rope_parameters()})
    assert again == longrope


@pytest.mark.parametrize(("scaling", "key"), [(s, k) for s, keys in rope_module._ASSUMED.items() for k in keys])
def test_assumed_defaults_are_transformers_defaults(scaling, key):
    """Each value RopeSpec fills in is the one transformers' rope function assumes."""
    params = {"yarn": dict(YARN), "proportional": {"rope_type": "proportional", "rope_theta": 1e6,
                                                   "partial_rotary_factor": 0.25}}[scaling]
    params.pop(key, None)
    stated = {**params, key: rope_module._ASSUMED[scaling][key]}
    omitted = _transformers_rope({**LONG, "rope_parameters": params})
    written = _transformers_rope({**LONG, "rope_parameters": stated})
    assert torch.equal(omitted[0], written[0]) and omitted[1] == written[1]


# -- configs that used to crash, and models without rope ---------------------------------------
LAYERED = {**TEXT, "layer_types": ["sliding_attention", "full_attention"]}
ODD_LAYOUTS = {
    "nested rope without full_attention": (
        {**TEXT, "layer_types": ["hybrid", "hybrid"], "rope_parameters": {
            "hybrid": {"rope_type": "default", "rope_theta": 5e6},
            "hybrid_sliding": {"rope_type": "default", "rope_theta": 1e4}}},
        dict(theta=5e6, has_rope=True),
    ),
    "nested rope, layer_types None": (
        {**TEXT, "layer_types": None, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}},
        dict(theta=1e6, scaling="linear", factor=8.0),
    ),
    "a layer type without rope (None)": (
        {**LAYERED, "rope_parameters": {"full_attention": None,
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        dict(theta=1e4, has_rope=True),
    ),
    "hybrid: linear attention layers beside a flat rope": (
        {**TEXT, "layer_types": ["linear_attention", "linear_attention", "full_attention"],
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}},
        dict(theta=1e7, rotary_dim=16, per_layer_type=()),
    ),
    "per-layer head_dim overrides": (
        {**LAYERED, "head_dim": 64, "per_layer_config": {"1": {"head_dim": 128}}, "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        dict(scaling="proportional", factor=1.0, head_dim=128, rotary_dim=32),
    ),
    "rope keys that are not numbers": (
        {**TEXT, "rope_parameters": {"rope_type": "linear", "factor": "8", "rope_theta": None,
                                     "mrope_section": ["a"], "nested": {"b": [1, 2]}}},
        dict(theta=10000.0, scaling="linear", factor=None),
    ),
    "legacy rotary_dim (no rope dict)": (
        {"model_type": "gptj", "n_embd": 1024, "n_head": 4, "rotary_dim": 64}, dict(head_dim=256, rotary_dim=64)
    ),
}
NO_ROPE = {
    "absolute positions (known model type)": {"model_type": "gpt2", "n_embd": 256, "n_head": 4},
    "ALiBi (known model type)": {"model_type": "bloom", "hidden_size": 256, "n_head": 4},
    "ALiBi switched on": {"model_type": "falcon", **TEXT, "alibi": True},
    "state-space layers": {"model_type": "mamba", "hidden_size": 256},
    "position_embedding_type absolute": {**TEXT, "position_embedding_type": "absolute"},
    "NoPE (position_embedding_type None)": {"model_type": "granitemoehybrid", **TEXT,
                                            "position_embedding_type": None},
    "every layer type without rope": {**LAYERED, "rope_parameters": {"full_attention": None,
                                                                     "sliding_attention": None}},
}


@pytest.mark.parametrize("name", ODD_LAYOUTS)
def test_odd_layouts(name):
    config, expected = ODD_LAYOUTS[name]
    spec = RopeSpec.from_config(config)
    for field, value in expected.items():
        assert getattr(spec, field) == value, f"{name}: {field}"
    assert isinstance(spec.problems(), list)
    hash(spec)


def test_layer_type_without_rope():
    spec = RopeSpec.from_config(ODD_LAYOUTS["a layer type without rope (None)"][0])
    assert not spec.for_layer_type("full_attention").has_rope
    assert spec.to_rope_parameters()["full_attention"] is None
    per_layer = RopeSpec.from_config(ODD_LAYOUTS["per-layer head_dim overrides"][0])
    assert per_layer.for_layer_type("sliding_attention").head_dim == 64


@pytest.mark.parametrize("name", NO_ROPE)
def test_models_without_rope(name):
    spec = RopeSpec.from_config(NO_ROPE[name])
    assert not spec.has_rope and spec.rotary_dim is None
    assert spec.problems() == []
    assert spec.to_rope_parameters() in ({}, {"full_attention": None, "sliding_attention": None})


def test_rope_models_say_so():
    assert all(RopeSpec.from_config(config).has_rope for config, _ in CASES.values())
    assert RopeSpec.from_config({"model_type": "falcon", **TEXT, "alibi": False}).has_rope


# -- every text or image-text-to-text config transformers ships ---------------------------------
def _generating_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    generating = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return sorted(t for t in CONFIG_MAPPING_NAMES if t in generating)


MODEL_TYPES = _generating_model_types()


def test_zoo_is_covered():
    assert len(MODEL_TYPES) > 200


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_transformers_default_config(model_type):
    """Never crash on a config transformers accepts; the loaded config and its dict agree."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as error:  # transformers itself rejects its default (e.g. required sub-configs)
        pytest.skip(f"transformers rejects the default {model_type} config: {type(error).__name__}")
    loaded = RopeSpec.from_config(config)
    raw = RopeSpec.from_config(config.to_dict())
    assert isinstance(loaded.problems(), list) and isinstance(raw.problems(), list)
    assert loaded == raw
    assert loaded.problems() == []


def test_heterogeneous_config_reads_each_layer_type():
    """A config whose head_dim varies per layer (per_layer_config) has one head size per type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING["gemma4_text"]()
    assert config.is_heterogeneous
    spec = RopeSpec.from_config(config)
    for index, layer_type in enumerate(config.layer_types):
        assert spec.for_layer_type(layer_type).head_dim == config.per_layer_config[index].head_dim
    assert RopeSpec.from_config(config.to_dict()) == spec
