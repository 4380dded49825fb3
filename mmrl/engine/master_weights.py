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

float16 weights, in one process or sharded, also need their loss scaled (`LossScaler`):
fp16 gradients underflow below ~6e-8 and overflow above 65504. bf16 has fp32's exponent
range and needs no scaling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


def needs_master(param: torch.Tensor, half_dtype: torch.dtype | None) -> bool:
    """Whether `param` trains through an fp32 master: trainable, and in the engine's half
    dtype (None: the engine keeps no masters)."""
    return half_dtype is not None and param.requires_grad and param.dtype == half_dtype


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


class LossScaler:
    """Dynamic loss scaling for float16 gradients (`Engine` turns it on for float16 weights
    with fp32 masters; bf16 has fp32's exponent range and needs none).

    fp16 gradients below ~6e-8 round to zero and above 65504 become inf. The loss is
    multiplied by `scale` before backward, so small gradients stay representable, and the
    fp32 gradients are divided by it before clipping and the optimizer step. A step whose
    gradients hold an inf or nan (on any rank) is skipped and the scale multiplied by
    `backoff`; after `growth_interval` good steps in a row it is multiplied by `growth`.

    Written here rather than with `torch.amp.GradScaler` (which does work on the masters
    in one process): the skip decision has to be all-reduced over the FSDP2 ranks, whose
    gradients are local shards, and `Engine.step` leaves gradients unscaled when they did
    not come from `Engine.backward`; both are a line each here and internals there.
    """

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000, backoff: float = 0.5,
                 growth: float = 2.0) -> None:
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"loss scale growth_interval must be a positive integer, got {growth_interval!r}")
        self.scale = float(scale)
        self.growth_interval = growth_interval
        self.backoff = backoff
        self.growth = growth
        self.good_steps = 0  # finite steps since the scale last changed
        self.skipped_steps = 0  # over the whole run

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor], scaled: bool, device: torch.device,
                across_ranks: bool = False, group=None) -> bool:
        """Divide `grads` (on `device`) in place by the scale (when `scaled`) and return
        whether all of them are finite, in this process or (`across_ranks`) on every rank
        of `group` (None: every process)."""
        # DTensor gradients (FSDP2) are unscaled shard by shard: the operation is elementwise.
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        found_inf = torch.zeros(1, device=device)
        inverse = torch.full((1,), 1.0 / self.scale if scaled else 1.0, device=device)
        # GradScaler's fused check-and-multiply kernel (CPU and CUDA), one dtype per call.
        for dtype in {g.dtype for g in local}:
            torch._amp_foreach_non_finite_check_and_unscale_([g for g in local if g.dtype == dtype],
                                                             found_inf, inverse)
        if across_ranks:  # each rank holds its own shards: one inf anywhere skips everywhere
            import torch.distributed as torch_dist

            torch_dist.all_reduce(found_inf, op=torch_dist.ReduceOp.MAX, group=group)
        return not found_inf.item()

    def update(self, finite: bool) -> None:
        """Back off after a skipped step; grow after `growth_interval` good ones."""
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
