"""An engine's weights and training state, out and back in.

    state = state_module(engine.model, engine.value_head)     # what a checkpoint names
    save(path, state, engine.stepper, dist)                   # model.safetensors + optimizer.pt
    load(path, state, engine.stepper, dist)                   # the run resumes exactly
    weights = full_weights(engine.model, dist, engine.stepper)  # HF-named, LoRA merged

A checkpoint folder holds `model.safetensors` (the weights under the state module's names,
the fp32 masters where the engine trains through them) and `optimizer.pt` (AdamW's state,
the schedule and the loss scale: `Optimizer.schedule_state`). Sharded engines gather full
state dicts on rank 0, which writes; every rank loads the full files. The trainer's
checkpoints (`mmrl.checkpoint`) hold one such folder per engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from mmrl.engine.optimizer import Optimizer
from mmrl.lora import merged_state_dict
from mmrl.parallel import Dist

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


def state_module(model: torch.nn.Module, value_head: torch.nn.Module | None = None) -> torch.nn.Module:
    """The module whose state dict a checkpoint holds: the model, or with a critic's value
    head both, under `model.` and `value_head.`."""
    if value_head is None:
        return model
    return torch.nn.ModuleDict({"model": model, "value_head": value_head})


def named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Parameters under their state-dict names, tied ones under each of their names."""
    return module.named_parameters(remove_duplicate=False)


def masters(module: torch.nn.Module, stepper: Optimizer | None) -> dict[str, torch.Tensor]:
    """The fp32 masters by state-dict name (local shards when sharded); empty without."""
    return stepper.masters_by_name(named_parameters(module)) if stepper else {}


def full_weights(model: torch.nn.Module, dist: Dist, stepper: Optimizer | None, *, value_head=None,
                 every_rank: bool = False) -> dict[str, torch.Tensor]:
    """HF-named full weights on CPU, LoRA merged in when present. When sharded, only
    rank 0 gets them (the others an empty dict) unless `every_rank`, which gathers
    them on every rank's device first (a colocated rollout engine per rank)."""
    if dist.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank, broadcast_from_rank0=False)
        state = get_model_state_dict(model, options=options)
        upcast = stepper.upcast_names if stepper else set()
        if upcast:  # the fp32 masters leave as the half weights they train
            prefix = "" if value_head is None else "model."
            state = {k: v.to(stepper.half_dtype) if prefix + k in upcast else v for k, v in state.items()}
        if every_rank:
            state = {k: v.detach().cpu() for k, v in state.items()}
    else:
        state = {k: v.detach() for k, v in model.state_dict().items()}
    return merged_state_dict(model, state)


def train_state(module: torch.nn.Module, stepper: Optimizer | None, dist: Dist, *,
                trainable_only: bool = False) -> dict:
    """{"model": full weights (the masters where there are), "optimizer": AdamW's state}
    on CPU (on rank 0 when sharded). `trainable_only`: the weights that train and no
    others (a LoRA run on a base checkpoint: the frozen base is rebuilt from it on resume
    and by `mmrl export`)."""
    optimizer = stepper.optimizer if stepper else None
    if dist.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optim_state = get_state_dict(
            module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    else:
        held = masters(module, stepper)
        model_state = {k: held.get(k, v).detach().cpu() for k, v in module.state_dict().items()}
        optim_state = optimizer.state_dict() if optimizer else {}
    if trainable_only:
        # By name on every path: under FSDP2, torch's ignore_frozen_params still kept the base.
        trained = {name for name, p in named_parameters(module) if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trained}
    return {"model": model_state, "optimizer": optim_state}


def partial_state(module: torch.nn.Module, model_state: dict, path: Path) -> bool:
    """Whether `model_state` lacks weights of `module` (a trainable-only checkpoint); a
    weight it holds that `module` lacks, or a missing weight that trains here, is an error
    naming the checkpoint."""
    names = dict(named_parameters(module))
    unknown = sorted(set(model_state) - set(module.state_dict()))
    if unknown:
        raise ValueError(f"{path}: the checkpoint holds {len(unknown)} weights this model lacks, e.g. {unknown[0]}")
    missing = [name for name in names if name not in model_state]
    lacking = [name for name in missing if names[name].requires_grad]
    if lacking:
        raise ValueError(f"{path}: the checkpoint lacks {len(lacking)} trained weights, e.g. {lacking[0]} "
                         "(it was saved by a run with other trainable parts)")
    return bool(missing)


def save(path: Path, module: torch.nn.Module, stepper: Optimizer | None, dist: Dist, *,
         trainable_only: bool = False) -> None:
    """Model (safetensors), optimizer, schedule and loss scale, so a run resumes exactly.
    Every rank calls it; the main rank writes."""
    from safetensors.torch import save_file

    state = train_state(module, stepper, dist, trainable_only=trainable_only)
    with dist.together():  # a failed write (a full disk) reaches every rank
        if dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            # Tied weights (embeddings = lm_head) share storage; safetensors wants copies.
            tensors = {k: v.detach().clone().contiguous() for k, v in state["model"].items()}
            save_file(tensors, str(path / MODEL_FILE))
            rest = {"optimizer": state["optimizer"], **(stepper.schedule_state() if stepper else {"scheduler": {}})}
            torch.save(rest, path / OPTIMIZER_FILE)


def load(path: Path, module: torch.nn.Module, stepper: Optimizer | None, dist: Dist) -> None:
    """What `save` wrote, into `module` and `stepper`, on every rank."""
    from safetensors.torch import load_file

    model_state = load_file(str(path / MODEL_FILE))
    rest = torch.load(path / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    partial = partial_state(module, model_state, path)
    if dist.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            module, stepper.optimizer if stepper else None,
            model_state_dict=model_state, optim_state_dict=rest["optimizer"],
            options=StateDictOptions(full_state_dict=True, strict=not partial),
        )
    else:
        module.load_state_dict(model_state, strict=not partial)
        # The file holds the fp32 masters (half weights from a run without them
        # are upcast, as at the start of a run).
        with torch.no_grad():
            for name, master in masters(module, stepper).items():
                if name in model_state:
                    master.copy_(model_state[name])
        if stepper is not None:
            stepper.masters.to_model()
            stepper.optimizer.load_state_dict(rest["optimizer"])
    if stepper is not None:
        stepper.load_schedule_state(rest)
