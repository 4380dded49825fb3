"""Partial rollouts: rounds of at most `rollout.partial_tokens` new tokens per sample, the
samples still generating carried to the next step under the new weights.

    rounds = PartialRollouts(trainer, buffer, recompute=...)   # in mmrl.buffer.steps_for
    batch = rounds.produce()                                    # a scored batch of finished groups

Each rollout round draws the next `data.prompts_per_step` prompts (groups of
`rollout.samples_per_prompt` responses) into flight, then every unfinished response in
flight generates at most N tokens (fewer where `rollout.max_new_tokens` comes first),
continuing from its prompt and its tokens so far (the rollout's `continue_from`, which
processes them again: no cache is kept between rounds). A response finishes at its stop
token or at `max_new_tokens`, as it would in one `generate` call: with greedy decoding and
unchanged weights the tokens are the same (tests/test_partial_rollouts.py). The groups
whose responses have all finished form the step's batch, in the order they were drawn; a
round that finishes none is followed by another before the update (the first steps of a
run, until the first groups are through). The others stay in the buffer
(`TrajectoryBuffer.in_flight`, written with each batch) and continue in the next step's
round, sampled by the weights after that update. A step's rollout is thus one round, of
at most N decode steps, over at most `prompts_per_step * ceil(max_new_tokens / N)` groups,
and a batch holds about `prompts_per_step` groups once the pipeline is full.

Each token keeps the version of the weights that sampled it and its behaviour log-prob:
the sampler's (`algo.behaviour: sampler`, the rollout's log-probs at the rollout
temperature) or the trainer's forward under those weights, run after each round for the
responses that grew in it (`recomputed`). The update weighs a token sampled by older
weights against it (`algo.off_policy`), whatever `algo.max_staleness` is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mmrl.buffer.store import InFlightGroup, InFlightResponse, RolloutBatch, TrajectoryBuffer
from mmrl.evaluation import conversations_of
from mmrl.rollout.base import RolloutResult, SamplingParams

if TYPE_CHECKING:
    from mmrl.trainer import Trainer


class PartialRollouts:
    """The batches of a partial rollout (module docstring), from `trainer`'s prompts,
    rollout and reward, with the groups in flight kept in `buffer.in_flight`."""

    def __init__(self, trainer: Trainer, buffer: TrajectoryBuffer,
                 recompute: Callable[[list, RolloutResult], torch.Tensor] | None):
        """`recompute(conversations, result)`: the current weights' log-probs of `result`'s
        tokens (`algo.behaviour: recomputed`); None takes the sampler's."""
        self.trainer = trainer
        self.buffer = buffer
        self.recompute = recompute
        r = trainer.recipe
        self.budget = r.rollout.partial_tokens
        self.max_new_tokens = r.rollout.max_new_tokens
        self.samples_per_prompt = r.rollout.samples_per_prompt
        self.index_of = {source: index for index, source in enumerate(trainer.train_set.source_rows)}

    def produce(self) -> RolloutBatch:
        """The next batch of finished groups, scored (sampled by the current weights, and
        for carried responses by older ones too)."""
        version = self.trainer.step
        carried = sum(r.finish is None for g in self.buffer.in_flight for r in g.responses)
        rounds = drawn = 0
        while not any(g.complete for g in self.buffer.in_flight):
            drawn += self._draw()
            self._round(version)
            rounds += 1
        finished = [g for g in self.buffer.in_flight if g.complete]
        self.buffer.in_flight = [g for g in self.buffer.in_flight if not g.complete]
        batch = self._batch(finished, version)
        batch.metrics = {"partial/rounds": float(rounds), "partial/carried_in": float(carried),
                         "partial/drawn_prompts": float(drawn),
                         "partial/carried_out": float(sum(r.finish is None for g in self.buffer.in_flight
                                                          for r in g.responses)),
                         "partial/waiting_groups": float(len(self.buffer.in_flight))}
        return batch

    def _draw(self) -> int:
        """The next prompts into flight, each with its `n` empty responses."""
        samples, rows = self.trainer._next_prompts()
        for row in rows:
            self.buffer.in_flight.append(InFlightGroup(
                index=self.index_of[row], row=row,
                responses=[InFlightResponse() for _ in range(self.samples_per_prompt)]))
        return len(rows)

    def _conversations(self, groups: list[InFlightGroup]) -> list:
        trainer = self.trainer
        samples = [trainer.train_set[g.index] for g in groups]
        return conversations_of(samples, [g.row for g in groups], trainer.train_set, f"step {trainer.step + 1}",
                                max_pixels=trainer.recipe.model.max_pixels)

    def _round(self, version: int) -> None:
        """Every unfinished response generates up to `budget` more tokens, recorded with
        `version` and their behaviour log-probs."""
        r = self.trainer.recipe
        groups = [g for g in self.buffer.in_flight if not g.complete]
        conversations = self._conversations(groups)
        active = [(number, response) for number, g in enumerate(groups) for response in g.responses
                  if response.finish is None]
        room = [self.max_new_tokens - len(response.tokens) for _, response in active]
        sampler = self.recompute is None
        params = SamplingParams(n=1, max_new_tokens=min(self.budget, max(room)), temperature=r.rollout.temperature,
                                top_p=r.rollout.top_p, logprobs=sampler,
                                logprobs_temperature=r.rollout.temperature or 1.0)
        with self.trainer._timed("rollout"):
            result = self.trainer.rollout.continue_from([conversations[number] for number, _ in active],
                                                        [response.tokens for _, response in active], params)
        before = [len(response.tokens) for _, response in active]
        for i, (_, response) in enumerate(active):
            made = int(result.response_mask[i].sum())
            kept = min(made, room[i])  # the batch's budget may exceed this response's room
            response.tokens += result.response_ids[i, :kept].tolist()
            response.versions += [version] * kept
            if sampler:
                response.behaviour += result.logprobs[i, :kept].float().tolist()
            if result.finish_reasons[i] == "stop" and kept == made:
                response.finish = "stop"
            elif len(response.tokens) >= self.max_new_tokens:
                response.finish = "length"
        if not sampler:
            grown = _responses_result([response for _, response in active],
                                      torch.tensor([number for number, _ in active]),
                                      self.trainer.processing.tokenizer.pad_token_id)
            logp = self.recompute(conversations, grown)
            for i, (_, response) in enumerate(active):
                response.behaviour += logp[i, before[i]:len(response.tokens)].tolist()

    def _batch(self, groups: list[InFlightGroup], version: int) -> RolloutBatch:
        """The finished groups as a scored batch."""
        trainer = self.trainer
        responses = [response for g in groups for response in g.responses]
        owners = torch.arange(len(groups)).repeat_interleave(self.samples_per_prompt)
        result = _responses_result(responses, owners, trainer.processing.tokenizer.pad_token_id)
        width = result.response_ids.shape[1]
        behaviour = torch.zeros(len(responses), width)
        versions = torch.zeros(len(responses), width, dtype=torch.long)
        for i, response in enumerate(responses):
            behaviour[i, :len(response.behaviour)] = torch.tensor(response.behaviour)
            versions[i, :len(response.versions)] = torch.tensor(response.versions, dtype=torch.long)
        if self.recompute is None:
            result.logprobs = behaviour.clone()
        samples = [trainer.train_set[g.index] for g in groups]
        rows = [g.row for g in groups]
        conversations = self._conversations(groups)
        rewards, outcomes, parts = trainer._score(samples, result, rows, trainer.train_set,
                                                  f"step {trainer.step + 1}", conversations)
        return RolloutBatch(samples=samples, rows=rows, conversations=conversations, result=result, rewards=rewards,
                            reward_parts=parts, outcomes=outcomes, version=version, data_end=tuple(trainer.position),
                            behaviour_logp=behaviour, indices=[g.index for g in groups], token_versions=versions)


def _responses_result(responses: list[InFlightResponse], owners: torch.Tensor, pad_id: int) -> RolloutResult:
    """The responses' tokens so far as a right-padded `RolloutResult` (`owners`: each
    one's prompt), "stop" or "length" as they finished (unfinished: "length")."""
    width = max([len(r.tokens) for r in responses] + [1])
    ids = torch.full((len(responses), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(responses), width)
    for i, response in enumerate(responses):
        ids[i, :len(response.tokens)] = torch.tensor(response.tokens, dtype=torch.long)
        mask[i, :len(response.tokens)] = 1.0
    return RolloutResult(response_ids=ids, response_mask=mask,
                         finish_reasons=[r.finish or "length" for r in responses], prompt_index=owners)


def partial_metrics(batch: RolloutBatch, version: int) -> dict[str, float]:
    """The rounds' figures (`PartialRollouts.produce`) and the batch's response tokens by
    how many updates before `version` their weights were: `partial/tokens_staleness_S`."""
    out = dict(batch.metrics)
    if batch.token_versions is not None:
        sampled = batch.result.response_mask > 0
        counts = Counter((version - batch.token_versions[sampled]).tolist())
        out.update({f"partial/tokens_staleness_{s}": float(n) for s, n in sorted(counts.items())})
        out["partial/token_staleness_max"] = float(max(counts, default=0))
    return out
