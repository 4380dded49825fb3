"""Merged projections in the decode step: sibling linear layers that read the same input
(a decoder layer's q/k/v, its MLP's gate/up) run as one matrix product.

A decode step feeds each product one token a row, so a small projection costs a
kernel's fixed time rather than its bytes (the q, k, v and o products of the VL-3B shape's
profile: bench/results/decode_bound_vl3b_512_profile_gpu.json; docs/performance.md,
"Merged projections"). Merged, a group is one product over one buffer of its weights.

    merging = MergedProjections(adapter.rollout.merged_projections, lambda m: decoder_layers(m, adapter))
    with merging.merged(model):
        ... decode steps ...

The adapter names each group by its members' leaf names (`Rollout.merged_projections`;
by default q/k/v and gate/up). While `merged` is open, the first member of a group
computes the whole group's product and leaves the others their slices; a member called
with another input than the one the first member got computes its own product, so a
group whose members do not share their input gives the same results, only no faster.
Only plain `nn.Linear` members of one input width, dtype and device, with biases on all
or none, are merged. The merged weights are copied from the members' own at each opening
(the update changes them, and `_half_linears` swaps in half copies just before) into
buffers kept between openings and marked static, so a recorded or compiled CUDA graph
replays on the same addresses. Results equal the separate products up to the rounding
of a wider product (a different kernel may sum in another order).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F


class _Site:
    """One group of sibling linear layers in one parent module, its merged buffers and
    the forwards that stand in for the members' while merging is open (kept: dynamo
    guards on a module's forward, and the same functions reuse what it compiled)."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.stash: list = []  # the input the first member saw, then the later members' slices
        self.forwards = [self._first] + [self._later(m, i == len(members) - 1) for i, m in enumerate(members[1:], 1)]

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias).split(self.sizes, -1)
        self.stash[:] = [x, *out[1:]]
        return out[0]

    def _later(self, module: torch.nn.Linear, last: bool):
        stash = self.stash

        def forward(x: torch.Tensor) -> torch.Tensor:
            if stash and stash[0] is x:
                out = stash.pop(1)
                if last:
                    stash.clear()
                return out
            return F.linear(x, module.weight, module.bias)

        return forward

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the members' current weights (and biases) into the merged buffers."""
        weights = [m.weight for m in self.members]
        shape = (sum(self.sizes), weights[0].shape[1])
        if self.weight is None or self.weight.shape != shape or self.weight.dtype != weights[0].dtype \
                or self.weight.device != weights[0].device:
            self.weight = _static(torch.empty(shape, dtype=weights[0].dtype, device=weights[0].device))
            self.bias = None
            if self.members[0].bias is not None:
                self.bias = _static(torch.empty(shape[0], dtype=self.members[0].bias.dtype, device=weights[0].device))
        torch.cat([w.detach() for w in weights], out=self.weight)
        if self.bias is not None:
            torch.cat([m.bias.detach().to(self.bias.dtype) for m in self.members], out=self.bias)


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """A buffer compiled graphs read in place (no copy into CUDA graph inputs), with no
    identity guard (as `mmrl.rollout.compiled._unguarded` marks the caches)."""
    torch._dynamo.mark_static_address(tensor, guard=False)
    return tensor


def merge_sites(layers: list[torch.nn.Module], groups: tuple[tuple[str, ...], ...]) -> list[_Site]:
    """The groups found in `layers`: in every module of each layer, each group whose
    members are all plain `nn.Linear` children of one input width, weight dtype and device,
    with biases on all or none, and no forward of their own already patched in."""
    sites = []
    for layer in layers:
        for parent in layer.modules():
            children = parent._modules
            for group in groups:
                members = [children.get(name) for name in group]
                if len(members) < 2 or not all(type(m) is torch.nn.Linear for m in members):
                    continue
                if len({(m.in_features, m.weight.dtype, m.weight.device) for m in members}) != 1:
                    continue
                if len({m.bias is None for m in members}) != 1 or any("forward" in vars(m) for m in members):
                    continue
                sites.append(_Site(members))
    return sites


class MergedProjections:
    """The merged groups of each model it opens on, found in `layers_of(model)` (its
    decoder layers) at the model's first opening."""

    def __init__(self, groups: tuple[tuple[str, ...], ...],
                 layers_of: Callable[[torch.nn.Module], list[torch.nn.Module]]):
        self.groups = tuple(tuple(group) for group in groups)
        self.layers_of = layers_of
        self._sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def sites(self, model: torch.nn.Module) -> list[_Site]:
        if model not in self._sites:
            self._sites[model] = merge_sites(self.layers_of(model), self.groups) if self.groups else []
        return self._sites[model]

    @contextlib.contextmanager
    def merged(self, model: torch.nn.Module) -> Iterator[int]:
        """While open, the groups of `model`'s decoder layers run merged; yields how many
        groups."""
        sites = self.sites(model)
        patched: list[torch.nn.Module] = []
        try:
            for site in sites:
                site.refresh()
                for module, forward in zip(site.members, site.forwards):
                    module.forward = forward
                    patched.append(module)
            yield len(sites)
        finally:
            for module in patched:
                del module.forward  # the class's forward again
            for site in sites:
                site.stash.clear()

    def merged_bytes(self, model: torch.nn.Module) -> int:
        """Bytes the merged buffers of `model` hold (0 before its first opening)."""
        return sum(t.numel() * t.element_size() for site in self._sites.get(model, ())
                   for t in (site.weight, site.bias) if t is not None)
