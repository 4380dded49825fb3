"""Partial rollouts: rounds of at most `rollout.partial_tokens` new tokens per sample, the
samples still generating carried to the next step under the new weights.

    rounds = PartialRollouts(trainer, buffer, recompute=...)   # in mmrl.buffer.steps_for
    batch = rounds.produce()                                    # a scored batch of finished groups

Each rollout round draws the next `data.prompts_per_step` prompts (groups of
`rollout.samples_per_prompt` responses) into flight, then every unfinished response in
flight generates at most N tokens (fewer where `rollout.max_new_tokens` comes first),
continuing from its prompt and its tokens so far. On the compiled rollout (`hf_compiled`,
with `rollout.keep_cache`, the default) one decode session (`mmrl.rollout.sessions`) lives
for the run: a carried response keeps its cache row between rounds, its older positions'
keys and values as the older weights computed them (the semantics of partial rollouts in
AReaL and Kimi k1.5), and its next round prefills only its last sampled token; finished
responses leave the cache at the next round. Elsewhere (`hf`, `keep_cache: false`,
sharded weights, sliding-window cache layers, a compiled path given up; said in one line
at the start) the rollout's `continue_from` processes the prompt and the tokens so far
again under the new weights, and a resumed run re-prefills its carried responses once
(caches are not persisted). A response finishes at its stop token or at `max_new_tokens`,
as it would in one `generate` call: with greedy decoding and unchanged weights the tokens
are the same on either path (tests/test_partial_rollouts.py,
tests/test_partial_kept_cache.py). The groups
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

import itertools
import sys
from collections import Counter
from collections.abc import Callable

import torch

from mmrl.buffer.store import InFlightGroup, InFlightResponse, RolloutBatch, TrajectoryBuffer
from mmrl.buffer.trainer_view import TrainerView
from mmrl.evaluation import conversations_of
from mmrl.rollout.base import RolloutResult, SamplingParams, right_padded
from mmrl.rollout.sessions import DecodeSession, session_for


class PartialRollouts:
    """The batches of a partial rollout (module docstring), from `trainer`'s prompts,
    rollout and reward, with the groups in flight kept in `buffer.in_flight`."""

    def __init__(self, trainer: TrainerView, buffer: TrajectoryBuffer,
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
        self.session, reason = kept_cache_session(trainer.rollout, keep_cache=r.rollout.keep_cache,
                                                  reserve=self.max_new_tokens)
        if reason is not None and trainer.dist.is_main:
            print(f"rollout.partial_tokens: carried samples re-prefill their tokens each round ({reason})",
                  file=sys.stderr, flush=True)
        # Each carried response's key in the session: id(response) -> (response, serial);
        # holding the response keeps its id from being reused while the key is live.
        self._keys: dict[int, tuple[InFlightResponse, int]] = {}
        self._serials = itertools.count()

    def produce(self) -> RolloutBatch:
        """The next batch of finished groups, scored (sampled by the current weights, and
        for carried responses by older ones too)."""
        version = self.trainer.step
        carried = sum(r.finish is None for g in self.buffer.in_flight for r in g.responses)
        prefilled = dict(self.session.stats) if self.session is not None else None
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
        if prefilled is not None:
            stats = self.session.stats
            batch.metrics["partial/prefill_tokens"] = float(stats["prefill_tokens"] - prefilled["prefill_tokens"])
            batch.metrics["partial/prefill_tokens_whole"] = float(stats["whole_tokens"] - prefilled["whole_tokens"])
        return batch

    def _draw(self) -> int:
        """The next prompts into flight, each with its `n` empty responses."""
        samples, rows = self.trainer.next_prompts()
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
        asked = [conversations[number] for number, _ in active]
        prefixes = [list(response.tokens) for _, response in active]
        with self.trainer.timed("rollout"):
            if self.session is not None:
                result = self.session.generate(self._session_keys([response for _, response in active]), asked,
                                               params, prefixes=prefixes)
            else:
                result = self.trainer.rollout.continue_from(asked, prefixes, params)
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

    def _session_keys(self, responses: list[InFlightResponse]) -> list[int]:
        """The session's key of each response (a new one for a response it has not seen);
        the keys of responses not in this round are let go, as the session lets go of their rows."""
        keys = {}
        for response in responses:
            known = self._keys.get(id(response))
            keys[id(response)] = known if known is not None and known[0] is response else \
                (response, next(self._serials))
        self._keys = keys
        return [serial for _, serial in keys.values()]

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
        rewards, outcomes, parts = trainer.score(samples, result, rows, trainer.train_set,
                                                  f"step {trainer.step + 1}", conversations)
        return RolloutBatch(samples=samples, rows=rows, conversations=conversations, result=result, rewards=rewards,
                            reward_parts=parts, outcomes=outcomes, version=version, data_end=tuple(trainer.position),
                            behaviour_logp=behaviour, indices=[g.index for g in groups], token_versions=versions)


def _responses_result(responses: list[InFlightResponse], owners: torch.Tensor, pad_id: int) -> RolloutResult:
    """The responses' tokens so far as a right-padded `RolloutResult` (`owners`: each
    one's prompt), "stop" or "length" as they finished (unfinished: "length")."""
    ids, mask = right_padded([r.tokens for r in responses], pad_id)
    return RolloutResult(response_ids=ids, response_mask=mask,
                         finish_reasons=[r.finish or "length" for r in responses], prompt_index=owners)


def kept_cache_session(rollout, keep_cache: bool, reserve: int) -> tuple[DecodeSession | None, str | None]:
    """The decode session that keeps carried responses' caches between rounds, or None
    and why the rounds re-prefill instead. `reserve`: the tokens a response may reach
    (`rollout.max_new_tokens`), so the first cache is sized for every round."""
    if not keep_cache:
        return None, "rollout.keep_cache is false"
    session = session_for(rollout, reserve=reserve)
    if session is None:
        return None, f"rollout backend {getattr(rollout, 'backend', type(rollout).__name__)!r} keeps no cache " \
                     "between calls; hf_compiled does"
    if session.stats["turn_by_turn"] is not None:
        return None, f"hf_compiled cannot keep a cache here: {session.stats['turn_by_turn']}"
    return session, None


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
