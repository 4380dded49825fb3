"""FSDP2's shard units (mmrl.engine.shard_units): nested shard layers come before the layer
holding them, and layers whose parameters are tied to each other form one unit (Zamba's
hybrid layers share one transformer block's weights; sharded one by one, the second
`fully_shard` met them sharded already: "Cannot concatenate overlapping meshes").

    .venv/bin/python -m pytest -q tests/test_shard_units.py
"""

import torch

from mmrl.engine.shard_units import shard_groups


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


class Hybrid(torch.nn.Module):
    """A hybrid layer: its own mixer (a shard layer itself) and a block it may share."""

    def __init__(self, block: torch.nn.Linear):
        super().__init__()
        self.mixer = Mixer()
        self.block = block
        self.linear = torch.nn.Linear(4, 4)


def _model(tied: bool) -> torch.nn.Module:
    first = torch.nn.Linear(4, 4)
    second = torch.nn.Linear(4, 4)
    if tied:  # separate modules, one weight (as transformers ties a shared block's copies)
        second.weight = first.weight
        second.bias = first.bias
    return torch.nn.ModuleDict({"layers": torch.nn.ModuleList([Hybrid(first), Mixer(), Hybrid(second)])})


def _position(groups, module) -> int:
    return next(i for i, group in enumerate(groups) if any(m is module for m in group))


def test_tied_layers_are_one_unit_after_the_layers_nested_in_them():
    model = _model(tied=True)
    groups = shard_groups(model, {"Hybrid", "Mixer"})
    first, plain, second = model["layers"]
    hybrids = [g for g in groups if any(isinstance(m, Hybrid) for m in g)]
    assert len(hybrids) == 1 and {id(m) for m in hybrids[0]} == {id(first), id(second)}
    for hybrid in (first, second):  # the mixer nested in each comes first
        assert _position(groups, hybrid.mixer) < _position(groups, hybrid)
    assert sorted(len(g) for g in groups) == [1, 1, 1, 2]
    assert sum(len(g) for g in groups) == 5 and _position(groups, plain) >= 0


def test_untied_layers_are_one_unit_each():
    model = _model(tied=False)
    groups = shard_groups(model, {"Hybrid", "Mixer"})
    assert [len(g) for g in groups] == [1] * 5
    for hybrid in (model["layers"][0], model["layers"][2]):
        assert _position(groups, hybrid.mixer) < _position(groups, hybrid)
    assert shard_groups(model, {"Absent"}) == []
