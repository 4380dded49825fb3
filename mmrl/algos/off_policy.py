"""Off-policy correction: per-token weights for tokens sampled by other weights than the
ones the update starts from, as pure tensor functions.

A trajectory trained `s` updates after it was sampled (`algo.max_staleness`, mmrl/buffer)
came from the behaviour policy b, whose log-probs the rollout recorded with it. PPO's ratio
r = pi / pi_old clips around pi_old, the policy before this update (the proximal policy);
the gap between pi_old and b is corrected by a weight w on each token's loss (the
decoupled PPO objective of Hilton et al. 2021, as AReaL, verl and slime train):

    loss_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high)),   rho_t = pi_old / b

The exact weight rho is unbounded, so `algo.off_policy` chooses how it is bounded:

    tis    w = min(rho, cap)                       truncated importance sampling (Ionides 2008;
                                                   verl's and slime's TIS, cap 2 by default)
    mask   w = rho inside [1/cap, cap], else 0     masked importance sampling: tokens the two
                                                   policies disagree on too much are dropped
    none   w = 1                                   no correction

    weights, stats = importance_weights(old_logp, behaviour_logp, mask, mode="tis", cap=2.0)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, importance_weights=weights)

Inputs are (N, T) per-token log-probs with a response `mask` (N, T). When the behaviour
log-probs equal the old ones every weight is exactly 1.0, and the loss is the uncorrected
loss bit for bit (IEEE multiplication by 1 is exact).
"""

from __future__ import annotations

import torch
from torch import Tensor

OFF_POLICY_MODES = ("tis", "mask", "none")

# exp() of a larger log ratio overflows in low precision (see mmrl/algos/kl.py).
_MAX_LOG_RATIO = 20.0


def importance_weights(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, mode: str = "tis",
                       cap: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights (N, T), detached, 1.0 off the mask, and their spread.

    Metrics (detached scalars over the masked tokens): ratio_mean, ratio_min, ratio_max of
    the raw rho = pi_old / b, and capped_fraction, the share of tokens whose weight is not
    rho (truncated by `tis`, dropped by `mask`; 0 for `none`).
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off-policy correction {mode!r}; valid modes: {', '.join(OFF_POLICY_MODES)}")
    if cap <= 1.0:
        raise ValueError(f"the importance-weight cap must be above 1, got {cap}")
    mask = mask.bool()
    log_ratio = (old_logp.detach() - behaviour_logp.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.where(mask, torch.exp(log_ratio), 1.0)
    if mode == "tis":
        capped = ratio > cap
        weights = ratio.clamp(max=cap)
    elif mode == "mask":
        capped = (ratio > cap) | (ratio < 1.0 / cap)
        weights = torch.where(capped, 0.0, ratio)
    else:
        capped = torch.zeros_like(mask)
        weights = torch.ones_like(ratio)
    capped = capped & mask
    count = mask.sum().clamp(min=1)
    with torch.no_grad():
        stats = {
            "ratio_mean": torch.where(mask, ratio, 0.0).sum() / count,
            "ratio_min": torch.where(mask, ratio, torch.inf).min() if mask.any() else ratio.new_ones(()),
            "ratio_max": torch.where(mask, ratio, -torch.inf).max() if mask.any() else ratio.new_ones(()),
            "capped_fraction": capped.float().sum() / count,
        }
    return weights, stats
