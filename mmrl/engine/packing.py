"""Padding-free batches for the engine: a padded micro-batch's real tokens packed into rows.

A joined batch (left-padded prompts, right-padded responses) spends compute on padding:
attention, MLPs, and above all the vocabulary projection of every response column. Packed,
the sequences lie end to end in rows of at most `row_tokens` tokens (whole sequences, in
their order, so media placeholders keep theirs), with the position ids each sequence has
on its own: 1-D, or the family's multi-axis (mrope) ids, carried over from the padded
batch (`mmrl.positions`). No attention mask is passed: transformers finds where a
sequence starts from the position ids (a reset), for SDPA, eager, flex and flash
attention alike (flash-attn's varlen kernel where that implementation is chosen). A
row's unused tail continues the counting of its last sequence's positions, so it stays
causally after every real token and no real token sees it.

Only the positions that predict response tokens reach the output embedding
(`keep_rows`), so logits exist for real response tokens alone; a critic takes its value
head at the same positions (`Engine.values`).

    packed = pack_sequences(seqs.inputs, seqs.response_mask, row_tokens=8192)
    with keep_rows(model, packed.logit_index):
        logits = model(**packed.inputs, use_cache=False, logits_to_keep=0).logits  # (1, N, V)
    logp_padded = packed.to_padded(logp_of_each_response_token)                  # (B, R)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mmrl.settle import PACK_TOKENS  # noqa: F401 (re-exported) tokens per packed row unless set

# Sequence-aligned inputs that the packed forward does not take: the mask (boundaries come
# from the positions) and the varlen lengths some helpers add.
_DROPPED = ("attention_mask", "cu_seqlens")


@dataclass
class PackedBatch:
    inputs: dict[str, torch.Tensor]  # (K, T) model inputs, position ids included, no mask
    logit_index: torch.Tensor  # (N,) flat (K * T) positions predicting the response tokens
    response_mask: torch.Tensor  # (B, R) bool: where the N values go back
    rows: list[list[int]]  # the sequences each packed row holds
    # (K, T) int32: which of its row's sequences each position belongs to (a row's unused
    # tail: its last sequence's), transformers' `seq_idx`; the model gets it only where
    # its stateful layers read it (`mmrl.engine.stateful_layers.packed_inputs`).
    seq_idx: torch.Tensor | None = None

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """(N,) per-response-token values back to the padded (B, R) layout, 0 elsewhere
        (differentiable)."""
        out = values.new_zeros(self.response_mask.shape)
        return out.masked_scatter(self.response_mask, values)


def bins_by_tokens(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Consecutive sequences grouped into rows of at most `row_tokens` tokens (a longer
    sequence gets a row of its own); order is kept."""
    rows: list[list[int]] = []
    used = 0
    for index, length in enumerate(lengths):
        if not rows or used + length > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


def pack_sequences(inputs: dict[str, torch.Tensor], response_mask: torch.Tensor, row_tokens: int,
                   pad_token_id: int = 0) -> PackedBatch:
    """Pack a joined batch (`Sequences.inputs`, with `position_ids`) into rows."""
    mask = inputs["attention_mask"].bool()
    batch, length = mask.shape
    device = mask.device
    lengths = mask.sum(-1)
    rows = bins_by_tokens(lengths.tolist(), row_tokens)
    width = max(int(lengths[r].sum()) for r in rows)
    row_of = torch.empty(batch, dtype=torch.long, device=device)
    offset = torch.empty(batch, dtype=torch.long, device=device)
    ordinal = torch.empty(batch, dtype=torch.long, device=device)  # its place among its row's sequences
    for k, members in enumerate(rows):
        index = torch.tensor(members, device=device)
        row_of[index] = k
        ordinal[index] = torch.arange(len(members), device=device)
        offset[index] = torch.cat([lengths.new_zeros(1), lengths[index].cumsum(0)[:-1]])
    rank = mask.long().cumsum(-1) - 1  # each real token's place in its sequence
    flat = row_of[:, None] * width + offset[:, None] + rank  # (B, L): its place in the packed rows
    destination = flat[mask]
    count = len(rows)

    def scatter(value: torch.Tensor, fill: torch.Tensor | int, axis: int = 0) -> torch.Tensor:
        """(…, B, L, …) with the sequence at `axis`, `axis + 1` -> (…, K, T, …)."""
        moved = value.movedim((axis, axis + 1), (0, 1))
        if isinstance(fill, torch.Tensor):
            out = fill.to(moved.dtype).reshape(count * width, *([1] * (moved.dim() - 2))).expand(
                count * width, *moved.shape[2:]).clone()
        else:
            out = moved.new_full((count * width, *moved.shape[2:]), fill)
        out[destination] = moved[mask]
        return out.reshape(count, width, *moved.shape[2:]).movedim((0, 1), (axis, axis + 1))

    # Filler positions count on from the column: after a row's last sequence, never a reset.
    filler_positions = torch.arange(width, device=device).repeat(count)
    packed = {}
    for key, value in inputs.items():
        if key in _DROPPED:
            continue
        if key == "position_ids":
            axis = value.dim() - 2  # (B, L) or (C, B, L)
            packed[key] = scatter(value, filler_positions, axis)
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, length):
            packed[key] = scatter(value, pad_token_id if key == "input_ids" else 0)
        else:
            packed[key] = value  # media tensors and grids: whole, in the same order
    if "position_ids" not in packed:
        raise ValueError("packing needs the adapter's position ids (the model would count positions across "
                         "sequences)")
    last_sequence = torch.tensor([len(members) - 1 for members in rows], device=device).repeat_interleave(width)
    seq_idx = scatter(ordinal[:, None].expand(batch, length), last_sequence).to(torch.int32)
    responses = response_mask.bool()
    prompt = length - responses.shape[1]
    # The logit predicting response token t sits one place before it.
    logit_index = flat[:, prompt:][responses] - 1
    return PackedBatch(inputs=packed, logit_index=logit_index, response_mask=responses, rows=rows, seq_idx=seq_idx)


@contextlib.contextmanager
def keep_rows(model: torch.nn.Module, index: torch.Tensor) -> Iterator[None]:
    """Within the block, the model's output embedding sees only the hidden states at the
    flat positions `index` of its (K, T, H) input, as one (1, N, H) row: logits are made
    for those positions alone (call the model with `logits_to_keep=0`, i.e. all)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("the model has no output embedding to restrict")

    def gather(module, args, kwargs):
        hidden = args[0] if args else kwargs["input"]
        picked = hidden.reshape(-1, hidden.shape[-1])[index].unsqueeze(0)
        return ((picked, *args[1:]), kwargs) if args else (args, {**kwargs, "input": picked})

    handle = head.register_forward_pre_hook(gather, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
