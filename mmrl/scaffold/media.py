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
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from mmrl.scaffold.base import TINY_VISION_SHAPES, Resolved, ScaffoldError
from mmrl.scaffold.shrink import (
    _OUTPUT_WIDTH, TinyInputs, _modeling_reads, _modeling_source, _one_line, build_text_config, build_tiny,
    shrink_values, tiny_text_values, tiny_vision_values,
)
from mmrl.tiny import TINY_TEXT_SHAPES

_TOKEN_FIELD = re.compile(r"^(.*)_token_(id|index)$")
# Processor __init__ arguments that are sub-processors or plumbing, never config values.
_PLUMBING = {"self", "image_processor", "tokenizer", "video_processor", "audio_processor", "feature_extractor",
             "chat_template", "kwargs", "args"}


def tiny_text_tokenizer(named_tokens: dict[str, str] | None = None, chat_template: str | None = None,
                        special_tokens: tuple[str, ...] = (), bos_token: str | None = None):
    """The ChatML character tokenizer every scaffolded tiny model starts from."""
    from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS
    from mmrl.tiny import char_tokenizer

    return char_tokenizer(special_tokens=(*CHATML_SPECIAL_TOKENS, *special_tokens), named_tokens=named_tokens,
                          eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template or CHATML,
                          bos_token=bos_token)


@dataclass
class MediaPlan:
    """How the tiny vision-language model and its processor are put together; the
    adapter's `tiny()` is rendered from this."""

    vision_key: str
    top_text_key: str
    vision: dict[str, Any]
    text_config_class: str
    text_overrides: dict[str, Any]
    named_tokens: dict[str, str]  # tokenizer attribute -> token
    token_fields: dict[str, str]  # config field -> token whose id it holds
    top: dict[str, Any]  # other top-level config values
    processor_class: str | None
    sub_processors: dict[str, tuple[str, dict[str, Any]]]  # argument -> (class, kwargs)
    processor_kwargs: dict[str, str]  # argument -> expression over `config`
    literals: list[str] = field(default_factory=list)  # other special tokens the processor's code names
    text_kwargs: dict[str, Any] = field(default_factory=dict)  # what the processing asks the processor for
    flat_images: bool = False  # the processor takes one flat image list, not one list per prompt
    image_placeholder: str | None = None
    video_placeholder: str | None = None
    notes: list[str] = field(default_factory=list)


def _init_parameters(cls) -> dict[str, Any]:
    try:
        return dict(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return {}


def _processor_class(model_type: str, config_cls=None):
    """The type's processor class: transformers' processor table, else the one processor
    class its own model package defines."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if name and hasattr(transformers, name):
        return getattr(transformers, name)
    found = _package_classes(config_cls, transformers.ProcessorMixin)
    return found[0] if len(found) == 1 else None


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


def _tokens_in_source(processor_cls) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """(named tokens, literal special tokens, optional tokens) the processor's code and
    defaults use. Optional tokens are tokenizer attributes the processor only reads when
    the tokenizer has them (`hasattr(tokenizer, "image_token")`), making its own token
    otherwise: the tiny tokenizer leaves them unset, as released tokenizers do, and holds
    the processor's own token as a plain special token."""
    from transformers import TokenizersBackend

    named: dict[str, str] = {}
    for name, parameter in _init_parameters(processor_cls).items():
        if name.endswith("_token") and isinstance(parameter.default, str):
            named[name] = parameter.default
    literals: list[str] = []
    try:
        source = inspect.getsource(inspect.getmodule(processor_cls))
    except (OSError, TypeError):
        source = ""
    optional: dict[str, str] = {}
    for attribute in re.findall(r"""hasattr\(\s*(?:self\.)?tokenizer\s*,\s*["'](\w+_token)["']\s*\)""", source):
        if attribute in named:
            continue
        own = re.search(rf"""self\.{attribute}\s*=\s*AddedToken\(\s*["']([^"']+)["']""", source)
        optional[attribute] = own.group(1) if own else (_class_default(processor_cls, attribute)
                                                        or f"<{attribute.removesuffix('_token')}>")
    # Tokens the processor fixes in its own code (`self.image_token = "<|IMAGE_PAD|>"`).
    for attribute, literal in re.findall(r"""self\.(\w+_token)\s*=\s*["'](<[^"'\s]{1,40}>)["']""", source):
        if attribute not in named and attribute not in optional:
            named[attribute] = literal
    for attribute in re.findall(r"tokenizer\.(\w+_token)\b", source):
        # Attributes every tokenizer has (bos_token, the add_bos_token switch) are not new tokens.
        if attribute not in named and attribute not in optional and not hasattr(TokenizersBackend, attribute) and (
                attribute not in ("pad_token", "eos_token", "bos_token", "unk_token")):
            default = _class_default(processor_cls, attribute)
            named[attribute] = default or f"<|{attribute.removesuffix('_token')}|>"
    # A processor token that is a tokenizer token under another name
    # (`self.image_token = tokenizer.context_image_token`) is that token, unless the
    # processor also reads the tokenizer's own attribute of that name (then the two differ).
    for attribute, target in re.findall(r"self\.(\w+_token)\s*=\s*(?:self\.)?tokenizer\.(\w+_token)\b", source):
        if attribute != target and target in named and not re.search(rf"tokenizer\.{attribute}\b", source):
            named[attribute] = named[target]
    for literal in re.findall(r"""["'](<[^<>"'\s{}]{1,40}>)["']""", source):
        if literal not in literals and literal not in named.values():
            literals.append(literal)
    return named, literals, optional


def _class_default(cls, attribute: str) -> str | None:
    value = getattr(cls, attribute, None)
    return value if isinstance(value, str) else None


# No image processor's edge is longer: larger `shortest_edge` / `longest_edge` values
# are pixel areas.
_LONGEST_EDGE = 8192


def _sized(processor_cls, image_size: int | None, vision: dict[str, Any] | None = None) -> dict[str, Any]:
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


def tiny_vision_language(resolved: Resolved) -> TinyInputs:
    """The tiny config and processor of a vision-language type, and the plan rendering
    needs to rebuild them."""
    import transformers

    config_cls = getattr(transformers, resolved.config_class)
    try:
        defaults = config_cls()
    except Exception as exc:
        raise ScaffoldError(f"{resolved.config_class}() fails with its own defaults ({_one_line(exc)}); write tiny() "
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
    named, literals, optional = _tokens_in_source(processor_cls)
    if "image_token" not in optional:
        named.setdefault("image_token", "<image>")
    # Config fields holding a token id: the processor token of the same stem, else a new one.
    token_fields: dict[str, str] = {}
    for key in defaults.to_dict():
        match = _TOKEN_FIELD.match(key)
        if match is None or key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            continue
        stem = match.group(1)
        token = _named_token(stem, named) or optional.get(f"{stem}_token") or f"<|{stem}|>"
        token_fields[key] = token
        if token not in named.values() and token not in optional.values():
            named[f"{stem}_token"] = token
    # Token ids the model code reads off its config that the config class leaves out
    # (`config.vision_start_token_id`): set where the processor names that token.
    for key in dict.fromkeys(re.findall(r"config\.(\w+_token_(?:id|index))\b", _modeling_source(config_cls))):
        if not hasattr(defaults, key) and (token := _named_token(_TOKEN_FIELD.match(key).group(1), named)):
            token_fields[key] = token
    literals = list(dict.fromkeys([*optional.values(), *(t for t in literals if t not in named.values())]))
    text_class = type(text_default).__name__
    text_overrides = _text_values(text_class, TINY_TEXT_SHAPES, config_cls)
    if (getattr(text_default, "sliding_window", 0) is None and "sliding_window" not in text_overrides
            and _modeling_reads(type(text_default), "sliding_attention")):
        # Model code that builds a sliding-window mask whatever its layers use: a window
        # wider than any tiny sequence, the same as none.
        text_overrides["sliding_window"] = 4096
    vision = {"model_type": getattr(vision_default, "model_type", "") or None,
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
    _plan_processor(resolved, plan, processor_cls, config)
    processor = build_processor(plan, tokenizer, config)
    try:
        plan.image_placeholder = find_placeholder(processor, tokenizer, plan, "image")
    except ScaffoldError as exc:
        plan.image_placeholder = _unexpanded_placeholder(resolved.model_class, config, processor, plan)
        if plan.image_placeholder is None:
            raise exc
    if "video_processor" in plan.sub_processors:
        plan.video_placeholder = find_placeholder(processor, tokenizer, plan, "video")
    tokenizer, config = build_config(resolved, plan)  # the id fields may point elsewhere now
    processor = build_processor(plan, tokenizer, config)
    plan.flat_images = _wants_flat_images(processor, plan.image_placeholder)
    tokenizer, config, processor = _fit_image_size(resolved, plan, tokenizer, config, processor)
    return TinyInputs(config=config, media=plan)


def _text_values(text_class: str, shapes: dict[str, int], config_cls) -> dict[str, Any]:
    """The shrunk text values; for a composite that is its own text config, without its
    sub-configs (the tower and any third one are shrunk as towers, not as text)."""
    values = tiny_text_values(text_class, shapes)
    if text_class != config_cls.__name__:
        return values
    return {k: v for k, v in values.items() if k not in (getattr(config_cls, "sub_configs", {}) or {})}


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
    wanted = _init_parameters(processor_cls)
    for argument, table in (("image_processor", IMAGE_PROCESSOR_MAPPING_NAMES),
                            ("video_processor", VIDEO_PROCESSOR_MAPPING_NAMES),
                            ("feature_extractor", FEATURE_EXTRACTOR_MAPPING_NAMES)):
        if argument in wanted:
            cls = _table_class(table, resolved.model_type, processor_cls)
            if cls is not None:
                kwargs = _sized(cls, vision_values.get("image_size"), vision_values)
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
    # tower's patch grid, until the tiny tower's own count replaces it (_fit_image_size).
    key = plan.vision_key
    for name, parameter in wanted.items():
        if (name not in plan.processor_kwargs and parameter.default is None and _COUNT_ARGUMENT.search(name)
                and type(vision_values.get("image_size")) is int and type(vision_values.get("patch_size")) is int):
            plan.processor_kwargs[name] = f"(config.{key}.image_size // config.{key}.patch_size) ** 2"
    model_inputs = inspect.signature(getattr(transformers, resolved.model_class).forward).parameters
    if "mm_token_type_ids" in model_inputs:  # media token types the model reads, if the processor makes them
        plan.text_kwargs = {"return_mm_token_type_ids": True}


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


def build_config(resolved: Resolved, plan: MediaPlan):
    import transformers

    # Processors that prepend a begin-of-text token read it off the tokenizer.
    tokenizer = tiny_text_tokenizer(named_tokens=plan.named_tokens, special_tokens=tuple(plan.literals),
                                    bos_token="<|endoftext|>")
    values = {plan.vision_key: dict(plan.vision), **plan.top}
    values.update({k: tokenizer.convert_tokens_to_ids(t) for k, t in plan.token_fields.items()})
    if plan.top_text_key is None:  # the composite is its own text config
        return tokenizer, build_text_config(plan.text_config_class, tokenizer, {**plan.text_overrides, **values})
    text = build_text_config(plan.text_config_class, tokenizer, plan.text_overrides)
    values[plan.top_text_key] = text.to_dict()
    try:
        config = getattr(transformers, resolved.config_class)(**values)
    except Exception as exc:
        raise ScaffoldError(f"{resolved.config_class} rejects the shrunk values ({_one_line(exc)}); write tiny() by "
                            "hand with values it accepts", category="config") from exc
    return tokenizer, config


def build_processor(plan: MediaPlan, tokenizer, config):
    """The tiny processor; the chat template places the placeholder that works."""
    import transformers

    from mmrl.tiny import as_loaded

    subs = {}
    for argument, (cls_name, kwargs) in plan.sub_processors.items():
        try:
            sub = getattr(transformers, cls_name)(**kwargs)
        except Exception as exc:
            raise ScaffoldError(f"{cls_name}({kwargs}) fails ({_one_line(exc)})", category="processor") from exc
        subs[argument] = as_loaded(sub) if argument == "image_processor" else sub
    kwargs = {name: eval(expression, {"config": config, "tokenizer": tokenizer})
              for name, expression in plan.processor_kwargs.items()}
    try:
        processor = getattr(transformers, plan.processor_class)(tokenizer=tokenizer, **subs, **kwargs)
    except Exception as exc:
        raise ScaffoldError(f"{plan.processor_class} cannot be built from the tiny tokenizer and its default "
                            f"sub-processors ({_one_line(exc)}); write tiny() by hand", category="processor") from exc
    return processor


# The words token names use for the two ends of a frame.
_FRAME_WORDS = {"start": "end", "begin": "end", "bos": "eos"}


def _named_token(stem: str, named: dict[str, str]) -> str | None:
    """The named token for a config field's stem (`vision_start` for
    `vision_start_token_id`), also where the processor spells the frame word differently
    (`vision_bos_token`)."""
    head, _, word = stem.rpartition("_")
    ends = tuple(dict.fromkeys(_FRAME_WORDS.values()))
    twins = next((g for g in (tuple(_FRAME_WORDS), ends) if word in g), ()) if head else ()
    for spelling in dict.fromkeys([stem, *(f"{head}_{w}" for w in twins)]):
        token = named.get(f"{spelling}_token") or named.get(spelling)
        if token:
            return token
    return None


def _frames(named: dict[str, str]) -> list[tuple[str, str]]:
    """(start, end) token pairs among the named tokens: `vision_start` / `vision_end`,
    `image_begin` / `image_end`, `vision_bos` / `vision_eos` (names that differ only in
    the frame word)."""
    from mmrl.processors.templates import CHATML_SPECIAL_TOKENS

    pairs = []
    for name, start in named.items():
        for word, end_word in _FRAME_WORDS.items():
            if word in name:
                end = named.get(name.replace(word, end_word))
                # The chat template's message markers frame messages, not media.
                if end is not None and end != start and not {start, end} & set(CHATML_SPECIAL_TOKENS):
                    pairs.append((start, end))
    return pairs


def find_placeholder(processor, tokenizer, plan: MediaPlan, kind: str) -> str | None:
    """The text that, written in a prompt beside one image (or video), the processor
    expands: the processor's own `*_token` for the kind inside a start/end frame the
    processor does not add itself (so that two media in a row stay two runs), else that
    token alone, then every other named token. The token it expands into most often is
    the one the model counts, so the config's id field for the kind is pointed at it."""
    from PIL import Image

    field = next((k for k in plan.token_fields if k.startswith(kind)), None)
    own = [t for name, t in plan.named_tokens.items() if name.startswith(kind)]
    specials = list(dict.fromkeys(list(plan.named_tokens.values()) + plan.literals))
    frames = _frames(plan.named_tokens)
    framed = [f"{a}{t}{b}" for t in own for a, b in frames if t not in (a, b)]
    candidates = list(dict.fromkeys(framed + own + specials))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    image = Image.new("RGB", (224, 168), (120, 30, 200))
    media = {"images": [image]} if kind == "image" else {"videos": [[image] * 4]}
    errors: list[str] = []

    def counted(token: str) -> dict[str, int]:
        row = processor(text=[f"look {token} here"], return_tensors="pt", **media)["input_ids"][0].tolist()
        return {t: row.count(i) for t, i in ids.items()}

    single = None
    try:  # what the processor inserts on its own, with no placeholder in the text
        alone = counted("")
    except Exception:
        alone = None
    for token in candidates:
        try:
            counts = counted(token)
        except Exception as exc:
            errors.append(f"{token}: {_one_line(exc, 120)}")
            continue
        if token in framed and any(counts.get(f) != 1 for frame in frames for f in frame if f in token):
            continue  # the processor frames media itself: a frame in the text would double it
        expanded = max(counts, key=lambda t: counts[t])
        if alone is not None and counts[expanded] == alone[expanded] + (expanded == token):
            continue  # passed through unexpanded beside what the processor inserts itself
        if counts[expanded] > 1 or counts[expanded] == 1 and expanded not in token:
            if field is not None:
                plan.token_fields[field] = expanded
            return token
        if alone is None and counts.get(token) == 1 and single is None:
            single = token  # required once per image and kept as one token (cross-attention models)
    if single is not None:
        if field is not None:
            plan.token_fields[field] = single
        return single
    if alone is not None and max(alone.values(), default=0) > 1:
        # The processor places the media tokens itself (before the text): no placeholder.
        if field is not None:
            plan.token_fields[field] = max(alone, key=lambda t: alone[t])
        return ""
    if kind == "image":
        raise ScaffoldError(f"no special token ({', '.join(candidates[:6])}) is expanded by {plan.processor_class} "
                            "beside an image" + (f" (first error: {errors[0]})" if errors else "")
                            + "; write the chat template by hand", category="processor")
    return None


def _unexpanded_placeholder(model_class: str, config, processor, plan: MediaPlan) -> str | None:
    """The image placeholder for a processor that expands no token (the released chat
    template writes them out): none, where the model reads the image by cross-attention
    and runs without one; else the kind's own token written once per image feature the
    tiny model makes, where that runs. None when neither does."""
    import torch
    from PIL import Image

    if runs_with_image(model_class, config, processor, "") is None:
        return ""
    own = [t for name, t in plan.named_tokens.items() if name.startswith("image")]
    if not own:
        return None
    try:  # how many features the tiny model makes of one image, at two sizes
        model = build_tiny(model_class, config)
        accepted = inspect.signature(model.get_image_features).parameters
        counts = set()
        for size in ((224, 168), (56, 56)):
            inputs = processor(text=["look here"], images=[Image.new("RGB", size, (9, 99, 199))], return_tensors="pt")
            media = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items() if k in accepted}
            with torch.no_grad():
                features = model.get_image_features(**media)
            features = getattr(features, "pooler_output", features)
            features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
            counts.add(features.numel() // features.shape[-1])
    except Exception:
        return None
    if len(counts) != 1:  # the count follows the image size: no fixed template can spell it
        return None
    count = counts.pop()
    # The token the config's id field already names (the config was built with it).
    field = next((k for k in plan.token_fields if k.startswith("image")), None)
    token = plan.token_fields[field] if field is not None else own[0]
    if count > 0 and runs_with_image(model_class, config, processor, token * count) is None:
        return token * count
    return None


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


def runs_with_image(model_class: str, config, processor, placeholder: str | None,
                    text_kwargs: dict[str, Any] | None = None) -> str | None:
    """None when the tiny model runs a forward/backward pass on one processed image
    beside `placeholder`, else the error in one line."""
    from PIL import Image

    try:
        model = build_tiny(model_class, config)
        inputs = processor(text=[f"look {placeholder} here"], images=[Image.new("RGB", (224, 168), (9, 99, 199))],
                           return_tensors="pt", **(text_kwargs or {}))
        inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}  # as mmrl's processing
        accepted = inspect.signature(model.forward).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            inputs = {k: v for k, v in inputs.items() if k in accepted}
        model(**{**inputs, "labels": inputs["input_ids"]}).loss.backward()
    except Exception as exc:
        return _one_line(exc)
    return None


# Text widths to try when the defaults do not run: wider heads for model code that
# splits a head into fixed rotary sections (multi-axis rope defaults written in code).
VLM_TEXT_CANDIDATES = (
    {},
    {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
     "head_dim": 128},
)
# Image sizes to try, besides multiples of the default: common tower sizes.
COMMON_IMAGE_SIZES = (224, 256, 336, 384, 448, 512, 896)


def _fit_image_size(resolved: Resolved, plan: MediaPlan, tokenizer, config, processor):
    """Default configs are not always one checkpoint's, and processors learn some counts
    only from a checkpoint. When the tiny model does not run on one image, try, in turn:
    wider text heads (model code that fixes rotary sections), the tower's `hidden_size` as
    the width it projects into the text model, one more image token per image than the
    processor's default (a class token), and other image sizes (vision tower and image
    processor together); keep the first combination that runs, else the defaults (verify
    then says why)."""
    import itertools

    import transformers

    from mmrl.tiny import TINY_TEXT_SHAPES

    if runs_with_image(resolved.model_class, config, processor, plan.image_placeholder, plan.text_kwargs) is None:
        return tokenizer, config, processor
    base = getattr(getattr(config, plan.vision_key), "image_size", None)
    sizes = [None]
    if isinstance(base, int):
        sizes += list(dict.fromkeys(s for s in (base * 2, base * 4, base // 2, *COMMON_IMAGE_SIZES) if s != base))
    processor_cls = getattr(transformers, plan.processor_class)
    counts = [{}] + [{name: str(parameter.default + 1)} for name, parameter in _init_parameters(processor_cls).items()
                     if type(parameter.default) is int and parameter.default in (0, 1) and "token" in name]
    count_arguments = _per_image_counts(processor_cls)
    saved = (dict(plan.vision), dict(plan.sub_processors), dict(plan.text_overrides), dict(plan.processor_kwargs))
    for text_shapes, projects, count, size in itertools.product(VLM_TEXT_CANDIDATES, (False, True), counts, sizes):
        if not (text_shapes or projects or count or size):
            continue  # the defaults, already tried
        width = (text_shapes or TINY_TEXT_SHAPES)["hidden_size"]
        plan.text_overrides = (_text_values(plan.text_config_class, {**TINY_TEXT_SHAPES, **text_shapes},
                                            getattr(transformers, resolved.config_class))
                               if text_shapes else dict(saved[2]))
        plan.vision = dict(saved[0])
        plan.vision.update({k: width for k in plan.vision if _OUTPUT_WIDTH.search(k)})
        if projects:
            plan.vision["hidden_size"] = width
            if "head_dim" in plan.vision:
                plan.vision["head_dim"] = width // plan.vision.get("num_attention_heads", 2)
        plan.processor_kwargs = {**saved[3], **count}
        plan.sub_processors = dict(saved[1])
        if size is not None:
            plan.vision["image_size"] = size
            vision_values = getattr(config, plan.vision_key).to_dict()
            plan.sub_processors = {arg: (name, _sized(getattr(transformers, name), size, vision_values))
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


_COUNT_ARGUMENT = re.compile(r"seq_len|seq_length|num_image_tokens|tokens_per_image|image_tokens_count")


def _per_image_counts(processor_cls) -> list[str]:
    """The processor's integer arguments that fix how many tokens an image gets."""
    return [name for name, parameter in _init_parameters(processor_cls).items()
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
