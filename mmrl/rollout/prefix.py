"""Prefill each distinct prompt once: the rows of a GRPO batch that repeat one prompt.

A rollout of n samples per prompt holds n equal rows per prompt (token ids, mask, media):
their prefill computes the same keys, values and last logits n times. The compiled
rollout (`mmrl.rollout.compiled`) prefills the distinct prompts' batch instead, one row
each, then copies every row's keys and values out of its prompt's row into the wide cache
the decode loop runs on; the rows part ways only through what they sample.

    distinct = distinct_prompts(batch, shared, placeholder_tokens(model))
    if distinct is not None:
        logits = prefill(distinct.batch)  # u rows, not all
        logits = logits.index_select(0, distinct.owners)

Which rows repeat which prompt:
- a batch with media: the `SharedMedia` the rollout made for it (its `owners`), and only
  where the batch's media are its prompts' own processed media laid out as one processor
  call lays them out (`SharedMedia.prompts_media`); that layout then gives the distinct
  prompts' media tensors, whatever the family concatenates per image or per row. Without a
  `SharedMedia` the media cannot be proven equal: no sharing;
- a batch without media: rows whose token entries (ids, mask, any other per-token entry)
  are equal.
In both cases every row's token entries are checked against its prompt's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmrl.engine.media import SharedMedia
from mmrl.processing import text_aligned


@dataclass
class DistinctPrompts:
    """A batch's distinct prompts: `first[j]`, the first row of the full batch that holds
    prompt j (u prompts); `owners[i]`, the prompt row i holds (rows,); `batch`, the u
    prompts' own batch (token entries of rows `first`, their media alone)."""

    first: torch.Tensor
    owners: torch.Tensor
    batch: dict

    @property
    def count(self) -> int:
        return len(self.first)

    def expand(self, positions: torch.Tensor) -> torch.Tensor:
        """The full batch's position ids from the prompts' ((u, S), or (axes, u, S) for
        mrope): each row its prompt's."""
        return positions.index_select(positions.dim() - 2, self.owners)


def distinct_prompts(batch: dict, shared: SharedMedia | None,
                     placeholders: Sequence[int] = ()) -> DistinctPrompts | None:
    """The distinct prompts of `batch` (see the module's docstring), or None where no prompt
    repeats or the repeats cannot be proven (the caller prefills every row)."""
    ids = batch["input_ids"]
    rows = len(ids)
    aligned = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and text_aligned(k, v, batch)}
    media_keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in aligned]
    if shared is not None and shared.parts is None and len(shared.owners) == rows:
        owners = torch.tensor(shared.owners, device=ids.device)
        first = _first_rows(owners, len(shared.singles))
    elif not media_keys:
        owners, first = _equal_rows(aligned)
    else:
        return None  # media without a record of which rows repeat which: not provably equal
    if first is None or len(first) == rows:
        return None
    # Each row's token entries must be its prompt's (a SharedMedia records the rows' prompts,
    # not their tokens).
    if not all(torch.equal(value, value.index_select(0, first).index_select(0, owners)) for value in aligned.values()):
        return None
    own = {k: v.index_select(0, first) if k in aligned else v for k, v in batch.items()}
    if media_keys:
        media = shared.prompts_media(batch, placeholders)
        if media is None or set(media) != set(media_keys):
            return None
        own.update(media)
    return DistinctPrompts(first, owners, own)


def _first_rows(owners: torch.Tensor, prompts: int) -> torch.Tensor | None:
    """The first row of each of `prompts` prompts (owners index them); None where one has no row."""
    rows = torch.arange(len(owners), device=owners.device)
    first = torch.full((prompts,), len(owners), device=owners.device).scatter_reduce(0, owners, rows, "amin")
    return None if bool((first == len(owners)).any()) else first


def _equal_rows(aligned: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Owners and first rows of the rows whose token entries are all equal, prompts numbered
    in order of their first row; (None, None) where an entry holds floats (equality of
    floats is not what a repeat means)."""
    if any(v.is_floating_point() for v in aligned.values()):
        return None, None
    keys = torch.cat([v.long() for v in aligned.values()], 1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = _first_rows(inverse, int(inverse.max()) + 1)
    order = first.argsort()  # unique sorts by value; renumber by first row
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    return rank[inverse], first[order]
