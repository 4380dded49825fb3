"""Stage 1, resolve: the config and model classes of a model type, from transformers'
auto tables; the family name; refusal of types the registry already holds."""

from __future__ import annotations

import keyword
import re

from mmrl.scaffold.base import Resolved, ScaffoldError


def resolve(model_type: str) -> Resolved:
    """The config and model class of `model_type`, from transformers' auto tables. A type
    in the image-text-to-text table is a vision-language family whatever its vision
    sub-config is called; its vision config is the sub-config that is not the text one."""
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_class = CONFIG_MAPPING_NAMES.get(model_type)
    if config_class is None:
        close = [t for t in CONFIG_MAPPING_NAMES if model_type.replace("-", "_") in t.replace("-", "_")][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ScaffoldError(f"unknown model type {model_type!r}: transformers has no config for it{hint}",
                            category="unknown")
    vision_language = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    config_cls = getattr(transformers, config_class, None)
    if config_cls is None:
        raise ScaffoldError(f"transformers names {config_class} for {model_type!r} but does not export it",
                            category="unsupported")
    for name in (vision_language, causal):
        if name and not hasattr(transformers, name):
            raise ScaffoldError(f"transformers names {name} for {model_type!r} but does not export it; "
                                "write the adapter by hand against the model's module", category="unsupported")
    if vision_language:
        key = vision_config_key(config_cls)
        if key is not None:
            return Resolved(model_type, config_class, vision_language, True, key)
        if not causal:
            raise ScaffoldError(
                f"{config_class} has no vision sub-config (its sub-configs: "
                f"{', '.join(getattr(config_cls, 'sub_configs', {}) or {}) or 'none'}): the image encoder is "
                "built into the decoder, so the scaffold cannot find a vision tower to shrink; write tiny() "
                "and parts by hand", category="unsupported")
    if causal:
        return Resolved(model_type, causal_config_class(config_cls, getattr(transformers, causal)), causal, False)
    raise ScaffoldError(
        f"model type {model_type!r} has no causal-LM or image-text-to-text model class in transformers; "
        "mmrl trains generative models only", category="unsupported")


def causal_config_class(config_cls, model_cls) -> str:
    """The config class a causal-LM class is built from: the type's own, or its text
    sub-config's class where the model class declares that one (a composite type whose
    causal LM is its text model alone), as transformers' `AutoModelForCausalLM` does."""
    text_class = (getattr(config_cls, "sub_configs", {}) or {}).get("text_config")
    if text_class is not None and getattr(model_cls, "config_class", None) is text_class:
        return text_class.__name__
    return config_cls.__name__


def vision_config_key(config_cls) -> str | None:
    """The sub-config of a multimodal config class that describes its image encoder:
    `vision_config` where present, else the one sub-config named for vision or images."""
    subs = dict(getattr(config_cls, "sub_configs", {}) or {})
    if "vision_config" in subs:
        return "vision_config"
    named = [k for k in subs if any(word in k for word in ("vision", "image", "visual"))]
    return named[0] if len(named) == 1 else None


def check_unregistered(resolved: Resolved, family: str, replace: bool = False) -> list[str]:
    """Refuse a type, architecture or family name the registry already holds; with
    `replace`, unregister the holder in this process instead. Returns the families
    unregistered (processes started later must hide them too)."""
    from mmrl.registry import families, unregister

    registered = families()
    replaced = []
    for adapter in registered:
        holds = resolved.model_type in adapter.model_types or resolved.model_class in adapter.hf_architectures
        if holds and replace:
            unregister(adapter.family)
            replaced.append(adapter.family)
        elif resolved.model_type in adapter.model_types:
            raise ScaffoldError(f"model type {resolved.model_type!r} is already registered by family "
                                f"{adapter.family!r} ({type(adapter).__module__})")
        elif resolved.model_class in adapter.hf_architectures:
            raise ScaffoldError(f"architecture {resolved.model_class} is already registered by family "
                                f"{adapter.family!r} ({type(adapter).__module__})")
    for adapter in families():
        if adapter.family == family:
            raise ScaffoldError(f"family {family!r} is already registered ({type(adapter).__module__}); "
                                "pick another name with --family")
    return replaced


def family_name(model_type: str, family: str | None) -> str:
    name = family or model_type.replace("-", "_").replace(".", "_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ScaffoldError(f"family name {name!r} is not a lower-case Python identifier; pass --family NAME")
    return name


def class_name(resolved: Resolved, family: str) -> str:
    if family == resolved.model_type.replace("-", "_"):
        return resolved.config_class.removesuffix("Config")
    return "".join(part.capitalize() for part in family.split("_"))
