"""A training engine's optimizer: AdamW, its LR schedule, fp32 master weights and loss
scaling, as one object.

    optimizer = Optimizer(engine.parameters(), names, adapter, recipe.optim, total_steps=100,
                          half_dtype=torch.bfloat16, dist=dist)
    optimizer.backward(loss)     # scaled by the loss scale on float16 engines
    norm = optimizer.step()      # unscale, clip, AdamW, masters -> model, schedule

Half-precision weights (`model.dtype: bfloat16`) train through fp32 master weights by
default (the engine's `master_weights=True`): at RL learning rates most AdamW steps are
smaller than bf16's resolution and would round away in the weights themselves. In one
process AdamW steps fp32 copies of the trainable half-precision parameters, with fp32
gradients and moments (`mmrl.engine.master_weights`), and after each step the model's
parameters are the masters rounded to bf16. Sharded, the masters are the FSDP2 shards
themselves: `mmrl.engine.surgery.apply_fsdp` upcasts those parameters to fp32 before
`fully_shard`, the policy all-gathers them in bf16 and reduces gradients in fp32, and this
object only names them (`upcast_names`). Cost per trainable parameter: +4 bytes
(masters), AdamW's moments 8 bytes instead of 4, gradients 4 instead of 2 (one process:
18 bytes with the bf16 weights; sharded: 16 bytes over the ranks, as for fp32 weights).
Checkpoints hold the masters (`mmrl.engine.state`); the full weights stay in bf16.

float16 weights (with masters, in one process or sharded) also get dynamic loss scaling
(`mmrl.engine.master_weights.LossScaler`): `backward(loss)` runs the loss times the
scale (2**16 to start), `step` divides the fp32 gradients by it before clipping, and
skips the AdamW step where any gradient on any rank is inf or nan, halving the scale;
2000 good steps in a row double it. A skipped step still advances the LR schedule, as in
torch's AMP recipe (GradScaler skips only `optimizer.step`), so the schedule keeps
counting the run's steps. `loss.backward()` called directly runs unscaled, and `step`
then takes the gradients as they are. fp32 and bf16 engines scale nothing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch

from mmrl.config import OptimConfig
from mmrl.engine.master_weights import LossScaler, MasterWeights, needs_master
from mmrl.parallel import Dist
from mmrl.parts import part_of


def lr_factor(optim: OptimConfig, total_steps: int):
    """The schedule's factor on the base learning rate at each step (warmup, then the
    recipe's cosine, linear or constant decay)."""

    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if optim.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if optim.schedule == "linear":
            return 1.0 - progress
        return 1.0

    return factor


def param_groups(parameters: Iterable[torch.nn.Parameter], names: dict[int, str], adapter, base_lr: float,
                 multipliers: dict[str, float]) -> list[dict]:
    """Trainable `parameters` grouped by learning rate: the base rate times the multiplier
    of the part (`mmrl.parts.part_of`) that the parameter's name (`names`, by id) is in;
    one group without multipliers."""
    by_lr: dict[float, list[torch.nn.Parameter]] = {}
    for param in parameters:
        if not param.requires_grad:
            continue
        part = part_of(names[id(param)], adapter) if id(param) in names else None
        by_lr.setdefault(base_lr * multipliers.get(part, 1.0), []).append(param)
    return [{"params": params, "lr": rate} for rate, params in by_lr.items()]


class Optimizer:
    def __init__(self, parameters: Iterable[torch.nn.Parameter], names: dict[int, str], adapter, optim: OptimConfig,
                 *, dist: Dist, lr: float | None = None, total_steps: int = 1, half_dtype: torch.dtype | None = None,
                 upcast_names: set[str] = frozenset(), loss_scale_growth_interval: int = 2000) -> None:
        """AdamW over the trainable ones of `parameters` (the engine's, after sharding;
        `names` by id for the LR multipliers); `half_dtype`: the dtype whose trainable
        weights step through fp32 masters (None: none); `upcast_names`: sharded, the
        state-dict names of the fp32 shards that are those masters."""
        self.dist = dist
        self.sharded = dist.distributed
        self.half_dtype = half_dtype
        # float16's narrow range needs a scaled loss; bf16 and fp32 never scale. Without
        # masters the unscaled gradients would be fp16 again, so no scaling there either.
        self.loss_scaler = (LossScaler(growth_interval=loss_scale_growth_interval)
                            if half_dtype == torch.float16 else None)
        self.scaled_backward = False  # whether the gradients held now are scaled
        self.step_skipped = False  # whether the last `step` skipped the optimizer (inf/nan)
        # fp32 masters in one process; none when sharded, where the upcast FSDP2 shards
        # are the masters.
        self.masters = MasterWeights()
        self.upcast_names = set(upcast_names)
        base_lr = lr if lr is not None else optim.lr
        groups = param_groups(parameters, names, adapter, base_lr, optim.lr_multipliers)
        if not groups:
            raise ValueError("nothing to train: every parameter is frozen")
        self.trained = [p for group in groups for p in group["params"]]  # the model's side of the masters
        if half_dtype is not None and not self.sharded:
            groups = self.masters.replace(groups, lambda param: needs_master(param, half_dtype))
        # One process on a GPU: the fused AdamW kernel (one launch over all parameters
        # instead of a dozen foreach passes), faster on the 0.5B bf16 update of
        # bench/packing.py (docs/performance.md, "Packing and compiled layers"). Sharded, the default.
        fused = {"fused": True} if dist.device.type == "cuda" and not self.sharded else {}
        self.optimizer = torch.optim.AdamW(groups, lr=base_lr, betas=optim.betas, weight_decay=optim.weight_decay,
                                           **fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(optim, total_steps))
        self.grad_clip = optim.grad_clip

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float:
        """The factor `backward` multiplies the loss by now (1.0 without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/nan gradients since the run began."""
        return self.loss_scaler.skipped_steps if self.loss_scaler is not None else 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled by `loss_scale` with loss scaling."""
        if self.loss_scaler is None:
            loss.backward()
            return
        (loss * self.loss_scaler.scale).backward()
        self.scaled_backward = True

    def step(self) -> float:
        """Clip gradients, take an optimizer and schedule step; returns the grad norm.
        With loss scaling the gradients are unscaled first, and a step with inf or nan
        gradients only drops them, backs the scale off and advances the schedule
        (`step_skipped`; it returns nan)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.step_skipped = False
        if self.loss_scaler is not None:
            grads = [p.grad for p in params if p.grad is not None]
            finite = self.loss_scaler.unscale(grads, self.scaled_backward, self.dist.device,
                                              across_ranks=self.sharded, group=self.dist.group)
            self.scaled_backward = False
            self.loss_scaler.update(finite)
            if not finite:
                return self._skip_step()
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.masters.to_model()
        self.scheduler.step()
        return float(norm)

    def _skip_step(self) -> float:
        self.step_skipped = True
        self.drop_gradients()
        with warnings.catch_warnings():
            # The schedule advances as in torch's AMP loop; a skipped first step makes
            # torch warn that the scheduler stepped before the optimizer did.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        return math.nan

    def drop_gradients(self) -> None:
        """Every gradient held, the model's and the masters', dropped."""
        for param in self.trained:
            param.grad = None
        self.masters.drop_gradients()
        self.scaled_backward = False

    def masters_by_name(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
        """The fp32 masters under the names of `named_parameters` (the engine's state-dict
        names; local shards when sharded); empty without masters."""
        if self.sharded:
            return {name: p for name, p in named_parameters if name in self.upcast_names}
        return self.masters.by_name(named_parameters)

    def schedule_state(self) -> dict:
        """What a checkpoint keeps besides the weights and AdamW's state: the schedule and
        the loss scale."""
        state = {"scheduler": self.scheduler.state_dict()}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_schedule_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        # Checkpoints from before loss scaling (or of bf16/fp32 runs) start from the default.
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
