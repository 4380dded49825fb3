"""Calls to a vision-language model's media encoder: transformers' `get_image_features` /
`get_video_features`, where a model holds them, how one call's output is cut per prompt
and how outputs are joined again, and encoding one image per call.

`mmrl.engine.media` shares each prompt's media among its samples with these. A family
whose tower lets a batch's images attend to each other (one sequence of every image's
patches, no mask between them: transformers' code for some towers) gives each image
features that depend on its neighbours in the batch, so a prompt's log-probs would change
with the batch it is in. Such a family declares `encode_images_alone` and its model's
encoder then runs once per image (`encode_each_image_alone`), which gives every image the
features it gets alone.

    encode_each_image_alone(model)      # on_load does this for a family that declares it
    features = model.model.get_image_features(pixel_values, image_grid_thw)   # per image inside
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import MISSING, fields, is_dataclass

import torch

ENCODER_METHODS = {"get_image_features": "image", "get_video_features": "video"}
# The fields of an encoder output that hold one entry per image; other sequence fields
# (hidden states, DeepStack features) hold one entry per layer.
PER_ITEM_FIELD = "pooler_output"
# Encoder outputs that the models' forwards never read: not joined, left empty.
UNREAD_FIELDS = ("last_hidden_state", "hidden_states", "attentions")


def encoder_owners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The innermost modules with media-encoding methods (the base VLM under the
    generation head and any PEFT wrapper): the ones a forward actually calls."""
    owners = [m for m in model.modules() if any(callable(getattr(m, n, None)) for n in ENCODER_METHODS)]
    return [m for m in owners if not any(o is not m and _contains(m, o) for o in owners)]


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def split(output, counts: list[int]) -> list | None:
    """`output` of one encoder call over several prompts, cut into one output per prompt
    given each prompt's placeholder-token count; None where the sizes do not divide
    that way (the caller then encodes prompt by prompt)."""
    try:
        return _split(output, counts)
    except _Uneven:
        return None


class _Uneven(Exception):
    pass


def _rows(t: torch.Tensor) -> int:
    """Feature vectors in a tensor (all dimensions but the last)."""
    return t.numel() // max(t.shape[-1], 1) if t.dim() else 0


def _adds_up(sequence, tokens: int) -> bool:
    """Whether a sequence can hold one tensor per image: tensors whose features add up to
    the prompt's tokens (one per layer would each be the size of the whole)."""
    return (isinstance(sequence, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in sequence)
            and sum(_rows(t) for t in sequence) == tokens)


def _split(output, counts: list[int]) -> list:
    if isinstance(output, torch.Tensor):
        return list(torch.split(output, _sizes(output.shape[0], counts)))
    if is_dataclass(output):
        per_field = {name: _split(value, counts) for name, value in _read_fields(output).items()}
        return [_rebuild(output, {name: parts[i] for name, parts in per_field.items()}) for i in range(len(counts))]
    if isinstance(output, (list, tuple)):
        # Several prompts with features hold two images or more between them.
        if len(output) > 1 and _adds_up(output, sum(counts)):
            return _group_items(output, counts)
        layers = [_split(item, counts) for item in output]
        return [type(output)(layer[i] for layer in layers) for i in range(len(counts))]
    raise _Uneven


def _group_items(items, counts: list[int]) -> list:
    """Per-image tensors grouped by prompt: each prompt takes images until their
    features reach its token count."""
    groups, position = [], 0
    for count in counts:
        taken, rows = [], 0
        while rows < count and position < len(items):
            rows += _rows(items[position])
            taken.append(items[position])
            position += 1
        if rows != count:
            raise _Uneven
        groups.append(type(items)(taken))
    if position != len(items):
        raise _Uneven
    return groups


def _read_fields(output) -> dict:
    """An encoder output's fields that the forwards read, by name. Besides the declared
    fields this is `pooler_output` where transformers sets it on an output class that does
    not declare it (a vision tower's `BaseModelOutput` in some versions): a plain
    attribute, which `fields` does not list."""
    names = [f.name for f in fields(output)]
    if PER_ITEM_FIELD not in names:
        names.append(PER_ITEM_FIELD)
    values = {name: getattr(output, name, None) for name in names if name not in UNREAD_FIELDS}
    return {name: value for name, value in values.items() if value is not None}


def _rebuild(like, values: dict):
    """An output of `like`'s class holding `values`, undeclared ones set as attributes
    the way transformers sets them. A field the class requires (no default, as
    `TimmWrapperModelOutput.last_hidden_state`) that is not carried is left None, as the
    unread fields are."""
    declared = {f.name for f in fields(like)}
    required = {f.name: None for f in fields(like) if f.default is MISSING and f.default_factory is MISSING}
    output = type(like)(**{**required, **{name: value for name, value in values.items() if name in declared}})
    for name, value in values.items():
        if name not in declared:
            setattr(output, name, value)
    return output


def _sizes(total: int, counts: list[int]) -> list[int]:
    """Rows of `total` per prompt in proportion to its token count, when that is exact."""
    tokens = sum(counts)
    if tokens == 0 or any(total * c % tokens for c in counts):
        raise _Uneven
    return [total * c // tokens for c in counts]


def join(outputs: list, counts: list[int], hint: bool = False):
    """Encoder outputs of consecutive rows (`counts`: each row's placeholder tokens)
    joined as if the rows had been encoded in one call: tensors concatenate along the
    first dimension, per-image sequences chain, per-layer sequences join layer by layer.
    Fields the models' forwards never read are left out."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if is_dataclass(first):
        values = {name: join([getattr(o, name) for o in outputs], counts, hint=name == PER_ITEM_FIELD)
                  for name in _read_fields(first)}
        return _rebuild(first, values)
    if isinstance(first, (list, tuple)):
        # Per image: every row's tensors add up to its tokens. A lone tensor fits "per
        # layer" too; only `hint` (the field is `pooler_output`) or a longer row tells.
        if all(_adds_up(o, c) for o, c in zip(outputs, counts)) and (hint or any(len(o) > 1 for o in outputs)):
            return type(first)(x for o in outputs for x in o)
        if any(len(o) != len(first) for o in outputs):
            raise ValueError("encoder outputs of the rows hold different numbers of layers")
        return type(first)(join([o[i] for o in outputs], counts) for i in range(len(first)))
    raise TypeError(f"cannot join encoder outputs of type {type(first).__name__}")


# -- one image per call ----------------------------------------------------------------
def encode_each_image_alone(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each media-encoding method of its encoder owners run once per image
    (or video) and the outputs joined as one call gives them (`one_at_a_time`). The
    method is set on the instance, bound to it (a deep copy binds the copy's), and shows
    the class method's signature, which transformers' generate reads to pick its arguments."""
    for owner in encoder_owners(model):
        for name in ENCODER_METHODS:
            method = getattr(type(owner), name, None)
            if callable(method):
                setattr(owner, name, types.MethodType(_per_image(method), owner))
    return model


def _per_image(method):
    @functools.wraps(method)
    def call(owner, *args, **kwargs):
        return one_at_a_time(method, owner, *args, **kwargs)

    return call


def one_at_a_time(method, owner: torch.nn.Module, *args, **kwargs):
    """`method(owner, *args, **kwargs)` run once per image. Only a call of two
    tensors is cut: the media and a grid (an argument named `*grid*`, one row of patch
    counts per image); the media by the grid rows' products where they add up to its rows,
    else along its first dimension where that has one entry per grid row. Any other call
    (one image, no grid, a third tensor that might hold per-image entries) runs as it is."""
    signature = inspect.signature(method)
    try:
        bound = signature.bind(owner, *args, **kwargs).arguments
    except TypeError:
        return method(owner, *args, **kwargs)
    kinds = {name: parameter.kind for name, parameter in signature.parameters.items()}
    if inspect.Parameter.VAR_POSITIONAL in {kinds[name] for name in bound}:
        return method(owner, *args, **kwargs)
    arguments = {}
    for name, value in list(bound.items())[1:]:  # past `self`
        arguments.update(value if kinds[name] is inspect.Parameter.VAR_KEYWORD else {name: value})
    tensors = [name for name, value in arguments.items() if isinstance(value, torch.Tensor)]
    grids = [name for name in tensors if "grid" in name and arguments[name].dim() == 2]
    if len(tensors) != 2 or len(grids) != 1:
        return method(owner, *args, **kwargs)
    grid_key, media_key = grids[0], next(name for name in tensors if name != grids[0])
    grid, media = arguments[grid_key], arguments[media_key]
    rows = grid.prod(-1).tolist()
    if len(rows) < 2:
        return method(owner, *args, **kwargs)
    if sum(rows) == media.shape[0]:
        pieces = torch.split(media, rows)
    elif media.shape[0] == len(rows):
        pieces = torch.split(media, 1)
    else:
        return method(owner, *args, **kwargs)
    outputs = [method(owner, **{**arguments, media_key: piece, grid_key: grid[i:i + 1]})
               for i, piece in enumerate(pieces)]
    return join(outputs, [feature_rows(output) for output in outputs], hint=True)


def feature_rows(output) -> int:
    """Feature vectors in one image's encoder output (its per-item field where it has one)."""
    if is_dataclass(output):
        output = getattr(output, PER_ITEM_FIELD, None)
        if output is None:
            return 0
    if isinstance(output, (list, tuple)):
        return sum(_rows(t) for t in output if isinstance(t, torch.Tensor))
    return _rows(output) if isinstance(output, torch.Tensor) else 0
