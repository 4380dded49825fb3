"""Packed rows for layers that carry a state along the sequence: each runs per sequence.

A packed row (`mmrl.engine.packing`) holds several sequences end to end. Attention keeps
them apart through the position ids (transformers builds a document mask from their
resets), but a convolution's window, a state-space scan or a linear-attention state
runs on from one sequence into the next. transformers' own argument for where packed
sequences start is `seq_idx` (`TransformersKwargs`: "sequence index for each token in a
flattened packed batch"); its models hand it, or `cu_seq_lens_q`, to the optional
kernels (causal-conv1d, mamba-ssm, flash-linear-attention), and their plain torch paths,
the ones that run on CPU and in our GPU image, ignore it (5.17 and 5.19 alike; the
survey: docs/training.md, "Packing hybrid models").

So mmrl does it itself, exactly and without naming a family:

- Which modules: in each decoder layer that the config's `layer_types` mark stateful
  (`mmrl.boundaries.STATEFUL_LAYER_KINDS`: conv, linear_attention, hybrid, ...), the
  innermost sequence mixers (`mmrl.parallel.gathered.is_mixer`) whose forward takes a
  decoding cache and that neither are nor hold attention (transformers' attention modules
  carry `is_causal`; they already see the packed mask).
- How: the packed forward passes `seq_idx` (`packed_inputs`); a pre-hook on each such
  layer reads it from the layer's keywords (transformers' layers receive the model's
  keywords) and hands its segments to the layer's mixers. Each mixer then runs on its
  row's sequences as a batch, one sequence a row, right-padded with zeros, and its output
  goes back to the packed positions. A causal layer's outputs do not depend on what lies
  after them, so each sequence gets what it gets alone (`tests/test_stateful_layers.py`;
  the padding-free probe's boundary case verifies it per family). The mixer's own
  `seq_idx` keyword is cleared, since its batch now holds one sequence a row.
- Checkpointed layers recompute with the same keywords, so the segments come again.
- Cost: those mixers see S x L positions for a row of T (S sequences, L the longest), and
  their layers stay out of layer compilation (`mmrl.engine.surgery`); handing the
  kernels their own arguments instead would avoid the padding where the kernels exist.

    install(model, adapter)               # once; [] where the model has no stateful layers
    model(**packed_inputs(model, packed))  # packed.inputs, plus seq_idx where installed

A family whose stateful state sits inside an attention module, or whose config does not
list its layer kinds, is not changed: its padding-free probe keeps failing and it stays
undeclared (`mmrl.boundaries.unpackable`).
"""

from __future__ import annotations

import inspect
import re

import torch

from mmrl.boundaries import STATEFUL_LAYER_KINDS, current_layer_kinds
from mmrl.parallel.gathered import is_mixer
from mmrl.parts import decoder_layers
from mmrl.wrappers import unwrapped

SEQUENCE_INDEX = "seq_idx"  # transformers' keyword for packed sequences (TransformersKwargs)
_HOOKED = "_mmrl_per_sequence"  # set on each hooked layer and mixer
_SEGMENTS = "_mmrl_segments"  # a mixer's segments while its layer runs
_CACHE_KEYS = ("past_key_values", "cache_params", "past_key_value")


class Segments:
    """Where the sequences of packed rows lie, as index maps between the (K, T) packed
    positions and a (S, L) batch of one sequence a row (L: the longest, shorter ones
    right-padded)."""

    def __init__(self, seq_idx: torch.Tensor) -> None:
        rows, length = seq_idx.shape
        starts = torch.ones_like(seq_idx, dtype=torch.bool)
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        starts = starts.flatten()
        first = starts.nonzero().flatten()  # (S,) flat position where each sequence starts
        total = rows * length
        lengths = torch.cat([first[1:], first.new_tensor([total])]) - first
        self.shape = (rows, length)
        self.count = first.numel()
        self.longest = int(lengths.max())
        offsets = torch.arange(self.longest, device=seq_idx.device)
        # Padding reads an extra zero position appended after the packed ones.
        self.gather = torch.where(offsets < lengths[:, None], first[:, None] + offsets, total)  # (S, L)
        segment = starts.long().cumsum(0) - 1
        self.scatter = segment * self.longest + torch.arange(total, device=seq_idx.device) - first[segment]  # (K*T,)

    @property
    def separates(self) -> bool:
        """Whether some row holds more than one sequence."""
        return self.count > self.shape[0]

    def to_sequences(self, value):
        """A (K, T, ...) tensor -> (S, L, ...), one sequence a row; anything else as it is."""
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != self.shape:
            return value
        flat = value.reshape(-1, *value.shape[2:])
        flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
        return flat[self.gather]

    def to_packed(self, value):
        """A (S, L, ...) tensor -> (K, T, ...); anything else as it is."""
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != (self.count,
                                                                                               self.longest):
            return value
        return value.reshape(-1, *value.shape[2:])[self.scatter].reshape(*self.shape, *value.shape[2:])


def sequence_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, total) int32 sequence index of each token of one packed row from its cumulative
    sequence lengths (`mmrl.positions.pack`'s `cu_seqlens`)."""
    counts = cu_seqlens[1:] - cu_seqlens[:-1]
    index = torch.repeat_interleave(torch.arange(counts.numel(), device=cu_seqlens.device), counts)
    return index[:total].to(torch.int32).unsqueeze(0)


# A forward parameter that hands a module its decoding cache: what a layer that carries a
# state along the sequence takes (a norm, an MLP or a router does not).
_CACHE_PARAMETER = re.compile(r"cache|past_key")


def _is_attention(module: torch.nn.Module) -> bool:
    return hasattr(module, "is_causal")


def _carries_state(module: torch.nn.Module) -> bool:
    """A sequence mixer with a decoding cache that is not attention and holds none."""
    if not is_mixer(module) or any(_is_attention(m) for m in module.modules()):
        return False
    try:
        names = list(inspect.signature(module.forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return any(_CACHE_PARAMETER.search(name) for name in names)


def stateful_mixers(model: torch.nn.Module, adapter) -> list[tuple[torch.nn.Module, list[torch.nn.Module]]]:
    """(layer, its mixers to run per sequence) for each decoder layer of a stateful kind;
    [] where the text config lists no layer kinds for exactly the layers found."""
    base = unwrapped(model)
    kinds = list(getattr(base.config.get_text_config(), "layer_types", None) or ())
    try:
        layers = decoder_layers(model, adapter)
    except ValueError:
        return []
    if not kinds or len(kinds) != len(layers):
        return []
    found = []
    for layer, kind in zip(layers, current_layer_kinds(kinds)):
        if kind not in STATEFUL_LAYER_KINDS:
            continue
        candidates = [m for m in layer.modules() if m is not layer and _carries_state(m)]
        ids = {id(m) for m in candidates}
        innermost = [m for m in candidates if not any(id(d) in ids for d in m.modules() if d is not m)]
        if innermost:
            found.append((layer, innermost))
    return found


def install(model: torch.nn.Module, adapter) -> list[torch.nn.Module]:
    """Hook each stateful layer and its mixers (module docstring); returns the mixers
    ([] where there are none). Idempotent."""
    hooked = []
    for layer, mixers in stateful_mixers(model, adapter):
        if not getattr(layer, _HOOKED, False):
            layer.register_forward_pre_hook(_layer_segments(mixers), with_kwargs=True)
            layer.register_forward_hook(_layer_done(mixers))
            for mixer in mixers:
                mixer.register_forward_pre_hook(_mixer_inputs, with_kwargs=True)
                # Innermost: a gathered sequence-parallel mixer's hook (registered first)
                # cuts the output after it is back in packed positions.
                mixer.register_forward_hook(_mixer_output, prepend=True)
                setattr(mixer, _HOOKED, True)
            setattr(layer, _HOOKED, True)
        hooked += mixers
    return hooked


def installed(model: torch.nn.Module) -> bool:
    """Whether `install` hooked some mixer of `model`."""
    return any(getattr(m, _HOOKED, False) for m in model.modules())


def hooked_layers(layers) -> set[int]:
    """ids of the `layers` whose mixers run per sequence (kept out of layer compilation:
    the segments are data-dependent)."""
    return {id(layer) for layer in layers if getattr(layer, _HOOKED, False)}


def packed_inputs(model: torch.nn.Module, packed) -> dict:
    """A packed batch's model inputs, with `seq_idx` where the model's stateful layers
    run per sequence."""
    if not installed(model):
        return packed.inputs
    return {**packed.inputs, SEQUENCE_INDEX: packed.seq_idx}


_LAST: list[tuple[torch.Tensor, Segments]] = []  # every layer of a forward gets the same seq_idx


def _segments_of(seq_idx: torch.Tensor) -> Segments:
    if _LAST and _LAST[0][0] is seq_idx:
        return _LAST[0][1]
    segments = Segments(seq_idx)
    _LAST[:] = [(seq_idx, segments)]
    return segments


def _layer_segments(mixers):
    def hook(layer, args, kwargs):
        seq_idx = kwargs.get(SEQUENCE_INDEX)
        cached = any(kwargs.get(key) is not None for key in _CACHE_KEYS)
        segments = None
        if isinstance(seq_idx, torch.Tensor) and seq_idx.dim() == 2 and not cached:
            segments = _segments_of(seq_idx)
            segments = segments if segments.separates else None
        _hand_over(mixers, segments)
        return None
    return hook


def _layer_done(mixers):
    def hook(layer, args, output):
        _hand_over(mixers, None)
        return None
    return hook


def _hand_over(mixers, segments: Segments | None) -> None:
    # Written only on a change: outside packed forwards (every decode step) the hooks only read.
    for mixer in mixers:
        if getattr(mixer, _SEGMENTS, None) is not segments:
            setattr(mixer, _SEGMENTS, segments)


def _mixer_inputs(module, args, kwargs):
    segments = getattr(module, _SEGMENTS, None)
    if segments is None:
        return None
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:2]) != segments.shape:
        raise ValueError(f"packed sequences: {type(module).__name__} got hidden states of shape "
                         f"{None if hidden is None else tuple(hidden.shape)}, not the packed rows' {segments.shape}")

    def per_sequence(value):
        if isinstance(value, (tuple, list)):
            return type(value)(segments.to_sequences(v) for v in value)
        return segments.to_sequences(value)

    kwargs = {name: per_sequence(value) for name, value in kwargs.items()}
    if SEQUENCE_INDEX in kwargs:
        kwargs[SEQUENCE_INDEX] = None  # one sequence a row now
    return tuple(per_sequence(a) for a in args), kwargs


def _mixer_output(module, args, output):
    segments = getattr(module, _SEGMENTS, None)
    if segments is None:
        return None
    if isinstance(output, (tuple, list)):
        return type(output)(segments.to_packed(v) for v in output)
    return segments.to_packed(output)


__all__ = ["SEQUENCE_INDEX", "Segments", "hooked_layers", "install", "installed", "packed_inputs",
           "sequence_index", "stateful_mixers"]
