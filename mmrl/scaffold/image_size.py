"""The image size of the tiny vision-language model and its processor.

Decides the arguments of an image/video processor (its size keys set to the vision
tower's image size, its patch geometry to the tower's) and, when the tiny model does not
run on one image with the defaults, the first combination of text width, tower width,
image token count and image size that runs (after any width a tower output meets at its
default is fitted to the tiny tower's).
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

from mmrl.scaffold.base import Resolved, ScaffoldError
from mmrl.scaffold.media_plan import (
    MediaPlan, build_config, build_processor, init_parameters, one_image_inputs, runs_with_image,
)
from mmrl.scaffold.shrink import TOWER_OUTPUT_WIDTH, build_tiny, vision_language_text_values

# No image processor's edge is longer: larger `shortest_edge` / `longest_edge` values
# are pixel areas.
_LONGEST_EDGE = 8192
# The patch size a processor is given until the tiny tower's own is measured (a common
# one: the placeholder search only needs the processor to expand an image).
STAND_IN_PATCH = 16


def sized_processor_kwargs(processor_cls, image_size: int | None,
                           vision: dict[str, Any] | None = None) -> dict[str, Any]:
    """Arguments of an image/video processor: its size keys set to `image_size`, and its
    patch geometry (`patch_size`, `merge_size`, `temporal_patch_size`, ...) set to the
    vision config's value of the same name (or a name ending in it: `spatial_merge_size`)."""
    if processor_cls is None:
        return {}
    try:
        default = processor_cls()
    except Exception:
        return {}
    sizes: dict[str, Any] = {}
    # A tower size may be (height, width).
    height, width = image_size if isinstance(image_size, (list, tuple)) else (image_size, image_size)
    for key in ("size", "crop_size", "max_image_size") if image_size is not None else ():
        value = getattr(default, key, None)
        if type(value) is int:  # one edge
            sizes[key] = max(height, width)
            continue
        if value is None or not isinstance(value, dict) and not hasattr(value, "__dict__"):
            continue
        items = dict(value) if isinstance(value, dict) else vars(value)
        edge = {"height": height, "width": width, "shortest_edge": min(height, width),
                "longest_edge": max(height, width)}
        if any(isinstance(items.get(k), int) and items[k] > _LONGEST_EDGE for k in ("shortest_edge", "longest_edge")):
            # Pixel areas, not edges (a min/max pixel budget): up to the tower's image area.
            edge = {"shortest_edge": min(items.get("shortest_edge") or 0, height * width),
                    "longest_edge": height * width}
        present = {k: edge[k] for k, v in items.items() if isinstance(v, int) and k in edge}
        if present:
            sizes[key] = present
    patch = (vision or {}).get("patch_size")
    for key, value in vars(default).items():
        if value is None and _COUNT_ARGUMENT.search(key) and type(image_size) is int and type(patch) is int:
            sizes[key] = (image_size // patch) ** 2  # a per-image count left to the checkpoint: the patch grid
            continue
        if type(value) is not int or "patch" not in key and "merge" not in key:
            continue
        match = next((v for k, v in (vision or {}).items() if (k == key or k.endswith("_" + key)) and type(v) is int),
                     None)
        if match is not None and match != value:
            sizes[key] = match
    return sizes


# Text widths to try when the defaults do not run: wider heads for model code that
# splits a head into fixed rotary sections (multi-axis rope defaults written in code).
VLM_TEXT_CANDIDATES = (
    {},
    {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
     "head_dim": 128},
)
# Image sizes to try, besides multiples of the default: common tower sizes.
COMMON_IMAGE_SIZES = (224, 256, 336, 384, 448, 512, 896)


def fit_image_size(resolved: Resolved, plan: MediaPlan, tokenizer, config, processor):
    """Default configs are not always one checkpoint's, and processors learn some counts
    only from a checkpoint. When the tiny model does not run on one image, try, in turn:
    a config map keyed by patch counts re-keyed to the tiny tower's count, wider text
    heads (model code that fixes rotary sections), the tower's `hidden_size` as the width
    it projects into the text model, one more image token per image than the processor's
    default (a class token), and other image sizes (vision tower and image processor
    together); keep the first combination that runs, else the defaults (verify
    then says why)."""
    import itertools

    import transformers

    from mmrl.tiny import TINY_TEXT_SHAPES

    failure = runs_with_image(resolved.model_class, config, processor, plan.image_placeholder, plan.text_kwargs)
    if failure is None:
        return tokenizer, config, processor
    rekeyed = _patch_count_keys_fitted(resolved, plan, config, processor)
    if rekeyed is not None:
        return rekeyed
    fitted = _input_widths_fitted(resolved, plan, config, failure)
    if fitted is not None:
        if fitted[1] is None:
            return fitted[0]
        tokenizer, config, processor = fitted[0]
    measured = _patch_measured(resolved, plan, tokenizer, config, processor)
    if measured is not None:
        return measured
    base = getattr(getattr(config, plan.vision_key), "image_size", None)
    sizes = [None]
    if isinstance(base, int):
        sizes += list(dict.fromkeys(s for s in (base * 2, base * 4, base // 2, *COMMON_IMAGE_SIZES) if s != base))
    processor_cls = getattr(transformers, plan.processor_class)
    counts = [{}] + [{name: str(parameter.default + 1)} for name, parameter in init_parameters(processor_cls).items()
                     if type(parameter.default) is int and parameter.default in (0, 1) and "token" in name]
    count_arguments = per_image_count_arguments(processor_cls)
    saved = (dict(plan.vision), dict(plan.sub_processors), dict(plan.text_overrides), dict(plan.processor_kwargs))
    for text_shapes, projects, count, size in itertools.product(VLM_TEXT_CANDIDATES, (False, True), counts, sizes):
        if not (text_shapes or projects or count or size):
            continue  # the defaults, already tried
        width = (text_shapes or TINY_TEXT_SHAPES)["hidden_size"]
        plan.text_overrides = (vision_language_text_values(plan.text_config_class, {**TINY_TEXT_SHAPES, **text_shapes},
                                                           getattr(transformers, resolved.config_class))
                               if text_shapes else dict(saved[2]))
        plan.vision = dict(saved[0])
        plan.vision.update({k: width for k in plan.vision if TOWER_OUTPUT_WIDTH.search(k)})
        if projects:
            plan.vision["hidden_size"] = width
            if "head_dim" in plan.vision:
                plan.vision["head_dim"] = width // plan.vision.get("num_attention_heads", 2)
        plan.processor_kwargs = {**saved[3], **count}
        plan.sub_processors = dict(saved[1])
        if size is not None:
            plan.vision["image_size"] = size
            vision_values = getattr(config, plan.vision_key).to_dict()
            plan.sub_processors = {
                arg: (name, sized_processor_kwargs(getattr(transformers, name), size, vision_values))
                for arg, (name, _) in saved[1].items()}
        try:
            tokenizer2, config2 = build_config(resolved, plan)
            processor2 = build_processor(plan, tokenizer2, config2)
        except ScaffoldError:
            continue
        if runs_with_image(resolved.model_class, config2, processor2, plan.image_placeholder, plan.text_kwargs) is None:
            return tokenizer2, config2, processor2
        # A processor that writes a fixed number of tokens per image (or tile): the
        # number of features the tiny tower gives for one.
        rows = _feature_rows(resolved.model_class, config2, processor2, plan) if count_arguments else None
        for name in count_arguments:
            if rows is None or getattr(processor2, name, None) == rows:
                break
            plan.processor_kwargs = {**plan.processor_kwargs, name: str(rows)}
            processor3 = build_processor(plan, tokenizer2, config2)
            if runs_with_image(resolved.model_class, config2, processor3, plan.image_placeholder,
                               plan.text_kwargs) is None:
                return tokenizer2, config2, processor3
    plan.vision, plan.sub_processors, plan.text_overrides, plan.processor_kwargs = (dict(v) for v in saved)
    return tokenizer, config, processor


def patch_count_maps(config) -> dict[str, dict[int, int]]:
    """The config's top-level maps keyed by patches per image (a field named for patches
    whose keys and values are integers, as JSON spells them or not: a projector's
    patches -> queries map), by field name."""
    maps = {}
    for name, value in config.to_dict().items():
        if "patch" not in name or not isinstance(value, dict) or not value:
            continue
        try:
            maps[name] = {int(k): int(v) for k, v in value.items()}
        except (TypeError, ValueError):
            continue
    return maps


def _patch_count_keys_fitted(resolved: Resolved, plan: MediaPlan, config, processor):
    """A map keyed by patch counts knows the checkpoint's counts only (its patch size at its
    image sizes), not the tiny tower's. Re-keyed to the count the tiny tower cuts one
    processed image into (its height and width over the tower's `patch_size`), each of the
    map's values tried in turn with it: the first that runs is kept, as
    (tokenizer, config, processor); None (the plan as it was) where none runs or there is no
    such map."""
    maps = patch_count_maps(config)
    patch = getattr(getattr(config, plan.vision_key, None), "patch_size", None)
    if not maps or type(patch) is not int:
        return None
    try:
        pixels = one_image_inputs(processor, plan.image_placeholder, plan.text_kwargs).get("pixel_values")
    except Exception:
        return None
    if pixels is None or pixels.dim() < 3:
        return None
    count = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    saved = dict(plan.top)
    for name, counts in maps.items():
        if count in counts:
            continue
        for value in dict.fromkeys(counts.values()):
            plan.top = {**saved, name: {count: value}}
            try:
                tokenizer, config = build_config(resolved, plan)
                processor = build_processor(plan, tokenizer, config)
            except ScaffoldError:
                continue
            if runs_with_image(resolved.model_class, config, processor, plan.image_placeholder,
                               plan.text_kwargs) is None:
                return tokenizer, config, processor
    plan.top = saved
    return None


# A linear layer given `in` features where its weight takes `expected` (torch's message).
_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")
# Two widths joined along another dimension (torch.cat's message): which of the two a
# config field holds is not said.
_CAT = re.compile(r"Sizes of tensors must match except in dimension \d+\. Expected size (\d+) but got size (\d+)")
# Widths to fit at most: each fitted width may reveal the next layer's.
_WIDTH_FITS = 4


def _width_pairs(failure: str) -> list[tuple[int, int]]:
    """(width a field holds, width it should take) pairs an error allows: a matmul's
    weight takes `expected` and is given `given`; a concatenation's two widths either way."""
    if match := _MATMUL.search(failure):
        return [(int(match.group(3)), int(match.group(2)))]
    if match := _CAT.search(failure):
        first, second = int(match.group(1)), int(match.group(2))
        return [(first, second), (second, first)]
    return []


def _int_leaves(value, path: tuple = ()):
    """(path, integer) for every integer in a config dict, its sub-config dicts and lists
    (a list entry's path ends in its index)."""
    if type(value) is int:
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _int_leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _int_leaves(item, (*path, index))


def _has_path(values, path: tuple) -> bool:
    for step in path:
        if isinstance(values, dict) and step in values:
            values = values[step]
        elif isinstance(values, list) and type(step) is int and step < len(values):
            values = values[step]
        else:
            return False
    return True


def _lone_field(vision: dict[str, Any], saved: dict[str, Any], width: int, defaults_only: bool):
    """The path of the one integer of `width` in the vision config's values: among those
    left at their default (not in `saved`, the plan's shrunk values), else, unless
    `defaults_only`, among all; None where there is not exactly one."""
    named = [path for path, v in _int_leaves(vision) if v == width]
    fields = [path for path in named if not _has_path(saved, path)]
    if not fields and not defaults_only:
        fields = named
    return fields[0] if len(fields) == 1 else None


def _with_leaf(values: dict[str, Any], source: dict[str, Any], path: tuple, width: int) -> dict[str, Any]:
    """`values` (the plan's vision values) with the integer at `path` set to `width`: a
    sub-config on the way is written as its model type plus what changed, a list whole
    (copied from `source`, the built config's values, where the plan lacks it)."""
    key, rest = path[0], path[1:]
    if not rest:
        return {**values, key: width}
    current = values.get(key)
    if isinstance(source.get(key), list):
        listed = list(current if isinstance(current, list) else source[key])
        listed[rest[0]] = width  # per-layer lists of widths are one level deep
        return {**values, key: listed}
    if not isinstance(current, dict):
        current = {"model_type": source[key]["model_type"]} if source[key].get("model_type") else {}
    return {**values, key: _with_leaf(current, source[key], rest, width)}


def _input_widths_fitted(resolved: Resolved, plan: MediaPlan, config, failure: str):
    """Where the tiny tower's output meets a layer that takes another width (a config
    field derived from the tower's, such as a concatenation of several of its layers'
    outputs, left at its default, or a shrunk width the code expects a multiple of
    another), or is joined to a tensor of another width (a sub-config's list of channel
    widths left at its default, concatenated with learned queries of the tiny width): the
    one vision config field of that width (in a sub-config or a list too) set to the
    width the layer is given, as long as the error names one. ((tokenizer, config,
    processor), None) once it runs, ((...), error) where it got further but still fails,
    None where no field fits (`plan` as it was)."""
    saved, fitted, kept = dict(plan.vision), None, dict(plan.vision)
    for _ in range(_WIDTH_FITS):
        vision = getattr(config, plan.vision_key).to_dict()
        pairs = [(expected, given) for expected, given in _width_pairs(failure) if given != expected]
        # A field left at its default first; else one the shrink set (a width the model's
        # code derives from another by a factor the shrink did not keep). Where either
        # width could be the field's, only a lone field left at its default is taken.
        choices = [(path, given) for expected, given in pairs
                   if (path := _lone_field(vision, saved, expected, defaults_only=len(pairs) > 1)) is not None]
        if len(choices) != 1:
            break
        plan.vision = _with_leaf(plan.vision, vision, *choices[0])
        try:
            tokenizer, config = build_config(resolved, plan)
            processor = build_processor(plan, tokenizer, config)
        except ScaffoldError:
            break
        failure = runs_with_image(resolved.model_class, config, processor, plan.image_placeholder, plan.text_kwargs)
        fitted, kept = ((tokenizer, config, processor), failure), dict(plan.vision)
        if failure is None:
            return fitted
    plan.vision = kept  # the vision values of the config returned (`saved` where none is)
    return fitted


_COUNT_ARGUMENT = re.compile(r"seq_len|seq_length|num_image_tokens|tokens_per_image|image_tokens_count")


def _patch_measured(resolved: Resolved, plan: MediaPlan, tokenizer, config, processor):
    """Where the processor's patch size is a stand-in (`MediaPlan.unset_patch`): the tiny
    tower's own, the processed image's side over the side of the square grid of features
    the tower gives it. (tokenizer, config, processor) where the tiny model then runs,
    else None (the stand-in kept)."""
    from PIL import Image

    name = plan.unset_patch
    if name is None:
        return None
    rows = _feature_rows(resolved.model_class, config, processor, plan)
    try:
        pixels = processor(text=[f"look {plan.image_placeholder} here"],
                           images=[Image.new("RGB", (224, 168), (9, 99, 199))], return_tensors="pt")["pixel_values"]
    except Exception:  # noqa: BLE001 - no measurement: the stand-in stays and verify says why
        return None
    height, width = pixels.shape[-2:]
    grid = math.isqrt(rows or 0)
    if not rows or grid * grid != rows or height != width or height % grid:
        return None
    stand_in, plan.processor_kwargs[name] = plan.processor_kwargs[name], str(height // grid)
    measured = build_processor(plan, tokenizer, config)
    if runs_with_image(resolved.model_class, config, measured, plan.image_placeholder, plan.text_kwargs) is None:
        return tokenizer, config, measured
    plan.processor_kwargs[name] = stand_in
    return None


def per_image_count_arguments(processor_cls) -> list[str]:
    """The processor's integer arguments that fix how many tokens an image gets (None by
    default where only a checkpoint says), in the order `__init__` takes them."""
    return [name for name, parameter in init_parameters(processor_cls).items()
            if (parameter.default is None or type(parameter.default) is int) and _COUNT_ARGUMENT.search(name)]


def _feature_rows(model_class: str, config, processor, plan: MediaPlan) -> int | None:
    """Feature rows the tiny model's tower makes for one image (or one tile of it):
    `get_image_features` on one processed image, its result's per-item length."""
    import torch
    from PIL import Image

    try:
        model = build_tiny(model_class, config)
        inputs = processor(text=[f"look {plan.image_placeholder} here"],
                           images=[Image.new("RGB", (224, 168), (9, 99, 199))], return_tensors="pt")
        accepted = inspect.signature(model.get_image_features).parameters
        with torch.no_grad():
            out = model.get_image_features(**{k: v for k, v in inputs.items() if k in accepted})
    except Exception:
        return None
    features = getattr(out, "pooler_output", None)
    if features is None:
        features = getattr(out, "last_hidden_state", out)
    if isinstance(features, (list, tuple)):
        features = features[0]
    if not isinstance(features, torch.Tensor) or features.dim() < 2:
        return None
    return int(features.shape[-2])
