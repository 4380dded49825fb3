"""Multi-turn rollout: an agent loop that drives any backend's `generate` turn by turn.

    agent = AgentRollout(make_rollout("hf", engine, processing), processing,
                         get_environment("tools", tools=["zoom"]), max_turns=3, max_tokens=256)
    result = agent.generate(rows, SamplingParams(n=8, max_new_tokens=8))   # dataset rows, not conversations
    result.texts            # each sample's final policy turn (what the reward scores)
    result.trajectories     # token ids, which of them the policy sampled, the conversation

The trainer turns the trajectories into training sequences with
`mmrl.rollout_batch.trajectory_sequences`.

Each sample is a conversation: the environment opens it (`reset(row)`), then policy
turns (the backend samples, `max_new_tokens` per turn) alternate with environment turns
(`step(messages)`: tool replies, possibly images) until the environment says done, the
policy has had `max_turns` turns, or the tokens after the prompt would exceed
`max_tokens`. A turn that would overflow the token budget is dropped whole, with the
environment turn before it: the sample ends at the policy turn before, so media
placeholders always keep their features.

Every policy turn is sampled from the conversation processed in one go (the family's
chat template and processor, all images so far), and the next turn's processed
conversation must begin with the previous one's tokens followed by the sampled ones
(`prefix` rule). So the final sequence holds each policy turn's tokens exactly as
sampled, in exactly the context they were sampled in; the trainer's loss mask covers
them alone (environment tokens, template tokens and images are context). A turn whose
text re-renders to other tokens (a stop token the template does not write, or a
tokenizer that does not round-trip) breaks the rule: the sample ends before it
(`finish` "drift", counted in the metrics).

On the compiled backend (`hf_compiled`) the loop opens a session
(`mmrl.rollout.sessions`) that keeps each sample's KV-cache row between turns: a later
turn prefills only what the prefix rule says is new (the environment's reply, template
tokens, new images), at the positions and with the media tensors of the whole
conversation, and finished samples free their rows. `keep_cache=False` (or any other
backend) samples each turn from its whole conversation.

`timed=True` (benches) records where each turn's seconds went in `agent.timings`: the
backend's call (on a session, its phases: processing, prefill, decode, ...), the
environment's steps, and the loop's own work on the turn's results.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmrl.rollout.base import RolloutResult, SamplingParams
from mmrl.rollout.sessions import session_for


@dataclass
class Trajectory:
    messages: list[dict]  # the whole conversation, the final policy turn included
    context: list[dict] = field(default_factory=list)  # the conversation before the last policy turn
    prompt_ids: list[int] = field(default_factory=list)  # `context` processed (generation prompt included)
    last_ids: list[int] = field(default_factory=list)  # the last policy turn's sampled tokens
    spans: list[tuple[int, int]] = field(default_factory=list)  # policy turns in prompt_ids + last_ids
    logprobs: list[float] = field(default_factory=list)  # sampler log-probs of the policy tokens, in order
    first: int = 0  # length of the opening prompt: training covers what follows it
    opening: int = 0  # messages of the opening conversation (what the environment's reset gave)
    prompt: int = 0  # the dataset row it answers (index into the rows given to `generate`)
    finish: str = ""  # done | turns | tokens | drift
    last_reason: str = ""  # the last policy turn's: stop | length
    turns: int = 0
    env_reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward after each policy turn
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.last_ids

    @property
    def policy_tokens(self) -> int:
        return sum(b - a for a, b in self.spans)

    @property
    def env_tokens(self) -> int:
        """Tokens after the opening prompt the policy did not sample (tool replies,
        images' placeholders, chat-template scaffolding)."""
        return len(self.ids) - self.first - self.policy_tokens


class AgentRollout:
    """The agent loop over `backend` (a `Rollout`); `env_factory` makes one environment
    per sample (`mmrl.envs.get_environment`)."""

    def __init__(self, backend, processing, env_factory: Callable[[], Any], *, max_turns: int = 4,
                 max_tokens: int = 1024, keep_cache: bool = True, timed: bool = False):
        if max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {max_turns}")
        self.backend = backend
        self.processing = processing
        self.env_factory = env_factory
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        # On the compiled backend, each sample's cache row lives from turn to turn
        # (`mmrl.rollout.sessions`); False re-prefills every conversation whole each turn.
        self.keep_cache = keep_cache
        self.session = None  # the last rollout's session, where one ran (its `stats`)
        # Per-turn seconds of the last rollout (`timed`; the session then syncs the device).
        self.timed = timed
        self.timings: list[dict] = []

    def sync(self, engine) -> None:
        self.backend.sync(engine)

    def _prompt_ids(self, result: RolloutResult, conversations: list[list[dict]]) -> list[list[int]]:
        batch = result.prompt_inputs if result.prompt_inputs is not None else self.processing(conversations)
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        return [row[keep].tolist() for row, keep in zip(ids.cpu(), mask.cpu())]

    def generate(self, rows: Sequence[dict], params: SamplingParams) -> RolloutResult:
        """`params.n` trajectories per dataset row, in row order (row 0's n first)."""
        if params.max_new_tokens > self.max_tokens:
            raise ValueError(f"rollout.max_tokens ({self.max_tokens}) is smaller than one turn's "
                             f"max_new_tokens ({params.max_new_tokens})")
        envs, trajectories = [], []
        for index, row in enumerate(rows):
            for _ in range(params.n):
                env = self.env_factory()
                envs.append(env)
                opening = list(env.reset(row))
                trajectories.append(Trajectory(messages=opening, opening=len(opening), prompt=index))
        turn_params = SamplingParams(n=1, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                                     top_p=params.top_p, seed=params.seed, logprobs=params.logprobs)
        active = list(range(len(trajectories)))
        # No room reserved for later turns: the cache grows when a turn needs it (a longer
        # cache costs every decode step), and the compiled rollout keeps its longest length.
        session = self.session = session_for(self.backend) if self.keep_cache else None
        if session is not None:
            session.timed = self.timed
        self.timings = []
        try:
            self._turns(trajectories, envs, active, params, turn_params, session)
        finally:
            if session is not None:
                session.close()
        return self._result(trajectories, params.n, len(rows), session)

    def _turns(self, trajectories: list[Trajectory], envs: list, active: list[int], params: SamplingParams,
               turn_params: SamplingParams, session) -> None:
        """Policy and environment turns until no sample is `active` (indices of `trajectories`);
        each turn through `session` where there is one (samples no longer active leave its
        cache), else through the backend's `generate`."""
        while active:
            began = time.perf_counter()
            conversations = [trajectories[i].messages for i in active]
            timed_before = len(session.stats["phases"]) if session is not None else 0
            if session is not None:
                result = session.generate(active, conversations, turn_params)
            else:
                result = self.backend.generate(conversations, turn_params)
            generated = time.perf_counter()
            environment_s = 0.0
            prompts = self._prompt_ids(result, conversations)
            still = []
            for row, i in enumerate(active):
                t, env = trajectories[i], envs[i]
                prompt = prompts[row]
                if t.turns == 0:
                    t.first = len(prompt)
                elif prompt[:len(t.ids)] != t.ids or len(prompt) - t.first + params.max_new_tokens > self.max_tokens:
                    # The environment turn since the last policy turn is dropped whole.
                    t.finish = "drift" if prompt[:len(t.ids)] != t.ids else "tokens"
                    t.messages = t.messages[:len(t.context) + 1]
                    continue
                length = int(result.response_mask[row].sum())
                sampled = result.response_ids[row, :length].tolist()
                t.context = copy.copy(t.messages)
                t.prompt_ids, t.last_ids = prompt, sampled
                t.spans.append((len(prompt), len(prompt) + length))
                if result.logprobs is not None:
                    t.logprobs += result.logprobs[row, :length].tolist()
                t.last_reason = result.finish_reasons[row]
                t.turns += 1
                t.messages = [*t.messages, {"role": "assistant", "content": self._content(t.messages, sampled)}]
                stepped = time.perf_counter()
                new, done, reward = env.step(t.messages)
                environment_s += time.perf_counter() - stepped
                t.env_reward += float(reward or 0.0)
                t.turn_rewards.append(float(reward or 0.0))
                t.tool_calls = int(getattr(env, "tool_calls", 0))
                t.tool_errors = int(getattr(env, "tool_errors", 0))
                if done:
                    t.finish = "done"
                elif t.turns >= self.max_turns:
                    t.finish = "turns"
                else:
                    t.messages = [*t.messages, *new]
                    still.append(i)
            if self.timed:
                ended = time.perf_counter()
                # The session's phases where this turn ran on its cache (not turn by turn).
                phases = session.stats["phases"][-1] if session is not None and len(
                    session.stats["phases"]) > timed_before else {}
                self.timings.append({"turn": len(self.timings) + 1, "rows": len(active),
                                     "generate_s": generated - began, "session": phases,
                                     "environment_s": environment_s, "agent_s": ended - generated - environment_s})
            active = still

    def _content(self, messages: list[dict], sampled: list[int]) -> str:
        """The policy turn as the assistant message's text: its tokens without the stop
        token (the chat template writes the end of turn), special tokens kept, no strip.
        Some templates write text of their own between the generation prompt and the
        content (Idefics3: "Assistant:" then " " + content); a turn that begins with
        that text gives it back to the template, so the rendering matches the tokens."""
        stops = set(self.processing.stop_token_ids)
        if sampled and sampled[-1] in stops:
            sampled = sampled[:-1]
        text = self.processing.tokenizer.decode(sampled, skip_special_tokens=False)
        inserted = self.inserted_before_content(messages)
        return text[len(inserted):] if inserted and text.startswith(inserted) else text

    def inserted_before_content(self, messages: list[dict]) -> str:
        """The text the chat template writes between the generation prompt and an
        assistant's content ("" where it writes none, or will not say)."""
        marker = "\u2063MMRL\u2063"
        try:
            prompt = self.processing.render(messages, add_generation_prompt=True)
            rendered = self.processing.render([*messages, {"role": "assistant", "content": marker}],
                                              add_generation_prompt=False)
        except Exception:  # a template that refuses the probe inserts nothing we can see
            return ""
        if not rendered.startswith(prompt) or marker not in rendered:
            return ""
        return rendered[len(prompt):rendered.index(marker)]

    def _result(self, trajectories: list[Trajectory], n: int, prompts: int, session=None) -> RolloutResult:
        pad = self.processing.tokenizer.pad_token_id
        tails = [t.ids[t.first:] for t in trajectories]
        width = max(1, max(len(x) for x in tails))
        ids = torch.full((len(tails), width), pad, dtype=torch.long)
        mask = torch.zeros(len(tails), width)
        logprobs = torch.zeros(len(tails), width)
        for row, (t, tail) in enumerate(zip(trajectories, tails)):
            ids[row, :len(tail)] = torch.tensor(tail, dtype=torch.long)
            position = 0
            for a, b in t.spans:
                mask[row, a - t.first:b - t.first] = 1
                if t.logprobs:
                    logprobs[row, a - t.first:b - t.first] = torch.tensor(t.logprobs[position:position + b - a])
                position += b - a
        count = max(len(trajectories), 1)
        stats = {
            "agent/turns": sum(t.turns for t in trajectories) / count,
            "agent/tool_calls": sum(t.tool_calls for t in trajectories) / count,
            "agent/tool_errors": sum(t.tool_errors for t in trajectories) / count,
            "agent/samples_calling_tools": sum(t.tool_calls > 0 for t in trajectories) / count,
            "tokens/policy": sum(t.policy_tokens for t in trajectories) / count,
            "tokens/environment": sum(t.env_tokens for t in trajectories) / count,
            "tokens/prompt": sum(t.first for t in trajectories) / count,
            # The environment's reward per policy turn (turns of every sample pooled).
            "agent/turn_reward": sum(map(sum, (t.turn_rewards for t in trajectories)))
            / max(sum(len(t.turn_rewards) for t in trajectories), 1),
            **{f"agent/finish_{kind}": sum(t.finish == kind for t in trajectories) / count
               for kind in ("done", "turns", "tokens", "drift")},
        }
        if session is not None and session.stats["turn_by_turn"] is None:
            # Tokens each sample's turns prefilled into the kept cache, against processing
            # every turn's whole conversation (what re-prefilling feeds).
            stats["agent/prefill_tokens"] = session.stats["prefill_tokens"] / count
            stats["agent/prefill_tokens_whole"] = session.stats["whole_tokens"] / count
            stats["agent/reprefilled_samples"] = session.stats["reprefilled_samples"] / count
        texts = self.processing.decode([t.last_ids for t in trajectories])
        return RolloutResult(
            response_ids=ids, response_mask=mask,
            finish_reasons=[t.last_reason if t.finish == "done" else t.finish for t in trajectories],
            prompt_index=torch.arange(prompts).repeat_interleave(n),
            logprobs=logprobs if any(t.logprobs for t in trajectories) else None,
            trajectories=trajectories, texts=texts,
            env_rewards=torch.tensor([t.env_reward for t in trajectories]), stats=stats,
        )


__all__ = ["AgentRollout", "Trajectory"]
