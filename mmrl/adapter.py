"""The adapter contract: everything a model family declares about itself.

A family subclasses `ModelAdapter` (text) or `VisionLanguageAdapter` (images/videos),
fills in the class attributes below and registers with `@register_model`. The core,
the trainer and the probes read only these declarations; nothing outside the family's
module knows which family it is. Declarations are plain typed values, checked once at
registration (`ModelAdapter.validate`), so a missing or malformed field fails early.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from mmrl import imports
from mmrl.imports import split_spec

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    from mmrl.processing import Processing
    from mmrl.rope import RopeSpec

PART_NAMES = ("embed", "language", "lm_head", "vision", "projector")
LORA_SCOPES = ("language", "vision", "all")
MODALITIES = ("text", "image", "video")

# The usual projection names of a decoder layer; families reference these instead of
# spelling the list again.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ATTN_AND_MLP = ATTENTION + MLP
# Sibling projections that read the same input, merged into one product in the compiled
# rollout's decode steps (`mmrl.rollout.merged`).
MERGED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _as_paths(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True, slots=True)
class Parts:
    """Named module (or parameter) paths of a model, the same names for every family.

    A parameter belongs to the part with the longest path that prefixes its name, so a
    projector nested inside the vision tower (`model.visual.merger`) is the projector,
    not vision. Each part accepts one path or several.
    """

    language: tuple[str, ...]
    lm_head: tuple[str, ...] = ("lm_head",)
    embed: tuple[str, ...] = ()
    vision: tuple[str, ...] = ()
    projector: tuple[str, ...] = ()

    def __init__(self, language, lm_head="lm_head", embed=None, vision=None, projector=None):
        for name, value in zip(PART_NAMES, (embed, language, lm_head, vision, projector)):
            object.__setattr__(self, name, _as_paths(value))

    def items(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(name, getattr(self, name)) for name in PART_NAMES]


# The layout of most HF causal LMs: `model` (decoder stack), `model.embed_tokens`, `lm_head`.
DECODER_PARTS = Parts(language="model", embed="model.embed_tokens", lm_head="lm_head")
# The layout of HF vision-language models built as vision tower + projector + language model.
VISION_TOWER_PARTS = Parts(
    language="model.language_model", embed="model.language_model.embed_tokens", lm_head="lm_head",
    vision="model.vision_tower", projector="model.multi_modal_projector",
)


@dataclass(frozen=True, slots=True)
class LoraTargets:
    """Leaf module names that LoRA wraps, per scope. `all` is language plus vision."""

    language: tuple[str, ...] = ATTN_AND_MLP
    vision: tuple[str, ...] = ()

    def for_scope(self, scope: str) -> dict[str, tuple[str, ...]]:
        """Map part name -> leaf names that LoRA targets for `scope`."""
        if scope not in LORA_SCOPES:
            raise ValueError(f"lora scope must be one of {LORA_SCOPES}, got {scope!r}")
        wanted = {"language": ("language",), "vision": ("vision",), "all": ("language", "vision")}[scope]
        return {part: getattr(self, part) for part in wanted if getattr(self, part)}


@dataclass(frozen=True, slots=True)
class SequenceParallel:
    """What Ulysses sequence parallelism needs from a family.

    `heads_attrs` name the text-config fields whose values must be divisible by the
    sequence-parallel degree; `split_inputs` are the batch keys cut along the sequence
    (position ids are cut along their last dimension, which also covers 3-D mrope ids).
    `masked_inputs` pairs a (B, S) boolean mask the decoder gets with the inputs that hold
    one row per True position (row-major order; a tensor or a list of tensors): the mask
    is cut like the sequence, and those inputs keep the rows of this rank's positions.
    `gather_mixers` (for decoders Ulysses cannot split by heads: recurrent, state-space or
    convolution layers, attention outside transformers' attention interface): no head
    split; each sequence-mixing module runs on the gathered sequence and everything else
    on this rank's positions (mmrl.parallel.gathered); the other fields then do not apply.
    """

    heads_attrs: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads")
    split_inputs: tuple[str, ...] = ("input_ids", "position_ids", "labels")
    masked_inputs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    gather_mixers: bool = False


@dataclass(frozen=True, slots=True)
class Rollout:
    """How the rollout engines know this family.

    `weight_prefixes` rewrites HF parameter names into vLLM's, longest prefix first.
    `merged_projections`: groups of sibling linear layers (leaf names) that read the same
    input, run as one product in the compiled rollout's decode steps (`mmrl.rollout.merged`;
    a group whose members do not share their input runs unmerged, so a wrong guess costs
    speed, not results).
    """

    vllm_architecture: str | None = None
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    merged_projections: tuple[tuple[str, ...], ...] = MERGED_PROJECTIONS

    def to_vllm_name(self, name: str) -> str:
        for hf_prefix, vllm_prefix in sorted(self.weight_prefixes, key=lambda p: -len(p[0])):
            if name.startswith(hf_prefix):
                return vllm_prefix + name[len(hf_prefix):]
        return name


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Features the family claims. Probes verify each claim; a failed claim fails CI."""

    generation: bool = True
    padding_free: bool = True
    gradient_checkpointing: bool = True
    lora_language: bool = True
    lora_vision: bool = False
    single_image: bool = False
    multi_image: bool = False
    video: bool = False
    # The training stack: FSDP2 sharding and a critic's value head need nothing
    # family-specific, so every family claims them unless it opts out; vLLM (it needs a
    # vLLM architecture whose outputs match) and sequence parallelism are claimed per family.
    fsdp2: bool = True
    critic: bool = True
    sequence_parallel: bool = False
    vllm: bool = False
    # Encoding a repeated prompt's images/videos once per batch (mmrl.engine.media) needs
    # only transformers' get_image_features/get_video_features: claimed unless opted out
    # (text families have no media, and their cell is n/a).
    media_sharing: bool = True
    # Images arriving mid-conversation in the agent loop (mmrl.rollout.agent) train as the
    # final conversation processed in one go; claimed per family (the prefix rule).
    multi_turn: bool = False

    def declared(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]

    @classmethod
    def none(cls) -> Capabilities:
        """Nothing claimed: for a family whose tiny model does not run yet."""
        return cls(**{f.name: False for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A random-init configuration plus the processor that matches it."""

    config: Any
    processor: Any
    notes: str = ""


def import_object(spec: str) -> Any:
    """The class `"package.module:Class"` (or `"package.module.Class"`) names: mmrl.imports'
    reader, so a wrong name is one line naming the spec and what the module defines."""
    return imports.import_object(spec, what="class", kind="class")


def lined_up_with_input_ids(module, args, kwargs, output):
    """Forward hook: an output whose logits (and hidden states) run longer than the
    input_ids, with positions of the model's own in front (media it embeds and prepends
    itself), cut to the last input_ids.shape[1] positions, as mmrl reads them. Shorter
    outputs (`logits_to_keep`, a cached decoding step) are left as they are."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if getattr(input_ids, "dim", lambda: 0)() != 2 or not hasattr(output, "logits"):
        return None
    length = input_ids.shape[1]

    def cut(tensor):
        longer = getattr(tensor, "dim", lambda: 0)() == 3 and tensor.shape[1] > length
        return tensor[:, -length:] if longer else tensor

    output.logits = cut(output.logits)
    if isinstance(getattr(output, "hidden_states", None), tuple):
        output.hidden_states = tuple(cut(h) for h in output.hidden_states)
    return output


def _computes_own_positions(model) -> bool:
    """Whether the model (or its inner model) computes multi-axis rope positions itself;
    under a PEFT wrapper, the wrapped model's."""
    from mmrl.positions import rope_index_owner

    return rope_index_owner(model) is not None


class ModelAdapter:
    """A text model family. Subclasses set the class attributes; hooks have defaults.

    Required: `family`, `model_types`, `hf_class`, `parts`, `shard_layers`,
    `tiny` (a method). Everything else has a default suitable for a decoder-only model.
    """

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    hf_class: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]] = ()
    modalities: ClassVar[tuple[str, ...]] = ("text",)
    parts: ClassVar[Parts]
    shard_layers: ClassVar[tuple[str, ...]]
    lora: ClassVar[LoraTargets] = LoraTargets()
    sequence_parallel: ClassVar[SequenceParallel | None] = SequenceParallel()
    rollout: ClassVar[Rollout] = Rollout()
    capabilities: ClassVar[Capabilities] = Capabilities()
    processing: ClassVar[type[Processing] | str] = "mmrl.processing:Processing"
    # Keyword arguments for `processing` (pixel budget defaults and the like).
    processing_options: ClassVar[dict[str, Any]] = {}
    # Whether a left-padded batch equals each prompt alone. Not so where the forward
    # ignores the mask for the pads in front (a recurrent state, positions counted from the
    # tensor's start): with False the engine runs each sequence in a row of its own,
    # right-padded, and HF rollout generates the prompts of one length at a time. The
    # padded-batch probe checks the layout the family declares.
    left_padding: ClassVar[bool] = True
    # Whether the model's outputs hold positions of its own in front of the input tokens
    # (image features it prepends itself rather than placing at placeholder tokens), so its
    # logits run longer than input_ids: with True, `on_load` lines them up with input_ids
    # again (`lined_up_with_input_ids`), as the engine and the probes read them.
    prepends_positions: ClassVar[bool] = False

    REQUIRED: ClassVar[tuple[str, ...]] = ("family", "model_types", "hf_class", "parts", "shard_layers")

    # -- registration ------------------------------------------------------------------
    @classmethod
    def validate(cls) -> None:
        """Raise TypeError naming the first missing or malformed declaration."""
        where = f"{cls.__module__}.{cls.__qualname__}"
        for name in cls.REQUIRED:
            if not hasattr(cls, name):
                raise TypeError(f"{where}: adapter is missing required field {name!r}")
        if not isinstance(cls.family, str) or not cls.family:
            raise TypeError(f"{where}: 'family' must be a non-empty string")
        for name in ("model_types", "shard_layers", "modalities", "architectures"):
            value = getattr(cls, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"{where}: {name!r} must be a tuple of strings, got {value!r}")
        if not cls.model_types:
            raise TypeError(f"{where}: 'model_types' must name at least one HF model_type")
        if ":" not in cls.hf_class:
            raise TypeError(f"{where}: 'hf_class' must read 'module:ClassName', got {cls.hf_class!r}")
        if not isinstance(cls.parts, Parts) or not cls.parts.language:
            raise TypeError(f"{where}: 'parts' must be a Parts with a language path")
        for typed, kind in (("lora", LoraTargets), ("rollout", Rollout), ("capabilities", Capabilities)):
            if not isinstance(getattr(cls, typed), kind):
                raise TypeError(f"{where}: {typed!r} must be a {kind.__name__}")
        unknown = set(cls.modalities) - set(MODALITIES)
        if unknown or "text" not in cls.modalities:
            raise TypeError(f"{where}: 'modalities' must include 'text' and only {MODALITIES}")
        if cls.capabilities.lora_vision and not cls.lora.vision:
            raise TypeError(f"{where}: capabilities.lora_vision is declared but lora.vision is empty")
        if cls.capabilities.vllm and not cls.rollout.vllm_architecture:
            raise TypeError(f"{where}: capabilities.vllm is declared but rollout.vllm_architecture is unset")
        if cls.tiny is ModelAdapter.tiny:
            raise TypeError(f"{where}: adapter must implement tiny() (a random-init config and processor)")

    # -- identity ----------------------------------------------------------------------
    @property
    def hf_architectures(self) -> tuple[str, ...]:
        return self.architectures or (split_spec(self.hf_class)[1],)

    @property
    def is_multimodal(self) -> bool:
        return len(self.modalities) > 1

    def model_class(self) -> type[PreTrainedModel]:
        return import_object(self.hf_class)

    def processing_class(self) -> type[Processing]:
        cls = self.processing
        return import_object(cls) if isinstance(cls, str) else cls

    # -- hooks with defaults -----------------------------------------------------------
    def tiny(self) -> TinyModel:
        """A random-init config and an offline processor, small enough for CPU tests."""
        raise NotImplementedError

    def rope(self, config: PretrainedConfig | dict) -> RopeSpec:
        """The family's rope settings, normalized.

        A raw config.json dict is first materialized with the family's HF config class,
        so defaults a sparse file omits (and legacy keys transformers converts) count.
        Families whose model code holds rope defaults override this."""
        from mmrl.rope import RopeSpec

        if isinstance(config, dict):
            config = self.config_from_dict(config)
        return RopeSpec.from_config(config)

    def config_from_dict(self, values: dict) -> PretrainedConfig:
        """The HF config object for a raw config.json dict of this family."""
        from transformers import AutoConfig

        values = dict(values)
        model_type = values.pop("model_type", self.model_types[0])
        return AutoConfig.for_model(model_type, **values)

    def position_ids(self, model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Position ids for a left- or right-padded batch: (B, L), or (C, B, L) for
        multi-axis (mrope) positions; `mmrl.positions.pack` keeps the leading axis.

        The default counts each sequence's tokens. For a model that computes multi-axis
        rope positions itself (it has transformers' `get_rope_index`) it returns None: the
        model then derives them from the batch (attention mask, media token types, grids),
        which is right for padded batches; packing such a family needs an override that
        writes them out (its padding_free probe says so)."""
        from mmrl.positions import sequential_positions

        if _computes_own_positions(model):
            return None
        return sequential_positions(batch["attention_mask"])

    def prepare_model(self, model: PreTrainedModel) -> PreTrainedModel:
        """Fix-ups a freshly built random-init model needs (e.g. zero-initialized weights)."""
        return model

    def on_load(self, model: PreTrainedModel) -> PreTrainedModel:
        """Fix-ups every built or loaded model gets, such as a forward hook that works
        around a bug of the model code (random init and checkpoints alike). The default
        lines up the outputs of a model that `prepends_positions`; an override that
        declares it calls this too."""
        if self.prepends_positions:
            model.register_forward_hook(lined_up_with_input_ids, with_kwargs=True)
        return model

    def __repr__(self) -> str:
        return f"<{type(self).__name__} family={self.family!r} model_types={self.model_types}>"


class VisionLanguageAdapter(ModelAdapter):
    """A family that reads images (and possibly videos) besides text."""

    modalities: ClassVar[tuple[str, ...]] = ("text", "image")
    capabilities: ClassVar[Capabilities] = Capabilities(single_image=True, multi_image=True)
    # Whether the model's encoder runs once per image: for a tower that lets a batch's
    # images attend to each other (transformers' code for some towers), so that an image's
    # features, and a prompt's log-probs, do not change with the batch it is in. With True,
    # `on_load` wraps the encoder (`mmrl.encoder_calls.encode_each_image_alone`).
    encode_images_alone: ClassVar[bool] = False
    REQUIRED = ModelAdapter.REQUIRED

    def on_load(self, model: PreTrainedModel) -> PreTrainedModel:
        model = super().on_load(model)
        if self.encode_images_alone:
            from mmrl.encoder_calls import encode_each_image_alone

            encode_each_image_alone(model)
        return model

    @classmethod
    def validate(cls) -> None:
        super().validate()
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not cls.parts.vision:
            raise TypeError(f"{where}: a vision-language adapter needs parts.vision")
        if "image" not in cls.modalities:
            raise TypeError(f"{where}: a vision-language adapter must list 'image' in modalities")
        if cls.capabilities.video and "video" not in cls.modalities:
            raise TypeError(f"{where}: capabilities.video is declared but 'video' is not a modality")

