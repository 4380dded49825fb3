"""RopeSpec: one normalized view of a config's rotary position embedding settings.

Checkpoints written by different transformers versions keep rope settings in different
places: `rope_parameters` (transformers 5), the legacy `rope_scaling` dict (with `type`
or `rope_type`, `mrope` as a pseudo-type), a top-level `rope_theta` or `rotary_dim`, nested
under a text or decoder sub-config, one dict per attention layer type, or per-layer
overrides of `per_layer_config`. This module reads all of them, from a raw `config.json`
dict or a loaded `PretrainedConfig`, into the same frozen `RopeSpec`, so two configs that
mean the same rope compare equal:

- defaults transformers' rope code assumes are filled in (yarn's `beta_fast`/`beta_slow`,
  the attention factor yarn and longrope derive, longrope's factor from the context
  lengths, the original context length), reusing `transformers.modeling_rope_utils`;
- a model without rotary embeddings (absolute, learned or ALiBi positions, state-space
  layers) gets `scaling="none"` (`has_rope` is False), decided from the config's keys and,
  for a dict that names its `model_type`, from the fields its transformers config class
  declares; a layer type whose rope entry is None gets the same.

    spec = RopeSpec.from_config(config)      # a loaded config, or a complete dict
    spec = adapter.rope(raw_dict)            # a sparse config.json: the family fills defaults
    spec.theta, spec.scaling, spec.factor, spec.rotary_dim, spec.mrope_section, spec.has_rope
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_THETA = 10000.0
NO_ROPE = "none"  # the scaling of a spec for positions that are not rotary


def scaling_types() -> tuple[str, ...]:
    """Rope types the installed transformers implements (plus the unscaled default)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ("default", *ROPE_INIT_FUNCTIONS)

# Keys that have a field of their own; everything else in a rope dict lands in `extra`.
_OWN_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "partial_rotary_factor", "mrope_section",
    "mrope_interleaved", "original_max_position_embeddings", "attention_factor",
}
# Values transformers' rope init functions assume when a config omits (or zeroes) a key:
# `_compute_yarn_parameters` (beta_fast/beta_slow `or 32`/`or 1`) and
# `_compute_proportional_rope_parameters` (`factor` 1.0) in modeling_rope_utils. The spec
# states them, so a config that omits one equals a config that writes it out;
# tests/test_rope.py checks each entry against those functions.
_ASSUMED = {"yarn": {"beta_fast": 32.0, "beta_slow": 1.0}, "proportional": {"factor": 1.0}}
# Switches that are on unless a config turns them off: kept in `extra` only when off.
_ON_UNLESS_OFF = {"yarn": ("truncate",)}
# Scalings whose code takes factor = max_position_embeddings / original when none is given.
_FACTOR_FROM_CONTEXT = ("yarn", "longrope")
# `position_embedding_type` values that mean rotary (any other value means no rope).
_ROTARY_KINDS = ("rope", "rotary")
# Switches that replace rotary positions by ALiBi biases when on.
_ALIBI_KEYS = ("alibi", "use_alibi")
# transformers' layer type for global attention: its rope is the model's main one.
_FULL_ATTENTION = "full_attention"
# Where composite configs keep the text decoder: `get_text_config(decoder=True)`'s names,
# then names older checkpoints used.
_TEXT_CONFIG_KEYS = ("decoder", "generator", "text_config", "llm_config", "language_config")


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeSpec:
    theta: float | None = DEFAULT_THETA  # None only without rope
    scaling: str = "default"
    factor: float | None = None
    # The cos/sin scaling transformers applies (yarn, longrope), None where it applies none.
    attention_factor: float | None = None
    partial_rotary_factor: float = 1.0
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    # Scaling-specific parameters (low/high_freq_factor, beta_fast, short_factor, ...).
    extra: tuple[tuple[str, Any], ...] = ()
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # Models with several attention layer types keep one spec per type.
    per_layer_type: tuple[tuple[str, RopeSpec], ...] = ()

    # -- derived -----------------------------------------------------------------------
    @property
    def has_rope(self) -> bool:
        return self.scaling != NO_ROPE

    @property
    def rotary_dim(self) -> int | None:
        if not self.has_rope or self.head_dim is None:
            return None
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mrope(self) -> bool:
        return self.mrope_section is not None

    def for_layer_type(self, layer_type: str) -> RopeSpec:
        return dict(self.per_layer_type).get(layer_type, self)

    def problems(self) -> list[str]:
        """Inconsistencies a model would trip over (empty when the spec is usable)."""
        found = []
        if self.has_rope:
            if self.scaling not in scaling_types():
                found.append(f"unknown rope scaling type {self.scaling!r}")
            if self.scaling != "default" and self.factor is None:
                found.append(f"rope scaling {self.scaling!r} needs a factor")
            if self.mrope_section is not None and self.rotary_dim is not None:
                if 2 * sum(self.mrope_section) != self.rotary_dim:
                    found.append(
                        f"mrope_section {list(self.mrope_section)} sums to {sum(self.mrope_section)}, "
                        f"but the rotary half-dimension is {self.rotary_dim // 2}"
                    )
        for layer_type, spec in self.per_layer_type:
            found += [f"{layer_type}: {p}" for p in spec.problems()]
        return found

    # -- conversion --------------------------------------------------------------------
    def to_rope_parameters(self) -> dict[str, Any]:
        """The transformers-5 `rope_parameters` dict for this spec ({} without rope; a
        layer type without rope maps to None, as transformers writes it)."""
        if self.per_layer_type:
            return {name: spec.to_rope_parameters() or None for name, spec in self.per_layer_type}
        if not self.has_rope:
            return {}
        out: dict[str, Any] = {"rope_type": self.scaling, "rope_theta": self.theta}
        if self.factor is not None:
            out["factor"] = self.factor
        if self.attention_factor is not None:
            out["attention_factor"] = self.attention_factor
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        if self.original_max_position_embeddings is not None and self.scaling != "default":
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.mrope_section is not None:
            out["mrope_section"] = list(self.mrope_section)
            if self.mrope_interleaved:
                out["mrope_interleaved"] = True
        out.update({key: _thaw(value) for key, value in self.extra})
        return out

    def with_(self, **changes) -> RopeSpec:
        return replace(self, **changes)

    @classmethod
    def from_config(cls, config) -> RopeSpec:
        """Normalize a raw config.json dict or a `PretrainedConfig` (text or multimodal)."""
        fields = _DictFields(_text_dict(config)) if isinstance(config, Mapping) else _ObjectFields(config)
        if not _uses_rope(fields):
            return WITHOUT_ROPE
        rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
        rope = dict(rope) if isinstance(rope, Mapping) else {}
        layer_types = fields.layer_types()
        nested = _per_layer_type(rope, layer_types)
        if nested is None:
            return _spec_from_dict(rope, _base_fields(fields, None, has_rope_dict=bool(rope)))
        per_type = tuple(
            (name, WITHOUT_ROPE if sub is None else _spec_from_dict(dict(sub), _base_fields(fields, name)))
            for name, sub in sorted(nested.items())
        )
        with_rope = [name for name, spec in per_type if spec.has_rope]
        if not with_rope:
            return replace(WITHOUT_ROPE, per_layer_type=per_type)
        listed = list(nested)  # last tie-break: the entry the config lists first
        main = min(with_rope, key=lambda name: (name != _FULL_ATTENTION, -layer_types.count(name), listed.index(name)))
        return replace(dict(per_type)[main], per_layer_type=per_type)


WITHOUT_ROPE = RopeSpec(theta=None, scaling=NO_ROPE)


# -- reading a config alike from a dict and from a PretrainedConfig ------------------------
class _ObjectFields:
    """A loaded config's fields, as its model code reads them."""

    def __init__(self, config):
        try:
            config = config.get_text_config(decoder=True)
        except Exception:  # several text configs, or not a transformers config at all
            pass
        self.config = config
        self.cls = type(config)

    def get(self, name: str):
        try:
            return getattr(self.config, name, None)
        except Exception:  # e.g. a per-layer attribute of a heterogeneous config
            return None

    def stored(self) -> Mapping[str, Any]:
        return getattr(self.config, "__dict__", {})

    def layer_types(self) -> list[str]:
        return _str_list(self.get("layer_types"))

    def per_layer(self, name: str) -> list | None:
        varying = self.get("per_layer_attributes") or ()
        if name not in varying and _aliases(self.cls).get(name) not in varying:
            return None
        try:
            return [getattr(layer, name, None) for layer in self.config.per_layer_config]
        except Exception:
            return None


class _DictFields:
    """A config.json dict's fields, with the aliases and per-layer overrides transformers
    applies when it loads the dict (its config class is looked up by `model_type`)."""

    def __init__(self, values: Mapping):
        self.values = values
        model_type = values.get("model_type")
        self.cls = _config_class(model_type) if isinstance(model_type, str) else None

    def get(self, name: str):
        alias = _aliases(self.cls).get(name)
        if alias is not None and alias in self.values:
            return self.values[alias]
        return self.values.get(name)

    def stored(self) -> Mapping[str, Any]:
        return self.values

    def layer_types(self) -> list[str]:
        return _str_list(self.get("layer_types"))

    def per_layer(self, name: str) -> list | None:
        overrides = self.values.get("per_layer_config")
        if not isinstance(overrides, Mapping):
            return None
        keys = (_aliases(self.cls).get(name, name), name)
        by_layer = {}
        for index, layer in overrides.items():
            found = [layer[key] for key in keys if isinstance(layer, Mapping) and key in layer]
            if found:
                try:
                    by_layer[int(index)] = found[0]
                except (TypeError, ValueError):  # not a layer index
                    continue
        if not by_layer:
            return None
        count = len(self.layer_types()) or _integer(self.get("num_hidden_layers")) or max(by_layer) + 1
        return [by_layer.get(i, self.get(name)) for i in range(count)]


def _text_dict(config: Mapping) -> Mapping:
    for key in _TEXT_CONFIG_KEYS:
        if isinstance(config.get(key), Mapping):
            return config[key]
    return config


@functools.cache
def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except Exception:  # unknown to this transformers, or its module does not import
        return None


def _aliases(cls) -> Mapping[str, str]:
    aliases = getattr(cls, "attribute_map", None)
    return aliases if isinstance(aliases, Mapping) else {}


def _uses_rope(fields) -> bool:
    """Whether the text model rotates positions: a `position_embedding_type` that names
    something else, or ALiBi switched on, says no; a rope or rotary key with a value says yes;
    otherwise the config class decides by declaring such a field. A dict of unknown model
    type is assumed rotary, as most configs that omit every rope key are older rotary
    checkpoints."""
    stored = fields.stored()
    if "position_embedding_type" in stored and stored["position_embedding_type"] not in _ROTARY_KINDS:
        return False
    if any(stored.get(key) is True for key in _ALIBI_KEYS):
        return False
    if any(_is_rope_key(key) and _given(value) for key, value in stored.items()):
        return True
    if fields.cls is None:
        return True
    declared = getattr(fields.cls, "__dataclass_fields__", None)
    return declared is None or any(_is_rope_key(name) for name in declared)


def _given(value) -> bool:
    return value is not None and not (isinstance(value, Mapping) and not value)


def _is_rope_key(name) -> bool:
    return isinstance(name, str) and name.startswith(("rope", "rotary"))


def _per_layer_type(rope: dict[str, Any], layer_types: list[str]) -> dict[str, Any] | None:
    """The per-layer-type entries of a nested rope dict (None for a flat one): keys that are
    layer types, or a dict whose values are all dicts or None. A None entry is a layer type
    without rope."""
    entries = {k: v for k, v in rope.items() if isinstance(v, Mapping) or (v is None and k in layer_types)}
    if set(entries) & set(layer_types):
        return entries
    if any(isinstance(v, Mapping) for v in rope.values()) and all(isinstance(v, Mapping) or v is None
                                                                 for v in rope.values()):
        return dict(rope)
    return None


def _base_fields(fields, layer_type: str | None, has_rope_dict: bool = True) -> dict[str, Any]:
    """Fields outside the rope dict, for the layers of `layer_type` (all layers if None);
    a per-layer field whose layers disagree reads as None."""
    layers = None
    types = fields.layer_types()
    if layer_type is not None and layer_type in types:
        layers = [i for i, t in enumerate(types) if t == layer_type]

    def value(name):
        per_layer = fields.per_layer(name)
        if per_layer is None:
            return fields.get(name)
        chosen = [v for i, v in enumerate(per_layer) if layers is None or i in layers]
        return chosen[0] if chosen and all(v == chosen[0] for v in chosen) else None

    heads, hidden = value("num_attention_heads"), value("hidden_size")
    head_dim = _integer(value("head_dim"))
    if head_dim is None and _integer(hidden) and _integer(heads):
        head_dim = hidden // heads
    partial = _number(value("partial_rotary_factor")) or _number(value("rotary_pct"))
    rotary_dim = _integer(value("rotary_dim"))
    if partial is None and not has_rope_dict and rotary_dim and head_dim:
        partial = rotary_dim / head_dim  # older rotary configs give the rotated width only
    default_theta = _number(getattr(fields.cls, "default_theta", None))
    return {
        "head_dim": head_dim,
        "max_position_embeddings": value("max_position_embeddings"),
        "partial_rotary_factor": partial,
        "original_max_position_embeddings": value("original_max_position_embeddings"),
        "rope_theta": _number(value("rope_theta")) or _number(value("rotary_emb_base")),
        "default_theta": default_theta or DEFAULT_THETA,
    }


# -- one rope dict ---------------------------------------------------------------------------
def _spec_from_dict(rope: dict[str, Any], base: dict[str, Any]) -> RopeSpec:
    params = _standardized(rope, base)
    scaling = params.get("rope_type") or params.get("type") or "default"
    if not isinstance(scaling, str):
        scaling = str(scaling)
    if scaling == "mrope":  # legacy pseudo-type: plain rope with sections
        scaling = "default"
    for key, assumed in _ASSUMED.get(scaling, {}).items():
        if not params.get(key):
            params[key] = assumed
    for key in _ON_UNLESS_OFF.get(scaling, ()):
        if params.get(key) is True:
            del params[key]
    theta = _number(params.get("rope_theta")) or base["rope_theta"] or base["default_theta"]
    partial = _number(params.get("partial_rotary_factor")) or base["partial_rotary_factor"] or 1.0
    original = params.get("original_max_position_embeddings") or base["original_max_position_embeddings"]
    original = original if _number(original) else None
    factor = _number(params.get("factor"))
    max_positions = _number(base["max_position_embeddings"])
    if factor is None and scaling in _FACTOR_FROM_CONTEXT and max_positions and original:
        factor = params["factor"] = max_positions / original
    section = params.get("mrope_section")
    extra = tuple(sorted((k, _freeze(v)) for k, v in params.items() if k not in _OWN_KEYS))
    return RopeSpec(
        theta=float(theta),
        scaling=scaling,
        factor=None if scaling == "default" else factor,
        attention_factor=_attention_factor(scaling, params, base),
        partial_rotary_factor=float(partial),
        head_dim=base["head_dim"],
        max_position_embeddings=base["max_position_embeddings"],
        original_max_position_embeddings=None if scaling == "default" else original,
        extra=extra,
        mrope_section=_sections(section),
        mrope_interleaved=bool(params.get("mrope_interleaved", False)),
    )


def _standardized(rope: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """`rope` after transformers' own `standardize_rope_params`: the rope type from a legacy
    `type`, theta and partial rotary factor from the top level, and the original context
    length (a top-level one first) for the scalings that use it."""
    config = _rope_only_config(rope, base)
    try:
        config.standardize_rope_params()
    except Exception:  # a malformed dict: read it as written
        return dict(rope)
    return dict(config.rope_parameters)


def _attention_factor(scaling: str, params: dict[str, Any], base: dict[str, Any]) -> float | None:
    """The cos/sin scaling transformers' init function for `scaling` returns (derived from
    factor, mscale and context lengths where the config gives none); None for 1."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    value = _number(params.get("attention_factor"))
    if scaling == "default":
        return None
    init = ROPE_INIT_FUNCTIONS.get(scaling)
    if init is not None:
        params = dict(params)
        if base["head_dim"] is None:
            # The attention factor does not depend on the head size: size the head so that
            # per-frequency lists (longrope's short_factor) fit.
            per_frequency = params.get("short_factor")
            size = 2 * len(per_frequency) if isinstance(per_frequency, list) and per_frequency else 2
            base = {**base, "head_dim": size, "partial_rotary_factor": None}
            params.pop("partial_rotary_factor", None)
        try:
            value = _number(init(_rope_only_config(params, base))[1])
        except Exception:  # transformers cannot compute this rope: keep what the config says
            pass
    return None if value is None or value == 1.0 else value


def _rope_only_config(rope: dict[str, Any], base: dict[str, Any]):
    """A stand-in config carrying only what transformers' rope functions read."""
    config = _rope_only_class()()
    config.rope_parameters = dict(rope)
    config.rope_theta = base["rope_theta"] or base["default_theta"]
    if base["partial_rotary_factor"] is not None:
        config.partial_rotary_factor = base["partial_rotary_factor"]
    if base["original_max_position_embeddings"] is not None:
        config.original_max_position_embeddings = base["original_max_position_embeddings"]
    config.max_position_embeddings = base["max_position_embeddings"]
    config.head_dim = base["head_dim"]
    config.hidden_size, config.num_attention_heads = base["head_dim"], 1
    return config


@functools.cache
def _rope_only_class():
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    return type("RopeOnlyConfig", (RotaryEmbeddingConfigMixin,), {})


# -- values ----------------------------------------------------------------------------------
def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _integer(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_list(value) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, str)]
    return []


def _sections(section) -> tuple[int, ...] | None:
    if not isinstance(section, (list, tuple)):
        return None
    try:
        return tuple(int(s) for s in section)
    except (TypeError, ValueError):
        return None


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    return value


def _thaw(value):
    return list(value) if isinstance(value, tuple) else value
