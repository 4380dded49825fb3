"""Encode each prompt's images and videos once, however many samples repeat it.

GRPO-style batches hold n samples of every prompt, and a plain forward runs the vision
tower over each copy of the prompt's media: n times the work for the same features. The
encoder is a function of the media alone, so a batch whose rows repeat a few prompts can
encode each distinct prompt once and hand every row its prompt's features. Gradients
stay exact: autograd sums the rows' contributions into the shared features, which is
what the plain path computes with n copies (up to float summation order).

The mechanism needs nothing family-specific. transformers' VLMs encode media through
`get_image_features` / `get_video_features` on their inner model and read the result's
`pooler_output` (and per-layer extras such as DeepStack features). Inside
`sharing(model, batch, shared)` those methods are wrapped for the duration of a forward or
`generate`. A call whose media tensors are the batch's own is answered in three steps:
- the original runs once over the distinct prompts' media, stacked as one processor call
  would lay them out;
- the output is cut back into prompts by each prompt's count of the modality's
  placeholder token (the count the model's own scatter consumes): tensors in
  proportion, per-image sequences image by image, per-layer sequences layer by layer;
- the per-prompt outputs are joined in row order.
Where the cut does not come out exact, the original runs once per prompt instead. Any
other call, one it cannot match, or a model without a placeholder-token id in its config
runs unchanged. A family whose encoder this fits declares `Capabilities.media_sharing`;
the `media_sharing` probe checks log-probs, gradients and the AdamW step against the
plain path.

    shared = SharedMedia.of(processing, conversations, owners=[0, 0, 1, 1])
    with sharing(model, batch, shared):
        out = model(**batch)

A row may also hold media of several pieces, some shared and some its own: a multi-turn
trajectory repeats its prompt's opening image and adds the images its tool replies
returned (`SharedMedia.of_pieces`). The joint call then encodes each distinct piece
once, and each row gets its pieces' features in order. Whether the pieces, processed
alone, lay out exactly the batch's media tensors (stacked, or joined within each row
where the processor batches media per row) is checked when the sharing is made; where
they do not, there is no sharing and the plain path runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from mmrl.encoder_calls import ENCODER_METHODS, encoder_owners, join, split
from mmrl.processing import stack_media, text_aligned


@dataclass
class SharedMedia:
    """Which distinct prompt each row of a batch repeats, and each distinct prompt's own
    processed batch (its media tensors, and token ids whose placeholder counts say which
    part of a joint encoder call's output is its own)."""

    owners: list[int]  # row -> index into `singles`
    singles: list[dict[str, torch.Tensor]]
    # Per row, the `singles` whose media, in this order, are the row's (None: its owner's
    # alone). Set by `of_pieces`.
    parts: list[list[int]] | None = None
    # device -> this sharing with its media tensors there (`on`).
    _on: dict = field(default_factory=dict, repr=False, compare=False)
    # The device `on` moved this sharing's media tensors to (None: made from a batch as processed).
    _device: torch.device | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, processing, conversations: Sequence, owners: Sequence[int]) -> SharedMedia | None:
        """From the rows' prompt ids (`owners[i]`: any hashable id of row i's prompt, with
        `conversations[i]` its conversation); None when no prompt repeats or none has
        media, where sharing would save nothing."""
        first: dict = {}
        for row, owner in enumerate(owners):
            first.setdefault(owner, row)
        if len(first) == len(owners):
            return None
        index = {owner: i for i, owner in enumerate(first)}
        shared = cls([index[o] for o in owners], [dict(processing([conversations[row]])) for row in first.values()])
        return shared if any(shared.media) else None

    @classmethod
    def of_pieces(cls, processing, pieces: Sequence[Sequence[tuple]], batch: dict,
                  placeholders: Sequence[int]) -> SharedMedia | None:
        """From each row's media as pieces, in order: `pieces[i]` lists `(key, conversation)`
        pairs, the conversation holding just that piece's images/videos; pieces under one
        key (any hashable) are processed and encoded once. `batch` is the rows processed
        together: the pieces' media tensors stacked in row order must be its media tensors,
        and each row's count of each of `placeholders` (`placeholder_tokens(model)`) the sum
        of its pieces'. None when they are not
        (the plain path then runs), or when no key repeats (nothing to save)."""
        index: dict = {}
        for row in pieces:
            for key, conversation in row:
                index.setdefault(key, conversation)
        if len(index) == sum(len(row) for row in pieces):
            return None
        keys = list(index)
        singles = [dict(processing([index[key]])) for key in keys]
        shared = cls(list(range(len(pieces))), singles)
        media = shared.media
        position = {key: i for i, key in enumerate(keys)}
        parts = [[position[key] for key, _ in row if media[position[key]]] for row in pieces]
        shared.parts = parts
        used = [i for part in parts for i in part]
        if len(set(used)) == len(used) or not _lays_out(shared, batch, placeholders):
            return None
        return shared

    @classmethod
    def of_singles(cls, singles: Sequence[dict], parts: Sequence[Sequence[int]], batch: dict,
                   placeholders: Sequence[int]) -> SharedMedia | None:
        """From pieces already processed alone (`singles`, one-row batches) and, per row of
        `batch`, the pieces its media are in order (`parts`, indices into `singles`): as
        `of_pieces` checks them, None where no piece repeats or they do not lay out
        `batch`'s media tensors and placeholder counts (a multi-turn session's new images:
        `mmrl.rollout.sessions`)."""
        shared = cls(list(range(len(parts))), list(singles), [list(part) for part in parts])
        used = [i for part in shared.parts for i in part]
        if len(set(used)) == len(used) or not _lays_out(shared, batch, placeholders):
            return None
        return shared

    def row_parts(self) -> list[list[int]]:
        """Per row, the `singles` whose media make up the row's, in order."""
        return self.parts if self.parts is not None else [[owner] for owner in self.owners]

    def select(self, owners: Sequence[int]) -> SharedMedia | None:
        """The sharing of a sub-batch whose rows repeat `owners[i]` (indices into this
        one's prompts), reusing their processed batches; None when no prompt repeats."""
        if self.parts is not None:
            raise ValueError("a sharing of pieces (SharedMedia.of_pieces) is made per batch, not selected")
        distinct = list(dict.fromkeys(owners))
        media = self.media
        if len(distinct) == len(owners) or not any(media[i] for i in distinct):
            return None
        index = {owner: i for i, owner in enumerate(distinct)}
        return SharedMedia([index[o] for o in owners], [self.singles[i] for i in distinct], _device=self._device)

    def rows(self, processing, conversations: Sequence,
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The batch of all rows (`conversations`, one per row), collated from the
        distinct prompts' batches: the same tensors as processing every row, without
        processing any image twice (`Processing.collate_rows` checks that once). Prompts
        whose batches hold different keys (image prompts beside video or text-only ones)
        have a layout only the processor knows: their rows are processed. With `device`
        (where the rows will run), the media tensors are collated there from the prompts'
        own (`on`): the rows' copies of each prompt's media (n samples of it) are made on
        the device, neither stacked on the host nor copied to the device row by row."""
        if not self.collatable or self.parts is not None:
            return dict(processing(list(conversations)))
        singles = self.singles if device is None else self.on(device).singles
        return processing.collate_rows([singles[o] for o in self.owners], list(conversations))

    def on(self, device: torch.device | str) -> SharedMedia:
        """This sharing with its prompts' media tensors on `device`, moved once and kept
        (a sub-batch's `select` of it keeps them there too). Their token entries stay where
        they are: the sharing reads placeholder counts from them on the host."""
        device = torch.device(device)
        if self._device == device:
            return self
        moved = self._on.get(device)
        if moved is None:
            singles = [{k: v.to(device) if isinstance(v, torch.Tensor) and not text_aligned(k, v, single) else v
                        for k, v in single.items()} for single in self.singles]
            # (it knows its device rather than holding itself: no reference cycle keeps its tensors alive)
            moved = self._on[device] = SharedMedia(self.owners, singles, self.parts, _device=device)
        return moved

    def prompts_media(self, batch: dict, placeholders: Sequence[int]) -> dict[str, torch.Tensor] | None:
        """The media tensors of a batch of the distinct prompts alone (one row each, in
        `singles`' order), laid out the way `batch`'s are (the rows' batch these owners
        describe): stacked, or joined per row. None where `batch`'s media are not the
        prompts' laid out either way (`_lays_out`), or for a sharing of pieces."""
        if self.parts is not None or not _lays_out(self, batch, placeholders):
            return None
        media, out = self.media, {}
        for key in self.keys:
            reference = batch[key]
            flat = stack_media([media[o][key] for o in self.owners if key in media[o]])
            if _equal(flat, reference):
                laid_out = stack_media([m[key] for m in media if key in m])
            else:
                laid_out = _stack_per_row([[m[key]] for m in media], len(media))
            out[key] = laid_out.to(device=reference.device, dtype=reference.dtype)
        return out

    @property
    def collatable(self) -> bool:
        """Whether every distinct prompt's batch holds the same keys."""
        return all(single.keys() == self.singles[0].keys() for single in self.singles)

    @property
    def media(self) -> list[dict[str, torch.Tensor]]:
        return [{k: v for k, v in single.items() if isinstance(v, torch.Tensor) and not text_aligned(k, v, single)}
                for single in self.singles]

    @property
    def ids(self) -> list[torch.Tensor]:
        return [single["input_ids"][0] for single in self.singles]

    @property
    def keys(self) -> set[str]:
        return set().union(*self.media)


def _lays_out(shared: SharedMedia, batch: dict, placeholders: Sequence[int]) -> bool:
    """Whether the rows' pieces, processed alone, give `batch`'s media tensors (stacked in
    row order) and, per row, its count of each placeholder token."""
    media, parts = shared.media, shared.row_parts()
    batch_media = {k for k, v in batch.items() if isinstance(v, torch.Tensor) and not text_aligned(k, v, batch)}
    if shared.keys != batch_media:
        return False
    for key in batch_media:
        per_row = [[media[i][key] for i in part if key in media[i]] for part in parts]
        if not (_equal(stack_media([t for row in per_row for t in row]), batch[key])
                or _equal(_stack_per_row(per_row, len(parts)), batch[key])):
            return False
    ids = [single_ids.cpu() for single_ids in shared.ids]
    rows = batch["input_ids"].cpu()
    return all(int((rows[row] == token).sum()) == sum(int((ids[i] == token).sum()) for i in part)
               for token in placeholders for row, part in enumerate(parts))


def _equal(tensor: torch.Tensor | None, reference: torch.Tensor) -> bool:
    return (tensor is not None and tensor.shape == reference.shape
            and torch.equal(tensor.to(device=reference.device, dtype=reference.dtype), reference))


def _stack_per_row(per_row: list[list[torch.Tensor]], rows: int) -> torch.Tensor | None:
    """The pieces' tensors as processors that batch media per row lay them out
    ((rows, items, ...), each row's items padded to the longest row's): each a single
    prompt's (1, items, ...), a row's pieces joined along the items. None where the
    pieces are not laid out that way."""
    if any(not row or any(t.shape[0] != 1 for t in row) for row in per_row) or len(per_row) != rows:
        return None
    return stack_media([stack_media([t[0] for t in row]).unsqueeze(0) for row in per_row])


def placeholder_tokens(model: torch.nn.Module) -> list[int]:
    """The ids of the tokens that media features replace, from the configs of the
    modules that encode media (transformers' names)."""
    tokens = {_placeholder_token(getattr(owner, "config", None), modality)
              for owner in encoder_owners(model) for modality in ENCODER_METHODS.values()}
    return sorted(tokens - {None})


@contextlib.contextmanager
def sharing(model: torch.nn.Module, batch: dict, shared: SharedMedia | None) -> Iterator[None]:
    """Within the block, media encoding of `batch` on `model` is shared per `shared`
    (nothing changes when `shared` is None)."""
    if shared is None:
        yield
        return
    rows = len(batch["input_ids"]) if "input_ids" in batch else None
    if rows is not None and rows != len(shared.owners):
        raise ValueError(f"the media sharing was made for {len(shared.owners)} rows, the batch has {rows}")
    patched = []
    for owner in encoder_owners(model):
        for name, modality in ENCODER_METHODS.items():
            if callable(getattr(owner, name, None)):
                original = getattr(owner, name)
                token = _placeholder_token(getattr(owner, "config", None), modality)
                # The instance's own method, if it has one (`encode_each_image_alone`), comes back after.
                patched.append((owner, name, owner.__dict__.get(name)))
                setattr(owner, name, _shared_call(original, batch, shared, token))
    try:
        yield
    finally:
        for owner, name, own in patched:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def _placeholder_token(config, modality: str) -> int | None:
    """The id of the token that a modality's features replace (transformers' names)."""
    for name in (f"{modality}_token_id", f"{modality}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _shared_call(original, batch: dict, shared: SharedMedia, token: int | None):
    media, ids = shared.media, shared.ids
    media_keys = shared.keys & set(batch)

    # The original's signature shows through: transformers' generate reads it to pick the
    # encoder's arguments before prefill.
    @functools.wraps(original)
    def call(*args, **kwargs):
        if token is None:  # no placeholder token to size each prompt's part by
            return original(*args, **kwargs)
        matched = {}
        for position, value in [*enumerate(args), *kwargs.items()]:
            if isinstance(value, torch.Tensor):
                key = _batch_key(value, batch, media_keys)
                if key is None:
                    return original(*args, **kwargs)  # not the batch's media: run as is
                matched[position] = key
        # Prompts with none of these inputs (a video-only prompt in an image call) have
        # nothing to encode; a prompt with only some of them is not understood.
        present = [sum(key in m for key in matched.values()) for m in media]
        if not matched or any(0 < n < len(matched) for n in present):
            return original(*args, **kwargs)
        prompts = [i for i, n in enumerate(present) if n]
        counts = {i: int((ids[i] == token).sum()) for i in prompts}

        def encode(values: dict) -> object:
            swap = {pos: value.to(device=_arg(args, kwargs, pos).device, dtype=_arg(args, kwargs, pos).dtype)
                    for pos, value in values.items()}
            return original(*[swap.get(i, a) for i, a in enumerate(args)], **{k: swap.get(k, v) for k, v in kwargs.items()})

        # One call over every distinct prompt's media, cut back into prompts by their
        # placeholder-token counts; where the cut does not fit, one call per prompt.
        parts = None
        if len(prompts) > 1:
            stacked = {pos: stack_media([media[i][key] for i in prompts]) for pos, key in matched.items()}
            parts = split(encode(stacked), [counts[i] for i in prompts])
        if parts is None:
            parts = [encode({pos: media[i][key] for pos, key in matched.items()}) for i in prompts]
        outputs = dict(zip(prompts, parts))
        # Each row's pieces in order (a row without pieces of its own: its prompt's).
        units = [piece for part in shared.row_parts() for piece in part if piece in outputs]
        return join([outputs[piece] for piece in units], [counts[piece] for piece in units])

    return call


def _arg(args: tuple, kwargs: dict, position):
    return args[position] if isinstance(position, int) else kwargs[position]


def _batch_key(value: torch.Tensor, batch: dict, keys: set[str]) -> str | None:
    """The batch media key whose tensor `value` is (itself, or a copy cast by autocast
    or FSDP's input casting)."""
    for key in sorted(keys):
        tensor = batch[key]
        if value is tensor:
            return key
        if value.shape == tensor.shape and torch.equal(value, tensor.to(device=value.device, dtype=value.dtype)):
            return key
    return None


