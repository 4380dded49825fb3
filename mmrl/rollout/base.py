"""The rollout API shared by every backend.

    rollout = make_rollout(recipe.rollout, actor_engine, processing)
    result = rollout.generate(conversations, SamplingParams(n=8, max_new_tokens=4))
    result.response_ids, result.response_mask, result.finish_reasons, result.prompt_index
    rollout.sync(engine)          # after each update: the rollout samples from new weights
    # partial rollouts (mmrl/buffer/partial.py), where a backend has it (hf):
    result = rollout.continue_from(conversations, prefixes, SamplingParams(max_new_tokens=4))

A backend returns, for each prompt, `n` right-padded responses with a mask that covers
the tokens up to and including the stop token. Special tokens that must never be
sampled (image placeholders, chat scaffolding) are blocked by every backend.

`continue_from` (optional: `can_continue(rollout)`) generates one response per
conversation after the response tokens it already has (`prefixes`), by processing the
prompt again with those tokens appended (`extend_prompts`): partial rollouts carry an
unfinished sample to the next round this way. It returns only the new tokens.
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
    # The temperature those log-probs are taken at (logits / it): 1 is the raw logits;
    # the rollout's own temperature makes them the sampling policy's (`algo.behaviour:
    # sampler`). Backends without `tempered_logprobs = True` give raw log-probs only.
    logprobs_temperature: float = 1.0
    # The compiled rollout draws its samples from a generator of its own seeded with this
    # (None: the default generator): a one-step-off batch is sampled alike whether it is
    # made beside the update, in another thread, or before it (mmrl/buffer/overlap.py).
    generator_seed: int | None = None

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


def can_continue(rollout) -> bool:
    """Whether `rollout` continues responses from prefix tokens (`continue_from`)."""
    return callable(getattr(rollout, "continue_from", None))


def extend_prompts(prompt_inputs: dict, prefixes: list[list[int]], pad_id: int) -> dict:
    """The processed, left-padded prompt batch (rows, T) with each row's `prefixes[row]`
    appended after its prompt, left-padded again: `input_ids` get the tokens,
    `attention_mask` ones, any other (rows, T) tensor (token types, media markers) zeros,
    the marks of text; other inputs (pixels, grids) are the prompts' and stay as they are."""
    ids, attention = prompt_inputs["input_ids"], prompt_inputs["attention_mask"]
    rows, width = ids.shape
    if len(prefixes) != rows:
        raise ValueError(f"{len(prefixes)} prefixes for {rows} prompts")
    aligned = [k for k, v in prompt_inputs.items()
               if isinstance(v, torch.Tensor) and v.dim() == 2 and tuple(v.shape) == (rows, width)]
    keep = attention.bool()
    lengths = [int(keep[row].sum()) + len(prefixes[row]) for row in range(rows)]
    longest = max(lengths, default=0)
    out = dict(prompt_inputs)
    for key in aligned:
        value = prompt_inputs[key]
        fill = pad_id if key == "input_ids" else 0
        extended = value.new_full((rows, longest), fill)
        for row in range(rows):
            prefix = prefixes[row]
            if key == "input_ids":
                tail = torch.tensor(prefix, dtype=value.dtype)
            else:
                tail = value.new_full((len(prefix),), 1 if key == "attention_mask" else 0)
            own = torch.cat([value[row][keep[row]], tail])
            extended[row, longest - len(own):] = own
        out[key] = extended
    return out


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


def right_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one right-padded batch: ids (N, W) long, `pad_id` after each row's
    tokens, and the float mask (N, W) of the tokens; W is the longest row, at least 1."""
    width = max([len(row) for row in rows] + [1])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1.0
    return ids, mask
