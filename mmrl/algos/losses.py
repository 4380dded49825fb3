"""Policy, value and entropy losses of the PPO/GRPO family, as pure tensor functions.

Inputs are per-token (N, T) with a `mask` (N, T), bool or float, marking response
tokens; `advantages` may be per-sequence (N,) and are then broadcast over tokens.
How per-token losses become one number is the `aggregation` mode (`aggregate`):

    token_mean               mean over all response tokens of the batch (DAPO)
    seq_mean_token_mean      mean per sequence, then over sequences (original GRPO)
    seq_mean_token_sum_norm  sum per sequence / a constant length, then mean (Dr. GRPO)

    loss, metrics = policy_loss(logp, old_logp, advantages, mask, clip_high=0.28)
    loss.backward()

The aggregation runs over the tensors it is given. When a batch is split into micro-
batches for gradient accumulation, `token_mean` of each micro-batch is not the batch
mean: scale each micro-batch loss by its token count over the batch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate(values: Tensor, mask: Tensor, mode: str = "token_mean", *, norm_length: int | None = None) -> Tensor:
    """Reduce per-token `values` (N, T) over the marked tokens to a scalar.

    `norm_length` is the constant divisor of `seq_mean_token_sum_norm`, usually the
    maximum response length of the run; a per-batch length would bring back the length
    bias that mode exists to remove, so it is required rather than guessed.
    Sequences without marked tokens do not count in `seq_mean_token_mean`.
    """
    mask = mask.bool()
    values = torch.where(mask, values, 0.0)  # padding may hold anything, even inf
    if mode == "token_mean":
        return values.sum() / mask.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        per_sequence = values.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        return per_sequence.sum() / mask.any(dim=-1).sum().clamp(min=1)
    if mode == "seq_mean_token_sum_norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError("aggregation 'seq_mean_token_sum_norm' needs a positive norm_length")
        return values.sum() / (values.shape[0] * norm_length)
    raise ValueError(f"unknown aggregation {mode!r}; valid modes: {', '.join(AGGREGATIONS)}")


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return aggregate(values, mask, "token_mean")


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    return advantages.detach().expand_as(like)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    dual_clip: float | None = None,
    norm_length: int | None = None,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss with separate lower and upper clip ranges.

    The ratio pi/pi_old is clipped to [1 - clip_low, 1 + clip_high]; a larger
    `clip_high` (DAPO: 0.28) lets unlikely tokens with positive advantage grow, which
    keeps entropy from collapsing. `dual_clip` (c > 1) also caps the loss of negative-
    advantage tokens at -c * A, so one huge ratio cannot dominate the batch.
    `importance_weights` (N, T), detached, multiply each token's loss: the off-policy
    correction of tokens another policy sampled (`mmrl.algos.off_policy`); None is 1.

    Returns the loss and detached scalar metrics (call `float()` when logging):
    clip_fraction (share of tokens whose gradient the clip removed), approx_kl (k3
    estimate of KL(pi_old || pi) from the sampled tokens), ratio_mean, and with
    `dual_clip` also dual_clip_fraction.
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be greater than 1, got {dual_clip}")
    mask = mask.bool()
    advantages = _per_token(advantages, logp)
    log_ratio = torch.where(mask, logp - old_logp.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(capped, cap, per_token)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    loss = aggregate(per_token, mask, aggregation, norm_length=norm_length)

    with torch.no_grad():
        metrics = {
            "clip_fraction": _masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
        if dual_clip is not None:
            metrics["dual_clip_fraction"] = _masked_mean(capped.float(), mask)
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss 0.5 * (V - R)^2, with PPO's value clipping around the rollout values.

    The new value may move at most `clip` from `old_values` before its error stops
    counting in its favour (the larger of the clipped and unclipped errors is used).
    `clip=None` gives the plain squared error. Metrics: clip_fraction.
    """
    mask = mask.bool()
    returns, old_values = returns.detach(), old_values.detach()
    error = (values - returns).pow(2)
    if clip is None:
        per_token, clipped_share = error, torch.zeros((), device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped_error = (clipped_values - returns).pow(2)
        per_token = torch.maximum(error, clipped_error)
        clipped_share = _masked_mean((clipped_error > error).float(), mask).detach()
    loss = 0.5 * aggregate(per_token, mask, aggregation, norm_length=norm_length)
    return loss, {"clip_fraction": clipped_share}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution of each position: (..., V) -> (...)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # bf16 sums over a large vocabulary drift
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def entropy_bonus(
    entropy: Tensor, mask: Tensor, coef: float, *, aggregation: str = "token_mean", norm_length: int | None = None
) -> Tensor:
    """The term to ADD to the loss to reward entropy: -coef * aggregated entropy."""
    return -coef * aggregate(entropy, mask, aggregation, norm_length=norm_length)
