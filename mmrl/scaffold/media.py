"""Stage 3, processor: the tiny tokenizer and processor, and the tiny vision-language config.

Everything is read from the model type's own classes:
- the processor class (transformers' processor table) and the sub-processors its
  `__init__` names (image processor, video processor), built from their defaults with
  the image size set to the vision tower's;
- the special tokens: the processor's `*_token` arguments, the tokenizer attributes its
  code reads (`tokenizer.boi_token`), and the config's `*_token_id` / `*_token_index`
  fields; each becomes one atomic token of a character-level tokenizer;
- processor arguments whose names the config also has (`patch_size`,
  `image_seq_length`, `spatial_merge_size`, ...) take the config's value;
- the text placeholder: the first special token that, put in a prompt beside one image,
  makes the processor emit the config's image token.

The plan and what is built from it live in `media_plan`, the special tokens and the
placeholder search in `placeholders`, the image size fitting in `image_size`.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from mmrl.errors import whole_cause
from mmrl.scaffold.base import TINY_VISION_SHAPES, Resolved, ScaffoldError
from mmrl.scaffold.image_size import STAND_IN_PATCH, fit_image_size, per_image_count_arguments, sized_processor_kwargs
from mmrl.scaffold.media_plan import MediaPlan, build_config, build_processor, init_parameters
from mmrl.scaffold.placeholders import find_placeholder, named_token, tokens_in_source, unexpanded_placeholder
from mmrl.scaffold.shrink import (
    TinyInputs, build_tiny, composite_tower_values, modeling_reads, modeling_source, shrink_values, tiny_vision_values,
    vision_language_text_values,
)
from mmrl.scaffold.vllm_fields import text_architecture, vllm_fields
from mmrl.tiny import TINY_TEXT_SHAPES

_TOKEN_FIELD = re.compile(r"^(.*)_token_(id|index)$")
# Processor __init__ arguments that are sub-processors or plumbing, never config values.
_PLUMBING = {"self", "image_processor", "tokenizer", "video_processor", "audio_processor", "feature_extractor",
             "chat_template", "kwargs", "args"}


def _processor_class(model_type: str, config_cls=None):
    """The type's processor class: transformers' processor table, else the one processor
    class its own model package defines, else the table's entry for the first model type
    whose model or config its modular source derives from (a model written as another's
    variant keeps that one's processor)."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if name and hasattr(transformers, name):
        return getattr(transformers, name)
    found = _package_classes(config_cls, transformers.ProcessorMixin)
    if len(found) == 1:
        return found[0]
    for parent in _derived_from(config_cls):
        name = PROCESSOR_MAPPING_NAMES.get(parent)
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def _derived_from(config_cls) -> list[str]:
    """Model types whose modeling or configuration module the config class's modular
    source (`modular_<type>.py`, transformers' own) imports, in order."""
    import importlib.util
    from pathlib import Path

    if config_cls is None:
        return []
    package = config_cls.__module__.rpartition(".")[0]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations)))
    sources = sorted(folder.glob("modular_*.py"))
    if not sources:
        return []
    imported = re.findall(r"^from \.\.(\w+)\.(?:modeling|configuration)_\w+ import", sources[0].read_text(), re.M)
    return list(dict.fromkeys(imported))


def _package_classes(config_cls, base) -> list:
    """Subclasses of `base` that the config class's own model package exports."""
    import importlib

    import transformers

    if config_cls is None:
        return []
    package = config_cls.__module__.rpartition(".")[0]
    try:
        module = importlib.import_module(package)
    except ImportError:
        return []
    names = getattr(module, "__all__", None) or dir(module)
    found = []
    for name in names:
        cls = getattr(transformers, name, None) or getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, base) and cls is not base and cls not in found:
            found.append(cls)
    return found


def _table_class(table: dict, model_type: str, processor_cls=None):
    """A sub-processor class from one of transformers' tables: the type's own entry, else
    the entry of a type that uses the same processor class."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    types = [model_type]
    if processor_cls is not None:
        types += [t for t, n in PROCESSOR_MAPPING_NAMES.items() if n == processor_cls.__name__ and t != model_type]
    for candidate in types:
        names = table.get(candidate)
        if isinstance(names, dict):
            names = names.get("torchvision") or names.get("pil") or next(iter(names.values()), None)
        elif isinstance(names, (tuple, list)):
            names = next((n for n in names if n), None)
        if names and hasattr(transformers, names):
            return getattr(transformers, names)
    return None


def tiny_vision_language(resolved: Resolved) -> TinyInputs:
    """The tiny config and processor of a vision-language type, and the plan rendering
    needs to rebuild them."""
    import transformers

    config_cls = getattr(transformers, resolved.config_class)
    try:
        defaults = config_cls()
    except Exception as exc:
        raise ScaffoldError(f"{resolved.config_class}() fails with its own defaults ({whole_cause(exc, 200)}); write tiny() "
                            "by hand", category="config") from exc
    text_default = defaults.get_text_config(decoder=True)
    vision_default = getattr(defaults, resolved.vision_config_key, None)
    vision_class = (getattr(config_cls, "sub_configs", {}) or {}).get(resolved.vision_config_key)
    if vision_default is None and isinstance(vision_class, type) and vision_class.__name__ != "AutoConfig":
        vision_default = vision_class()  # a tower left out by default (a text-only default)
    if vision_default is None:
        raise ScaffoldError(f"{resolved.config_class} has no separate text and vision sub-configs by default; write "
                            "tiny() by hand", category="config")
    # A composite whose own fields configure its text model (it is its own text config)
    # keeps the text values at its top level: text_key None.
    text_key = None if text_default is defaults else next(
        (k for k, v in vars(defaults).items() if v is text_default), None)
    if text_key is None and text_default is not defaults:
        raise ScaffoldError(f"{resolved.config_class}: the text sub-config sits under no attribute the scaffold can "
                            "set; write tiny() by hand", category="config")
    processor_cls = _processor_class(resolved.model_type, config_cls)
    if processor_cls is None:
        raise ScaffoldError(f"transformers has no processor class for {resolved.model_type!r}; write tiny()'s "
                            "processor by hand", category="processor")
    named, literals, optional = tokens_in_source(processor_cls)
    if "image_token" not in optional:
        named.setdefault("image_token", "<image>")
    # Config fields holding a token id: the processor token of the same stem, else a new one.
    token_fields: dict[str, str] = {}
    for key in defaults.to_dict():
        match = _TOKEN_FIELD.match(key)
        if match is None or key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            continue
        stem = match.group(1)
        token = named_token(stem, named) or optional.get(f"{stem}_token") or f"<|{stem}|>"
        token_fields[key] = token
        if token not in named.values() and token not in optional.values():
            named[f"{stem}_token"] = token
    # Token ids the model code reads off its config that the config class leaves out
    # (`config.vision_start_token_id`): set where the processor names that token.
    for key in dict.fromkeys(re.findall(r"config\.(\w+_token_(?:id|index))\b", modeling_source(config_cls))):
        if not hasattr(defaults, key) and (token := named_token(_TOKEN_FIELD.match(key).group(1), named)):
            token_fields[key] = token
    literals = list(dict.fromkeys([*optional.values(), *(t for t in literals if t not in named.values())]))
    text_class = _text_config_class(config_cls, text_key, text_default).__name__
    text_overrides = vision_language_text_values(text_class, TINY_TEXT_SHAPES, config_cls)
    if (getattr(text_default, "sliding_window", 0) is None and "sliding_window" not in text_overrides
            and modeling_reads(type(text_default), "sliding_attention")):
        # Model code that builds a sliding-window mask whatever its layers use: a window
        # wider than any tiny sequence, the same as none.
        text_overrides["sliding_window"] = 4096
    vision = {"model_type": getattr(vision_default, "model_type", "") or None, **composite_tower_values(vision_default),
              **tiny_vision_values(vision_default, getattr(text_default, "hidden_size", None))}
    vision = {k: v for k, v in vision.items() if v is not None}
    top_tied = {getattr(text_default, "hidden_size", -1): TINY_TEXT_SHAPES["hidden_size"]}
    vision_hidden = getattr(vision_default, "hidden_size", None)
    if isinstance(vision_hidden, int):
        tiny_hidden = vision.get(dict(getattr(vision_default, "attribute_map", {})).get(
            "hidden_size", "hidden_size"), vision_hidden)
        top_tied[vision_hidden] = tiny_hidden
        # The tower's width after merging merge x merge patches into one token (their
        # channels stacked): a projector input of that width follows the tiny tower's.
        for key, merge in vision_default.to_dict().items():
            if "merge" in key and type(merge) is int and merge > 1:
                top_tied.setdefault(vision_hidden * merge * merge, tiny_hidden * merge * merge)
    top = {k: v for k, v in shrink_values(defaults, {}, tied=top_tied).items()
           if k not in (text_key, resolved.vision_config_key) and (text_key is not None or k not in text_overrides)}
    if isinstance(defaults.to_dict().get("hidden_size"), int) and text_key is not None:
        # A composite config's own width is its text model's, even where the
        # defaults disagree (a 1536-wide top level over a 4096-wide text default).
        top["hidden_size"] = text_overrides.get("hidden_size", TINY_TEXT_SHAPES["hidden_size"])
    # A top-level field that mirrors a tower field (same name, same default) is copied
    # onto the tower by the config class (`insert_layer_id`): it takes the shrunk value,
    # or the class writes the full-size one back. The standard shapes are left out: a
    # top-level depth or width is the text model's.
    own_top, own_vision = defaults.to_dict(), vision_default.to_dict()
    for key, value in vision.items():
        if (key not in top and key not in TINY_VISION_SHAPES and key in own_top and key in own_vision
                and own_top[key] == own_vision[key] and own_top[key] != value):
            top[key] = value
    # Tower layers the projector reads (`vision_feature_layer(s)`), kept inside the tiny
    # tower's hidden states (its depth plus the embeddings).
    depth = vision.get("num_hidden_layers", TINY_VISION_SHAPES["num_hidden_layers"])
    for key, value in defaults.to_dict().items():
        if "feature_layer" in key and key not in top:
            inside = [min(max(v, -(depth + 1)), depth) if type(v) is int else v for v in (
                value if isinstance(value, list) else [value])]
            if inside != (value if isinstance(value, list) else [value]):
                top[key] = inside if isinstance(value, list) else inside[0]
    # A third sub-config between tower and text model (a Q-Former) shrinks like the tower.
    for key in getattr(config_cls, "sub_configs", {}) or {}:
        sub = getattr(defaults, key, None)
        if key not in (text_key, resolved.vision_config_key) and hasattr(sub, "to_dict") and sub is not text_default:
            values = shrink_values(sub, TINY_VISION_SHAPES, tied=top_tied, layer_indexes=True)
            top[key] = {"model_type": getattr(sub, "model_type", None), **values} if getattr(
                sub, "model_type", None) else values
    plan = MediaPlan(
        vision_key=resolved.vision_config_key, top_text_key=text_key, vision=vision, text_config_class=text_class,
        text_overrides=text_overrides, named_tokens=named, token_fields=token_fields, top=top,
        processor_class=processor_cls.__name__, sub_processors={},
        processor_kwargs={}, literals=literals,
    )
    tokenizer, config = build_config(resolved, plan)
    config = _with_unset_sizes(resolved, plan, config_cls, config)
    _plan_processor(resolved, plan, processor_cls, config)
    processor = build_processor(plan, tokenizer, config)
    try:
        plan.image_placeholder = find_placeholder(processor, tokenizer, plan, "image")
    except ScaffoldError as exc:
        plan.image_placeholder = unexpanded_placeholder(resolved.model_class, config, processor, plan)
        if plan.image_placeholder is None:
            raise exc
    if "video_processor" in plan.sub_processors:
        plan.video_placeholder = find_placeholder(processor, tokenizer, plan, "video")
    tokenizer, config = build_config(resolved, plan)  # the id fields may point elsewhere now
    processor = build_processor(plan, tokenizer, config)
    plan.flat_images = _wants_flat_images(processor, plan.image_placeholder)
    tokenizer, config, processor = fit_image_size(resolved, plan, tokenizer, config, processor)
    if _add_vllm_fields(resolved, plan, config):
        tokenizer, config = build_config(resolved, plan)
    return TinyInputs(config=config, media=plan)


def _text_config_class(config_cls, text_key: str | None, text_default):
    """The class of the tiny text config: the default's, unless the composite's own model
    package defines the one config class that declares itself that sub-config
    (`base_config_key == text_key`) and the default is not one of it. A composite whose
    default text config is a generic one (a Llama config) while its text model reads
    fields only its own text config class has (`attention_multiplier`) builds only from
    its own class."""
    from transformers import PretrainedConfig

    own = [cls for cls in _package_classes(config_cls, PretrainedConfig)
           if text_key is not None and getattr(cls, "base_config_key", None) == text_key]
    return own[0] if len(own) == 1 and not isinstance(text_default, own[0]) else type(text_default)


def _with_unset_sizes(resolved: Resolved, plan: MediaPlan, config_cls, config):
    """`config`, or, where the tiny model cannot be built from it, the config with the text
    sizes its default leaves None given tiny values (`tiny_text_values(unset_sizes=True)`),
    if that one builds (`plan.text_overrides` then holds them). A model that needs a
    package not installed (a timm tower) stops here with that cause: every later stage
    (the processor's placeholder search runs the model) would fail on it too and name
    another."""
    try:
        build_tiny(resolved.model_class, config)
        return config
    except ScaffoldError as exc:
        if isinstance(exc.__cause__, ImportError):
            raise
    kept = plan.text_overrides
    plan.text_overrides = {**kept, **{k: v for k, v in vision_language_text_values(
        plan.text_config_class, TINY_TEXT_SHAPES, config_cls, unset_sizes=True).items() if k not in kept}}
    try:
        _, sized = build_config(resolved, plan)
        build_tiny(resolved.model_class, sized)
        return sized
    except ScaffoldError:
        plan.text_overrides = kept
        return config


def _add_vllm_fields(resolved: Resolved, plan: MediaPlan, config) -> bool:
    """Add to `plan` the fields vLLM's model reads that the tiny config (its top level or
    text config) lacks (`mmrl.scaffold.vllm_fields`); whether any was added."""
    text = config.get_text_config(decoder=True)
    architectures = (resolved.model_class, *filter(None, [text_architecture(text)]))
    top = {k: v for k, v in vllm_fields(config, *architectures).items() if k not in plan.top}
    own = {} if text is config else vllm_fields(text, *architectures)
    plan.top.update(top)
    plan.text_overrides.update(own)
    return bool(top or own)


def _plan_processor(resolved: Resolved, plan: MediaPlan, processor_cls, config) -> None:
    """Fill in the processor part of `plan`: sub-processors from transformers' tables
    (sized to the tower), a second tokenizer where one is required, arguments the config
    also holds, and whether the model reads media token types."""
    import transformers
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    vision_config = getattr(config, plan.vision_key)
    vision_values = vision_config.to_dict()
    wanted = init_parameters(processor_cls)
    for argument, table in (("image_processor", IMAGE_PROCESSOR_MAPPING_NAMES),
                            ("video_processor", VIDEO_PROCESSOR_MAPPING_NAMES),
                            ("feature_extractor", FEATURE_EXTRACTOR_MAPPING_NAMES)):
        if argument in wanted:
            cls = _table_class(table, resolved.model_type, processor_cls) or next(
                filter(None, (_table_class(table, t) for t in _sub_config_types(config))), None)
            if cls is not None:
                kwargs = sized_processor_kwargs(cls, vision_values.get("image_size"), vision_values)
                plan.sub_processors[argument] = (cls.__name__, {**kwargs, **_switches_off_to_save(cls, kwargs)})
    # A second tokenizer the processor needs (a Q-Former's) is the same tiny one.
    for name, parameter in wanted.items():
        if name.endswith("tokenizer") and name != "tokenizer" and parameter.default is inspect.Parameter.empty:
            plan.processor_kwargs[name] = "tokenizer"
    for name in wanted:
        if name in _PLUMBING or name.endswith("_token") or name in plan.processor_kwargs:
            continue
        field = re.sub(r"(?<![a-z])img(?![a-z])", "image", name)  # `img_size` is the config's `image_size`
        if field in vision_values:
            plan.processor_kwargs[name] = f"config.{plan.vision_key}.{field}"
        elif field in config.to_dict():
            plan.processor_kwargs[name] = f"config.{field}"
    # A per-image token count the processor cannot do without (None by default): the
    # tower's patch grid, until the tiny tower's own count replaces it (fit_image_size).
    key = plan.vision_key
    for name in per_image_count_arguments(processor_cls):
        if (name not in plan.processor_kwargs and wanted[name].default is None
                and type(vision_values.get("image_size")) is int and type(vision_values.get("patch_size")) is int):
            plan.processor_kwargs[name] = f"(config.{key}.image_size // config.{key}.patch_size) ** 2"
    # A patch size the processor cannot expand an image without (None by default) and no
    # config field gives (a timm tower has none): a stand-in that lets the placeholder
    # search see the expansion, replaced by the tiny tower's measured grid.
    for name, parameter in wanted.items():
        if name.endswith("patch_size") and parameter.default is None and name not in plan.processor_kwargs:
            plan.processor_kwargs[name], plan.unset_patch = str(STAND_IN_PATCH), name
            break
    model_inputs = inspect.signature(getattr(transformers, resolved.model_class).forward).parameters
    if "mm_token_type_ids" in model_inputs:  # media token types the model reads, if the processor makes them
        plan.text_kwargs = {"return_mm_token_type_ids": True}


def _sub_config_types(config) -> list[str]:
    """Model types of the composite's sub-configs: those the tiny config holds, then those
    its configuration module builds by name (`CONFIG_MAPPING["parakeet_encoder"](...)`), which
    include a part the default config leaves out (an audio encoder, None by default). A
    sub-processor the type's own table entry lacks is that part's (a Parakeet encoder's
    feature extractor, for the processor's `feature_extractor`)."""
    import inspect as inspect_module

    held = [getattr(getattr(config, key, None), "model_type", None)
            for key in getattr(type(config), "sub_configs", {}) or {}]
    try:
        source = inspect_module.getsource(inspect_module.getmodule(type(config)))
    except (OSError, TypeError):
        source = ""
    named = re.findall(r"""CONFIG_MAPPING\[\s*["'](\w+)["']\s*\]""", source)
    return list(dict.fromkeys(t for t in [*held, *named] if t))


def _switches_off_to_save(cls, kwargs: dict[str, Any]) -> dict[str, bool]:
    """A sub-processor that cannot be saved with its defaults (a feature that needs a file
    its checkpoint ships, a font to draw timestamps with): the switches its error names
    in backticks ("or disable `draw_on_frames`": boolean attributes of the instance, on by
    default) turned off, where it then saves; else nothing. The generated tests save and
    reload the tiny model."""
    import tempfile

    def save_error(values) -> str | None:
        try:
            with tempfile.TemporaryDirectory() as folder:
                cls(**values).save_pretrained(folder)
        except Exception as exc:  # a processor's save may raise anything
            return str(exc)
        return None

    try:
        instance = cls(**kwargs)
    except Exception:
        return {}
    message = save_error(kwargs)
    if message is None:
        return {}
    switches = {name: False for name in re.findall(r"`(\w+)`", message) if getattr(instance, name, None) is True}
    return switches if switches and save_error({**kwargs, **switches}) is None else {}


def _wants_flat_images(processor, placeholder: str | None) -> bool:
    """Whether the processor refuses one image list per prompt (`[[image]]`) but takes
    the same image in a flat list."""
    from PIL import Image

    image = Image.new("RGB", (224, 168), (9, 99, 199))

    def takes(images) -> bool:
        try:
            processor(text=[f"look {placeholder or ''} here"], images=images, return_tensors="pt")
        except Exception:
            return False
        return True

    return not takes([[image]]) and takes([image])
