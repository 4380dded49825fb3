"""Position ids for padded and packed (padding-free) batches.

A padded batch is (B, L) with an attention mask (left or right padding). A packed batch
is the same tokens laid end to end in one row, (1, T), with `cu_seqlens` marking where
each sequence starts. Position ids are computed once on the padded batch by the
family's adapter (1-D, or 3-D for mrope) and carried through `pack`, so packed
positions are by construction those of each sequence on its own.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch

from mmrl.wrappers import unwrapped


def sequential_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row; padding gets 0. Shape (B, L)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp_(min=0).masked_fill_(attention_mask == 0, 0)


def rope_index_positions(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Multi-axis rope positions of a padded batch as the model's own `get_rope_index`
    (transformers') computes them over the whole batch, which is what the model computes
    when it is given none; written out, they stay each sequence's own in packed rows and
    with shared media (whose batch holds each prompt's media once). (C, B, L), with a
    leading row counting each sequence's tokens where the model's text stack reads one
    (transformers finds packed-sequence boundaries there)."""
    owner = _required_owner(model)
    arguments = {name: batch[name] for name in inspect.signature(owner.get_rope_index).parameters
                 if isinstance(batch.get(name), torch.Tensor)}
    positions = owner.get_rope_index(**arguments)[0]
    if _reads_text_row(unwrapped(model)):
        text = sequential_positions(batch["attention_mask"]).to(positions)
        positions = torch.cat([text[None], positions])
    return positions


def rope_index_per_row(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`rope_index_positions` one row at a time, for a model whose `get_rope_index` is
    right for one prompt but counts media across a batch's rows: each row with its slice
    of the per-token inputs and its share of the per-media ones (`image_grid_thw`: as many
    entries as the row holds runs of the config's `image_token_id`)."""
    owner = _required_owner(model)
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    config = unwrapped(model).config
    rows = {"attention_mask": batch["attention_mask"].split(1)}
    for name in inspect.signature(owner.get_rope_index).parameters:
        value = batch.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if value.shape[:2] == ids.shape:  # one entry per token
            rows[name] = value.split(1)
        else:  # one entry per media item: each row's runs of the item's token
            token = ids.eq(getattr(config, name.split("_")[0] + "_token_id")) & mask
            runs = token[:, 0].long() + (token[:, 1:] & ~token[:, :-1]).sum(-1)
            rows[name] = value.split(runs.tolist())
    return torch.cat([rope_index_positions(model, {name: parts[row] for name, parts in rows.items()})
                      for row in range(ids.shape[0])], dim=1)


def rope_index_owner(model):
    """The module that computes the model's multi-axis rope positions itself (transformers'
    `get_rope_index`): the model or its inner model, under a PEFT wrapper the wrapped
    model's; None for a model that leaves its positions to the caller."""
    base = unwrapped(model)
    return next((m for m in (base, getattr(base, "model", None)) if hasattr(m, "get_rope_index")), None)


def _required_owner(model):
    """`rope_index_owner`, or the error that the model has none."""
    owner = rope_index_owner(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} has no get_rope_index to compute its rope positions with")
    return owner


def _reads_text_row(model) -> bool:
    """Whether the model's code splits a leading row of plain text positions off its
    position ids (`position_ids.shape[0] == 4`: text, then temporal, height, width), in
    the module of any of its classes (a text stack built from the text config may come
    from another model's module)."""
    found = _TEXT_ROW_READERS.get(type(model))
    if found is None:
        found = _TEXT_ROW_READERS[type(model)] = any(
            _module_reads_text_row(inspect.getmodule(cls)) for cls in {type(m) for m in model.modules()})
    return found


_TEXT_ROW_READERS: dict[type, bool] = {}


@functools.cache
def _module_reads_text_row(module) -> bool:
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return _TEXT_ROW.search(source) is not None


_TEXT_ROW = re.compile(r"position_ids\.shape\[0\]\s*==\s*4")


def cu_seqlens_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence lengths (B + 1,), int32, as varlen attention kernels expect."""
    lengths = attention_mask.sum(-1).to(torch.int32)
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def pack(batch: dict[str, torch.Tensor], keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Remove padding: every (B, L, ...) tensor in `keys` becomes (1, T, ...).

    `position_ids` may be (B, L) or (C, B, L) (mrope); its sequence axis is the last
    one. Adds `cu_seqlens`. Tensors not in `keys` (pixel values, grids) pass through.
    """
    mask = batch["attention_mask"].bool()
    batch_size, length = mask.shape
    keys = keys or tuple(
        k for k, v in batch.items()
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == (batch_size, length)
        and k != "attention_mask"
    )
    out = {k: v for k, v in batch.items() if k not in keys and k != "attention_mask"}
    for key in keys:
        out[key] = batch[key][mask].unsqueeze(0)
    positions = batch.get("position_ids")
    if positions is not None:
        if positions.dim() == 3:
            out["position_ids"] = positions[:, mask].unsqueeze(1)
        else:
            out["position_ids"] = positions[mask].unsqueeze(0)
    out["cu_seqlens"] = cu_seqlens_from_mask(batch["attention_mask"])
    return out


def unpack(values: torch.Tensor, attention_mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Inverse of `pack` for one per-token tensor: (1, T, ...) -> (B, L, ...)."""
    mask = attention_mask.bool()
    out = values.new_full((*mask.shape, *values.shape[2:]), fill)
    out[mask] = values[0]
    return out
