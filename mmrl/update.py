"""One RL step's update from a scored rollout, as the trainer runs it.

    update = PolicyUpdate(recipe, dist, actor, ref, critic, estimator, processing, adapter)
    plan = update.plan(conversations, rollout_result, kept_rows, rewards, group_size, temperature, outcomes)
    plan.advantages                # {rollout row: mean advantage}, for the samples log
    metrics.update(plan.metrics)   # what planning measured (the KL in the reward)
    metrics.update(update.run(plan))   # the optimizer steps

`plan` turns the kept rows into training sequences in micro-batches planned into
mini-batches (`mmrl.rollout_batch`), takes the old-policy, reference and value estimates
and computes the advantages; `run` takes the plan's optimizer steps. Every rank runs as
many micro-batches and optimizer steps as the others (FSDP2's collectives). Loss weights
make the summed micro-batch gradients those of the whole mini-batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmrl.algos import importance_weights, kl_estimate, kl_in_reward, kl_loss, policy_loss, scalar_to_token_rewards
from mmrl.algos.losses import aggregate, value_loss
from mmrl.engine import Engine, Sequences
from mmrl.rollout.base import RolloutResult
from mmrl.rollout_batch import Mini, training_batches

if TYPE_CHECKING:
    from mmrl.adapter import ModelAdapter
    from mmrl.algos import AdvantageEstimator
    from mmrl.config import Recipe
    from mmrl.parallel import Dist
    from mmrl.processing import Processing


@dataclass
class UpdatePlan:
    """One step's update as planned: the micro-batches (each with its rollout rows, old,
    reference and value estimates and advantages in `extras`), the mini-batches over them,
    and what planning found."""
    batches: list[Sequences]
    minis: list[Mini]  # one optimizer step each: (micro-batch index, loss scale) per pass
    temperature: float
    advantages: dict[int, float]  # each kept rollout row's advantage, the mean over its response tokens
    metrics: dict[str, float] = field(default_factory=dict)
    estimate_seconds: float = 0.0  # spent on the old-policy, reference and value passes


@dataclass
class PolicyUpdate:
    recipe: Recipe
    dist: Dist
    actor: Engine
    ref: Engine | None
    critic: Engine | None
    estimator: AdvantageEstimator
    processing: Processing
    adapter: ModelAdapter

    def plan(self, conversations: list | None, result: RolloutResult, rows: torch.Tensor, rewards: torch.Tensor,
             group_size: int, temperature: float, outcomes: torch.Tensor | None = None) -> UpdatePlan:
        """The update of the kept `rows` of `result` (answering `conversations`; None for a
        multi-turn rollout), scored `rewards` (one per rollout row; `outcomes`: the reward
        function's part alone, for per-turn credit)."""
        batches, minis = training_batches(conversations, result, rows, algo=self.recipe.algo, dist=self.dist,
                                          processing=self.processing, adapter=self.adapter, actor=self.actor)
        start = time.perf_counter()
        self._estimate(batches, minis, temperature)
        seconds = time.perf_counter() - start
        advantages, metrics = self._advantages(batches, rewards[rows], group_size,
                                               outcomes[rows] if outcomes is not None else None)
        return UpdatePlan(batches, minis, temperature, advantages, metrics, seconds)

    @torch.no_grad()
    def _estimate(self, batches: list[Sequences], minis: list[Mini], temperature: float) -> None:
        """Old-policy, reference and value estimates of the sampled tokens. The passes follow
        the update's plan (`minis`), zero-weighted repeats included, so every rank runs as
        many forwards as the others (FSDP2's collectives); a repeat stores the same values."""
        algo = self.recipe.algo
        need_old = (algo.epochs_per_rollout > 1 or algo.mini_batches > 1
                    or (self.ref is not None and algo.kl_in == "reward"))
        for index, _ in (entry for mini in minis for entry in mini):
            seqs = batches[index]
            if need_old:
                seqs.extras["old_logp"] = self.actor.log_probs(seqs, temperature, with_entropy=False)[0]
            if self.ref is not None:
                seqs.extras["ref_logp"] = self.ref.log_probs(seqs, temperature, with_entropy=False)[0]
            if self.critic is not None:
                seqs.extras["values"] = self.critic.values(seqs)

    def _advantages(self, batches: list[Sequences], rewards: torch.Tensor, group_size: int,
                    outcomes: torch.Tensor | None = None) -> tuple[dict[int, float], dict[str, float]]:
        """Advantages (and value targets) over the whole kept batch, stored per micro-batch;
        returns each kept rollout row's advantage, the mean over its response tokens, and
        the KL in the reward (`kl/reward`) where there is one.
        Groups stay whole: the uniform-group filter drops groups, never single rows. With
        `algo.credit_assignment: turn`, `outcomes` are the reward function's scores alone
        and each environment reward is credited to the policy turns up to the one it
        followed (`AdvantageEstimator.compute_by_turn`)."""
        algo = self.recipe.algo
        metrics: dict[str, float] = {}
        width = max(s.response_ids.shape[1] for s in batches)

        def gather(key_or_fn) -> torch.Tensor:
            parts = [key_or_fn(s) if callable(key_or_fn) else s.extras[key_or_fn] for s in batches]
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts]).cpu()

        mask = gather(lambda s: s.response_mask)
        by_turn = algo.credit_assignment == "turn"
        token_rewards = gather("turn_rewards") if by_turn else scalar_to_token_rewards(rewards, mask)
        if self.ref is not None and algo.kl_in == "reward":
            kl = kl_estimate(gather("old_logp"), gather("ref_logp"), algo.kl_estimator)
            token_rewards = kl_in_reward(token_rewards, kl, algo.kl_coef, mask)
            metrics["kl/reward"] = (kl * mask).sum().item() / max(mask.sum().item(), 1)
        values = gather("values") if self.critic is not None else None
        if by_turn:
            advantages, returns = self.estimator.compute_by_turn(
                outcomes, token_rewards, gather("turn"), group_size=group_size, values=values, gamma=algo.gamma,
                lam=algo.lam)
        else:
            advantages, returns = self.estimator.compute(
                token_rewards, mask, group_size=group_size, values=values, gamma=algo.gamma, lam=algo.lam
            )
        offset = 0
        for seqs in batches:
            size, length = seqs.response_ids.shape
            seqs.extras["advantages"] = advantages[offset:offset + size, :length].to(self.dist.device)
            if returns is not None:
                seqs.extras["returns"] = returns[offset:offset + size, :length].to(self.dist.device)
            offset += size
        means = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        rows = torch.cat([seqs.extras["rows"].cpu() for seqs in batches]).tolist()
        return dict(zip(rows, means.tolist())), metrics

    def run(self, plan: UpdatePlan) -> dict[str, float]:
        """Policy (and critic) updates: `epochs_per_rollout` passes over the plan's
        mini-batches, one optimizer step each."""
        algo = self.recipe.algo
        batches, minis, temperature = plan.batches, plan.minis, plan.temperature
        # Loss weights make the summed micro-batch gradients equal the gradient of the
        # whole mini-batch across ranks: FSDP averages over ranks, hence the world-size
        # factor. With sequence parallelism every group counts its tokens P times over P
        # times as many ranks, and FSDP sums the group's partial gradients: the same
        # weights hold. A zero-scaled (filler) micro-batch adds nothing.
        tokens = [float(s.response_mask.sum()) for s in batches]
        totals = []
        for mini in minis:
            real = [i for i, scale in mini if scale]
            totals.append((self.dist.all_reduce_sum(sum(tokens[i] for i in real)) / self.dist.world_size,
                           self.dist.all_reduce_sum(float(sum(batches[i].size for i in real))) / self.dist.world_size))
        sums: dict[str, float] = defaultdict(float)
        steps = taken = 0
        # float16 engines scale the loss (`Engine.backward`) and skip steps whose
        # gradients overflowed; the grad norm averages over the steps taken.
        scaled = [(prefix, e) for prefix, e in (("", self.actor), ("critic_", self.critic))
                  if e is not None and e.loss_scaler is not None]
        skipped = {prefix: engine.skipped_steps for prefix, engine in scaled}
        for _ in range(algo.epochs_per_rollout):
            for mini, (global_tokens, global_rows) in zip(minis, totals):
                for key, value in self._accumulate(batches, tokens, mini, global_tokens, global_rows,
                                                   temperature).items():
                    _add(sums, key, value)
                norm = self.actor.step()
                if not self.actor.step_skipped:
                    sums["grad_norm"] += norm
                    taken += 1
                if self.critic is not None:
                    self.critic.step()
                steps += 1
        metrics = {key: value if key in _EXTREMES else value / steps for key, value in sums.items()
                   if key != "grad_norm"}
        if taken:
            metrics["grad_norm"] = sums["grad_norm"] / taken
        metrics["tokens"] = sum(tokens)
        metrics["update/optimizer_steps"] = steps
        metrics["update/micro_batches"] = len(batches)
        for prefix, engine in scaled:
            metrics[f"update/{prefix}loss_scale"] = engine.loss_scale
            metrics[f"update/{prefix}skipped_steps"] = engine.skipped_steps - skipped[prefix]
        return metrics

    def _accumulate(self, batches: list, tokens: list[float], mini: list, global_tokens: float, global_rows: float,
                    temperature: float) -> dict[str, float]:
        """One mini-batch's gradients, micro-batch by micro-batch, and its metric sums.
        Under `gradient_checkpointing: auto`, a GPU that runs out of memory here gets
        checkpointing turned on and the mini-batch is redone from zeroed gradients, so
        the step is the one it would have been (`Engine.checkpoint_after_oom`)."""
        try:
            return self._micro_batches(batches, tokens, mini, global_tokens, global_rows, temperature)
        except torch.OutOfMemoryError:
            if not self.actor.can_checkpoint_after_oom():
                raise
        # Outside the except block, so the failed pass's activations are free to go.
        self.actor.checkpoint_after_oom()
        if self.critic is not None:
            self.critic.drop_gradients()
        print("update: out of GPU memory without activation checkpointing; turned it on "
              "(gradient_checkpointing: auto) and redid the mini-batch", flush=True)
        return self._micro_batches(batches, tokens, mini, global_tokens, global_rows, temperature)

    def _micro_batches(self, batches: list, tokens: list[float], mini: list, global_tokens: float,
                       global_rows: float, temperature: float) -> dict[str, float]:
        algo = self.recipe.algo
        norm_length = self.recipe.rollout.max_new_tokens
        sums: dict[str, float] = defaultdict(float)
        for index, scale in mini:
            seqs, count = batches[index], tokens[index]
            if algo.loss_aggregation == "token_mean":
                share = count / global_tokens if global_tokens else 0.0
            else:
                share = seqs.size / global_rows
            weight = scale * share
            logp, entropy = self.actor.log_probs(seqs, temperature)
            # Old log-probs are taken before the first step whenever there are
            # several; with one the ratio is exactly 1.
            old = seqs.extras.get("old_logp", logp.detach())
            # Tokens sampled by older weights (mmrl.buffer) carry their behaviour log-probs.
            behaviour = seqs.extras.get("behaviour_logp")
            weights = None
            token_share = scale * count / global_tokens if global_tokens else 0.0
            if behaviour is not None:
                weights, spread = importance_weights(old, behaviour, seqs.response_mask, mode=algo.off_policy,
                                                     cap=algo.is_cap)
                for key in ("ratio_mean", "capped_fraction"):
                    _add(sums, f"off_policy/{key}", token_share * float(spread[key]))
                for key in ("ratio_max", "ratio_min"):
                    _add(sums, f"off_policy/{key}", float(spread[key]))
            loss, stats = policy_loss(
                logp, old, seqs.extras["advantages"], seqs.response_mask, clip_low=algo.clip_low,
                clip_high=algo.clip_high, aggregation=algo.loss_aggregation, norm_length=norm_length,
                importance_weights=weights,
            )
            if self.ref is not None and algo.kl_in == "loss":
                kl_term = kl_loss(logp, seqs.extras["ref_logp"], seqs.response_mask, coef=algo.kl_coef,
                                  kind=algo.kl_estimator, aggregation=algo.loss_aggregation,
                                  norm_length=norm_length)
                loss = loss + kl_term
                sums["kl/loss"] += weight * float(kl_term.detach()) / algo.kl_coef
            entropy_mean = aggregate(entropy, seqs.response_mask, "token_mean")
            if algo.entropy_coef:
                # Aggregated as the loss is, so the micro-batch split changes nothing.
                loss = loss - algo.entropy_coef * aggregate(entropy, seqs.response_mask,
                                                            algo.loss_aggregation, norm_length=norm_length)
            self.actor.backward(loss * weight)
            sums["loss/policy"] += weight * float(loss.detach())
            sums["entropy"] += token_share * float(entropy_mean.detach())
            sums["clip_fraction"] += weight * float(stats["clip_fraction"])
            sums["approx_kl"] += weight * float(stats["approx_kl"])
            if self.critic is not None:
                values = self.critic.values(seqs)
                vloss, _ = value_loss(values, seqs.extras["values"], seqs.extras["returns"],
                                      seqs.response_mask)
                self.critic.backward(vloss * weight)
                sums["loss/value"] += weight * float(vloss.detach())
        return sums


# Metrics that are a maximum or minimum over the update's tokens, not averages over its steps.
_EXTREMES = {"off_policy/ratio_max": max, "off_policy/ratio_min": min}


def _add(sums: dict[str, float], key: str, value: float) -> None:
    """Count a metric's value into `sums`; a maximum or minimum (`_EXTREMES`) is kept as one."""
    sums[key] = _EXTREMES[key](sums[key], value) if key in _EXTREMES and key in sums else sums.get(key, 0.0) + value


__all__ = ["PolicyUpdate", "UpdatePlan"]
