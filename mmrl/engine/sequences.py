"""Prompt + response sequences as the training engines consume them.

A rollout returns left-padded prompts (B, P) and right-padded responses (B, R). Joined,
every response starts at column P, so the logits that predict response token t sit at
column P - 1 + t for every row: one slice, no gather. Sequence-aligned extra inputs
(token type ids and the like) are extended over the response with zeros (text), and
position ids are recomputed by the family's adapter on the joined batch, which keeps
3-D mrope positions right.

Media tensors are flattened over all images of a batch in family-specific ways, so a
sub-batch is made by processing its conversations again rather than by slicing.

`left_padded` widens a joined batch on the left to a multiple of some length (the compiled
decoder layers' alignment, `mmrl.engine.compiled_layers.ALIGNED_LENGTH`): more masked
padding before the prompts, the response columns where they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmrl.adapter import ModelAdapter
from mmrl.engine.media import SharedMedia

# Batch keys that are not model inputs of the joined sequence.
_NOT_INPUTS = ("position_ids",)


@dataclass
class Sequences:
    inputs: dict[str, torch.Tensor]  # model inputs over prompt + response, with position ids
    response_ids: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) float, 1 on real response tokens
    prompt_length: int
    # Per-row tensors that travel with the batch (rewards, advantages, old log-probs, ...).
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # Rows that repeat a prompt, for encoding its media once (`mmrl.engine.media`).
    shared: SharedMedia | None = None
    # The id that fills padding (packing fills its rows' tails with it).
    pad_token_id: int | None = None

    @property
    def size(self) -> int:
        return self.response_ids.shape[0]

    def to(self, device: torch.device) -> Sequences:
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return Sequences(
            inputs={k: move(v) for k, v in self.inputs.items()},
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            prompt_length=self.prompt_length,
            extras={k: v.to(device) for k, v in self.extras.items()},
            shared=self.shared.on(device) if self.shared is not None else None,
            pad_token_id=self.pad_token_id,
        )


def join(
    prompt_batch: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    adapter: ModelAdapter,
    model,
    pad_token_id: int,
    shared: SharedMedia | None = None,
) -> Sequences:
    """Join left-padded prompts and right-padded responses into training sequences."""
    batch_size, prompt_length = prompt_batch["input_ids"].shape
    response_length = response_ids.shape[1]
    # Responses join the prompts where the prompts are (a GPU rollout's tokens beside a
    # batch processed on CPU, or the other way round).
    device = prompt_batch["input_ids"].device
    response_ids = response_ids.to(device)
    response_mask = response_mask.to(device=device, dtype=prompt_batch["attention_mask"].dtype)
    inputs: dict[str, torch.Tensor] = {}
    for key, value in prompt_batch.items():
        if key in _NOT_INPUTS:
            continue
        if key == "input_ids":
            ids = response_ids.masked_fill(response_mask == 0, pad_token_id)
            inputs[key] = torch.cat([value, ids.to(value.dtype)], dim=1)
        elif key == "attention_mask":
            inputs[key] = torch.cat([value, response_mask], dim=1)
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (batch_size, prompt_length):
            inputs[key] = torch.cat([value, value.new_zeros(batch_size, response_length)], dim=1)
        else:
            inputs[key] = value
    positions = adapter.position_ids(model, inputs)
    if positions is not None:  # None: the model computes its own (multi-axis rope)
        inputs["position_ids"] = positions
    return Sequences(
        inputs=inputs,
        response_ids=response_ids,
        response_mask=response_mask.float(),
        prompt_length=prompt_length,
        shared=shared,
        pad_token_id=pad_token_id,
    )


def left_padded(inputs: dict[str, torch.Tensor], multiple: int, pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """`inputs` (a joined batch, `Sequences.inputs`) with masked padding columns added on the
    left up to a length that is a multiple of `multiple`: token ids `pad_token_id` (0 for
    None), mask and other per-token entries 0, position ids those of the first column (a
    padding column's own, or the row's first token's: masked either way). The last columns,
    the response and the positions that predict it, are where they were; media tensors are
    the same objects (media sharing matches them). No real token sees a new column, so
    log-probs change only by the rounding of attention over a longer masked row."""
    ids = inputs["input_ids"]
    extra = -ids.shape[1] % multiple
    if not extra:
        return inputs
    padded = dict(inputs)
    for key, value in inputs.items():
        if key == "position_ids":  # (B, L) or (C, B, L)
            padded[key] = torch.cat([value[..., :1].expand(*value.shape[:-1], extra), value], dim=-1)
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == ids.shape:
            fill = (pad_token_id or 0) if key == "input_ids" else 0
            padded[key] = torch.cat([value.new_full((value.shape[0], extra), fill), value], dim=1)
    return padded
