"""LoRA through peft, targeted by part: `language`, `vision` or `all`.

The family declares which leaf modules LoRA wraps in each part (`adapter.lora`); this
module turns that into peft's explicit module list, so a projector nested in a vision
tower, or a vision MLP that reuses a language layer name, is never targeted by accident.

    model = apply_lora(model, scope="all", rank=8)
    merged = merge_lora(model)
"""

from __future__ import annotations

import torch

from mmrl.adapter import ModelAdapter
from mmrl.parts import _adapter_for, part_of


def lora_target_modules(model: torch.nn.Module, scope: str, adapter: ModelAdapter | None = None) -> list[str]:
    """Full names of the linear modules LoRA wraps for `scope`."""
    adapter = _adapter_for(model, adapter)
    wanted = adapter.lora.for_scope(scope)
    if not wanted:
        raise ValueError(f"family {adapter.family!r} declares no LoRA targets for scope {scope!r}")
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        part = part_of(name, adapter)
        if part in wanted and name.rsplit(".", 1)[-1] in wanted[part]:
            names.append(name)
    if not names:
        raise ValueError(f"family {adapter.family!r}: LoRA targets for {scope!r} match no linear module")
    return names


def apply_lora(
    model: torch.nn.Module,
    scope: str = "language",
    rank: int = 8,
    alpha: int | None = None,
    dropout: float = 0.0,
    adapter: ModelAdapter | None = None,
    init_lora_weights: bool | str = True,
):
    """Wrap `model` in a peft LoRA model for the modules of `scope`."""
    from peft import LoraConfig, get_peft_model

    targets = lora_target_modules(model, scope, adapter)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=dropout,
        target_modules=targets,
        init_lora_weights=init_lora_weights,
    )
    return get_peft_model(model, config)


def merge_lora(model):
    """Fold LoRA weights into the base model and return it without peft wrappers."""
    return model.merge_and_unload()


_PEFT_PREFIX = "base_model.model."


def merged_state_dict(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights of `model` with any LoRA folded in.

    Plain models pass through unchanged. For a peft model, each wrapped layer's weight
    becomes W + scale * B @ A and the adapter tensors are dropped, so the result loads
    into the base architecture (and into a rollout engine) as is.
    """
    if not any(".lora_A." in k for k in state):
        return state
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        out[name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")] = tensor
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = module_name.removeprefix(_PEFT_PREFIX) + ".weight"
        for adapter_name in module.active_adapters:
            if adapter_name not in module.lora_A:
                continue
            a = state[f"{module_name}.lora_A.{adapter_name}.weight"].float()
            b = state[f"{module_name}.lora_B.{adapter_name}.weight"].float()
            delta = (b @ a) * module.scaling[adapter_name]
            out[key] = (out[key].float() + delta).to(out[key].dtype)
    return out
