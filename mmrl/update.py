"""One RL step's update from a scored rollout, as the trainer runs it.

    update = PolicyUpdate(recipe, dist, actor, ref, critic, estimator, processing, adapter)
    batches, minis = update.batches(conversations, rollout_result, kept_rows)
    update.estimate(batches, minis, temperature)       # old, reference and value estimates
    advantages = update.advantages(batches, rewards, group_size, metrics, outcomes)   # {row: mean}
    metrics.update(update.run(batches, minis, temperature))   # the optimizer steps

The kept rows become training sequences in micro-batches (by rows, or by tokens with
`algo.micro_batch_tokens`), planned into mini-batches (`mmrl.engine.batching`); every
rank runs as many micro-batches and optimizer steps as the others (FSDP2's collectives).
Loss weights make the summed micro-batch gradients those of the whole mini-batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmrl.engine import Engine, join

if TYPE_CHECKING:
    from mmrl.adapter import ModelAdapter
    from mmrl.algos import AdvantageEstimator
    from mmrl.config import Recipe
    from mmrl.parallel import Dist
    from mmrl.processing import Processing


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

    def sequences(self, conversations: list, ids: torch.Tensor, mask: torch.Tensor, prompts: dict | None = None,
                   owners: list[int] | None = None, media=None):
        """Training sequences of rows answering `conversations`; `owners` (the rows'
        prompt indices) lets repeated prompts share their media encoding, with their
        processed media taken from `media` (the rollout's) where it has them."""
        from mmrl.engine.media import SharedMedia

        length = max(1, int(mask.sum(-1).max()))
        shared = None
        if owners and self.actor.shares_media:
            shared = media.select(owners) if media is not None else SharedMedia.of(self.processing, conversations, owners)
        if prompts is None:
            prompts = shared.rows(self.processing, conversations) if shared is not None else dict(self.processing(conversations))
        seqs = join(prompts, ids[:, :length], mask[:, :length], self.adapter, self.actor.model,
                    self.processing.tokenizer.pad_token_id, shared=shared)
        return seqs.to(self.dist.device)


    def batches(self, conversations: list, result, rows: torch.Tensor) -> tuple[list, list]:
        """Training sequences of the kept `rows` in micro-batches, and the update's plan:
        its mini-batches as lists of (micro-batch index, loss scale) (`mmrl.engine.batching`)."""
        from mmrl.engine.batching import even_out, update_plan

        algo = self.recipe.algo
        lengths = self._row_lengths(conversations, result, rows) if algo.micro_batch_tokens else [0] * len(rows)
        # Every rank takes as many optimizer steps, and as many passes per step (FSDP2's
        # collectives), as the others: the fewest kept rows bound the mini-batches.
        mini_batches = min(algo.mini_batches, *(int(n) for n in self.dist.all_gather_objects(len(rows))))
        plan = update_plan(lengths, mini_batches=mini_batches, micro_batch_size=algo.micro_batch_size,
                           micro_batch_tokens=algo.micro_batch_tokens)
        if self.dist.distributed:
            counts = self.dist.all_gather_objects([len(mini) for mini in plan])
            plan = even_out(plan, [max(c) for c in zip(*counts)])
        parts = list(dict.fromkeys(micro.rows for mini in plan for micro in mini if micro.scale))
        index = {part: i for i, part in enumerate(parts)}
        minis = [[(index[micro.rows], micro.scale) for micro in mini] for mini in plan]
        chosen_rows = [rows[list(part)] for part in parts]
        if result.trajectories is not None:
            from mmrl.rollout.agent import trajectory_sequences

            pad = self.processing.tokenizer.pad_token_id
            # Samples of one prompt encode its opening media once (`shared_pieces`).
            batches = [trajectory_sequences([result.trajectories[i] for i in chosen.tolist()], self.processing,
                                            self.adapter, self.actor.model, pad,
                                            share=self.actor.shares_media).to(self.dist.device)
                       for chosen in chosen_rows]
            return _with_rows(batches, chosen_rows), minis
        owners = result.prompt_index.tolist()
        expanded = [conversations[i] for i in owners]
        # One micro-batch of every row: the rollout's own prompt batch is that batch.
        reuse = result.prompt_inputs if len(parts) == 1 and len(rows) == len(expanded) else None
        batches = []
        for chosen in chosen_rows:
            batches.append(self.sequences([expanded[i] for i in chosen], result.response_ids[chosen],
                                           result.response_mask[chosen], reuse, [owners[i] for i in chosen],
                                           result.shared_media))
        return _with_rows(batches, chosen_rows), minis

    def _row_lengths(self, conversations: list, result, rows: torch.Tensor) -> list[int]:
        """Tokens (prompt + response) of each kept row, for micro-batches by token budget."""
        if result.trajectories is not None:
            return [len(result.trajectories[i].prompt_ids) + len(result.trajectories[i].last_ids)
                    for i in rows.tolist()]
        responses = result.response_mask.sum(-1).long()
        if result.prompt_inputs is not None:
            prompts = result.prompt_inputs["attention_mask"].sum(-1).long().cpu()
        else:  # a backend that kept no processed batch: each prompt processed once
            per_prompt = self.processing(conversations)["attention_mask"].sum(-1).long()
            prompts = per_prompt[result.prompt_index]
        return (prompts[rows] + responses[rows]).tolist()

    @torch.no_grad()
    def estimate(self, batches: list, minis: list, temperature: float) -> None:
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

    def advantages(self, batches: list, rewards: torch.Tensor, group_size: int, metrics: dict,
                    outcomes: torch.Tensor | None = None) -> dict[int, float]:
        """Advantages (and value targets) over the whole kept batch, stored per micro-batch;
        returns each kept rollout row's advantage, the mean over its response tokens.
        Groups stay whole: the uniform-group filter drops groups, never single rows. With
        `algo.credit_assignment: turn`, `outcomes` are the reward function's scores alone
        and each environment reward is credited to the policy turns up to the one it
        followed (`AdvantageEstimator.compute_by_turn`)."""
        from mmrl.algos import kl_estimate, kl_in_reward, scalar_to_token_rewards

        algo = self.recipe.algo
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
        return dict(zip(rows, means.tolist()))

    def run(self, batches: list, minis: list, temperature: float) -> dict[str, float]:
        """Policy (and critic) updates: `epochs_per_rollout` passes over the mini-batches
        (`minis`: lists of (micro-batch index, loss scale)), one optimizer step each."""
        algo = self.recipe.algo
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
        from mmrl.algos import importance_weights, kl_loss, policy_loss
        from mmrl.algos.losses import aggregate, value_loss

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


def _with_rows(batches: list, chosen_rows: list[torch.Tensor]) -> list:
    """Each micro-batch tagged with the rollout rows it holds (`extras["rows"]`), so values
    computed over the batch can be told back by row."""
    for seqs, chosen in zip(batches, chosen_rows):
        seqs.extras["rows"] = chosen
    return batches
