"""Config fields vLLM's model classes read that transformers' config classes lack.

vLLM's model classes are written for published checkpoints, whose config.json carries
fields the transformers config class does not define (`conv_dim`, `rotary_dim`,
`first_k_dense_replace`, ...): a config built in code, as the scaffold's tiny config is,
lacks them and vLLM fails on the first read. `FIELD_RULES` is one table keyed by field
name: each rule derives the value from the config itself (or from the modeling code
beside its class, which fixes what a field may otherwise switch), or returns None where
the config does not say (then the field stays unset and the probe's gap names it).

A field is filled only where the vLLM modules that serve the architecture read it and
the config lacks it, so no other config gains it.

    vllm_fields(config, "Lfm2ForCausalLM")   # {"conv_dim": 64}
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any, Callable

from mmrl.scaffold.shrink import modeling_source
from mmrl.scaffold.vllm_registry import vllm_model_class


def _rope_value(config, key: str):
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get(key) if isinstance(rope, dict) else None


def _head_dim(config) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _rotary_dim(config) -> int | None:
    """The rotated width of a head: head_dim x partial_rotary_factor (transformers' rope
    reads a missing factor as 1.0: the whole head)."""
    factor = getattr(config, "partial_rotary_factor", None) or _rope_value(config, "partial_rotary_factor") or 1.0
    head_dim = _head_dim(config)
    return int(head_dim * factor) if head_dim is not None else None


def _first_dense_layers(config) -> int | None:
    """How many leading layers are dense, from the per-layer MLP kinds."""
    kinds = getattr(config, "mlp_layer_types", None)
    if not isinstance(kinds, list) or "dense" not in kinds:
        return None
    return next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))


def _conv_width(config) -> int | None:
    """A short-convolution layer (one with `conv_L_cache`) mixes the whole hidden state."""
    return getattr(config, "hidden_size", None) if hasattr(config, "conv_L_cache") else None


def _block_width(config) -> int | None:
    """A block whose feed-forward is sized by `block_multiple_of` works on the whole
    hidden state."""
    return getattr(config, "hidden_size", None) if hasattr(config, "block_multiple_of") else None


def _one_group(field: str) -> Callable[[Any], int | None]:
    """1 (all experts one group) where the config routes experts and its modeling code
    never groups them."""
    def rule(config) -> int | None:
        routed = any(hasattr(config, name) for name in ("num_experts", "n_routed_experts", "num_local_experts"))
        return 1 if routed and field not in modeling_source(type(config)) else None
    return rule


def _router_scoring(config) -> str | None:
    """The function the modeling code applies to its router logits."""
    source = modeling_source(type(config))
    if re.search(r"sigmoid\(\s*router_logits", source):
        return "sigmoid"
    if re.search(r"softmax\(\s*router_logits", source):
        return "softmax"
    return None


def _topk_renormalized(config) -> bool | None:
    """True where the modeling code always divides the top-k routing weights by their sum."""
    source = modeling_source(type(config))
    return True if re.search(r"(top|routing|router)\w*\.sum\(dim=-1, keepdim=True\)", source) else None


def _scaled_by_modeling(field: str) -> Callable[[Any], bool | None]:
    """True where the modeling code computes the scale the field switches on."""
    return lambda config: True if f"self.{field} =" in modeling_source(type(config)) else None


def _expert_width(config) -> int | None:
    """One expert's feed-forward width."""
    return getattr(config, "moe_intermediate_size", None)


def _zero_experts(config) -> str | None:
    """Zero experts pass their input through (transformers' modeling adds it unchanged)."""
    return "identity" if getattr(config, "zero_expert_num", None) else None


def _key_norm(config) -> bool | None:
    """True where the modeling code always normalizes keys (builds `k_norm` with no
    switch of its own)."""
    source = modeling_source(type(config))
    return True if "self.k_norm = " in source and "qk_norm" not in source else None


def _routing_bias(config) -> bool | None:
    """True where the modeling code always adds a bias to the router's scores when it
    picks experts (builds `e_score_correction_bias` with no switch of its own)."""
    source = modeling_source(type(config))
    return True if "self.e_score_correction_bias = " in source and "routing_bias" not in source else None


def _spatial_merge(config) -> int | None:
    """The patches merged per side, on the config or its vision config."""
    for owner in (config, getattr(config, "vision_config", None)):
        value = getattr(owner, "spatial_merge_size", None)
        if isinstance(value, int):
            return value
    return None


# Field name -> the rule that derives its value from the config (None: it does not say).
FIELD_RULES: dict[str, Callable[[Any], Any]] = {
    "conv_dim": _conv_width,
    "rotary_dim": _rotary_dim,
    "first_k_dense_replace": _first_dense_layers,
    "score_func": _router_scoring,
    "scoring_func": _router_scoring,
    "expert_hidden_dim": _expert_width,
    "zero_expert_type": _zero_experts,
    "norm_topk_prob": _topk_renormalized,
    "route_norm": _topk_renormalized,
    "n_group": _one_group("n_group"),
    "topk_group": _one_group("topk_group"),
    "block_dim": _block_width,
    "mla_scale_q_lora": _scaled_by_modeling("mla_scale_q_lora"),
    "mla_scale_kv_lora": _scaled_by_modeling("mla_scale_kv_lora"),
    "spatial_conv_size": _spatial_merge,
    "qk_norm": _key_norm,
    "use_routing_bias": _routing_bias,
}

_MODELS_PACKAGE = "vllm.model_executor.models"
_SIBLING_IMPORT = re.compile(r"^from \.(\w+) import", re.MULTILINE)
_READ = re.compile(r"config\.(\w+)|(?:getattr|hasattr)\(\s*[\w.]*config,\s*[\"'](\w+)[\"']")


@functools.lru_cache(maxsize=None)
def _module_text(module: str) -> str:
    spec = importlib.util.find_spec(_MODELS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(spec.submodule_search_locations[0]) / f"{module}.py"
    return path.read_text() if path.is_file() else ""


def vllm_reads(*architectures: str) -> set[str]:
    """Config fields read by the vLLM modules serving `architectures`, and by the sibling
    modules they import (a multimodal model's language model), read as text."""
    modules = [cls.split(":")[0] for cls, _ in map(vllm_model_class, architectures) if cls]
    seen: set[str] = set()
    fields: set[str] = set()
    while modules:
        module = modules.pop()
        if module in seen:
            continue
        seen.add(module)
        text = _module_text(module)
        fields.update(a or b for a, b in _READ.findall(text))
        modules += [m for m in _SIBLING_IMPORT.findall(text) if m not in ("utils", "interfaces", "vision")]
    return fields


def vllm_fields(config, *architectures: str) -> dict[str, Any]:
    """{field: value} for the fields `FIELD_RULES` derives that vLLM's modules for
    `architectures` read and `config` lacks."""
    reads = vllm_reads(*architectures)
    values = {}
    for field, rule in FIELD_RULES.items():
        if field in reads and not hasattr(config, field) and (value := rule(config)) is not None:
            values[field] = value
    return values


def text_architecture(text_config) -> str | None:
    """The causal-LM architecture transformers names for a text config's model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(text_config, "model_type", None))


__all__ = ["FIELD_RULES", "text_architecture", "vllm_fields", "vllm_reads"]
