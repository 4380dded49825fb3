"""RopeSpec: one normalized view of a config's rotary position embedding settings.

Checkpoints written by different transformers versions keep rope settings in different
places: `rope_parameters` (transformers 5), the legacy `rope_scaling` dict (with `type`
or `rope_type`, `mrope` as a pseudo-type), a top-level `rope_theta`, nested under
`text_config` for vision-language models, or one dict per attention layer type. This
module reads all of them, from a raw `config.json` dict or a loaded `PretrainedConfig`,
into the same frozen `RopeSpec`, so two configs that mean the same rope compare equal.

    spec = RopeSpec.from_config(config)      # a loaded config, or a complete dict
    spec = adapter.rope(raw_dict)            # a sparse config.json: the family fills defaults
    spec.theta, spec.scaling, spec.factor, spec.rotary_dim, spec.mrope_section
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

DEFAULT_THETA = 10000.0


def scaling_types() -> tuple[str, ...]:
    """Rope types the installed transformers implements (plus the unscaled default)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ("default", *ROPE_INIT_FUNCTIONS)

# Keys that have a field of their own; everything else in a rope dict lands in `extra`.
_OWN_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "partial_rotary_factor", "mrope_section",
    "mrope_interleaved", "original_max_position_embeddings",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeSpec:
    theta: float = DEFAULT_THETA
    scaling: str = "default"
    factor: float | None = None
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
    def rotary_dim(self) -> int | None:
        return None if self.head_dim is None else int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mrope(self) -> bool:
        return self.mrope_section is not None

    def for_layer_type(self, layer_type: str) -> RopeSpec:
        return dict(self.per_layer_type).get(layer_type, self)

    def problems(self) -> list[str]:
        """Inconsistencies a model would trip over (empty when the spec is usable)."""
        found = []
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
        """The transformers-5 `rope_parameters` dict for this spec."""
        if self.per_layer_type:
            return {name: spec.to_rope_parameters() for name, spec in self.per_layer_type}
        out: dict[str, Any] = {"rope_type": self.scaling, "rope_theta": self.theta}
        if self.factor is not None:
            out["factor"] = self.factor
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        if self.original_max_position_embeddings is not None and self.scaling != "default":
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.mrope_section is not None:
            out["mrope_section"] = list(self.mrope_section)
            if self.mrope_interleaved:
                out["mrope_interleaved"] = True
        out.update(dict(self.extra))
        return out

    def with_(self, **changes) -> RopeSpec:
        return replace(self, **changes)

    @classmethod
    def from_config(cls, config) -> RopeSpec:
        """Normalize a raw config.json dict or a `PretrainedConfig` (text or multimodal)."""
        text = _text_config(config)
        rope = _get(text, "rope_parameters") or _get(text, "rope_scaling") or {}
        rope = dict(rope)
        base = _base_fields(text)
        if rope and all(isinstance(v, dict) for v in rope.values()):
            per_type = tuple(
                (name, _spec_from_dict(dict(sub), text, base)) for name, sub in sorted(rope.items())
            )
            main = dict(per_type).get("full_attention", per_type[0][1])
            return replace(main, per_layer_type=per_type)
        return _spec_from_dict(rope, text, base)


def _get(config, key: str, default=None):
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _text_config(config):
    if isinstance(config, dict):
        for key in ("text_config", "llm_config", "language_config"):
            if isinstance(config.get(key), dict):
                return config[key]
        return config
    return config.get_text_config(decoder=True)


def _base_fields(text) -> dict[str, Any]:
    heads = _get(text, "num_attention_heads")
    hidden = _get(text, "hidden_size")
    head_dim = _get(text, "head_dim") or (hidden // heads if hidden and heads else None)
    return {
        "head_dim": head_dim,
        "max_position_embeddings": _get(text, "max_position_embeddings"),
        "partial_rotary_factor": _get(text, "partial_rotary_factor") or _get(text, "rotary_pct"),
        "original_max_position_embeddings": _get(text, "original_max_position_embeddings"),
        "rope_theta": _get(text, "rope_theta"),
    }


def _spec_from_dict(rope: dict[str, Any], text, base: dict[str, Any]) -> RopeSpec:
    scaling = rope.get("rope_type") or rope.get("type") or "default"
    if scaling == "mrope":  # legacy pseudo-type: plain rope with sections
        scaling = "default"
    theta = rope.get("rope_theta") or base["rope_theta"] or DEFAULT_THETA
    section = rope.get("mrope_section")
    partial = rope.get("partial_rotary_factor") or base["partial_rotary_factor"] or 1.0
    original = rope.get("original_max_position_embeddings") or base["original_max_position_embeddings"]
    extra = tuple(sorted((k, _freeze(v)) for k, v in rope.items() if k not in _OWN_KEYS))
    factor = rope.get("factor")
    return RopeSpec(
        theta=float(theta),
        scaling=scaling,
        factor=None if factor is None or scaling == "default" else float(factor),
        partial_rotary_factor=float(partial),
        head_dim=base["head_dim"],
        max_position_embeddings=base["max_position_embeddings"],
        original_max_position_embeddings=None if scaling == "default" else original,
        extra=extra,
        mrope_section=None if section is None else tuple(int(s) for s in section),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
    )


def _freeze(value):
    return tuple(value) if isinstance(value, list) else value
