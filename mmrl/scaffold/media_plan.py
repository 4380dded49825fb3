"""The media plan of a vision-language type, and what is built from it.

A `MediaPlan` records how the tiny vision-language model and its processor are put
together (the adapter's `tiny()` is rendered from it). This module decides nothing about
the type: it turns a plan into the tiny tokenizer, config and processor (`build_config`,
`build_processor`) and says whether the tiny model runs a training step on one processed
image (`runs_with_image`) and whether its logits there run longer than its input_ids
(`prepends_positions`). `media` fills the plan in; `placeholders` and `image_size`
adjust it, reading a processor class's arguments through `init_parameters`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from mmrl.errors import whole_cause
from mmrl.scaffold.base import Resolved, ScaffoldError
from mmrl.scaffold.shrink import build_text_config, build_tiny, built_or_repaired


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
    # A processor's patch size that no config gives (a timm tower's): a stand-in until
    # the tiny tower's own grid is measured (`image_size.fit_image_size`).
    unset_patch: str | None = None
    notes: list[str] = field(default_factory=list)


def init_parameters(cls) -> dict[str, Any]:
    """The arguments `cls.__init__` takes, by name ({} where its signature cannot be read):
    how the stages that fill a plan in learn what a processor class accepts."""
    try:
        return dict(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return {}


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
    config_cls = getattr(transformers, resolved.config_class)
    try:
        config, _ = built_or_repaired(lambda v: config_cls(**v), values,
                                      lambda v, _: _shared_values_kept(config_cls, plan.vision_key, v))
    except Exception as exc:  # a validator may raise anything
        raise ScaffoldError(f"{resolved.config_class} rejects the shrunk values ({whole_cause(exc, 200)}); write tiny() "
                            "by hand with values it accepts", category="config") from exc
    return tokenizer, config


def _shared_values_kept(config_cls, vision_key: str, values: dict[str, Any]) -> dict[str, Any] | None:
    """`values` with the tower's copies of top-level fields set to the top level's, where
    the default config holds the same value in both (a composite whose validator wants its
    tower's `video_temporal_patch_size` equal to its own); None when there are none to set."""
    from transformers import PretrainedConfig

    try:
        default = config_cls()
    except Exception:
        return None
    tower = getattr(default, vision_key, None)
    if tower is None:
        return None
    common = set(PretrainedConfig().to_dict())
    top, below = default.to_dict(), tower.to_dict()
    vision = dict(values.get(vision_key) or {})
    changed = False
    for name, value in top.items():
        if name in common or name == vision_key or name not in below or below[name] != value:
            continue
        wanted = values.get(name, value)
        if vision.get(name) != wanted:
            vision[name] = wanted
            changed = True
    return {**values, vision_key: vision} if changed else None


def build_processor(plan: MediaPlan, tokenizer, config):
    """The tiny processor; the chat template places the placeholder that works."""
    import transformers

    from mmrl.tiny import as_loaded

    subs = {}
    for argument, (cls_name, kwargs) in plan.sub_processors.items():
        try:
            sub = getattr(transformers, cls_name)(**kwargs)
        except ImportError as exc:  # transformers' stand-in for a class whose package is missing
            raise ScaffoldError(f"{cls_name} needs a package not installed here ({whole_cause(exc, 120)}); install "
                                "it, or write tiny()'s processor by hand", category="processor") from exc
        except Exception as exc:
            raise ScaffoldError(f"{cls_name}({kwargs}) fails ({whole_cause(exc, 200)})", category="processor") from exc
        subs[argument] = as_loaded(sub) if argument == "image_processor" else sub
    kwargs = {name: eval(expression, {"config": config, "tokenizer": tokenizer})
              for name, expression in plan.processor_kwargs.items()}
    try:
        processor = getattr(transformers, plan.processor_class)(tokenizer=tokenizer, **subs, **kwargs)
    except Exception as exc:
        raise ScaffoldError(f"{plan.processor_class} cannot be built from the tiny tokenizer and its default "
                            f"sub-processors ({whole_cause(exc, 200)}); write tiny() by hand", category="processor") from exc
    return processor


def one_image_inputs(processor, placeholder: str | None, text_kwargs: dict[str, Any] | None = None,
                     model=None) -> dict:
    """The processor's tensors for one image beside `placeholder`, floats in float32 as
    mmrl's processing gives them, and only those `model`'s forward takes where it names
    its arguments: what the fitting stages run the tiny model on."""
    from PIL import Image

    inputs = processor(text=[f"look {placeholder} here"], images=[Image.new("RGB", (224, 168), (9, 99, 199))],
                       return_tensors="pt", **(text_kwargs or {}))
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    accepted = inspect.signature(model.forward).parameters if model is not None else {}
    if accepted and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        inputs = {k: v for k, v in inputs.items() if k in accepted}
    return inputs


def runs_with_image(model_class: str, config, processor, placeholder: str | None,
                    text_kwargs: dict[str, Any] | None = None) -> str | None:
    """None when the tiny model runs a forward/backward pass on one processed image
    beside `placeholder`, else the error in one line."""
    try:
        model = build_tiny(model_class, config)
        inputs = one_image_inputs(processor, placeholder, text_kwargs, model)
        model(**{**inputs, "labels": inputs["input_ids"]}).loss.backward()
    except Exception as exc:
        return whole_cause(exc, 200)
    return None


def prepends_positions(model, processor, placeholder: str | None, text_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the tiny model's logits on one processed image run longer than its
    input_ids: positions of its own (image features it prepends) in front of the text's,
    which the adapter's `prepends_positions` cuts off again. False where it does not run."""
    import torch

    try:
        inputs = one_image_inputs(processor, placeholder, text_kwargs, model)
        with torch.no_grad():
            logits = model(**inputs).logits
    except Exception:
        return False
    return logits.dim() == 3 and logits.shape[1] > inputs["input_ids"].shape[1]


def images_see_each_other(model, processor, placeholder: str | None, text_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the tiny model's encoder gives an image other features beside another
    image in one call than alone (a tower that lets a batch's images attend to each
    other), and encoding one image per call (`encode_each_image_alone`) gives it its
    features alone: then the adapter declares `encode_images_alone`. False where the
    encoder does not run on two prompts' images, or encoding one per call changes nothing."""
    import torch
    from PIL import Image

    from mmrl.encoder_calls import ENCODER_METHODS, encode_each_image_alone, encoder_owners

    owners = [o for o in encoder_owners(model) if callable(getattr(o, "get_image_features", None))]
    if len(owners) != 1:
        return False
    owner = owners[0]
    images = [Image.new("RGB", (224, 168), (9, 99, 199)), Image.effect_noise((168, 224), 60).convert("RGB")]
    accepted = inspect.signature(owner.get_image_features).parameters

    def first_features() -> torch.Tensor:
        """The first image's features, encoded with the second and alone."""
        out = []
        for batch in (images, images[:1]):
            inputs = processor(text=[f"look {placeholder} here"] * len(batch), images=[[i] for i in batch],
                               return_tensors="pt", padding=True, **(text_kwargs or {}))
            inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items() if k in accepted}
            with torch.no_grad():
                features = owner.get_image_features(**inputs)
            features = getattr(features, "pooler_output", features)
            out.append(features[0] if isinstance(features, (list, tuple)) else features)
        joint, alone = out
        return (joint[: alone.shape[0]] - alone).abs().max() / alone.abs().max().clamp_min(1e-12)

    try:
        if first_features() < 1e-4:
            return False
        encode_each_image_alone(model)
        return bool(first_features() < 1e-5)
    except Exception:
        return False
    finally:
        for name in ENCODER_METHODS:
            owner.__dict__.pop(name, None)
