"""Build a model, its processor and its adapter from a checkpoint or a random init.

    built = build_model("/path/to/checkpoint")                 # local weights (safetensors)
    built = build_model("Qwen/Qwen2-VL-2B-Instruct")            # a hub id, through the HF cache
    built = build_model("qwen2_vl", random_init=True)           # the family's tiny config
    built = build_model("llama", random_init=True, config=cfg)  # any config, random weights
    built = build_recipe_model(recipe.model, seed=0)            # what a recipe's model section says
    built.save("/tmp/ckpt")                                     # save_pretrained both
    batch = built.processing([conversation])                    # prompts -> model inputs
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmrl.adapter import ModelAdapter
from mmrl.hub import checkpoint_folder
from mmrl.processing import Processing
from mmrl.registry import adapter_for_config, get_adapter


@dataclass
class BuiltModel:
    model: Any
    processing: Processing
    adapter: ModelAdapter

    @property
    def processor(self):
        return self.processing.processor

    @property
    def tokenizer(self):
        return self.processing.tokenizer

    def save(self, path: str | Path) -> Path:
        """`save_pretrained` the model (safetensors) and its processor into `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.processor.save_pretrained(path)
        return path

    def inputs(self, conversations, add_generation_prompt: bool = True) -> dict[str, torch.Tensor]:
        """Processor-made batch with the family's position ids added."""
        batch = dict(self.processing(conversations, add_generation_prompt=add_generation_prompt))
        positions = self.adapter.position_ids(self.model, batch)
        if positions is not None:  # None: the model computes its own (multi-axis rope)
            batch["position_ids"] = positions
        return batch


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
        except KeyError:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}") from None
    return dtype


def build_model(
    name_or_path: str | Path,
    *,
    random_init: bool = False,
    config=None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    seed: int = 0,
    processing_options: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    config_overrides: dict[str, Any] | None = None,
    tiny_vocabulary: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    processor=None,
) -> BuiltModel:
    """Build model + processing for a family name, a local checkpoint directory or a hub
    id (`org/name[@revision]`, read through the HF cache; mmrl/hub.py says how a name is
    told apart).

    With `random_init=True`, `name_or_path` names a family (or a checkpoint whose
    config is used) and the weights are random: the family's tiny config unless
    `config` is given; `config_overrides` (nested by sub-config name) apply to random
    inits only, and `tiny_vocabulary` ({"characters": str, "words": [...]}, see
    `mmrl.tiny.vocabulary`) shapes the tiny tokenizer. Weights are read from
    safetensors only. `attn_implementation` None means SDPA where the model class
    supports it, else eager attention. `device` is where random weights are drawn (on a
    GPU, seconds for billions of parameters that take minutes on the CPU; a seed draws
    other numbers there than on the CPU) and checkpoints are loaded to; None: the CPU.
    `processor`: its processor, loaded before (by `recipe_config` for the checks before the
    build, or the actor's for a reference or critic beside it): not loaded again.
    """
    path, is_checkpoint, adapter = _locate(name_or_path, weights=not random_init, trust_remote_code=trust_remote_code)
    if attn_implementation is None:
        attn_implementation = default_attention(adapter.model_class())
    dtype = _dtype(dtype)
    if processor is None and is_checkpoint:
        processor = load_processor(path, adapter, trust_remote_code)
    if random_init:
        adapter, config, processor = _random_init_config(path if is_checkpoint else None, adapter, config, processor,
                                                         trust_remote_code, config_overrides, tiny_vocabulary)
        config._attn_implementation = attn_implementation
        # Without `device`, the caller's default device (`with torch.device(...)`) holds.
        place = torch.device(device) if device is not None else torch.get_default_device()
        with torch.random.fork_rng(devices=[place] if place.type == "cuda" else [], device_type=place.type), place:
            torch.manual_seed(seed)
            model = adapter.model_class()._from_config(config, dtype=dtype)
            model = adapter.prepare_model(model)
    else:
        if config_overrides or tiny_vocabulary:
            raise ValueError("config_overrides and tiny_vocabulary apply to random_init=True builds only")
        if not is_checkpoint:
            raise FileNotFoundError(
                f"{name_or_path}: not a checkpoint directory (pass random_init=True to build a family's tiny model)"
            )
        model = adapter.model_class().from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation,
            use_safetensors=True, trust_remote_code=trust_remote_code,
            **({"device_map": {"": torch.device(device)}} if device is not None else {}),
        )
    _warn_frozen(model)
    model = adapter.on_load(model)
    eos = getattr(model.generation_config, "eos_token_id", None)
    stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    processing = make_processing(adapter, processor, processing_options, stop_token_ids=stop_ids)
    return BuiltModel(model=model, processing=processing, adapter=adapter)


def make_processing(adapter: ModelAdapter, processor, options: dict[str, Any] | None = None, *,
                    stop_token_ids: list[int] | None = None) -> Processing:
    """`adapter`'s processing of `processor`: the family's processing options, then `options`
    (a recipe's pixel bounds: `pixel_options`) over them."""
    stops = {"stop_token_ids": stop_token_ids} if stop_token_ids is not None else {}
    return adapter.processing_class()(processor, **{**stops, **adapter.processing_options, **(options or {})})


def pixel_options(model) -> dict[str, int]:
    """A recipe `model` section's `min_pixels` and `max_pixels`, where set."""
    return {k: v for k, v in (("min_pixels", model.min_pixels), ("max_pixels", model.max_pixels)) if v is not None}


def _warn_frozen(model) -> None:
    """One warning where the model comes built with frozen parameters (a config's own
    `freeze_*` settings, as IDEFICS's `freeze_vision_layers`): mmrl freezes by named parts
    (`model.freeze`) and never unfreezes, so they would stay frozen in training."""
    frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]
    if frozen:
        import warnings

        settings = sorted(k for k, v in model.config.to_dict().items() if k.startswith("freeze") and v is True)
        why = f" (its config sets {', '.join(settings)})" if settings else ""
        warnings.warn(f"{type(model).__name__} comes with {len(frozen)} frozen parameters{why}, the first "
                      f"{frozen[0]}; mmrl never unfreezes them, so training leaves them as they are", stacklevel=3)


def _locate(name_or_path: str | Path, *, weights: bool, trust_remote_code: bool) -> tuple[Path, bool, ModelAdapter]:
    """The folder a build reads (a hub id becomes its snapshot folder, weights fetched only
    with `weights`), whether it is a checkpoint (not a family name), and the adapter."""
    folder = checkpoint_folder(name_or_path, weights=weights, trust_remote_code=trust_remote_code)
    path = folder if folder is not None else Path(str(name_or_path))
    is_checkpoint = path.is_dir()
    return path, is_checkpoint, get_adapter(path if is_checkpoint else name_or_path, source=str(name_or_path))


def _random_init_config(checkpoint: Path | None, adapter: ModelAdapter, config, processor, trust_remote_code: bool,
                        config_overrides: dict[str, Any] | None, tiny_vocabulary: dict[str, Any] | None):
    """The adapter, customized config and processor of a random init: the given config, a
    checkpoint's, or the family's tiny one (its processor too where none was loaded)."""
    if config is None and checkpoint is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    if config is None or processor is None:
        from mmrl.tiny import vocabulary

        with vocabulary(**(tiny_vocabulary or {})) if tiny_vocabulary else _nothing():
            tiny = adapter.tiny()
        config = config if config is not None else tiny.config
        processor = processor if processor is not None else tiny.processor
    adapter = adapter_for_config(config)
    return adapter, customized_config(config, adapter, config_overrides or {}), processor


def recipe_config(model, *, processor: bool = True) -> tuple[Any, Any]:
    """The processor and the config that a recipe's `model` section builds with, read
    without building the model (nor fetching a hub checkpoint's weights): the trainer's
    checks before the build read them, and the build takes the processor. `processor=False`:
    a checkpoint's processor is not loaded (None in its place; a large vocabulary's tokenizer
    takes seconds to load). A family's random init always comes with its tiny processor."""
    path, is_checkpoint, adapter = _locate(model.path, weights=False, trust_remote_code=model.trust_remote_code)
    if model.random_init and not is_checkpoint:
        _, config, loaded = _random_init_config(None, adapter, None, None, model.trust_remote_code,
                                                model.config_overrides or None, model.tiny_vocabulary or None)
        return loaded, config
    from transformers import AutoConfig

    loaded = load_processor(path, adapter, model.trust_remote_code) if is_checkpoint and processor else None
    config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    if model.random_init:  # a checkpoint's config with the recipe's overrides
        config = customized_config(config, adapter_for_config(config), model.config_overrides or {})
    return loaded, config


def build_recipe_model(model, *, seed: int = 0, device: str | torch.device | None = None,
                       processor=None) -> BuiltModel:
    """The model a recipe's `model` section (`mmrl.config.ModelConfig`) describes, before
    freezing and LoRA: what the trainer builds for the actor (with the `processor` its
    checks loaded), the reference and the critic (these two with the actor's;
    `build_model`)."""
    return build_model(
        model.path, random_init=model.random_init, dtype=model.dtype, attn_implementation=model.attn_implementation,
        seed=seed, processing_options=pixel_options(model), trust_remote_code=model.trust_remote_code,
        config_overrides=model.config_overrides or None, tiny_vocabulary=model.tiny_vocabulary or None,
        device=device, processor=processor,
    )


def default_attention(model_class) -> str:
    """SDPA for a model class that supports it, else eager (transformers raises when a
    class without SDPA support is asked for it)."""
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def customized_config(config, adapter: ModelAdapter, overrides: dict[str, Any]):
    """A copy of `config` with overrides applied, checked for rope consistency."""
    import copy

    config = copy.deepcopy(config)
    _apply_overrides(config, overrides, "config")
    problems = adapter.rope(config).problems()
    if problems:
        raise ValueError(f"config: {problems[0]}")
    return config


def _apply_overrides(config, overrides: dict[str, Any], where: str) -> None:
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"{where}.{key}: {type(config).__name__} has no such field")
        current = getattr(config, key)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            _apply_overrides(current, value, f"{where}.{key}")
        else:
            setattr(config, key, value)
    _resize_layer_types(config, overrides, where)


def _resize_layer_types(config, overrides: dict[str, Any], where: str) -> None:
    """Keep `layer_types` (one entry per layer) in step with a new layer count."""
    layers, types = getattr(config, "num_hidden_layers", None), getattr(config, "layer_types", None)
    if "num_hidden_layers" not in overrides or "layer_types" in overrides or not types or len(types) == layers:
        return
    if len(set(types)) != 1:
        raise ValueError(
            f"{where}.num_hidden_layers: the layers mix types {sorted(set(types))}; override layer_types too"
        )
    config.layer_types = [types[0]] * layers


def load_model(path: str | Path, **kwargs) -> BuiltModel:
    """`build_model` for a checkpoint directory (weights loaded, not random)."""
    return build_model(path, random_init=False, **kwargs)


# Tokenizer classes that mean "tokenizer.json defines everything": AutoTokenizer would
# swap in the model type's own class, which rebuilds the pipeline from the vocabulary
# and changes how a tokenizer that is not the family's real one splits text.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _own_tokenizer_class(path: Path) -> bool:
    """Whether a checkpoint's tokenizer must be loaded by mmrl itself, as its saved generic
    class (`_GENERIC_TOKENIZERS`), rather than by `AutoTokenizer`."""
    import json

    config_file = path / "tokenizer_config.json"
    return config_file.is_file() and json.loads(config_file.read_text()).get("tokenizer_class") in _GENERIC_TOKENIZERS


def _load_tokenizer(path: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer, TokenizersBackend

    if _own_tokenizer_class(path):
        return TokenizersBackend.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_processor(path: Path, adapter: ModelAdapter, trust_remote_code: bool):
    """A checkpoint's processor (its tokenizer for a text family). Where the saved tokenizer
    class is generic (`_own_tokenizer_class`: mmrl's tiny checkpoints and exports of them,
    Llama 3-based VLMs), mmrl loads the tokenizer itself and the processor takes that one
    (`_processor_takes`) rather than loading its own through `AutoTokenizer` beside it, which
    costs seconds with a large vocabulary."""
    from transformers import AutoProcessor

    if not adapter.is_multimodal:
        return _load_tokenizer(path, trust_remote_code)
    if not _own_tokenizer_class(path):
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer = _load_tokenizer(path, trust_remote_code)
    with _processor_takes(tokenizer):
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    if getattr(processor, "tokenizer", None) is not tokenizer:  # a processor class that loads it its own way
        processor = AutoProcessor.from_pretrained(path, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
    return processor


@contextlib.contextmanager
def _processor_takes(tokenizer):
    """Within the block, a processor's `from_pretrained` takes `tokenizer` as its tokenizer.
    transformers' processors load theirs through `AutoTokenizer` even when given one (and then
    deep-copy the one given with their other arguments), through
    `ProcessorMixin._load_tokenizer_from_pretrained`, which this swaps for the block; where
    that hook is missing (another transformers) nothing changes, and `load_processor` sees
    that the processor's tokenizer is not this one."""
    from transformers import ProcessorMixin

    hook = ProcessorMixin.__dict__.get("_load_tokenizer_from_pretrained")
    if not isinstance(hook, classmethod):
        yield
        return

    def take(cls, sub_processor_type, *args, **kwargs):
        if sub_processor_type == "tokenizer":
            return tokenizer
        return hook.__func__(cls, sub_processor_type, *args, **kwargs)

    ProcessorMixin._load_tokenizer_from_pretrained = classmethod(take)
    try:
        yield
    finally:
        ProcessorMixin._load_tokenizer_from_pretrained = hook
