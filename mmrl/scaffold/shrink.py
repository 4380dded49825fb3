"""Stage 2, config: a tiny config of the type's own config class, shrunk through its own
sub-config classes so that their validation passes.

What to shrink is read from the default config itself, never from a table of types:
- the standard shape fields (hidden size, layers, heads, ...) under whatever names the
  class maps them to (`attribute_map`: `n_embd`, `d_model`, `n_layer`, ...);
- every other integer field whose default equals one of the default shapes (an
  `embedding_size` that equals `hidden_size`, a vision `out_hidden_size` that equals the
  text width) follows that shape;
- expert counts, low-rank widths and per-head widths by what their names say they are;
- per-layer lists (`layer_types`, `mlp_layer_types`, ...) keep one layer of each kind,
  so a hybrid or sliding/full model stays hybrid when it is two layers deep;
- layer indexes of a vision tower (DeepStack lists, full-attention blocks, the layer a
  merger is inserted after) are remapped into the shrunk depth.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from itertools import combinations, permutations
from pathlib import Path
from typing import Any

from mmrl.errors import whole_cause
from mmrl.scaffold.base import TINY_VISION_SHAPES, Resolved, ScaffoldError
from mmrl.tiny import TINY_TEXT_SHAPES

# The standard shape names (transformers' canonical attribute names).
_LAYERS, _HIDDEN, _INTERMEDIATE, _HEADS, _KV_HEADS, _HEAD_DIM = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim")
# Integers that are never shapes, whatever their value. A scale is a divisor of positions
# or values: Llama 4's attention `floor_scale` (8192) equals its intermediate width by
# default, and following that width to 128 made its query scaling step inside a tiny prompt.
_NOT_SHAPES = re.compile(r"token|vocab|position|seed|window|chunk|max_|length|bucket|ctx|steps|rate|epoch|"
                         r"image_size|patch|merge|temporal|resolution|stride|group_size|pad|num_labels|scale")
# Vision config fields that hold the width a tower projects into the text model: they
# follow the text model's width (here and when image_size widens the tiny text model).
TOWER_OUTPUT_WIDTH = re.compile(r"^out_hidden_size$|^out_hidden_dim$|^text_hidden_size$|^output_dim$|^out_dim$|"
                                r"^projection_dim$|^llm_hidden_size$")
# How many experts a mixture holds (routed, shared).
_EXPERT_COUNTS = re.compile(r"(^|_)(n_routed_experts|num_experts|num_local_experts|moe_num_experts|n_experts"
                            r"|num_routed_experts|n_shared_experts|num_shared_experts)$")
# Experts a token is routed to (a router's top-k).
_EXPERTS_PER_TOKEN = re.compile(r"(experts_per_tok|experts_per_token|moe_topk|moe_k|^top_k$|num_selected_experts|topk)$")
# A count of layers under a name other than `num_hidden_layers`.
_LAYER_COUNT = re.compile(r"^depth$|^num_layers$|^n_layers$|^num_blocks$")
# Sizes a name announces, for integers that follow no default shape.
_BY_NAME = (
    (re.compile(r"(^|_)(n_routed_experts|num_experts|num_local_experts|moe_num_experts|n_experts|num_routed_experts"
                r"|zero_expert_num)$"), 4),
    (_EXPERTS_PER_TOKEN, 2),
    (re.compile(r"(^|_)(n_group|num_expert_group|topk_group|n_shared_experts|num_shared_experts)$"), 1),
    (re.compile(r"lora_rank$|_rank$"), 16),
    (re.compile(r"(intermediate|ffn|mlp)[a-z_]*size$|_ffn_dim$|^ffn_dim$|dim_ff$|^dff$"), 128),
    (re.compile(r"head_dim$|head_size$|_head_dim_|^kv_channels$|dim_head$|^rotary_dim$"), "per-head"),
    (re.compile(r"(d_state|state_size|ssm_state_size|mamba_d_state)$"), 16),
    (_LAYER_COUNT, "layers"),
    (re.compile(r"(mamba_n_heads|mamba_num_heads|linear_num_value_heads|linear_num_key_heads)$"), 2),
    # A state-space layer's head groups divide its (tiny: 2) heads.
    (re.compile(r"(^|_)(n_groups|ngroups)$"), 1),
)


@dataclass
class TinyInputs:
    """The tiny config and what rendering needs to rebuild it in the adapter's `tiny()`."""

    config: Any
    # The values a text family's tiny() passes to its config class (`sized_config`).
    text_overrides: dict[str, Any] = field(default_factory=dict)
    media: Any = None  # mmrl.scaffold.media_plan.MediaPlan for vision-language types


def shrink_values(default, shapes: dict[str, int], tied: dict[int, int] | None = None,
                  layer_indexes: bool = False) -> dict[str, Any]:
    """Values that shrink the config instance `default` to `shapes` (canonical names)."""
    amap = dict(getattr(default, "attribute_map", {}) or {})
    own = default.to_dict()
    values: dict[str, Any] = {}
    defaults_of_shapes: dict[int, int] = {}
    for name, tiny in shapes.items():
        key = amap.get(name, name)
        if _read_only(default, key):
            continue
        current = own.get(key, _attribute(default, key))
        widths = isinstance(current, int) and not isinstance(current, bool) and name in (_HIDDEN, _INTERMEDIATE)
        if widths:  # only widths are distinctive enough for another field to be tied to them
            defaults_of_shapes.setdefault(current, tiny)
        if tied and widths and current in tied:
            # A width equal to another config's default width is an output width
            # (a vision tower's projection into the text model): it follows that one.
            values[key] = tied[current]
        elif key in own or _attribute(default, key) is not None:
            values[key] = tiny
    follow = {**defaults_of_shapes, **(tied or {})}
    layers_key = amap.get(_LAYERS, _LAYERS)
    if layers_key not in own:
        # A tower that counts its blocks under another name (`depth`): its per-layer lists
        # and layer indexes are read against that count.
        layers_key = next((k for k in own if type(own[k]) is int and _LAYER_COUNT.search(k)), layers_key)
    depth = own.get(layers_key)
    for key, value in own.items():
        if value is None and key not in values and _EXPERTS_PER_TOKEN.search(key):
            # Left unset by default (checkpoints write it) but a router needs it: a
            # top-k of None reaches `torch.topk` as k.
            values[key] = 2
            continue
        if key in values or isinstance(value, bool) or not isinstance(value, int):
            continue
        by_name = next((size for pattern, size in _BY_NAME if pattern.search(key)), None)
        if by_name is None and _NOT_SHAPES.search(key):
            continue
        if by_name == "per-head":  # the tiny width over the tiny head count
            by_name = shapes.get(_HEAD_DIM) or shapes.get(_HIDDEN, 64) // shapes.get(_HEADS, 2)
        elif by_name == "layers":
            by_name = shapes.get(_LAYERS)
        if by_name is not None and value > by_name:
            values[key] = by_name
        elif by_name is None and value > 8 and value in follow:
            values[key] = follow[value]
    # Dropout off: a tiny model's checks (and vLLM's parity probe) compare deterministic passes.
    for key, value in own.items():
        if ("dropout" in key or "pdrop" in key) and type(value) is float and value > 0 and key not in values:
            values[key] = 0.0
    # Without grouped-query attention by default (or with attention that needs as many
    # key/value heads as query heads), keep it so.
    heads, kv = amap.get(_HEADS, _HEADS), amap.get(_KV_HEADS, _KV_HEADS)
    if (kv in values or kv in own) and own.get(kv) in (None, own.get(heads)) and heads in values:
        values[kv] = values[heads]
    elif kv not in values and type(own.get(kv)) is int and type(own.get(heads)) is int and heads in values:
        # Grouped-query attention the tiny shapes do not name: the same grouping, scaled.
        values[kv] = max(1, values[heads] * own[kv] // own[heads])
    # Sub-configs of a text config (a patcher, an encoder, a global model) shrink alike,
    # written as their model type plus what changed.
    for key in getattr(type(default), "sub_configs", {}) or {}:
        sub = getattr(default, key, None)
        if hasattr(sub, "to_dict") and key not in values:
            changed = shrink_values(sub, shapes, tied=follow, layer_indexes=layer_indexes)
            if changed:
                values[key] = {"model_type": getattr(sub, "model_type", None), **changed} if getattr(
                    sub, "model_type", None) else changed
    if isinstance(depth, int) and depth > 0 and (values.get(layers_key) or shapes.get(_LAYERS)):
        values.update(_per_layer_lists(own, depth, values.get(layers_key, shapes.get(_LAYERS)), layers_key,
                                       layer_indexes))
        # A count of some of the layers (the last 15 of 35 share their key/value cache)
        # keeps its share of the shrunk depth, at least one layer and not all of them.
        tiny_depth = values.get(layers_key)
        for key, value in own.items():
            if (_SOME_LAYERS.match(key) and key != layers_key and key not in values and type(value) is int
                    and 0 < value < depth and isinstance(tiny_depth, int) and tiny_depth > 1):
                share = min(max(1, round(value * tiny_depth / depth)), tiny_depth - 1)
                if share != value:
                    values[key] = share
    return values


def _attribute(config, key: str):
    """`config.key`, or None where reading it raises (per-layer attributes refuse a
    global read)."""
    try:
        return getattr(config, key, None)
    except Exception:
        return None


def _read_only(config, key: str) -> bool:
    """A property without a setter (derived from other fields), or one whose setter
    refuses even the value it reads (a length limit the model does not have): never set it."""
    attribute = getattr(type(config), key, None)
    if not isinstance(attribute, property):
        return False
    if attribute.fset is None:
        return True
    try:
        attribute.fset(copy.deepcopy(config), attribute.fget(config))
    except Exception:  # a refusing setter may raise anything
        return True
    return False


def _per_layer_lists(own: dict[str, Any], depth: int, tiny_depth: int, layers_key: str,
                     layer_indexes: bool) -> dict[str, Any]:
    """Per-layer lists shortened to one layer of each kind (and the depth that needs);
    with `layer_indexes`, lists of layer indexes remapped into the new depth."""
    lists = {k: v for k, v in own.items() if isinstance(v, (list, tuple)) and len(v) == depth and depth > 1}
    out: dict[str, Any] = {}
    if lists:
        keep: list[int] = []
        seen: set[tuple] = set()
        for i in range(depth):
            kind = tuple(_hashable(v[i]) for v in lists.values())
            if kind not in seen:
                seen.add(kind)
                keep.append(i)
        while len(keep) < tiny_depth and len(keep) < depth:
            keep.append(next(i for i in range(depth) if i not in keep))
        keep.sort()
        out = {k: [v[i] for i in keep] for k, v in lists.items()}
        out[layers_key] = len(keep)
        tiny_depth = len(keep)
    if layer_indexes:
        for key, value in own.items():
            if key in out:
                continue
            if type(value) is int and _LAYER_INDEX.search(key) and 0 <= value < depth:
                # One layer named by its index (where a merger is inserted): it must
                # still name a layer of the shrunk depth, or the code that runs there
                # never runs and the tiny model's shapes no longer agree.
                out[key] = min(value * tiny_depth // depth, tiny_depth - 1)
                continue
            if not isinstance(value, (list, tuple)) or not value:
                continue
            if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < depth for v in value) and (
                    "index" in key or "indices" in key or "layer" in key or "block" in key or "idx" in key):
                remapped = sorted({min(v * tiny_depth // depth, tiny_depth - 1) for v in value})
                if len(remapped) == tiny_depth and len(value) < depth and tiny_depth > 1:
                    remapped = remapped[1:]  # a subset of the layers stays a subset
                out[key] = remapped
    return out


# A count of some of the layers (`num_kv_shared_layers`, `num_dense_layers`).
_SOME_LAYERS = re.compile(r"^num_\w+_layers$")
# A single layer's index (`insert_layer_id`), not a count or a range bound.
_LAYER_INDEX = re.compile(r"layer_(id|idx|index)$")


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


# Tiny shapes to try in turn: some model code needs more heads (a fixed model-parallel
# split, rotary widths cut per head) or as many key/value heads as query heads.
TEXT_SHAPE_CANDIDATES = (
    TINY_TEXT_SHAPES,
    {**TINY_TEXT_SHAPES, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
     "num_key_value_heads": 4},
    {**TINY_TEXT_SHAPES, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
     "num_key_value_heads": 8},
    # Hybrids that place attention by a period (every 8th layer) need the depth.
    {**TINY_TEXT_SHAPES, "num_hidden_layers": 8},
)


def tiny_text_values(config_class: str, shapes: dict[str, int] = TINY_TEXT_SHAPES, *,
                     attend_last: bool = False, unset_experts: bool = False,
                     derived: bool = False, unset_sizes: bool = False) -> dict[str, Any]:
    """The values that shrink a text config class (only fields the class has); with
    `attend_last`, a stack the default config leaves all linear-attention gets one
    attention layer, its last (`_attending_last`); with `unset_experts`, expert counts the
    default config leaves None get tiny values (`_unset_expert_counts`); with `derived`,
    fields the class derives itself are left to it (`_derived_by_the_class`); with
    `unset_sizes`, integer fields the default leaves None and the model code reads get
    tiny values (`_unset_sizes`)."""
    import transformers

    cls = getattr(transformers, config_class)
    try:
        default = cls()
    except Exception as exc:
        raise ScaffoldError(f"{config_class}() fails with its own defaults ({whole_cause(exc, 200)}); write tiny() by hand",
                            category="config") from exc
    values = shrink_values(default, shapes, layer_indexes=True)
    if derived:
        for key in _derived_by_the_class(cls, default):
            values.pop(key, None)
    if attend_last:
        values.update(_attending_last(default, values, shapes))
    if unset_experts:
        values.update(_unset_expert_counts(default, values))
    if unset_sizes:
        values.update(_unset_sizes(cls, default, values, shapes))
        values.update(_unset_per_layer_kinds(cls, default, values, shapes))
    values.update(_unset_layer_kinds(cls, default, values, shapes))
    rope = getattr(default, "rope_parameters", None)
    layer_types = getattr(default, "layer_types", None)
    if not rope and layer_types and re.search(r"rope_parameters\[\s*layer_type\s*\]", modeling_source(cls)):
        # Model code that reads one rope entry per layer type, under a default config
        # that has none (released checkpoints write them): plain rope for each type.
        entry = {"rope_type": "default", "rope_theta": float(getattr(default, "rope_theta", None) or 10000.0)}
        values["rope_parameters"] = {t: _tiny_rope(entry, cls, values, default) or dict(entry)
                                     for t in dict.fromkeys(layer_types)}
        return _accepted(cls, default, values)
    rope = _tiny_rope(rope, cls, values, default)
    if rope is not None:
        values["rope_parameters"] = rope
    return _accepted(cls, default, values)


def vision_language_text_values(text_class: str, shapes: dict[str, int], config_cls,
                                unset_sizes: bool = False) -> dict[str, Any]:
    """The shrunk values of a vision-language type's text config class `text_class`; for a
    composite `config_cls` that is its own text config, without its sub-configs (the tower
    and any third one are shrunk as towers, not as text). `unset_sizes` as in
    `tiny_text_values`."""
    values = tiny_text_values(text_class, shapes, unset_sizes=unset_sizes)
    if text_class != config_cls.__name__:
        return values
    return {k: v for k, v in values.items() if k not in (getattr(config_cls, "sub_configs", {}) or {})}


def _accepted(cls, default, values: dict[str, Any]) -> dict[str, Any]:
    """`values`, or, where the class's validation rejects them, the same values with the
    fields its message names related again as the default config relates them
    (`_relations_kept`) if the class accepts those; else `values`, whose rejection is
    reported where the config is built."""
    try:
        return built_or_repaired(lambda v: cls(**v), values,
                                 lambda v, error: _relations_kept(default, v, str(error)))[1]
    except Exception:  # a validator may raise anything
        return values


def built_or_repaired(build, values: dict[str, Any], repair) -> tuple[Any, dict[str, Any]]:
    """(build(values), values); where that raises, the same with `repair(values, error)`'s
    values when it offers some (not None). Raises the first error when neither builds."""
    try:
        return build(values), values
    except Exception as error:  # a validator may raise anything
        repaired = repair(values, error)
        if repaired is None:
            raise
        try:
            return build(repaired), repaired
        except Exception:
            raise error from None


def _relations_kept(default, values: dict[str, Any], message: str) -> dict[str, Any] | None:
    """Integer fields named in a validation `message` that the default config relates and
    the shrunk values no longer do, related again by changing a field left at its default:
    - a divisor (the default's 16 divides a shrunk field's default 2048 but not its tiny 2)
      becomes the largest that divides the tiny value;
    - a product (by default a * b == c * d, one side shrunk) is kept by solving for a field
      left at its default, the solution that shrinks it most (a count of heads follows a
      shrunk width and per-head width).
    None where nothing changes."""
    own = default.to_dict()
    named = {k: v for k, v in own.items()
             if type(v) is int and v > 0 and re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", message)}
    tiny = {k: values.get(k, v) for k, v in named.items()}
    if not all(type(v) is int and v > 0 for v in tiny.values()):
        return None
    changed: dict[str, int] = {}
    for shrunk, divisor in permutations(named, 2):
        if (shrunk in values and divisor not in values and named[shrunk] % named[divisor] == 0
                and tiny[shrunk] % tiny[divisor]):
            changed[divisor] = math.gcd(tiny[shrunk], tiny[divisor])
    for (a, b), (c, d) in combinations(list(combinations(named, 2)), 2):
        if len({a, b, c, d}) < 4 or named[a] * named[b] != named[c] * named[d]:
            continue
        solutions = []
        for solve, mate, (e, f) in ((a, b, (c, d)), (b, a, (c, d)), (c, d, (a, b)), (d, c, (a, b))):
            product = tiny[e] * tiny[f]
            if solve not in values and product % tiny[mate] == 0 and 0 < product // tiny[mate] <= named[solve]:
                solutions.append((product // tiny[mate] / named[solve], solve, product // tiny[mate]))
        if solutions:
            _, solve, value = min(solutions)
            changed[solve] = value
    return {**values, **changed} if changed else None


_LINEAR = "linear_attention"
_ATTENTION_INDEXES = re.compile(r"^(attn|attention)_layer_(indices|indexes|ids)$")


def _attending_last(default, values: dict[str, Any], shapes: dict[str, int]) -> dict[str, Any]:
    """A hybrid whose default config holds no attention layer (its released checkpoints
    do): the per-layer kinds with the last layer full attention, or an unset list of
    attention-layer indexes naming the last layer. A stack of linear-attention layers
    alone cannot run in transformers' cache, which asks an attention layer for the length."""
    changed: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, list) and len(value) > 1 and all(kind == _LINEAR for kind in value):
            changed[key] = [*value[:-1], "full_attention"]
    if not changed:
        depth = values.get(dict(getattr(default, "attribute_map", {}) or {}).get(_LAYERS, _LAYERS),
                           shapes.get(_LAYERS))
        for key, value in default.to_dict().items():
            if value is None and _ATTENTION_INDEXES.match(key) and depth:
                changed[key] = [depth - 1]
    return changed


def _unset_layer_kinds(cls, default, values: dict[str, Any], shapes: dict[str, int]) -> dict[str, Any]:
    """Per-layer kinds (`layer_types`) read off the model code where it keys its attention
    masks by them (`causal_mask_mapping = {"kind": ...}` indexed by `layer_types[i]`),
    where the default config leaves them None, or lists only stateless kinds while the
    code keys a stateful one (a convolution, linear attention: `mmrl.boundaries`): every
    kind once, attention last (transformers' cache asks an attention layer for the
    length), and as many layers as kinds where the tiny depth holds fewer. Released
    checkpoints write the list; a default without it builds no layer, and one without
    the stateful kind builds a tiny model on which a hybrid's packing and sequence
    parallelism would be verified without the layers that decide them (Lfm2's default
    is all attention, its checkpoints interleave short convolutions)."""
    from mmrl.boundaries import STATEFUL_LAYER_KINDS

    own = default.to_dict().get("layer_types", 0)
    if own == 0 or (own is None and "layer_types" in values):
        return {}
    if own is not None and (not isinstance(own, (list, tuple)) or set(own) & STATEFUL_LAYER_KINDS):
        return {}
    source = modeling_source(cls)
    mapping = re.search(r"causal_mask_mapping\s*=\s*\{(.*?)\n\s*\}", source, re.S)
    if mapping is None or not re.search(r"causal_mask_mapping\[[^\]]*layer_types\[", source):
        return {}
    kinds = list(dict.fromkeys(re.findall(r'^\s*["\'](\w+)["\']\s*:', mapping.group(1), re.M)))
    if len(kinds) < 2 or (own is not None and not set(kinds) & STATEFUL_LAYER_KINDS):
        return {}
    kinds.sort(key=lambda kind: kind == "full_attention")
    layers_key = dict(getattr(default, "attribute_map", {}) or {}).get(_LAYERS, _LAYERS)
    depth = max(shapes.get(_LAYERS, 2), len(kinds)) if own is not None else \
        max(values.get(layers_key, shapes.get(_LAYERS, 2)), len(kinds))
    layer_types = [kinds[0]] * (depth - len(kinds)) + kinds
    out = {"layer_types": layer_types, layers_key: depth}
    if own is None:
        return out
    # The default's other per-layer fields: a list of its attention layers' indexes (Lfm2's
    # full_attn_idxs, every layer) names the new list's; any other per-layer list is left
    # alone, and then so is the default's list.
    attending = [i for i, kind in enumerate(own) if kind == "full_attention"]
    for key, value in default.to_dict().items():
        if key == "layer_types" or not isinstance(value, (list, tuple)):
            continue
        if list(value) == attending:
            out[key] = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        elif len(value) == len(own):
            return {}
    return out


def _derived_by_the_class(cls, default) -> set[str]:
    """Fields whose class default is None but which the default config holds a value
    for: the class derives them from other fields when it is built (a query/key head
    width as the sum of its rotary and plain parts). Shrunk each on its own by name, they
    can break the sum the class would have kept; left out, the class derives them from
    the shrunk fields. Tried only after the shrunk values failed. Never a sub-config: the
    class builds one left None at its full default size (BLT's four), the opposite of tiny."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return set()
    own = default.to_dict()
    sub_configs = set(getattr(cls, "sub_configs", {}) or {})
    return {f.name for f in dataclasses.fields(cls)
            if f.default is None and own.get(f.name) is not None and f.name not in sub_configs}


def _unset_expert_counts(default, values: dict[str, Any]) -> dict[str, Any]:
    """Expert counts (routed, shared) the default config leaves None: released checkpoints
    write them, and model code that sizes its experts by them fails on None. A None count
    can also mean a dense model (a switch elsewhere turns the mixture on), so this is
    tried only after the default's own None has failed."""
    return {key: next(size for pattern, size in _BY_NAME if pattern.search(key))
            for key, value in default.to_dict().items()
            if value is None and key not in values and _EXPERT_COUNTS.search(key)}


# An annotation that allows an integer or None and nothing else (`int | None`).
_OPTIONAL_INT = re.compile(r"^(int \| None|None \| int|Optional\[int\])$")


def _unset_fields(cls, default, values: dict[str, Any]) -> list:
    """The dataclass fields of config class `cls` that its default config leaves None and
    the shrink has not set (`values`): what `_unset_sizes` and `_unset_per_layer_kinds` fill."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return []
    own = default.to_dict()
    return [f for f in dataclasses.fields(cls) if own.get(f.name, 0) is None and f.name not in values]


def _unset_sizes(cls, default, values: dict[str, Any], shapes: dict[str, int]) -> dict[str, Any]:
    """Integer fields (annotated `int | None`) the default config leaves None and the
    model code reads (`config.indexer_budget`): released checkpoints write them, and code
    that builds the part they size unconditionally fails on None. By name where the name
    says a size (`_BY_NAME`), else 1, which every tiny count a validator relates it to
    divides and is divided by. None often means "off" (a window, a scaling), so this is
    tried only after the default's own None has failed; fields whose names are not
    shapes (`_NOT_SHAPES`: token ids, windows) are left alone."""
    reads = set(re.findall(r"config\.(\w+)", modeling_source(cls)))
    out: dict[str, Any] = {}
    for f in _unset_fields(cls, default, values):
        name = f.name
        if name not in reads or _NOT_SHAPES.search(name) or not _OPTIONAL_INT.match(str(f.type).replace("typing.", "")):
            continue
        size = next((size for pattern, size in _BY_NAME if pattern.search(name)), 1)
        if size == "per-head":
            size = shapes.get(_HEAD_DIM) or shapes.get(_HIDDEN, 64) // shapes.get(_HEADS, 2)
        elif size == "layers":
            size = shapes.get(_LAYERS, 2)
        out[name] = size
    return out


def _unset_per_layer_kinds(cls, default, values: dict[str, Any], shapes: dict[str, int]) -> dict[str, Any]:
    """Per-layer kind lists (`mlp_layer_types`, annotated `list[str] | None`) the default
    config leaves None while the model code indexes them by layer and compares the entry
    with a kind (`config.mlp_layer_types[layer_idx] == "sparse"`): released checkpoints
    write them, and a default without one builds no layer. The kinds are those the code
    compares with and those the class's docstring names for the field (`"dense"` or
    `"sparse"`), in the docstring's order, one layer of each (the first kind fills a
    deeper stack); only where that names two kinds or more. Tried only after the
    default's None has failed, with `_unset_sizes`."""
    source = modeling_source(cls)
    layers_key = dict(getattr(default, "attribute_map", {}) or {}).get(_LAYERS, _LAYERS)
    out: dict[str, Any] = {}
    for f in _unset_fields(cls, default, values):
        name = f.name
        if "list[str]" not in str(f.type):
            continue
        indexed = rf"config\.{name}\[\s*\w+\s*\]"
        compared = re.findall(rf"""{indexed}\s*(?:==|!=)\s*["'](\w+)["']""", source)
        compared += re.findall(rf"""["'](\w+)["']\s*(?:==|!=)\s*{indexed}""", source)
        if not compared:
            continue
        entry = re.search(rf"^\s*{name} \(.*?\):\n(.*?)(?=^\s*\w+ \(|\Z)", cls.__doc__ or "", re.M | re.S)
        documented = re.findall(r'`"(\w+)"`', entry.group(1)) if entry else []
        kinds = list(dict.fromkeys([*documented, *compared]))
        if len(kinds) < 2:  # the other kinds unknown: a list of one would drop them (Lfm2-MoE's convolutions)
            continue
        depth = max(values.get(layers_key, shapes.get(_LAYERS, 2)), len(kinds))
        out[name] = [kinds[0]] * (depth - len(kinds)) + kinds
        out[layers_key] = depth
    return out


def _tiny_rope(rope, cls, values: dict[str, Any], default):
    """One rope entry for the tiny text config with its multi-axis split made explicit
    and rescaled; None where the entry has no such split (it stays as it is)."""
    if isinstance(rope, dict) and rope.get("rope_type") and not rope.get("mrope_section") and modeling_reads(
            cls, "mrope_section"):
        # The model splits its rotary width over (time, height, width) but the
        # default config leaves the split to a value hard-coded in the model (or
        # to none): give it one, in the proportions of the released checkpoints.
        rope = {**rope, "mrope_section": _modeling_default(cls, "mrope_section") or [16, 24, 24]}
    rope = _rescaled_mrope(rope, values, default)
    if rope is not None and "mrope_interleaved" not in rope and _INTERLEAVED_MROPE.search(modeling_source(cls)):
        # The model always interleaves its axes (height and width in every third frequency)
        # and reads no flag for it; released checkpoints say so in their config, which
        # vLLM reads (without it, vLLM rotates the axes in blocks: other positions).
        rope = {**rope, "mrope_interleaved": True}
    return rope


# Rope frequencies recomposed with height and width in every third slot (an interleaved layout).
_INTERLEAVED_MROPE = re.compile(r"slice\(\s*offset\s*,\s*\w+\s*,\s*3\s*\)")


def modeling_source(config_class) -> str:
    """The text of the modeling module beside a config class ("" where there is none):
    read, not imported."""
    import importlib.util

    spec = importlib.util.find_spec(config_class.__module__.replace(".configuration_", ".modeling_"))
    return Path(spec.origin).read_text() if spec is not None and spec.origin is not None else ""


def modeling_reads(config_class, key: str) -> bool:
    """Whether the modeling module beside a config class reads `key`."""
    return f'"{key}"' in modeling_source(config_class)


def _modeling_default(config_class, key: str) -> list[int] | None:
    """The list the modeling module falls back to for a rope key (`.get("key", [8, 12, 12])`)."""
    found = re.search(rf"""get\(\s*["']{key}["']\s*,\s*\[([\d,\s]+)\]""", modeling_source(config_class))
    return [int(v) for v in found.group(1).split(",") if v.strip()] if found else None


def _rescaled_mrope(rope, values: dict[str, Any], default) -> dict[str, Any] | None:
    """A rope dict whose multi-axis sections still sum to half the (shrunk) rotary width."""
    if not isinstance(rope, dict) or not rope.get("mrope_section"):
        return None
    head_dim = values.get("head_dim") or values.get("hidden_size", 64) // values.get("num_attention_heads", 2)
    partial = rope.get("partial_rotary_factor") or getattr(default, "partial_rotary_factor", None) or 1.0
    half = int(head_dim * partial) // 2
    section = [int(s) for s in rope["mrope_section"]]
    scaled = [max(1, s * half // sum(section)) for s in section]
    # The remainder goes to the last axis, so that axes of equal size stay equal
    # (height and width: some models interleave them).
    scaled[-1] += half - sum(scaled)
    return {**rope, "mrope_section": scaled}


def build_text_config(config_class: str, tokenizer, values: dict[str, Any]):
    from mmrl.tiny import sized_config

    try:
        return sized_config(f"transformers:{config_class}", tokenizer, **values)
    except Exception as exc:
        raise ScaffoldError(f"{config_class} rejects the shrunk values ({whole_cause(exc, 200)}); "
                            "write tiny() by hand with values it accepts", category="config") from exc


def build_tiny(model_class: str, config):
    """`model_class` built from the shrunk `config` (random init, the caller's RNG state
    untouched), with SDPA where the class supports it; a ScaffoldError if it cannot be."""
    import torch
    import transformers

    from mmrl.build import default_attention

    cls = getattr(transformers, model_class)
    config._attn_implementation = default_attention(cls)
    try:
        with torch.random.fork_rng(devices=[]):
            return cls._from_config(config)
    except Exception as exc:
        raise ScaffoldError(f"{model_class} cannot be built from the shrunk config ({whole_cause(exc, 200)}); write tiny() "
                            "by hand", category="model-init") from exc


def runs(model_class: str, config) -> None:
    """Build `model_class` from `config` and run one short forward and backward pass;
    a ScaffoldError says which of the two failed."""
    import torch

    model = build_tiny(model_class, config)
    ids = torch.arange(3, 11).reshape(1, 8) % config.get_text_config(decoder=True).vocab_size
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as exc:
        raise ScaffoldError(f"{model_class} does not run on the shrunk config ({whole_cause(exc, 200)}); write tiny() by "
                            "hand with values its code accepts", category="forward") from exc


def composite_tower_values(vision_default) -> dict[str, Any]:
    """The patch geometry (`patch_size`, `spatial_merge_size`, ...: integer fields named for
    patches or merging) in which a composite config's default vision tower differs from its
    config class's own defaults (LLaVA's CLIP tower: patch 14, where CLIPVisionConfig says
    32). A tiny config passes its tower as a dict, which the class fills in with its own
    defaults, so without these the tiny tower would cut its images into other patches than
    the composite's (a 112-pixel image in patches of 32: no whole grid, which vLLM's CLIP
    rejects). The image size is left to the tiny model's fitting (`fit_image_size`)."""
    try:
        own = type(vision_default)().to_dict()
    except Exception:  # a class that needs arguments: no defaults to differ from
        return {}
    return {key: value for key, value in vision_default.to_dict().items()
            if ("patch" in key or "merge" in key) and type(value) is int and own.get(key) != value}


def tiny_vision_values(vision_default, text_hidden_default: int | None) -> dict[str, Any]:
    """Values that shrink a vision sub-config (image and patch size kept); integers equal
    to the default text width follow the tiny text width (projection outputs)."""
    tied = {text_hidden_default: TINY_TEXT_SHAPES[_HIDDEN]} if text_hidden_default else {}
    values = shrink_values(vision_default, TINY_VISION_SHAPES, tied=tied, layer_indexes=True)
    # Widths a vision tower projects into the text model, by what their names say.
    for key, value in vision_default.to_dict().items():
        if isinstance(value, int) and not isinstance(value, bool) and TOWER_OUTPUT_WIDTH.search(key):
            values[key] = TINY_TEXT_SHAPES[_HIDDEN]
    return values



