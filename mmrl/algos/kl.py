"""KL regularization toward a reference policy, estimated from the sampled tokens.

With tokens x sampled from the policy pi and d = log pi(x) - log ref(x), the usual
per-token estimators of KL(pi || ref) are (Schulman, "Approximating KL divergence"):

    k1 = d                          unbiased, high variance, can be negative
    k2 = d^2 / 2                    biased, low variance, non-negative
    k3 = exp(-d) - (-d) - 1         unbiased, low variance, non-negative

Where to use which, as in common practice:
- In the reward (PPO/RLHF style), use k1: `kl_in_reward(token_rewards, kl_estimate(logp,
  ref_logp, "k1"), coef)`. The reward is a value, not differentiated, so k1's
  unbiasedness is what matters, and the return sums it to the sequence KL.
- In the loss (GRPO style), use k3: `kl_loss(logp, ref_logp, mask, coef=...)`. Note that
  as a loss k1 has zero expected gradient, k2's gradient is the true gradient of
  KL(pi || ref), and k3's is, in expectation, that of the forward KL(ref || pi); k3 is
  the GRPO/DeepSeekMath choice and works well in practice. Pick "k2" for the exact
  reverse-KL gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.algos.losses import aggregate

KL_ESTIMATORS = ("k1", "k2", "k3")

# exp() of a larger log ratio overflows in low precision and turns the gradient into
# NaN (0 * inf) even when the result is clamped afterwards.
_MAX_LOG_RATIO = 20.0


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3", *, clamp: float | None = None) -> Tensor:
    """Per-token estimate of KL(pi || ref), same shape as `logp`.

    `clamp` bounds the result to [-clamp, clamp]: a few tokens the reference finds
    very unlikely would otherwise dominate the penalty (10 is a common choice for k3).
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.pow(2)
    elif kind == "k3":
        reverse = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(reverse) - reverse - 1.0
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_ESTIMATORS)}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def kl_in_reward(token_rewards: Tensor, kl: Tensor, coef: float, mask: Tensor | None = None) -> Tensor:
    """Token rewards minus coef * KL (the KL is detached: rewards are not differentiated).

    With a `mask`, the KL of unmarked tokens is ignored.
    """
    penalty = coef * kl.detach()
    if mask is not None:
        penalty = torch.where(mask.bool(), penalty, 0.0)
    return token_rewards - penalty


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    coef: float,
    kind: str = "k3",
    clamp: float | None = None,
    aggregation: str = "token_mean",
    norm_length: int | None = None,
) -> Tensor:
    """The term to add to the policy loss: coef * aggregated per-token KL to the reference."""
    kl = kl_estimate(logp, ref_logp.detach(), kind, clamp=clamp)
    return coef * aggregate(kl, mask, aggregation, norm_length=norm_length)
