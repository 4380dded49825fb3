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
`generate`: a call whose media tensors are the batch's own is answered by calling the
original once per distinct prompt, with that prompt's media, and joining the outputs in
row order. Any other call, or a call it cannot match, runs unchanged. A family whose
encoder this fits declares `Capabilities.media_sharing`; the `media_sharing` probe checks
log-probs and gradients against the plain path.

    shared = SharedMedia.of(processing, conversations, owners=[0, 0, 1, 1])
    with sharing(model, batch, shared):
        out = model(**batch)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, is_dataclass

import torch

ENCODER_METHODS = ("get_image_features", "get_video_features")
# The fields of an encoder output that hold one entry per image; other sequence fields
# (hidden states, DeepStack features) hold one entry per layer.
PER_ITEM_FIELD = "pooler_output"
# Encoder outputs that the models' forwards never read: not joined, left empty.
UNREAD_FIELDS = ("last_hidden_state", "hidden_states", "attentions")


@dataclass
class SharedMedia:
    """Which distinct prompt each row of a batch repeats, and each such prompt's media
    inputs (the processor's media tensors for that prompt alone)."""

    owners: list[int]  # row -> index into `media`
    media: list[dict[str, torch.Tensor]]

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
        media = []
        for row in first.values():
            batch = dict(processing([conversations[row]]))
            media.append({k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and not _text_aligned(k, v, batch)})
        if not any(media):
            return None
        return cls(owners=[index[o] for o in owners], media=media)

    @property
    def keys(self) -> set[str]:
        return set().union(*self.media)

    def to(self, device: torch.device) -> SharedMedia:
        return SharedMedia(self.owners, [{k: v.to(device) for k, v in m.items()} for m in self.media])


def _text_aligned(key: str, value: torch.Tensor, batch: dict) -> bool:
    ids = batch.get("input_ids")
    return key == "input_ids" or (ids is not None and value.dim() == 2 and value.shape == ids.shape)


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
    for owner in _encoder_owners(model):
        for name in ENCODER_METHODS:
            if callable(getattr(owner, name, None)):
                original = getattr(owner, name)
                setattr(owner, name, _shared_call(original, batch, shared))
                patched.append((owner, name))
    try:
        yield
    finally:
        for owner, name in patched:
            delattr(owner, name)


def _encoder_owners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The innermost modules with media-encoding methods (the base VLM under the
    generation head and any PEFT wrapper): the ones a forward actually calls."""
    owners = [m for m in model.modules() if any(callable(getattr(m, n, None)) for n in ENCODER_METHODS)]
    return [m for m in owners if not any(o is not m and _contains(m, o) for o in owners)]


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _shared_call(original, batch: dict, shared: SharedMedia):
    media_keys = shared.keys & set(batch)

    # The original's signature shows through: transformers' generate reads it to pick the
    # encoder's arguments before prefill.
    @functools.wraps(original)
    def call(*args, **kwargs):
        matched = {}
        for position, value in [*enumerate(args), *kwargs.items()]:
            if isinstance(value, torch.Tensor):
                key = _batch_key(value, batch, media_keys)
                if key is None:
                    return original(*args, **kwargs)  # not the batch's media: run as is
                matched[position] = key
        # Prompts with none of these inputs (a video-only prompt in an image call) have
        # nothing to encode; a prompt with only some of them is not understood.
        present = [sum(key in media for key in matched.values()) for media in shared.media]
        if not matched or any(0 < n < len(matched) for n in present):
            return original(*args, **kwargs)
        outputs = {}
        for index, media in enumerate(shared.media):
            if present[index]:
                swap = {pos: media[key].to(device=_arg(args, kwargs, pos).device, dtype=_arg(args, kwargs, pos).dtype)
                        for pos, key in matched.items()}
                outputs[index] = original(*[swap.get(i, a) for i, a in enumerate(args)],
                                          **{k: swap.get(k, v) for k, v in kwargs.items()})
        return join([outputs[owner] for owner in shared.owners if owner in outputs])

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


def join(outputs: list):
    """Encoder outputs of consecutive rows joined as if the rows had been encoded in one
    call: tensors concatenate along the first dimension; per-item sequences
    (`pooler_output`) chain; per-layer sequences concatenate layer by layer."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if is_dataclass(first):
        values = {}
        for f in fields(first):
            if f.name in UNREAD_FIELDS or getattr(first, f.name) is None:
                continue
            items = [getattr(o, f.name) for o in outputs]
            values[f.name] = _chain(items) if f.name == PER_ITEM_FIELD else _join_value(items)
        return type(first)(**values)
    return _join_value(outputs)


def _chain(items: list):
    if isinstance(items[0], torch.Tensor):
        return torch.cat(items)
    return type(items[0])(x for item in items for x in item)


def _join_value(items: list):
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(items)
    if isinstance(first, (list, tuple)):
        return type(first)(_join_value([item[i] for item in items]) for i in range(len(first)))
    raise TypeError(f"cannot join encoder outputs of type {type(first).__name__}")
