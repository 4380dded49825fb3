"""The rollout API shared by every backend.

    rollout = make_rollout(recipe.rollout, actor_engine, processing)
    result = rollout.generate(conversations, SamplingParams(n=8, max_new_tokens=4))
    result.response_ids, result.response_mask, result.finish_reasons, result.prompt_index
    rollout.sync(engine)          # after each update: the rollout samples from new weights

A backend returns, for each prompt, `n` right-padded responses with a mask that covers
the tokens up to and including the stop token. Special tokens that must never be
sampled (image placeholders, chat scaffolding) are blocked by every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mmrl.engine.media import SharedMedia


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # Ask for the sampled tokens' log-probs (temperature 1, whole vocabulary); the HF
    # backend keeps every step's logits for it, so it is off unless a caller needs them.
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutResult:
    response_ids: torch.Tensor  # (N * n, R), right-padded with pad
    response_mask: torch.Tensor  # (N * n, R) float
    finish_reasons: list[str]  # "stop" or "length", per response
    prompt_index: torch.Tensor  # (N * n,) index of the prompt each response answers
    logprobs: torch.Tensor | None = None  # (N * n, R) sampler log-probs when the backend has them
    # The processed (expanded, left-padded) prompt batch the backend generated from, when
    # it made one: the trainer reuses it instead of processing the same prompts again.
    prompt_inputs: dict[str, torch.Tensor] | None = None
    # Each prompt's own media inputs, when the backend encoded them once per prompt
    # (mmrl.engine.media): the update passes take theirs from it.
    shared_media: SharedMedia | None = None
    # Multi-turn rollouts (`mmrl.rollout.agent`): each response's trajectory, the text of
    # its final policy turn (what the reward scores), the environments' rewards, and
    # per-sample statistics (turns, tool calls, tokens by source) for the metrics.
    trajectories: list | None = None
    texts: list[str] | None = None
    env_rewards: torch.Tensor | None = None
    stats: dict[str, float] | None = None

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)


class Rollout(Protocol):
    def generate(self, conversations: list[list[dict]], params: SamplingParams) -> RolloutResult: ...

    def sync(self, engine) -> None: ...


def trim_responses(
    sequences: torch.Tensor, stop_ids: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Cut generated rows at their first stop token (kept): ids, mask, finish reasons."""
    is_stop = torch.isin(sequences, torch.tensor(stop_ids, device=sequences.device))
    # Tokens after the first stop token are not part of the response.
    after_stop = (is_stop.cumsum(-1) - is_stop.long()) > 0
    mask = (~after_stop).float()
    ids = sequences.masked_fill(after_stop, pad_id)
    reasons = ["stop" if row.any() else "length" for row in is_stop]
    return ids, mask, reasons
