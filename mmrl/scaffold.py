"""`mmrl add-model`: scaffold a model family from what transformers already knows.

The scaffold resolves an HF `model_type` through transformers' auto tables (no remote
code, no network), builds the family's tiny random-init model on CPU, reads the layout
off the instantiated modules (decoder stack, embeddings, lm_head, vision tower,
projector, block classes, linear leaves for LoRA, rope) and writes an adapter that
declares exactly that. It then imports the written adapter, runs the zoo's quick
numerical checks on it and declares only the capabilities that passed.

    mmrl add-model olmo2                       # models/olmo2.py, tests/test_family_olmo2.py, docs
    mmrl add-model olmo2 --out ../my_families  # an out-of-tree plugin package instead
    mmrl add-model olmo2 --dry-run             # print what would be written

Nothing here knows a family by name: everything comes from transformers' tables and
the modules of the tiny model.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import shutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mmrl.adapter import ATTN_AND_MLP, DECODER_PARTS, VISION_TOWER_PARTS, Capabilities, Parts

# Shapes of a tiny vision tower: small enough for CPU, and the depth of one block.
TINY_VISION_SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
# The zoo's tolerance (fp32 logits, max absolute difference).
TOLERANCE = 2e-4
# Capabilities the quick check decides; the rest stay at their defaults for the probes.
CHECKED = ("generation", "padding_free", "gradient_checkpointing", "lora_language", "lora_vision",
           "single_image", "multi_image", "media_sharing")
# Checked and written for vision-language families only (text families have no media).
VISION_ONLY = ("lora_vision", "single_image", "multi_image", "media_sharing")


class ScaffoldError(ValueError):
    """The model type cannot be scaffolded (unknown, already registered, files exist)."""


@dataclass(frozen=True)
class Resolved:
    """A model type as transformers' auto tables name it."""

    model_type: str
    config_class: str  # "ConfigName" in the transformers namespace
    model_class: str
    is_vision_language: bool


@dataclass
class Discovery:
    """What inspecting the tiny model found; the adapter is rendered from this."""

    resolved: Resolved
    family: str
    class_name: str
    parts: Parts
    decoder_layer: str
    vision_block: str | None
    language_leaves: tuple[str, ...]
    vision_leaves: tuple[str, ...]
    rope: Any
    vllm_architecture: str | None
    vllm_note: str
    text_config_class: str | None = None
    vision_defaults: dict[str, Any] = field(default_factory=dict)
    vision_model_type: str | None = None
    image_token: str | None = None
    image_token_field: str | None = None
    processor_class: str | None = None
    image_processor_class: str | None = None
    processor_kwargs: dict[str, str] = field(default_factory=dict)
    image_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    fill_in: list[str] = field(default_factory=list)


@dataclass
class Layout:
    """Where the files of a scaffolded family go."""

    root: Path
    adapter: Path
    processing: Path | None
    test: Path
    extra: dict[Path, str]  # path -> content of the package/docs files
    appends: dict[Path, str]  # existing files that get a line added
    adapter_module: str
    processing_module: str | None
    in_tree: bool


@dataclass
class Result:
    family: str
    written: list[Path]
    next_command: str
    capabilities: Capabilities | None
    notes: list[str]
    dry_run: bool
    contents: dict[Path, str]


# -- 1. resolve ------------------------------------------------------------------------
def resolve(model_type: str) -> Resolved:
    """The config and model class of `model_type`, from transformers' auto tables."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_class = CONFIG_MAPPING_NAMES.get(model_type)
    if config_class is None:
        close = [t for t in CONFIG_MAPPING_NAMES if model_type.replace("-", "_") in t.replace("-", "_")][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ScaffoldError(f"unknown model type {model_type!r}: transformers has no config for it{hint}")
    vision_language = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    import transformers

    config_cls = getattr(transformers, config_class)
    if vision_language and "vision_config" in getattr(config_cls, "sub_configs", {}):
        return Resolved(model_type, config_class, vision_language, True)
    if causal:
        return Resolved(model_type, config_class, causal, False)
    raise ScaffoldError(
        f"model type {model_type!r} has no causal-LM or image-text-to-text model class in transformers; "
        "mmrl trains generative models only"
    )


def check_unregistered(resolved: Resolved, family: str) -> None:
    from mmrl.registry import families

    registered = families()
    for adapter in registered:
        if resolved.model_type in adapter.model_types:
            raise ScaffoldError(f"model type {resolved.model_type!r} is already registered by family "
                                f"{adapter.family!r} ({type(adapter).__module__})")
        if resolved.model_class in adapter.hf_architectures:
            raise ScaffoldError(f"architecture {resolved.model_class} is already registered by family "
                                f"{adapter.family!r} ({type(adapter).__module__})")
    for adapter in registered:
        if adapter.family == family:
            raise ScaffoldError(f"family {family!r} is already registered ({type(adapter).__module__}); "
                                "pick another name with --family")


def family_name(model_type: str, family: str | None) -> str:
    name = family or model_type.replace("-", "_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ScaffoldError(f"family name {name!r} is not a lower-case Python identifier; pass --family NAME")
    return name


def class_name(resolved: Resolved, family: str) -> str:
    if family == resolved.model_type.replace("-", "_"):
        return resolved.config_class.removesuffix("Config")
    return "".join(part.capitalize() for part in family.split("_"))


# -- 2. inspect ------------------------------------------------------------------------
def tiny_text_tokenizer(named_tokens: dict[str, str] | None = None, chat_template: str | None = None):
    """The ChatML character tokenizer every scaffolded tiny model starts from."""
    from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS
    from mmrl.tiny import char_tokenizer

    return char_tokenizer(special_tokens=CHATML_SPECIAL_TOKENS, named_tokens=named_tokens, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", chat_template=chat_template or CHATML)


def _path_of(model, module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise ScaffoldError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _block_lists(model, prefix: str) -> list[tuple[str, Any]]:
    """ModuleLists under `prefix` whose items are all one class, most parameters first."""
    import torch

    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and _under(name, prefix):
            if len({type(m) for m in module}) == 1 and any(True for _ in module.parameters()):
                found.append((name, module))
    return sorted(found, key=lambda item: -sum(p.numel() for p in item[1].parameters()))


def _linear_leaves(block) -> tuple[str, ...]:
    import torch

    leaves: list[str] = []
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf not in leaves:
            leaves.append(leaf)
    return tuple(leaves)


def vllm_architecture(architecture: str) -> tuple[str | None, str]:
    """(architecture, note) from vLLM's model registry, read as text so that checking
    costs no vLLM import; (None, why) when vLLM is absent or lacks the architecture."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, "vLLM is not installed here, so its registry was not checked"
    registry = Path(spec.submodule_search_locations[0]) / "model_executor" / "models" / "registry.py"
    if not registry.is_file():
        return None, f"vLLM's model registry was not found at {registry}"
    match = re.search(rf'"{re.escape(architecture)}":\s*\(\s*"([^"]+)",\s*"([^"]+)"', registry.read_text())
    if match is None:
        return None, f"vLLM's model registry has no {architecture}"
    module, cls = match.groups()
    backend = " (its Transformers backend)" if module == "transformers" else ""
    return architecture, f"vLLM serves {architecture}{backend}"


def _tiny_text_config(config_class: str, tokenizer):
    from mmrl.tiny import tiny_text_config

    return tiny_text_config(f"transformers:{config_class}", tokenizer)


def inspect_family(resolved: Resolved, family: str) -> Discovery:
    """Build the tiny model on CPU and read the family's layout off its modules."""
    import torch
    import transformers

    from mmrl.rope import RopeSpec

    model_cls = getattr(transformers, resolved.model_class)
    discovery_extra: dict[str, Any] = {}
    if resolved.is_vision_language:
        config, discovery_extra = _tiny_vision_language_config(resolved)
    else:
        config = _tiny_text_config(resolved.config_class, tiny_text_tokenizer())
    with torch.random.fork_rng(devices=[]):
        model = model_cls._from_config(config)
    embed = _path_of(model, model.get_input_embeddings())
    lm_head = _path_of(model, model.get_output_embeddings())
    language = embed.rpartition(".")[0]
    text_config = config.get_text_config(decoder=True)
    decoder_lists = [(n, m) for n, m in _block_lists(model, language) if len(m) == text_config.num_hidden_layers]
    if not decoder_lists:
        raise ScaffoldError(f"{resolved.model_class}: no list of {text_config.num_hidden_layers} decoder layers "
                            f"under {language!r}")
    decoder = decoder_lists[0][1]
    fill_in: list[str] = []
    vision = projector = ()
    vision_block = None
    vision_leaves: tuple[str, ...] = ()
    if resolved.is_vision_language:
        vision, projector, vision_block, vision_leaves = _vision_parts(model, language, fill_in)
    parts = Parts(language=language, embed=embed, lm_head=lm_head, vision=vision or None,
                  projector=projector or None)
    uncovered = _uncovered_parameters(model, parts)
    if uncovered:
        fill_in.append(f"parts: parameters in no part: {', '.join(uncovered[:5])}")
    rope = RopeSpec.from_config(config)
    if rope.is_mrope:
        fill_in.append("position_ids: the config uses multi-axis (mrope) rope; override `position_ids`")
    architecture, note = vllm_architecture(resolved.model_class)
    return Discovery(
        resolved=resolved, family=family, class_name=class_name(resolved, family), parts=parts,
        decoder_layer=type(decoder[0]).__name__, vision_block=vision_block,
        language_leaves=_linear_leaves(decoder[0]), vision_leaves=vision_leaves, rope=rope,
        vllm_architecture=architecture, vllm_note=note, fill_in=fill_in, **discovery_extra,
    )


def _uncovered_parameters(model, parts: Parts) -> list[str]:
    names = []
    paths = [p for _, group in parts.items() for p in group]
    for name, _ in model.named_parameters(remove_duplicate=False):
        if not any(_under(name, p) for p in paths):
            names.append(name)
    return names


def _vision_parts(model, language: str, fill_in: list[str]):
    """(vision paths, projector paths, vision block class, vision linear leaves): the
    vision tower is the sibling of the language model that holds a stack of blocks;
    every other sibling with parameters (and loose parameters beside them) projects."""
    inner_path = language.rpartition(".")[0]
    inner = model.get_submodule(inner_path) if inner_path else model
    prefix = f"{inner_path}." if inner_path else ""
    towers, projector = [], []
    for name, child in inner.named_children():
        path = prefix + name
        if path == language or not any(True for _ in child.parameters()):
            continue
        blocks = _block_lists(model, path)
        size = sum(p.numel() for p in child.parameters())
        (towers if blocks else projector).append((size, path, blocks))
    projector_paths = [path for _, path, _ in projector]
    projector_paths += [prefix + name for name, _ in inner.named_parameters(recurse=False)]
    if not towers:
        fill_in.append("parts.vision / shard_layers: no vision tower with a stack of blocks was found")
        return (), tuple(projector_paths), None, ()
    towers.sort(key=lambda t: -t[0])
    _, vision_path, blocks = towers[0]
    # A second stacked sibling (rare) is treated as part of the projector.
    projector_paths += [path for _, path, _ in towers[1:]]
    if not projector_paths:
        fill_in.append("parts.projector: the projector sits inside the vision tower; name its path")
    block = blocks[0][1][0]
    return (vision_path,), tuple(projector_paths), type(block).__name__, _linear_leaves(block)


# -- 2b. the tiny vision-language model ------------------------------------------------
def _tiny_vision_language_config(resolved: Resolved):
    """A tiny config and what rendering needs to rebuild it: the default text and vision
    sub-configs of the config class, shrunk to the tiny shapes (image and patch sizes
    kept, so the default image processor still fits)."""
    import transformers

    config_cls = getattr(transformers, resolved.config_class)
    defaults = config_cls()
    text_default = defaults.get_text_config(decoder=True)
    vision_default = defaults.vision_config
    text_config_class = type(text_default).__name__
    named, image_token, token_field = _image_token(resolved, defaults)
    tokenizer = tiny_text_tokenizer(named_tokens=named)
    text = _tiny_text_config(text_config_class, tokenizer)
    vision_defaults = {k: getattr(vision_default, k) for k in ("image_size", "patch_size")
                       if getattr(vision_default, k, None) is not None}
    vision = {"model_type": vision_default.model_type, **TINY_VISION_SHAPES, **vision_defaults}
    values = {"text_config": text.to_dict(), "vision_config": vision}
    if token_field:
        values[token_field] = tokenizer.convert_tokens_to_ids(image_token)
    config = config_cls(**values)
    processor_cls = _processor_class(resolved)
    image_processor_class, image_sizes = _image_processor(resolved, vision_defaults.get("image_size"))
    return config, dict(
        text_config_class=text_config_class, vision_defaults=vision_defaults,
        vision_model_type=vision_default.model_type, image_token=image_token, image_token_field=token_field,
        processor_class=processor_cls.__name__ if processor_cls else None,
        image_processor_class=image_processor_class, image_sizes=image_sizes,
        processor_kwargs=_processor_kwargs(processor_cls, config) if processor_cls else {},
    )


def _image_token(resolved: Resolved, defaults) -> tuple[dict[str, str], str, str | None]:
    """The processor's image placeholder text and the config field holding its id."""
    token = "<image>"
    processor_cls = _processor_class(resolved)
    if processor_cls is not None:
        parameter = _init_parameters(processor_cls).get("image_token")
        if parameter is not None and isinstance(parameter.default, str):
            token = parameter.default
    token_field = next((f for f in ("image_token_id", "image_token_index") if hasattr(defaults, f)), None)
    return {"image_token": token}, token, token_field


def _init_parameters(cls) -> dict[str, Any]:
    import inspect

    return dict(inspect.signature(cls.__init__).parameters)


def _processor_class(resolved: Resolved):
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(resolved.model_type)
    return getattr(transformers, name, None) if name else None


def _image_processor(resolved: Resolved, image_size: int | None):
    """(class name, size kwargs) of the model type's image processor, its sizes set to
    the vision tower's `image_size`."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(resolved.model_type) or {}
    name = names.get("torchvision") or names.get("pil") if isinstance(names, dict) else names
    if not name or not hasattr(transformers, name):
        return None, {}
    default = getattr(transformers, name)()
    sizes: dict[str, dict[str, int]] = {}
    for key in ("size", "crop_size"):
        value = getattr(default, key, None)
        if value is None or image_size is None:
            continue
        items = value.items() if isinstance(value, dict) else vars(value).items()
        present = {k: image_size for k, v in items if isinstance(v, int) and k in (
            "height", "width", "shortest_edge", "longest_edge")}
        if present:
            sizes[key] = present
    return name, sizes


# Processor arguments the scaffold fills from the config: the processor needs the same
# value the model reads, so it is taken from the config, not written twice.
def _processor_kwargs(processor_cls, config) -> dict[str, str]:
    skip = {"self", "image_processor", "tokenizer", "video_processor", "chat_template", "kwargs"}
    kwargs = {}
    for name in _init_parameters(processor_cls):
        if name in skip or name.endswith("_token"):
            continue
        if hasattr(config.vision_config, name):
            kwargs[name] = f"config.vision_config.{name}"
        elif name in config.to_dict():
            kwargs[name] = f"config.{name}"
    return kwargs


# -- 3. render -------------------------------------------------------------------------
def _str(value: str) -> str:
    """A string literal in the house's double quotes."""
    return f'"{value}"' if re.fullmatch(r"[^\"\\\n]*", value) else repr(value)


def _tuple(values) -> str:
    values = tuple(values)
    return "(" + ", ".join(_str(v) for v in values) + ("," if len(values) == 1 else "") + ")"


def _call(head: str, args: list[str], indent: str = "    ", width: int = 116) -> str:
    """`head(arg, ...)` on one line when it fits, else its arguments wrapped below."""
    line = f"{head}({', '.join(args)})"
    if len(indent) + len(line) <= width:
        return line
    rows, row = [], ""
    for arg in args:
        if row and len(indent) + 4 + len(row) + len(arg) + 2 > width:
            rows.append(row.rstrip())
            row = ""
        row += arg + ", "
    rows.append(row.rstrip())
    inner = "\n".join(indent + "    " + r for r in rows)
    return f"{head}(\n{inner}\n{indent})"


def _literal_dict(values: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{_str(k)}: {v!r}" for k, v in values.items()) + "}"


def _one_or_tuple(values: tuple[str, ...]) -> str:
    return _str(values[0]) if len(values) == 1 else _tuple(values)


def _parts_source(parts: Parts, imports: set[str]) -> str:
    if parts == DECODER_PARTS:
        imports.add("DECODER_PARTS")
        return "DECODER_PARTS"
    if parts == VISION_TOWER_PARTS:
        imports.add("VISION_TOWER_PARTS")
        return "VISION_TOWER_PARTS"
    if replace(parts, projector=VISION_TOWER_PARTS.projector) == VISION_TOWER_PARTS:
        imports.add("VISION_TOWER_PARTS")
        return f"replace(VISION_TOWER_PARTS, projector={_one_or_tuple(parts.projector)})"
    imports.add("Parts")
    fields = [f"{name}={_one_or_tuple(paths)}" for name, paths in parts.items() if paths]
    return "Parts(\n        " + ", ".join(fields) + ",\n    )"


def _leaves_source(leaves: tuple[str, ...], imports: set[str]) -> str:
    if sorted(leaves) == sorted(ATTN_AND_MLP):
        imports.add("ATTN_AND_MLP")
        return "ATTN_AND_MLP"
    return _tuple(leaves)


def _rope_line(rope) -> str:
    text = f"{rope.scaling} rope, theta {rope.theta:g}"
    if rope.partial_rotary_factor != 1.0:
        text += f", rotating {rope.partial_rotary_factor:g} of each head"
    if rope.per_layer_type:
        text += f", one rope per layer type ({', '.join(t for t, _ in rope.per_layer_type)})"
    if rope.is_mrope:
        text += f", mrope sections {list(rope.mrope_section)}"
    return text


def _capabilities_source(d: Discovery, verified: Capabilities | None, imports: set[str],
                         checked: bool = False) -> list[str]:
    if verified is None:
        why = "the tiny model did not run, see above" if checked else "--no-verify"
        return [f"    # Capabilities: the defaults, not checked while scaffolding ({why});",
                f"    # the zoo tests and `mmrl support-matrix --family {d.family}` verify them."]
    imports.add("Capabilities")
    defaults = Capabilities()
    claims = [f"{name}={getattr(verified, name)}" for name in CHECKED
              if (getattr(verified, name) or getattr(defaults, name))
              and (d.resolved.is_vision_language or name not in VISION_ONLY)]
    return [
        "    # What `mmrl add-model` verified on the tiny model. fsdp2 and critic are claimed by",
        "    # default; claim vllm and sequence_parallel once `mmrl support-matrix --family",
        f"    # {d.family}` verifies them.",
        "    capabilities = " + _call("Capabilities", claims),
    ]


def _base_capabilities(d: Discovery) -> Capabilities:
    if d.resolved.is_vision_language:
        return Capabilities(single_image=True, multi_image=True)
    return Capabilities()


def render_adapter(d: Discovery, layout: Layout, verified: Capabilities | None,
                   processing_ref: str | None = None, checked: bool = False) -> str:
    """The adapter module's source: declarations first, then the tiny model."""
    vlm = d.resolved.is_vision_language
    base = "VisionLanguageAdapter" if vlm else "ModelAdapter"
    adapter_imports = {base, "Rollout", "TinyModel"}
    lines = ["@register_model", f"class {d.class_name}({base}):",
             f"    family = {_str(d.family)}",
             f"    model_types = {_tuple([d.resolved.model_type])}",
             f"    hf_class = \"transformers:{d.resolved.model_class}\""]
    lines.append(f"    parts = {_parts_source(d.parts, adapter_imports)}")
    shard = (d.decoder_layer,) + ((d.vision_block,) if d.vision_block else ())
    lines.append(f"    shard_layers = {_tuple(shard)}")
    if vlm:
        adapter_imports.add("LoraTargets")
        language = _leaves_source(d.language_leaves, adapter_imports)
        lines.append("    lora = " + _call("LoraTargets", [f"language={language}", f"vision={_tuple(d.vision_leaves)}"]))
    elif sorted(d.language_leaves) != sorted(ATTN_AND_MLP):
        adapter_imports.add("LoraTargets")
        lines.append(f"    lora = LoraTargets(language={_tuple(d.language_leaves)})")
    lines += _capabilities_source(d, verified, adapter_imports, checked)
    if processing_ref:
        lines.append(f"    processing = {_str(processing_ref)}")
    lines.append(f"    # {d.vllm_note}.")
    if d.vllm_architecture:
        lines.append(f"    rollout = Rollout(vllm_architecture={_str(d.vllm_architecture)})")
    else:
        lines.append("    rollout = Rollout()")
    lines.append("")
    lines += _tiny_source(d)
    summary = (f'"""{d.class_name} ({"vision-language" if vlm else "text"}, transformers {d.resolved.model_class}): '
               f"scaffolded by `mmrl add-model {d.resolved.model_type}`.")
    layout_text = (f"Layout read off the tiny model: decoder layers {d.decoder_layer}"
                   + (f", vision blocks {d.vision_block}" if d.vision_block else "") + f"; {_rope_line(d.rope)}. "
                   "The tiny tokenizer speaks ChatML; a real checkpoint brings its own chat template.")
    header = [textwrap.fill(summary, 100), "", textwrap.fill(layout_text, 88)]
    if d.fill_in:
        header += ["", "Fill in by hand (the scaffold could not work these out):"]
        header += [textwrap.fill(item, 88, initial_indent="- ", subsequent_indent="  ") for item in d.fill_in]
    header.append('"""')
    imports = ["from dataclasses import replace", ""] if "replace(" in "\n".join(lines) else []
    imports.append("from mmrl.adapter import " + ", ".join(sorted(adapter_imports, key=_import_order)))
    if vlm:
        imports.append("from mmrl.processors.templates import CHATML_SPECIAL_TOKENS")
        imports.append("from mmrl.registry import register_model")
        imports.append("from mmrl.tiny import char_tokenizer, tiny_text_config")
    else:
        imports.append("from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS")
        imports.append("from mmrl.registry import register_model")
        imports.append("from mmrl.tiny import char_tokenizer, tiny_text_config")
    body = "\n".join(header) + "\n\n" + "\n".join(imports) + "\n"
    if vlm:
        body += "\n" + _vision_template_source(d) + "\n"
    return body + "\n\n" + "\n".join(lines) + "\n"


def _import_order(name: str) -> tuple[bool, str]:
    return (not name.isupper(), name)


def _tiny_source(d: Discovery) -> list[str]:
    if d.resolved.is_vision_language:
        return _tiny_vision_source(d)
    source = textwrap.dedent(f"""\
        def tiny(self) -> TinyModel:
            tokenizer = char_tokenizer(
                special_tokens=CHATML_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                chat_template=CHATML,
            )
            config = tiny_text_config("transformers:{d.resolved.config_class}", tokenizer)
            return TinyModel(config=config, processor=tokenizer)
        """)
    return textwrap.indent(source, "    ").rstrip().split("\n")


def _vision_template_source(d: Discovery) -> str:
    return textwrap.dedent(f"""\
        IMAGE_TOKEN = {_str(d.image_token)}
        # ChatML with the processor's image placeholder where an image part stands.
        CHAT_TEMPLATE = (
            "{{% for message in messages %}}"
            "{{{{ '<|im_start|>' + message['role'] + '\\\\n' }}}}"
            "{{% if message['content'] is string %}}{{{{ message['content'] }}}}"
            "{{% else %}}{{% for part in message['content'] %}}"
            "{{% if part['type'] == 'text' %}}{{{{ part['text'] }}}}"
            "{{% elif part['type'] == 'image' %}}{{{{ '{d.image_token}' }}}}"
            "{{% endif %}}{{% endfor %}}{{% endif %}}"
            "{{{{ '<|im_end|>\\\\n' }}}}"
            "{{% endfor %}}"
            "{{% if add_generation_prompt %}}{{{{ '<|im_start|>assistant\\\\n' }}}}{{% endif %}}"
        )""")


def _tiny_vision_source(d: Discovery) -> list[str]:
    indent = " " * 4  # the body of tiny(), before the class indent is added
    vision = [f"model_type={_str(d.vision_model_type)}"]
    vision += [f"{k}={v!r}" for k, v in {**TINY_VISION_SHAPES, **d.vision_defaults}.items()]
    config = ["text_config=text.to_dict()", "vision_config=vision"]
    if d.image_token_field:
        config.append(f"{d.image_token_field}=tokenizer.image_token_id")
    sizes = [f"{k}={_literal_dict(v)}" for k, v in d.image_sizes.items()]
    processor = [f"image_processor=transformers.{d.image_processor_class}({', '.join(sizes)})",
                 "tokenizer=tokenizer", "chat_template=CHAT_TEMPLATE"]
    processor += [f"{k}={v}" for k, v in d.processor_kwargs.items()]
    source = textwrap.dedent(f"""\
        def tiny(self) -> TinyModel:
            import transformers

            tokenizer = char_tokenizer(
                special_tokens=CHATML_SPECIAL_TOKENS, named_tokens={{"image_token": IMAGE_TOKEN}},
                eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
            )
            text = tiny_text_config("transformers:{d.text_config_class}", tokenizer)
            # The default vision tower, shrunk; its image and patch size are kept and the
            # image processor resizes to that image size.
            vision = @VISION@
            config = @CONFIG@
            processor = @PROCESSOR@
            return TinyModel(config=config, processor=processor)
        """)
    width = 112  # 116 less the class indent
    source = (source.replace("@VISION@", _call("dict", vision, indent, width))
              .replace("@CONFIG@", _call(f"transformers.{d.resolved.config_class}", config, indent, width))
              .replace("@PROCESSOR@", _call(f"transformers.{d.processor_class}", processor, indent, width)))
    return textwrap.indent(source, "    ").rstrip().split("\n")


def render_test(d: Discovery, layout: Layout) -> str:
    if layout.in_tree:
        return textwrap.dedent(f'''\
            """The zoo suite (tests/test_zoo.py) for the {d.family} family alone.

                .venv/bin/python -m pytest -q tests/test_family_{d.family}.py
            """

            import inspect

            import pytest

            import test_zoo

            FAMILY = {_str(d.family)}


            def zoo_checks():
                """Each zoo test whose family parametrization includes FAMILY."""
                for name, check in vars(test_zoo).items():
                    if not name.startswith("test_") or not callable(check):
                        continue
                    marks = [m for m in getattr(check, "pytestmark", []) if m.name == "parametrize"]
                    if all(FAMILY in m.args[1] for m in marks if m.args[0] == "family"):
                        yield pytest.param(check, id=name.removeprefix("test_"))


            @pytest.mark.parametrize("check", list(zoo_checks()))
            def test_zoo(check, tmp_ckpt):
                arguments = {{"family": FAMILY, "tmp_ckpt": tmp_ckpt}}
                check(**{{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters}})
            ''')
    return textwrap.dedent(f'''\
        """Zoo checks for the out-of-tree {d.family} family: save/reload, forward/backward,
        generation, padded == single, packed == padded, parts, LoRA merge.

            python -m pytest -q tests/test_family_{d.family}.py
        """

        import importlib
        import sys
        from pathlib import Path

        import pytest
        import torch

        from mmrl import build_model, load_model
        from mmrl.checks import (
            generate, lora_merge_difference, logits_of, loss_and_backward, packed_vs_padded, padded_vs_single,
            sample_conversations,
        )
        from mmrl.parts import check_parts, parameters_by_part

        # Importing the module registers the family (an installed package also loads it
        # through its `mmrl.models` entry point).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        importlib.import_module({_str(layout.adapter_module)})

        FAMILY = {_str(d.family)}
        TOLERANCE = 2e-4


        def test_save_reload_forward_backward_generate(tmp_path):
            built = build_model(FAMILY, random_init=True)
            conversations = sample_conversations(built.adapter)
            before = logits_of(built.model.eval(), built.inputs(conversations))
            built.save(tmp_path)
            reloaded = load_model(tmp_path)
            assert torch.allclose(before, logits_of(reloaded.model.eval(), reloaded.inputs(conversations)), atol=1e-5)
            assert torch.isfinite(loss_and_backward(reloaded, conversations))
            assert generate(reloaded, conversations, max_new_tokens=8).shape == (len(conversations), 8)


        def test_parts_cover_the_model():
            built = build_model(FAMILY, random_init=True)
            assert check_parts(built.model) == []
            assert None not in parameters_by_part(built.model)


        def test_padded_batch_matches_each_prompt_alone():
            built = build_model(FAMILY, random_init=True)
            assert padded_vs_single(built, sample_conversations(built.adapter)) < TOLERANCE


        def test_packed_batch_matches_padded():
            built = build_model(FAMILY, random_init=True)
            if not built.adapter.capabilities.padding_free:
                pytest.skip("padding_free is not declared")
            assert packed_vs_padded(built, sample_conversations(built.adapter)) < TOLERANCE


        def test_lora_merge_matches_unmerged():
            built = build_model(FAMILY, random_init=True)
            if not built.adapter.capabilities.lora_language:
                pytest.skip("lora_language is not declared")
            gap, effect = lora_merge_difference(built, sample_conversations(built.adapter), "language")
            assert effect > 1e-3 and gap < TOLERANCE
        ''')


def render_processing(d: Discovery) -> str:
    return textwrap.dedent(f'''\
        """{d.class_name} input processing (scaffolded by `mmrl add-model {d.resolved.model_type}`).

        The generic `Processing` renders the chat template and calls the HF processor; a
        family subclasses it for what differs. The pixel budget (`min_pixels` /
        `max_pixels`) is not mapped onto this processor's arguments, so images keep the
        processor's own size; override `image_kwargs` to honour a budget.
        """

        from mmrl.processing import Processing


        class {d.class_name}Processing(Processing):
            """The generic processing, under this family's name."""
        ''')


# -- layouts ---------------------------------------------------------------------------
def repo_root() -> Path:
    """The source checkout the zoo lives in (an installed mmrl has none)."""
    import mmrl.models

    root = Path(next(iter(mmrl.models.__path__))).resolve().parent
    if not all((root / name).is_dir() for name in ("models", "processors", "tests", "docs")):
        raise ScaffoldError(f"{root} is not an mmrl source checkout; write an out-of-tree package with --out DIR")
    return root


def layout_for(d: Discovery, out: Path | None) -> Layout:
    family, vlm = d.family, d.resolved.is_vision_language
    if out is None:
        root = repo_root()
        line = (f"- `{family}` ({'vision-language' if vlm else 'text'}): transformers "
                f"`{d.resolved.model_class}`, [models/{family}.py](../models/{family}.py), "
                f"scaffolded by `mmrl add-model {d.resolved.model_type}`\n")
        return Layout(
            root=root, adapter=root / "models" / f"{family}.py",
            processing=root / "processors" / f"{family}.py" if vlm else None,
            test=root / "tests" / f"test_family_{family}.py", extra={},
            appends={root / "docs" / "families.md": line},
            adapter_module=f"mmrl.models.{family}",
            processing_module=f"mmrl.processors.{family}" if vlm else None, in_tree=True,
        )
    root = Path(out).resolve()
    package = f"mmrl_{family}"
    pyproject = textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "mmrl-{family.replace('_', '-')}"
        version = "0.1.0"
        description = "The {family} model family for mmrl (scaffolded by mmrl add-model)"
        dependencies = ["mmrl"]

        [project.entry-points."mmrl.models"]
        {family} = "{package}.{family}"

        [tool.setuptools]
        packages = ["{package}"]
        """)
    readme = textwrap.dedent(f"""\
        # {package}

        The `{family}` family (transformers `{d.resolved.model_class}`) for mmrl, scaffolded by
        `mmrl add-model {d.resolved.model_type} --out`. Install it next to mmrl and the family
        registers itself through the `mmrl.models` entry point:

            pip install -e .
            mmrl models
            python -m pytest -q tests/test_family_{family}.py
        """)
    return Layout(
        root=root, adapter=root / package / f"{family}.py",
        processing=root / package / "processing.py" if vlm else None,
        test=root / "tests" / f"test_family_{family}.py",
        extra={root / "pyproject.toml": pyproject, root / "README.md": readme,
               root / package / "__init__.py": f'"""The {family} model family for mmrl."""\n'},
        appends={}, adapter_module=f"{package}.{family}",
        processing_module=f"{package}.processing" if vlm else None, in_tree=False,
    )


# -- 4. verify -------------------------------------------------------------------------
def _load_file(module_name: str, path: Path):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def verify(d: Discovery, layout: Layout, notes: list[str]) -> Capabilities | None:
    """Import the rendered adapter (under a scratch module name), run the zoo's quick
    checks on its tiny model and return the capabilities that passed (None when the
    tiny model does not run at all; `d.fill_in` then says why)."""
    import torch

    from mmrl import build_model
    from mmrl.checks import (
        generate, lora_merge_difference, loss_and_backward, packed_vs_padded, padded_vs_single,
        sample_conversations,
    )
    from mmrl.registry import unregister

    scratch = Path(tempfile.mkdtemp(prefix="mmrl-add-model-"))
    names = []
    try:
        processing_ref = None
        if layout.processing is not None:
            (scratch / "processing.py").write_text(render_processing(d))
            name = f"_mmrl_scaffold_processing_{d.family}"
            _load_file(name, scratch / "processing.py")
            names.append(name)
            processing_ref = f"{name}:{d.class_name}Processing"
        (scratch / "adapter.py").write_text(render_adapter(d, layout, _base_capabilities(d), processing_ref))
        name = f"_mmrl_scaffold_adapter_{d.family}"
        _load_file(name, scratch / "adapter.py")
        names.append(name)
        try:
            return _run_checks(d, notes, torch, build_model, generate, lora_merge_difference,
                               loss_and_backward, packed_vs_padded, padded_vs_single, sample_conversations)
        finally:
            unregister(d.family)
    finally:
        for name in names:
            sys.modules.pop(name, None)
        shutil.rmtree(scratch, ignore_errors=True)


def _run_checks(d, notes, torch, build_model, generate, lora_merge_difference, loss_and_backward,
                packed_vs_padded, padded_vs_single, sample_conversations) -> Capabilities | None:
    verified: dict[str, bool] = {}

    def check(capability: str, run) -> None:
        try:
            ok, detail = run()
        except Exception as exc:  # a failing check is a finding, not a crash
            ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        verified[capability] = ok
        if not ok:
            notes.append(f"{capability} not declared: {detail}")

    def fresh():
        return build_model(d.family, random_init=True)

    try:
        built = fresh()
        conversations = sample_conversations(built.adapter)
        gap = padded_vs_single(built, conversations)
    except Exception as exc:  # the tiny model itself does not run: nothing can be verified
        message = " ".join(str(exc).split())[:300]
        d.fill_in.append(f"tiny(): the scaffolded tiny model does not run ({type(exc).__name__}: {message}); "
                         "the processor's arguments (image size, tokens per image, special tokens) must "
                         "agree with the config; then run the family's tests")
        return None
    if gap >= TOLERANCE:
        d.fill_in.append(f"position_ids: a padded batch differs from each prompt alone by {gap:.2g}")
    vlm = d.resolved.is_vision_language

    def learns():
        loss = loss_and_backward(built, conversations)
        grads = [p.grad for p in built.model.parameters() if p.grad is not None]
        return bool(torch.isfinite(loss)) and any(g.abs().sum() > 0 for g in grads), f"loss {loss.item():.3g}"

    def generates():
        tokens = generate(built, conversations, max_new_tokens=4)
        return tokens.shape == (len(conversations), 4), f"generated shape {tuple(tokens.shape)}"

    def packs():
        gap = packed_vs_padded(built, conversations)
        return gap < TOLERANCE, f"packed and padded logits differ by {gap:.2g}"

    def checkpoints():
        model = fresh()
        plain = loss_and_backward(model, conversations)
        grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
        model.model.zero_grad(set_to_none=True)
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        again = loss_and_backward(model, conversations)
        same = all(torch.allclose(g, p.grad, atol=1e-5) for n, p in model.model.named_parameters()
                   if (g := grads.get(n)) is not None and p.grad is not None)
        return bool(torch.allclose(plain, again, atol=1e-6)) and same, "checkpointed gradients differ"

    def lora(scope):
        def run():
            gap, effect = lora_merge_difference(fresh(), conversations, scope)
            return effect > 1e-3 and gap < TOLERANCE, f"LoRA ({scope}) merge gap {gap:.2g}, effect {effect:.2g}"
        return run

    def two_images():
        model = fresh()
        loss = loss_and_backward(model, sample_conversations(model.adapter, images_per_prompt=2))
        return bool(torch.isfinite(loss)), f"loss {loss.item()}"

    check("single_image" if vlm else "generation", learns)
    check("generation", generates)
    check("padding_free", packs)
    check("gradient_checkpointing", checkpoints)
    check("lora_language", lora("language"))
    def shares_media():
        from mmrl.probes import Subject, probe
        from mmrl.registry import get_adapter

        result = probe("media_sharing").run(Subject(get_adapter(d.family), source=d.family))
        return result.status == "verified", result.reason

    if vlm:
        check("lora_vision", lora("vision") if d.vision_leaves else (lambda: (False, "no vision leaves")))
        check("multi_image", two_images)
        check("media_sharing", shares_media)
    return Capabilities(**{name: verified.get(name, False) for name in CHECKED})


# -- 5. write --------------------------------------------------------------------------
def write_all(contents: dict[Path, str]) -> list[Path]:
    """Stage every file in a temporary folder beside its target, then move them all
    into place; if a move fails, the files already moved are put back."""
    staged: list[tuple[Path, Path, Path | None]] = []
    stage_root = Path(tempfile.mkdtemp(prefix=".mmrl-add-model-", dir=_existing_parent(_common_root(contents))))
    try:
        for i, (path, text) in enumerate(contents.items()):
            temp = stage_root / f"{i}.tmp"
            temp.write_text(text)
            staged.append((path, temp, None))
        moved: list[tuple[Path, Path | None]] = []
        try:
            for path, temp, _ in staged:
                path.parent.mkdir(parents=True, exist_ok=True)
                backup = None
                if path.exists():
                    backup = stage_root / f"{len(moved)}.bak"
                    shutil.copy2(path, backup)
                shutil.move(str(temp), str(path))
                moved.append((path, backup))
        except BaseException:
            for path, backup in reversed(moved):
                if backup is not None:
                    shutil.move(str(backup), str(path))
                else:
                    path.unlink(missing_ok=True)
            raise
    finally:
        shutil.rmtree(stage_root, ignore_errors=True)
    return [path for path, _, _ in staged]


def _common_root(contents: dict[Path, str]) -> Path:
    import os

    return Path(os.path.commonpath([str(p.parent) for p in contents]))


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


# -- all together ----------------------------------------------------------------------
def scaffold(model_type: str, *, family: str | None = None, out: str | Path | None = None,
             dry_run: bool = False, force: bool = False, check: bool = True) -> Result:
    """Resolve, inspect, render, verify and write a family; see the module docstring."""
    resolved = resolve(model_type)
    name = family_name(model_type, family)
    check_unregistered(resolved, name)
    discovery = inspect_family(resolved, name)
    layout = layout_for(discovery, Path(out) if out is not None else None)
    contents: dict[Path, str] = {}
    planned = [layout.adapter, layout.test, *layout.extra] + ([layout.processing] if layout.processing else [])
    existing = [p for p in planned if p.exists()]
    if existing and not force:
        raise ScaffoldError(f"{existing[0]} exists; pass --force to overwrite (nothing was written)")
    notes: list[str] = []
    verified = verify(discovery, layout, notes) if check else None
    processing_ref = None
    if layout.processing is not None:
        contents[layout.processing] = render_processing(discovery)
        processing_ref = f"{layout.processing_module}:{discovery.class_name}Processing"
    contents[layout.adapter] = render_adapter(discovery, layout, verified, processing_ref, checked=check)
    contents[layout.test] = render_test(discovery, layout)
    contents.update(layout.extra)
    for path, line in layout.appends.items():
        current = path.read_text() if path.exists() else FAMILIES_HEADER
        if line.strip() not in current:
            contents[path] = current.rstrip("\n") + "\n" + line
    if layout.in_tree:
        command = f".venv/bin/python -m pytest -q {layout.test.relative_to(layout.root)}"
    else:
        command = f"cd {layout.root} && python -m pytest -q {layout.test.relative_to(layout.root)}"
    written = list(contents) if dry_run else write_all(contents)
    return Result(family=name, written=written, next_command=command,
                  capabilities=verified, notes=notes + [f"fill in: {item}" for item in discovery.fill_in],
                  dry_run=dry_run, contents=contents)


FAMILIES_HEADER = """# Model families

Every family mmrl registers in this repository, one line each. `mmrl models` lists what
is registered at run time (plugins included); the support matrix
([support_matrix.md](support_matrix.md)) says what each one verifiably supports.
`mmrl add-model MODEL_TYPE` appends a line here when it scaffolds a family.

"""
