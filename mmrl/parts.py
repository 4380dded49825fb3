"""Named parts of a model (`vision`, `projector`, `language`, `embed`, `lm_head`).

Every family declares where its parts live (`adapter.parts`); these helpers resolve a
parameter name to its part, so `freeze(model, parts=("vision",))` means the same thing
for every vision-language model. A parameter belongs to the part whose path is the
longest prefix of its name; PEFT wrappers' name prefixes are ignored.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from mmrl.adapter import PART_NAMES, ModelAdapter
from mmrl.wrappers import unwrapped

_WRAPPER_PREFIXES = ("base_model.model.",)


def _unwrap_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def model_adapter(model: torch.nn.Module, adapter: ModelAdapter | None) -> ModelAdapter:
    """`adapter` when given, else the registered family of the model's config."""
    if adapter is not None:
        return adapter
    from mmrl.registry import adapter_for_config

    return adapter_for_config(model.config)


def part_of(name: str, adapter: ModelAdapter) -> str | None:
    """The part a parameter or module name belongs to, or None."""
    name = _unwrap_name(name)
    best, best_len = None, -1
    for part, paths in adapter.parts.items():
        for path in paths:
            if (name == path or name.startswith(path + ".")) and len(path) > best_len:
                best, best_len = part, len(path)
    return best


def parameters_by_part(
    model: torch.nn.Module, adapter: ModelAdapter | None = None
) -> dict[str | None, list[tuple[str, torch.nn.Parameter]]]:
    """Parameters grouped by part; parameters in no part sit under None."""
    adapter = model_adapter(model, adapter)
    groups: dict[str | None, list] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups[part_of(name, adapter)].append((name, param))
    return dict(groups)


def part_modules(model: torch.nn.Module, part: str, adapter: ModelAdapter | None = None) -> list[torch.nn.Module]:
    """The modules a part's paths name (paths that name a parameter are skipped)."""
    adapter = model_adapter(model, adapter)
    paths = dict(adapter.parts.items()).get(part, ())
    return [module for name, module in model.named_modules() if _unwrap_name(name) in paths]


def check_parts(model: torch.nn.Module, adapter: ModelAdapter | None = None) -> list[str]:
    """Declared part paths that name nothing in `model` (empty when all resolve)."""
    adapter = model_adapter(model, adapter)
    names = {_unwrap_name(n) for n, _ in model.named_modules()}
    names |= {_unwrap_name(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    return [f"{part}: {path}" for part, paths in adapter.parts.items() for path in paths if path not in names]


def freeze(
    model: torch.nn.Module,
    parts: Iterable[str] = ("vision",),
    adapter: ModelAdapter | None = None,
) -> int:
    """Stop gradients for every parameter of the named parts; returns how many froze."""
    parts = tuple(parts)
    adapter = model_adapter(model, adapter)
    unknown = set(parts) - set(PART_NAMES)
    if unknown:
        raise ValueError(f"unknown part(s) {sorted(unknown)}; parts are {PART_NAMES}")
    missing = [p for p in parts if not getattr(adapter.parts, p)]
    if missing:
        raise ValueError(f"family {adapter.family!r} has no {', '.join(missing)} part")
    frozen = 0
    for part in parts:
        for _, param in parameters_by_part(model, adapter).get(part, []):
            if param.requires_grad:
                param.requires_grad_(False)
                frozen += 1
    return frozen


def _layer_lists(module: torch.nn.Module, layer_names: set[str]) -> list[torch.nn.ModuleList]:
    """`module`'s ModuleList children that hold layers of the `layer_names` classes."""
    return [child for child in module.children()
            if isinstance(child, torch.nn.ModuleList) and any(type(m).__name__ in layer_names for m in child)]


def decoder_stack(model: torch.nn.Module, adapter) -> torch.nn.Module:
    """The module that runs the text decoder layers: the parent of the ModuleList of
    `adapter.shard_layers` modules that lies under `adapter.parts.language`."""
    base = unwrapped(model)
    layer_names = set(adapter.shard_layers)
    found = [(name, module) for name, module in base.named_modules() for _ in _layer_lists(module, layer_names)]
    language = adapter.parts.language

    def under_language(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") or p.startswith(name + ".") for p in language)

    stacks = [(name, module) for name, module in found if under_language(name)]
    if len(stacks) != 1:
        raise ValueError(f"cannot find the text decoder layers: {len(stacks)} module lists of "
                         f"{sorted(layer_names)} under {list(language)} (found {[n for n, _ in found]})")
    return stacks[0][1]


def decoder_layers(model: torch.nn.Module, adapter) -> list[torch.nn.Module]:
    """The text decoder's layers, in order (the `adapter.shard_layers` modules of `decoder_stack`'s list)."""
    layer_names = set(adapter.shard_layers)
    lists = _layer_lists(decoder_stack(model, adapter), layer_names)
    return [m for m in lists[0] if type(m).__name__ in layer_names] if lists else []
