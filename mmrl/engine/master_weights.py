"""fp32 master weights for half-precision parameters trained in one process.

`Engine` uses it for trainable bf16/fp16 parameters when it does not shard (sharded, the
fp32 FSDP2 shards are the masters): AdamW steps the fp32 copies, so steps below bf16's
resolution (most of them at RL learning rates) accumulate instead of rounding away.

    masters = MasterWeights()
    groups = masters.replace(groups, needs_master)   # the optimizer's groups, masters in
    ...backward()...                                 # hooks move the grads into the masters
    optimizer.step(); masters.to_model()             # the model's weights: masters rounded

Gradients: each backward's half gradient is rounded once (2**-9 relative for bf16) and
added into the master's fp32 gradient as soon as it is complete, then freed; micro-batches
sum in fp32 without compounding the rounding, and clipping and AdamW see fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class MasterWeights:
    def __init__(self) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (model's, master)
        self._master_of: dict[int, torch.nn.Parameter] = {}

    def replace(self, groups: list[dict], needs_master: Callable[[torch.Tensor], bool]) -> list[dict]:
        """`groups` with each parameter for which `needs_master` holds replaced by its fp32
        master, and a hook that moves that parameter's gradients into the master's."""
        for group in groups:
            params = []
            for param in group["params"]:
                if needs_master(param):
                    master = torch.nn.Parameter(param.detach().float())
                    self._master_of[id(param)] = master
                    self.pairs.append((param, master))
                    param.register_post_accumulate_grad_hook(self._accumulate)
                    param = master
                params.append(param)
            group["params"] = params
        return groups

    def _accumulate(self, param: torch.Tensor) -> None:
        master = self._master_of[id(param)]
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad)
        param.grad = None

    @torch.no_grad()
    def to_model(self) -> None:
        """The model's parameters become their masters rounded to nearest."""
        if self.pairs:
            params, masters = zip(*self.pairs)
            torch._foreach_copy_(list(params), list(masters))

    def by_name(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.nn.Parameter]:
        """The masters under the names of their model parameters."""
        return {name: self._master_of[id(p)] for name, p in named_parameters if id(p) in self._master_of}

    def drop_gradients(self) -> None:
        for _, master in self.pairs:
            master.grad = None
