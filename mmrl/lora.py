"""LoRA through peft, targeted by part: `language`, `vision` or `all`.

The family declares which leaf modules LoRA wraps in each part (`adapter.lora`); this
module turns that into peft's explicit module list, so a projector nested in a vision
tower, or a vision MLP that reuses a language layer name, is never targeted by accident.
`targets` replaces the family's leaf names inside the scope's parts.

    model = apply_lora(model, scope="all", rank=8)            # alpha 2 x rank, no dropout
    model = apply_lora(model, scope="language", rank=16, alpha=16, targets=["q_proj", "v_proj"])
    merged = merge_lora(model)
    reference = AdapterFreeReference(actor_engine)  # the base model's log-probs, no second copy
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from mmrl.adapter import ModelAdapter
from mmrl.parts import model_adapter, part_of


def lora_target_modules(model: torch.nn.Module, scope: str, adapter: ModelAdapter | None = None,
                        targets: Sequence[str] | None = None) -> list[str]:
    """Full names of the linear modules LoRA wraps for `scope`: those of the scope's
    parts whose leaf name the family declares, or, with `targets`, one of `targets`
    (each must name at least one linear module there)."""
    adapter = model_adapter(model, adapter)
    declared = adapter.lora.for_scope(scope)
    parts = _scope_parts(scope) if targets else set(declared)
    if not parts:
        raise ValueError(f"family {adapter.family!r} declares no LoRA targets for scope {scope!r}")
    names, leaves_here = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        part, leaf = part_of(name, adapter), name.rsplit(".", 1)[-1]
        if part not in parts:
            continue
        leaves_here.add(leaf)
        if leaf in (targets or declared[part]):
            names.append(name)
    if targets:
        missing = [t for t in targets if t not in leaves_here]
        if missing:
            there = f"its linear leaf names there: {', '.join(sorted(leaves_here))}" if leaves_here else "none there"
            raise ValueError(f"{', '.join(missing)} names no linear module in the {scope!r} scope of family "
                             f"{adapter.family!r} ({there})")
    if not names:
        raise ValueError(f"family {adapter.family!r}: LoRA targets for {scope!r} match no linear module")
    return names


def _scope_parts(scope: str) -> set[str]:
    """The parts a scope covers, whatever the family declares for them."""
    return {"language": {"language"}, "vision": {"vision"}, "all": {"language", "vision"}}.get(scope, set())


def apply_lora(
    model: torch.nn.Module,
    scope: str = "language",
    rank: int = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
    adapter: ModelAdapter | None = None,
    init_lora_weights: bool | str = True,
    targets: Sequence[str] | None = None,
):
    """Wrap `model` in a peft LoRA model for the modules of `scope` (or `targets` inside
    it); `alpha` None is 2 x `rank`, a scale (alpha / rank) of 2."""
    from peft import LoraConfig, get_peft_model

    modules = lora_target_modules(model, scope, adapter, targets)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=dropout,
        target_modules=modules,
        init_lora_weights=init_lora_weights,
    )
    return get_peft_model(model, config)


def keep_lora_dropout(model: torch.nn.Module, dropout: float) -> None:
    """Set the adapters' dropout back to `dropout` after an engine switched every dropout
    off (`mmrl.engine.engine.disable_dropout`): it is the one a recipe asks for by name."""
    if not dropout:
        return
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for layer in module.lora_dropout.values():
                if isinstance(layer, torch.nn.Dropout):
                    layer.p = dropout


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward inside the block: peft's `disable_adapter`, which skips
    every LoRA branch (weights untouched, so no merge or copy)."""
    with model.disable_adapter():
        yield


class AdapterFreeReference:
    """The reference policy of a LoRA actor: the actor's own engine with its adapters
    switched off, so the frozen starting model is not built, loaded and held twice (a
    7B in bf16 is ~15 GB). It offers what the update asks of a reference engine."""

    def __init__(self, actor):
        self.actor = actor

    @torch.no_grad()
    def log_probs(self, seqs, temperature: float = 1.0, with_entropy: bool = True):
        with adapters_disabled(self.actor.model):
            return self.actor.log_probs(seqs, temperature, with_entropy=with_entropy)


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
