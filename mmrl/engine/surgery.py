"""Every change mmrl makes to a HuggingFace model, as an ordered list of steps.

An `Engine` settles its options once (`resolve`: every "auto" decided for this model,
process and device) and then runs `apply_all`, which calls these steps in this order on
the model it was given (each takes the model and the `Settings`, and returns what it
installed; `Changes` records it):

1. `apply_device`: the model moves to this process's device.
2. `apply_dropout_off`: every dropout probability set to 0 (`disable_dropout` says why),
   unless the engine keeps dropout (`dropout=True`).
3. `apply_ulysses`: Ulysses sequence parallelism's attention and input splitting
   (`mmrl.parallel.ulysses`; `mmrl.parallel.gathered` where the family gathers its
   mixers), with `dist.sequence_parallel` > 1.
4. `apply_stateful_layers`: with packed rows, the convolution, state-space and
   linear-attention mixers of the layers the config marks stateful run one sequence a row
   (`mmrl.engine.stateful_layers`), so no state crosses a packed sequence boundary.
5. `apply_checkpointing`: activation checkpointing (`gradient_checkpointing: true`, or
   "auto" on sharded GPU ranks: `mmrl.settle.checkpointing_choice`); `enable_checkpointing`
   turns it on later too (after an out-of-memory update, `after_oom`).
6. `apply_varlen`: the flash varlen attention for packed rows on a GPU
   (`mmrl.engine.varlen`).
7. `apply_compiled_layers`: the text decoder's layers compiled in the engine's forwards
   (`mmrl.engine.compiled_layers`), except those of step 4 (their segments are
   data-dependent), which stay eager.
8. `apply_vision_attention`: the vision tower's per-image attention in one call per
   layer, where the model code allows it (`mmrl.engine.vision_attention`).
9. `apply_fsdp`: with several processes, FSDP2's `fully_shard` on the family's
   `shard_layers`, then the root and the value head; trainable half-precision parameters
   are upcast to fp32 first (the shards are then the master weights, `mmrl.engine.optimizer`).
10. `apply_frozen`: an engine that does not train freezes every parameter and runs in
    eval mode; one that trains runs in training mode (a loaded checkpoint comes in eval mode).

Elsewhere, and only there: `mmrl.build.build_model` loads the model in the recipe's dtype
and attention; before the engine the trainer freezes the recipe's parts
(`mmrl.parts.freeze`) and wraps LoRA adapters (`mmrl.lora.apply_lora`); the compiled
rollout switches the text decoder's attention for the span of a decode
(`mmrl.rollout.compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import mmrl.engine.stateful_layers as stateful_layers
import mmrl.engine.varlen as varlen
import mmrl.engine.vision_attention as vision_attention
from mmrl.boundaries import unverified_layer_kinds, unverified_ulysses
from mmrl.engine.compiled_layers import CompiledLayers
from mmrl.engine.master_weights import HALF_DTYPES, needs_master
from mmrl.engine.shard_units import shard_groups
from mmrl.parallel import Dist, gathered, ulysses
from mmrl.parts import decoder_layers as find_decoder_layers
from mmrl.settle import AFTER_OOM, checkpointing_choice, compile_layers_choice


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """The engine's options settled for one model, process and device (`resolve`)."""

    adapter: object  # the family's `ModelAdapter`
    dist: Dist
    trains: bool  # the engine has an optimizer
    dropout: bool  # keep the model's dropout
    checkpointing: bool  # activation checkpointing from the start
    checkpointing_auto: bool  # `gradient_checkpointing: auto` (turned on after an OOM)
    pack: bool  # packed (padding-free) rows
    varlen: bool  # try the flash varlen kernel (packed rows on a GPU, no Ulysses)
    compile_layers: bool
    compile_layers_asked: bool  # `compile_layers=True`: a model without decoder layers is an error
    half_dtype: torch.dtype | None  # trainable weights that step through fp32 masters; None: no masters
    mixed_precision: bool  # bf16 compute on GPUs

    @property
    def sequence_parallel(self) -> int:
        return self.dist.sequence_parallel

    @property
    def sharded(self) -> bool:
        return self.dist.distributed


@dataclass(kw_only=True, slots=True)
class Changes:
    """What `apply_all` installed, by step."""

    dropout_off: list[str] = field(default_factory=list)  # "module.attribute=old value"
    ulysses: bool = False
    stateful_layers: int = 0  # mixers run one packed sequence a row
    checkpointing: bool = False  # whether the model recomputes activations in backward now
    varlen: bool = False
    compiled_layers: CompiledLayers | None = None
    vision_attention: bool = False
    upcast: set[str] = field(default_factory=set)  # parameter names upcast to fp32 shards (masters)
    frozen: bool = False


def resolve(model: torch.nn.Module, adapter, dist: Dist, *, trains: bool, pack: bool, dropout: bool,
            gradient_checkpointing: bool | str, compile_layers: bool | str, master_weights: bool,
            mixed_precision: bool, require_compiled_layers: bool | None = None) -> Settings:
    """`Settings` from the engine's options (`pack` already resolved): each "auto" decided
    by the rules of `mmrl.settle` (a trainer passes them settled already), each option
    checked. `require_compiled_layers` (None: `compile_layers is True`): a model whose
    decoder layers cannot be found for compiling is an error, not a model left uncompiled."""
    checkpointing = checkpointing_choice(gradient_checkpointing, dist).value
    on_gpu = dist.device.type == "cuda"
    half = {p.dtype for p in model.parameters() if p.requires_grad and p.dtype in HALF_DTYPES}
    if len(half) > 1:
        raise ValueError(f"trainable parameters mix half-precision dtypes {sorted(map(str, half))}")
    return Settings(
        adapter=adapter, dist=dist, trains=trains, dropout=dropout,
        checkpointing=checkpointing is True,
        checkpointing_auto=checkpointing == AFTER_OOM or gradient_checkpointing == "auto",
        pack=pack, varlen=pack and on_gpu and dist.sequence_parallel == 1,
        compile_layers=compile_layers_choice(compile_layers, dist).value,
        compile_layers_asked=compile_layers is True if require_compiled_layers is None else require_compiled_layers,
        half_dtype=next(iter(half)) if trains and master_weights and half else None,
        mixed_precision=mixed_precision,
    )


def apply_all(model: torch.nn.Module, settings: Settings, value_head: torch.nn.Module | None = None) -> Changes:
    """Every step of the module docstring, in its order. `value_head` (a critic's) is
    sharded and frozen with the model."""
    apply_device(model, settings)
    return Changes(  # keyword arguments run in the order written
        dropout_off=apply_dropout_off(model, settings),
        ulysses=apply_ulysses(model, settings),
        stateful_layers=apply_stateful_layers(model, settings),
        checkpointing=apply_checkpointing(model, settings),
        varlen=apply_varlen(model, settings),
        compiled_layers=apply_compiled_layers(model, settings),
        vision_attention=apply_vision_attention(model, settings),
        upcast=apply_fsdp(model, settings, value_head),
        frozen=apply_frozen(model, settings, value_head),
    )


def apply_device(model: torch.nn.Module, settings: Settings) -> None:
    model.to(settings.dist.device)


# Names of the probabilities with which models drop activations, attention weights,
# whole layers (LayerDrop) or residual branches (stochastic depth) in training mode.
DROPOUT_NAMES = ("dropout", "pdrop", "drop_prob", "layerdrop", "drop_path")


def _is_drop_probability(name: str, value) -> bool:
    return isinstance(value, float) and value > 0 and any(part in name.lower() for part in DROPOUT_NAMES)


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout probability that `model` applies in training mode to 0, and
    return what was changed: `nn.Dropout` modules (LoRA's too), float probabilities that
    modules hold for functional dropout, LayerDrop and stochastic depth, and the configs'
    fields (some forwards read them there). The model stays in training mode, which
    gradient checkpointing is gated on.

    Policy-gradient updates weight the log-probs of sampled tokens against the rollout's
    and the old and reference policies' (all computed without dropout): dropout in the
    update alone makes the ratios noise, so RL trainers switch it off."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            changed.append(f"{name or 'model'}.p={module.p}")
            module.p = 0.0
            continue
        for attribute, value in list(vars(module).items()):
            if _is_drop_probability(attribute, value):
                changed.append(f"{name or 'model'}.{attribute}={value}")
                setattr(module, attribute, 0.0)
    configs, seen = [getattr(model, "config", None)], set()
    while configs:
        config = configs.pop()
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        for attribute, value in list(vars(config).items()):
            if _is_drop_probability(attribute, value):
                setattr(config, attribute, 0.0)
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
                configs.append(value)  # a sub-config (text, vision, ...)
    return changed


def apply_dropout_off(model: torch.nn.Module, settings: Settings) -> list[str]:
    """Dropout off unless asked for; an engine that does not train runs in eval mode anyway."""
    return [] if settings.dropout else disable_dropout(model)


def apply_ulysses(model: torch.nn.Module, settings: Settings) -> bool:
    """Ulysses sequence parallelism over the ranks of dist's SP group (1: off), or gathered
    mixers where the family asks for them (`SequenceParallel.gather_mixers`)."""
    if settings.sequence_parallel == 1:
        return False
    if settings.adapter.sequence_parallel is not None and settings.adapter.sequence_parallel.gather_mixers:
        gathered.install(model, settings.adapter)
    else:
        if unverified := unverified_layer_kinds(settings.adapter, model.config):
            raise ValueError(unverified_ulysses(settings.adapter, unverified))
        ulysses.install(model, settings.adapter)
    return True


def enable_checkpointing(model: torch.nn.Module, settings: Settings) -> bool:
    """Recompute each layer's activations in the backward pass instead of keeping them;
    returns whether the model now does."""
    kwargs = {"use_reentrant": False}
    if settings.sequence_parallel > 1:
        kwargs["context_fn"] = ulysses.checkpoint_context
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return checkpoints(model)


def checkpoints(model: torch.nn.Module) -> bool:
    """Whether `model` recomputes activations in backward. transformers' flag walks every
    module, which adds up when asked per layer call: the engine reads it once and keeps
    the answer."""
    return bool(getattr(model, "is_gradient_checkpointing", False))


def apply_stateful_layers(model: torch.nn.Module, settings: Settings) -> int:
    """Packed rows: the stateful layers' mixers run per sequence; how many there are."""
    return len(stateful_layers.install(model, settings.adapter)) if settings.pack else 0


def apply_checkpointing(model: torch.nn.Module, settings: Settings) -> bool:
    """Activation checkpointing where the settings ask for it; returns whether the model
    checkpoints (it may have been built so)."""
    return enable_checkpointing(model, settings) if settings.checkpointing else checkpoints(model)


def decoder_layers(model: torch.nn.Module, adapter) -> list[torch.nn.Module]:
    """The text decoder's layers (`mmrl.parts.decoder_layers`); empty where not found."""
    try:
        return find_decoder_layers(model, adapter)
    except ValueError:
        return []


def apply_varlen(model: torch.nn.Module, settings: Settings) -> bool:
    """Packed rows on a GPU: flash varlen attention where the mask is document-causal."""
    if not settings.varlen:
        return False
    return varlen.available() and varlen.install(model, decoder_layers(model, settings.adapter))


def apply_compiled_layers(model: torch.nn.Module, settings: Settings) -> CompiledLayers | None:
    """The text decoder's layers compiled in the log-prob and value forwards; None where
    they are not (or cannot be found)."""
    if not settings.compile_layers:
        return None
    layers = decoder_layers(model, settings.adapter)
    if not layers and settings.compile_layers_asked:
        raise ValueError("compile_layers: cannot find the text decoder's layers to compile")
    per_sequence = stateful_layers.hooked_layers(layers)
    layers = [layer for layer in layers if id(layer) not in per_sequence]
    return CompiledLayers(layers) if layers else None


def apply_vision_attention(model: torch.nn.Module, settings: Settings) -> bool:
    """The vision tower's per-image/per-window attention in one call per layer, where the
    model code offers a sequence-boundaries path."""
    return vision_attention.install(model)


def apply_fsdp(model: torch.nn.Module, settings: Settings, value_head: torch.nn.Module | None = None) -> set[str]:
    """FSDP2 over the family's `shard_layers`, the root and `value_head`, when several
    processes run; returns the names (in `model`) of the parameters upcast to fp32 first,
    whose shards are the master weights."""
    if not settings.sharded:
        return set()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist, half = settings.dist, settings.half_dtype
    policy = None
    if half is not None:
        # FSDP2 over fp32 parameters with a half param_dtype is a master-weight scheme:
        # the fp32 shards are what AdamW steps, the all-gathered copies are half.
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    elif dist.device.type == "cuda" and settings.mixed_precision:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mesh": dist.mesh, **({"mp_policy": policy} if policy else {})}
    # Nested shard layers first, layers tied to each other in one unit (shard_units says why).
    groups = shard_groups(model, set(settings.adapter.shard_layers))
    groups += [[model]] + ([[value_head]] if value_head is not None else [])
    upcast_names = {name for name, p in model.named_parameters(remove_duplicate=False) if needs_master(p, half)}
    upcast: set[int] = set()
    for group in groups:
        if half is not None:
            # Unit by unit, just before its shard: one layer at a time exists in fp32
            # unsharded, not the whole model.
            for param in (p for module in group for p in module.parameters()):
                if id(param) not in upcast and needs_master(param, half):
                    param.data = param.data.float()
                    upcast.add(id(param))
        fully_shard(group if len(group) > 1 else group[0], **kwargs)
    sharded = [module for group in groups for module in group]
    if settings.sequence_parallel > 1:
        # Each rank of an SP group holds a partial gradient of the same batch: sum
        # them, and average over the data-parallel groups only.
        for module in sharded:
            module.set_gradient_divide_factor(float(dist.dp_size))
            if dist.device.type != "cuda":  # gloo has no pre-multiplied sum
                module.set_force_sum_reduction_for_comms(True)
    # FSDP2 picks its root at the first forward it sees. HF generate may call a
    # submodule first (the vision encoder, before prefill), so settle the root now.
    model._get_fsdp_state()._lazy_init()
    return upcast_names


def apply_frozen(model: torch.nn.Module, settings: Settings, value_head: torch.nn.Module | None = None) -> bool:
    """An engine that does not train: no parameter needs a gradient, and eval mode. One
    that trains runs in training mode: `from_pretrained` leaves a model in eval mode,
    where transformers skips activation checkpointing and LoRA its dropout."""
    if settings.trains:
        model.train()
        return False
    heads = [value_head] if value_head is not None else []
    for module in [model, *heads]:
        module.requires_grad_(False)
    model.eval()
    return True
