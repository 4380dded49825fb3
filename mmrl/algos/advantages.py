"""Advantage estimators: how much better each sampled response (or token) was than expected.

Pure tensor functions, no model code. Shapes: per-sequence tensors are (N,), per-token
tensors (N, T) with a `mask` (N, T), bool or float, marking response tokens. Grouped
estimators assume the G samples of one prompt sit next to each other: rows
[g*G, (g+1)*G) are the samples of prompt g, which is how rollouts are laid out.

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    grpo_advantages(rewards, group_size=2)          # critic-free, one value per sequence
    estimator = get_advantage_estimator("gae")      # or pick one by name ...
    advantages, returns = estimator.compute(token_rewards, mask, values=values, gamma=1.0, lam=0.95)

Per-turn credit for multi-turn rollouts (`estimator.compute_by_turn`, docs/agents.md):
`turn` (N, T) numbers each sampled token by its policy turn (1, 2, ...; 0 elsewhere), the
environment's reward after each turn sits on that turn's last token, the reward
function's score (`outcome`, (N,)) counts at the last turn. Per-token estimators take
these token rewards as they are (the return-to-go does the rest); grouped estimators
normalize the outcome and each turn's rewards within the prompt's group apart, and turn
k's tokens get the outcome's advantage plus those of turns k, k+1, ...:

    A[i, k] = est(outcome)[i] + sum over j >= k of est(R[:, j])[i]

where R[i, j] is sample i's reward after its turn j (0 where it had no turn j) and `est`
the estimator's group normalization (GRPO, Dr. GRPO, RLOO). Each column is normalized
on its own, so a column whose rewards are all equal adds 0, never x / eps.

Every estimator returns tensors without gradient: advantages are targets, not outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

GROUP_SCALES = ("std", "none")


def _as_float(values: Tensor) -> Tensor:
    return values if values.is_floating_point() else values.float()


def _grouped(rewards: Tensor, group_size: int, *, at_least: int = 1) -> Tensor:
    """View (N,) rewards as (N / group_size, group_size), checking the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (N,), got shape {tuple(rewards.shape)}")
    if group_size < at_least:
        raise ValueError(f"group_size must be at least {at_least}, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return _as_float(rewards).view(-1, group_size)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over the tokens that `mask` marks (0 when none are marked)."""
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """Shift and scale the marked entries to mean 0, variance 1; unmarked entries become 0.

    The variance is the unbiased one (Bessel-corrected), like `torch.std`.
    """
    mask = mask.bool()
    mean = masked_mean(values, mask)
    centered = torch.where(mask, values - mean, 0.0)
    variance = centered.pow(2).sum() / (mask.sum() - 1).clamp(min=1)
    return centered * torch.rsqrt(variance + eps)


@torch.no_grad()
def scalar_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each row's scalar reward on its last response token: (N,) -> (N, T).

    Rows without response tokens get no reward. Works for any mask, not only
    right-padded ones, because it looks for the last marked position.
    """
    mask = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=-1)
    token_rewards = torch.zeros(mask.shape, dtype=_as_float(rewards).dtype, device=rewards.device)
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    token_rewards[rows, last[has_tokens]] = _as_float(rewards)[has_tokens]
    return token_rewards


@torch.no_grad()
def grpo_advantages(rewards: Tensor, group_size: int, *, scale: str = "std", eps: float = 1e-6) -> Tensor:
    """GRPO: each reward minus its group's mean, divided by the group's std + eps.

    `scale="none"` skips the division (Dr. GRPO), which removes the bias toward groups
    whose rewards barely differ. The std is unbiased (`torch.std`), as in the reference
    implementations. A group whose rewards are all equal gets zero advantages.
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"scale must be one of {GROUP_SCALES}, got {scale!r}")
    groups = _grouped(rewards, group_size, at_least=2)
    centered = groups - groups.mean(dim=-1, keepdim=True)
    if scale == "std":
        centered = centered / (groups.std(dim=-1, keepdim=True) + eps)
    return centered.reshape(-1)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the OTHER rewards of its group.

    Equal to G / (G - 1) times the reward minus the full group mean.
    """
    groups = _grouped(rewards, group_size, at_least=2)
    others_mean = (groups.sum(dim=-1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).reshape(-1)


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go per token, skipping unmarked tokens (their rewards are ignored and
    they do not count as a discount step)."""
    mask = mask.bool()
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(mask, returns, 0.0)


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: discounted per-token returns, whitened over every valid token of the batch.

    The batch-wide whitening replaces a critic or a group baseline; rewards need no
    grouping, so this also works with one sample per prompt.
    """
    returns = _discounted_returns(_as_float(token_rewards), mask, gamma)
    return masked_whiten(returns, mask)


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (PPO with a critic) -> (advantages, returns).

    The value after a response's last token is 0 (the episode ends there), so right-
    padded responses of different lengths are handled row by row. Unmarked tokens are
    skipped entirely: their rewards and values never leak into the estimate, and any
    marked token after them bootstraps from the next marked one. Returns are the value
    targets, advantages + values. Both are 0 off the mask; no whitening is applied.
    """
    mask = mask.bool()
    token_rewards, values = _as_float(token_rewards), _as_float(values).detach()
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(mask[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = running
    advantages = torch.where(mask, advantages, 0.0)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def uniform_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Bool (N,): True for every sample of a group whose rewards are all equal.

    Such groups have zero GRPO/RLOO advantage and so carry no gradient; DAPO's dynamic
    sampling drops them and samples more prompts instead (`keep = ~uniform_groups(...)`).
    """
    groups = _grouped(rewards, group_size)
    uniform = groups.amax(dim=-1) == groups.amin(dim=-1)
    return uniform.repeat_interleave(group_size)


@dataclass(frozen=True, slots=True)
class AdvantageEstimator:
    """An estimator and what it consumes, so the trainer can call any of them the same way.

    `per_token` estimators credit each token from token rewards; the others give one
    value per sequence from the sum of its token rewards and the group of its prompt.
    `needs_critic` estimators also take the critic's values and return value targets.
    """

    name: str
    fn: Callable[..., Any]
    per_token: bool
    needs_critic: bool = False
    options: tuple[tuple[str, Any], ...] = ()

    def compute(
        self,
        token_rewards: Tensor,
        mask: Tensor,
        *,
        group_size: int | None = None,
        values: Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token advantages (N, T), 0 off the mask, and value targets (None without a critic).

        `token_rewards` is (N, T): a scalar reward placed by `scalar_to_token_rewards`,
        possibly minus a KL penalty (`kl_in_reward`).
        """
        options = dict(self.options)
        if self.needs_critic:
            if values is None:
                raise ValueError(f"advantage estimator {self.name!r} needs critic values")
            return self.fn(token_rewards, values, mask, gamma=gamma, lam=lam, **options)
        if self.per_token:
            return self.fn(token_rewards, mask, gamma=gamma, **options), None
        if group_size is None:
            raise ValueError(f"advantage estimator {self.name!r} needs group_size")
        mask = mask.bool()
        rewards = torch.where(mask, _as_float(token_rewards), 0.0).sum(dim=-1)
        per_sequence = self.fn(rewards, group_size, **options)
        return torch.where(mask, per_sequence[:, None], 0.0), None

    def compute_by_turn(
        self,
        outcome: Tensor,
        token_rewards: Tensor,
        turn: Tensor,
        *,
        group_size: int | None = None,
        values: Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
    ) -> tuple[Tensor, Tensor | None]:
        """Per-turn credit: like `compute`, with each policy turn's tokens credited the
        rewards from that turn on (module docstring). `turn` (N, T) is each token's 1-based
        policy turn, 0 off the policy's tokens; `token_rewards` (N, T) hold the rewards
        earned after each turn (on its last token; a KL penalty may sit on any token);
        `outcome` (N,) is the reward function's score, counted at the last turn."""
        if turn.shape != token_rewards.shape:
            raise ValueError(f"turn {tuple(turn.shape)} and token_rewards {tuple(token_rewards.shape)} differ")
        mask = turn > 0
        token_rewards = torch.where(mask, _as_float(token_rewards), 0.0)
        if self.per_token:  # the return-to-go credits each turn
            return self.compute(token_rewards + scalar_to_token_rewards(outcome, mask), mask, group_size=group_size,
                                values=values, gamma=gamma, lam=lam)
        if group_size is None:
            raise ValueError(f"advantage estimator {self.name!r} needs group_size")
        options = dict(self.options)
        turns = int(turn.max()) if turn.numel() else 0
        # R[i, j]: sample i's rewards on its turn j's tokens (column 0 gathers the unmarked ones, dropped).
        per_turn = torch.zeros(turn.shape[0], turns + 1, dtype=token_rewards.dtype, device=token_rewards.device)
        per_turn = per_turn.scatter_add_(1, turn.long(), token_rewards)[:, 1:]
        columns = [self.fn(per_turn[:, j], group_size, **options) for j in range(turns)]
        to_go = torch.stack(columns, dim=-1).flip(-1).cumsum(-1).flip(-1) if columns else per_turn
        by_turn = self.fn(_as_float(outcome), group_size, **options)[:, None] + to_go
        by_turn = torch.cat([torch.zeros_like(by_turn[:, :1]), by_turn], dim=-1)  # turn 0: no credit
        return torch.where(mask, by_turn.gather(1, turn.long()), 0.0), None


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator("grpo", grpo_advantages, per_token=False),
    "dr_grpo": AdvantageEstimator("dr_grpo", grpo_advantages, per_token=False, options=(("scale", "none"),)),
    "rloo": AdvantageEstimator("rloo", rloo_advantages, per_token=False),
    "reinforce_pp": AdvantageEstimator("reinforce_pp", reinforce_pp_advantages, per_token=True),
    "gae": AdvantageEstimator("gae", gae_advantages, per_token=True, needs_critic=True),
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under `name` (see `ADVANTAGE_ESTIMATORS`)."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}") from None
