"""The units FSDP2 shards a model in: the family's `shard_layers`, nested ones first, and
layers that share parameters together.

`fully_shard` gives each parameter to one unit. A layer holding another shard layer (a
hybrid block holding a state-space layer) must be sharded after it, or it takes that
layer's parameters and the inner `fully_shard` meets them sharded already. Layers whose
parameters are tied to each other's (a transformer block shared by several hybrid layers,
its weights tied across them) must be sharded in one `fully_shard([a, b])` call, which
holds the tied parameter once; sharded apart, the second call meets it sharded already.

    for group in shard_groups(model, {"DecoderLayer"}):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
"""

from __future__ import annotations

import torch


def shard_groups(model: torch.nn.Module, layer_names: set[str]) -> list[list[torch.nn.Module]]:
    """The modules whose class name is in `layer_names`, grouped where they own a
    parameter in common (past those of shard layers nested in them), in an order in which
    every group comes after the groups of the layers nested in it."""
    # Reversed pre-order: every module comes after the modules nested in it.
    units = [module for module in reversed(list(model.modules())) if type(module).__name__ in layer_names]
    unit_ids = {id(unit) for unit in units}
    owner: dict[int, int] = {}  # parameter id -> the first unit owning it
    group_of = list(range(len(units)))  # union-find over the units' indexes

    def root(index: int) -> int:
        while group_of[index] != index:
            index = group_of[index]
        return index

    for index, unit in enumerate(units):
        nested = {id(p) for sub in unit.modules() if sub is not unit and id(sub) in unit_ids for p in sub.parameters()}
        for param in unit.parameters():
            if id(param) in nested:
                continue
            if id(param) in owner:
                group_of[root(index)] = root(owner[id(param)])
            else:
                owner[id(param)] = index
    members: dict[int, list[int]] = {}
    for index in range(len(units)):
        members.setdefault(root(index), []).append(index)
    # A group is sharded where its last member would be: after everything nested in any member.
    return [[units[i] for i in group] for group in sorted(members.values(), key=max)]


__all__ = ["shard_groups"]
