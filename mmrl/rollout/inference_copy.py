"""The compiled rollout's inference copy of sharded (FSDP2) weights.

Under FSDP2 every forward of the engine's model is collective, so plain `generate` steps
every rank together (`synced_gpus`) and no rank can run a decode loop of its own. The
compiled rollout (`mmrl.rollout.compiled`) instead decodes each rank's prompts on an
unsharded copy of the full weights, built once from the model's class and config and
refreshed from the shards after each update:

    copy = InferenceCopy(engine, keep="auto")   # every rank; sized against free GPU memory
    model = copy.refresh(engine)                # every rank: gathered module by module
    ... each rank decodes its own prompts on `model` ...
    copy.release()                              # its memory back, unless it is kept

The copy computes in the dtype the sharded forward computes in (FSDP2's param dtype: bf16
on CUDA with mixed precision; else the weights' own, so a CPU test compares exactly).
The gather is `DTensor.full_tensor`, the collective the state-dict path
(`mmrl.engine.state.full_weights`, which vLLM's weight sync uses) runs for every tensor at
once, here one module at a time: beside the copy only one full tensor is in flight, not a
second model. LoRA adapters are merged into their layers' weights as
`mmrl.lora.merged_state_dict` merges them.

`keep`: "keep" holds the copy between rollouts and refreshes it in place (a compiled CUDA
graph replays on the same addresses); "free" releases its storage after each rollout
(the next refresh allocates it again, so CUDA graphs record anew); "auto" keeps it when
it takes at most 1 / KEEP_SHARE of the free memory measured at the start, less what the
first update will add (AdamW's moments and the gradients of the trainable shards), and
always on the CPU. Where the copy and the largest gathered tensor do not fit in the free
GPU memory of every rank (less AdamW's moments), building one raises `CopyDoesNotFit`
(its message is one line).
"""

from __future__ import annotations

import copy as copying

import torch

from mmrl.engine import varlen, vision_attention
from mmrl.parallel import Dist, ulysses
from mmrl.wrappers import unwrapped

# "auto" keeps the copy between rollouts when it takes at most 1 / KEEP_SHARE of the free
# device memory measured before the first step: the rest is left to the update.
KEEP_SHARE = 2
KEEP_CHOICES = ("auto", "keep", "free")
# peft's prefix on the names of a wrapped model's weights (as in `mmrl.lora`).
_PEFT_PREFIX = "base_model.model."
_GIB = 1024 ** 3


class CopyDoesNotFit(ValueError):
    """The inference copy does not fit in a rank's free device memory."""


def copy_dtype(engine) -> torch.dtype:
    """The dtype the sharded forward computes in (`mmrl.engine.surgery.apply_fsdp`'s
    policy): the half dtype of master-weight training, bf16 on CUDA with mixed precision,
    else the weights' own."""
    if engine.settings.half_dtype is not None:
        return engine.settings.half_dtype
    if engine.dist.device.type == "cuda" and engine.mixed_precision:
        return torch.bfloat16
    return next(p.dtype for p in engine.model.parameters() if p.is_floating_point())


def copy_bytes(engine, dtype: torch.dtype) -> tuple[int, int]:
    """The copy's bytes in `dtype` (each weight once, LoRA adapters merged away), and the
    bytes of the largest full tensor the gather holds at once (in the shards' dtype)."""
    total = largest = 0
    for name, parameter in _unique_parameters(engine.model):
        if ".lora_" in name:
            continue
        total += parameter.numel() * dtype.itemsize  # a DTensor's numel is its full shape's
        largest = max(largest, parameter.numel() * parameter.dtype.itemsize)
    return total, largest


def pending_training_bytes(engine) -> tuple[int, int]:
    """Bytes this rank's training state will take once the first update runs, beside the
    free memory measured before it: AdamW's two fp32 moments of each trainable shard (kept
    from then on, so they are there at every later rollout), and its fp32 gradients (during
    each update only). (0, 0) for an engine that does not train or has stepped already."""
    stepper = getattr(engine, "stepper", None)
    if stepper is None or len(stepper.optimizer.state):
        return 0, 0
    shard = sum(_local(p).numel() for p in engine.parameters() if p.requires_grad) * 4
    return 2 * shard, shard


def free_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take: the driver's free memory and the
    blocks torch's allocator holds unused; None off CUDA (not measured)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class InferenceCopy:
    """An unsharded copy of `engine`'s model for decoding, in `copy_dtype(engine)`.
    Building it is collective (every rank measures its free memory; all decide alike)."""

    def __init__(self, engine, keep: str = "auto"):
        if keep not in KEEP_CHOICES:
            raise ValueError(f"rollout.inference_copy must be one of {', '.join(KEEP_CHOICES)}, got {keep!r}")
        self.dist: Dist = engine.dist
        self.dtype = copy_dtype(engine)
        self.bytes, gather_bytes = copy_bytes(engine, self.dtype)
        free = free_memory(self.dist.device)
        moments, gradients = pending_training_bytes(engine)
        if free is not None:
            free -= moments  # AdamW's state, there from the first update on
        frees = [f for f in self.dist.all_gather_objects(free) if f is not None]
        self.free_bytes = min(frees) if frees else None  # the fullest rank's
        if self.free_bytes is not None and self.bytes + gather_bytes > self.free_bytes:
            raise CopyDoesNotFit(
                f"the compiled rollout's inference copy of the full weights ({_size(self.bytes)} in "
                f"{str(self.dtype).removeprefix('torch.')}, plus {_size(gather_bytes)} to gather) does not "
                f"fit in the free GPU memory of every rank ({_size(self.free_bytes)} on the fullest)")
        if keep == "auto":
            # Kept, the copy is there during the update too, beside the gradients.
            room = None if self.free_bytes is None else self.free_bytes - gradients
            keep = "keep" if room is None or self.bytes * KEEP_SHARE <= room else "free"
        self.keep = keep == "keep"
        # The fix-ups every built or loaded model of the family gets (`mmrl.build`).
        self.model = engine.adapter.on_load(_empty_copy(engine.model, self.dtype, self.dist.device))
        if engine.vision_one_call:  # the prefill's vision tower as fast as the engine's
            vision_attention.install(self.model)
        self.fresh = False  # whether the copy holds the engine's current weights
        self._allocated = True

    def stale(self) -> None:
        """The engine's weights changed (an update): the next `refresh` gathers them."""
        self.fresh = False

    @torch.no_grad()
    def refresh(self, engine) -> torch.nn.Module:
        """The copy with the engine's current weights (gathered when they changed since the
        last refresh; collective then, on every rank in the same order)."""
        if self.fresh:
            return self.model
        self._allocate()
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        filled: set[int] = set()
        merged_under: list[str] = []  # LoRA layers: their submodules are merged already

        def write(name: str, value: torch.Tensor) -> None:
            target = targets.get(_copy_name(name))
            if target is None:
                raise ValueError(f"the inference copy has no weight {_copy_name(name)!r} (from {name!r})")
            target.copy_(value)
            filled.add(id(target))

        seen: set[int] = set()
        for module_name, module in engine.model.named_modules():
            if any(module_name.startswith(prefix) for prefix in merged_under):
                continue
            if _is_lora_layer(module):
                merged_under.append(module_name + ".")
                for name, value in _merged_lora(module).items():
                    write(f"{module_name}.{name}", value)
                continue
            for name, parameter in module.named_parameters(recurse=False):
                if id(parameter) in seen:
                    continue  # a tied weight, written with its first name
                seen.add(id(parameter))
                write(f"{module_name}.{name}" if module_name else name, _full(parameter))
        missing = [name for name, p in targets.items() if id(p) not in filled]
        if missing:
            raise ValueError(f"the engine's weights left {len(missing)} of the inference copy's unset, "
                             f"e.g. {missing[0]!r}")
        self.fresh = True
        return self.model

    def release(self) -> None:
        """Free the copy's weight memory unless it is kept (the next `refresh` gathers
        again)."""
        if self.keep or not self._allocated:
            return
        for parameter in _unique_parameters(self.model, names=False):
            parameter.untyped_storage().resize_(0)
        self._allocated = False
        self.fresh = False

    def _allocate(self) -> None:
        if self._allocated:
            return
        for parameter in _unique_parameters(self.model, names=False):
            parameter.untyped_storage().resize_(parameter.numel() * parameter.element_size())
        self._allocated = True

    def resident_bytes(self) -> int:
        """Bytes the copy's weights hold now (0 once released)."""
        return sum(p.untyped_storage().nbytes() for p in _unique_parameters(self.model, names=False))


def _empty_copy(source: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A plain (unsharded) model of `source`'s class and config on `device`: weights in
    `dtype`, uninitialised; buffers (rope frequencies and the like) copied from `source`
    as they are."""
    base = unwrapped(source)
    cls = _unsharded_class(type(base))
    config = copying.deepcopy(base.config)
    _plain_attention(config)
    with torch.device("meta"):
        model = cls._from_config(config)
    model.generation_config = copying.deepcopy(base.generation_config)
    buffers = dict(base.named_buffers())
    replaced: dict[int, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            if id(parameter) not in replaced:  # tied weights stay one tensor
                replaced[id(parameter)] = torch.nn.Parameter(
                    torch.empty(parameter.shape, dtype=dtype if parameter.is_floating_point() else parameter.dtype,
                                device=device), requires_grad=False)
            module._parameters[name] = replaced[id(parameter)]
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            if full not in buffers:
                raise ValueError(f"the engine's model has no buffer {full!r} to copy into its inference copy")
            module._buffers[name] = buffers[full].detach().to(device).clone()
    model.eval()
    model.requires_grad_(False)
    return model


def _plain_attention(config) -> None:
    """Give back the attention implementations that the engine's surgery replaced with
    its own (`mmrl.engine.varlen`, `mmrl.engine.vision_attention`, Ulysses') the one they
    stand in for, config by config: transformers builds no model on an unknown name, and
    the copy's modules carry none of the surgery's hooks (each rank decodes whole
    sequences of its own)."""
    replaced = {varlen.NAME: varlen.BASE, vision_attention.NAME: vision_attention.BASE, **ulysses.BASES}
    pending = [config]
    while pending:
        current = pending.pop()
        if current._attn_implementation in replaced:
            current._attn_implementation = {"": replaced[current._attn_implementation]}  # this config only
        pending += [getattr(current, key) for key in current.sub_configs if getattr(current, key, None) is not None]


def _unsharded_class(cls: type) -> type:
    """The model class under FSDP2's per-instance subclass (`FSDP<Name>`)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def _unique_parameters(model: torch.nn.Module, names: bool = True):
    seen: set[int] = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) not in seen:
            seen.add(id(parameter))
            yield (name, parameter) if names else parameter


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly sharded) parameter."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) parameter: an all-gather for a DTensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def _copy_name(name: str) -> str:
    """The plain model's name for a weight of the engine's (peft's prefix and
    `base_layer` gone, as `mmrl.lora.merged_state_dict` names them)."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "active_adapters")


def _merged_lora(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA layer's base weights with its active adapters folded in, W + scale * B @ A,
    computed as `mmrl.lora.merged_state_dict` computes it (gathered when sharded)."""
    merged = {name: _full(p) for name, p in module.base_layer.named_parameters()}
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            continue
        a = _full(module.lora_A[adapter].weight).float()
        b = _full(module.lora_B[adapter].weight).float()
        delta = (b @ a) * module.scaling[adapter]
        merged["weight"] = (merged["weight"].float() + delta).to(merged["weight"].dtype)
    return merged


def describe(copy: InferenceCopy) -> str:
    """A few words on the copy for the run's summary: its size, dtype and whether it is kept."""
    free = "" if copy.free_bytes is None else f" of {_size(copy.free_bytes)} free"
    return (f"inference copy {_size(copy.bytes)} in {str(copy.dtype).removeprefix('torch.')}{free}, "
            f"{'kept between rollouts' if copy.keep else 'freed after each rollout'}")


def _size(count: int) -> str:
    return f"{count / _GIB:.1f} GiB" if count >= _GIB // 10 else f"{count / 1024 ** 2:.1f} MiB"


__all__ = ["CopyDoesNotFit", "InferenceCopy", "KEEP_CHOICES", "copy_bytes", "copy_dtype", "describe", "free_memory",
           "pending_training_bytes"]
