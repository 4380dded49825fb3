"""Ulysses sequence parallelism: P ranks share one sequence, each holding S/P positions.

DeepSpeed-Ulysses, for any HF decoder through transformers' registration APIs:

    layout = install(model, adapter)          # once, before FSDP wraps the model
    with active(group):                       # around a forward of the whole model
        out = model(**inputs, logits_to_keep=local_columns(...))

- `install` registers the attention function "mmrl_ulysses" (and its mask function) with
  transformers' `AttentionInterface` / `AttentionMaskInterface`, selects it for the text
  decoder only (`config.get_text_config()`; a vision tower keeps its own attention), and
  adds a forward pre-hook to the module that runs the decoder layers. Outside `active`
  both functions hand over to the implementation the model had, so HF generate with a
  KV cache runs on the same model unchanged.
- The model had "sdpa" or "eager" (a class without SDPA, or one built eager). On "eager"
  the name is "mmrl_ulysses_eager", and inside `active` each rank runs the family's own
  `eager_attention_forward` (transformers' convention: a function of the attention
  class's module) on its heads, so what that function adds to the scores (soft-capping,
  attention sinks) holds under Ulysses too; per-head parameters of the attention module
  (sinks) are cut to the rank's heads. On "sdpa" it runs torch's SDPA as transformers'
  sdpa function does (which, like it, applies no soft-capping).
- Inside `active`, the hook cuts `inputs_embeds` / `input_ids` and the adapter's
  `sequence_parallel.split_inputs` (position ids along their last dimension, which
  covers 3-D mrope ids) to this rank's slice, after padding the sequence to a multiple
  of P. Each attention call all-to-alls q/k/v from (B, H, S/P, D) to (B, H/P, S, D),
  attends over the whole sequence with a mask built from the full 2-D attention mask
  (causal, padding, sliding window, packed sequences and any mask function the model
  adds, e.g. bidirectional image blocks), and all-to-alls back. KV heads that P does not
  divide are repeated up to the query heads first.
- Results stay on the rank that owns their positions: `gather_columns` all-gathers
  per-token results (log-probs, values) along the response, and its backward returns
  only this rank's columns. The loss is then the same on every rank of the group, every
  position's gradient is seeded exactly once, and each rank's parameter gradients are a
  partial sum over the group; FSDP's reduction sums them (`Engine` sets its divide
  factor to the data-parallel size, not the world size).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from mmrl.parts import decoder_layers, decoder_stack
from mmrl.wrappers import unwrapped

NAME = "mmrl_ulysses"
EAGER_NAME = "mmrl_ulysses_eager"
# What the text decoder runs when no sequence-parallel forward is active, by the name
# Ulysses is registered under: the implementation the model was built with.
BASES = {NAME: "sdpa", EAGER_NAME: "eager"}
BASE = BASES[NAME]


@dataclass
class _Context:
    group: object
    size: int
    rank: int
    # Set by the pre-hook: packed-sequence ids of the whole (padded) batch, when the
    # decoder gets no attention mask and its positions restart within a row.
    packed: torch.Tensor | None = None
    # Set by gathered mode's first-layer hook (mmrl.parallel.gathered): the whole
    # sequence's length, which its mixers gather to.
    length: int | None = None

    def padded(self, length: int) -> int:
        return -(-length // self.size) * self.size


_CONTEXT: _Context | None = None


@contextlib.contextmanager
def active(group, rank: int | None = None, size: int | None = None):
    """Run the forwards inside with the sequence split over the ranks of `group`."""
    global _CONTEXT
    previous = _CONTEXT
    size = size if size is not None else torch_dist.get_world_size(group)
    rank = rank if rank is not None else torch_dist.get_rank(group)
    _CONTEXT = _Context(group=group, size=size, rank=rank)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = previous


def current() -> _Context | None:
    return _CONTEXT


def checkpoint_context():
    """`context_fn` for `torch.utils.checkpoint`: a recomputed layer sees the sequence-
    parallel context its forward saw, though backward runs outside `active`."""
    saved = _CONTEXT

    @contextlib.contextmanager
    def restore():
        global _CONTEXT
        previous = _CONTEXT
        _CONTEXT = saved
        try:
            yield
        finally:
            _CONTEXT = previous

    return contextlib.nullcontext(), restore()


# -- which columns a rank owns -----------------------------------------------------------------
def owned_range(length: int, rank: int, size: int) -> tuple[int, int]:
    """Global positions [start, stop) of rank `rank` for a sequence of `length` (padded
    to a multiple of `size`; the last rank's slice may end in padding)."""
    local = -(-length // size)
    return rank * local, (rank + 1) * local


def local_columns(length: int, first: int, last: int, rank: int, size: int) -> tuple[torch.Tensor, list[int]]:
    """Local indices of the global columns [first, last) this rank owns, and how many
    columns every rank of the group owns (in rank order)."""
    widths = []
    for r in range(size):
        start, stop = owned_range(length, r, size)
        widths.append(max(0, min(last, stop) - max(first, start)))
    start, stop = owned_range(length, rank, size)
    lo = max(first, start)
    columns = torch.arange(lo, max(lo, min(last, stop))) - start
    return columns, widths


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, widths, rank, group):
        ctx.span = (sum(widths[:rank]), widths[rank])
        width = max(widths)
        padded = F.pad(local, (0, width - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in widths]
        torch_dist.all_gather(parts, padded, group=group)
        return torch.cat([part[..., :n] for part, n in zip(parts, widths)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start, width = ctx.span
        return grad[..., start:start + width], None, None, None


def gather_columns(local: torch.Tensor, widths: list[int], rank: int, group) -> torch.Tensor:
    """Concatenate every rank's columns (last dim) in rank order. Backward keeps this
    rank's columns only: valid when the loss is the same on every rank of the group."""
    return _GatherColumns.apply(local, widths, rank, group)


# -- all-to-all ---------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group, size: int, heads_to_sequence: bool) -> torch.Tensor:
    """(B, H, S/P, D) -> (B, H/P, S, D), or back."""
    batch, heads, length, dim = x.shape
    if heads_to_sequence:
        send = x.reshape(batch, size, heads // size, length, dim).transpose(0, 1).contiguous()
    else:
        send = x.reshape(batch, heads, size, length // size, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    torch_dist.all_to_all_single(received, send, group=group)
    # received[i] is rank i's piece: its slice of the sequence, or its group of heads.
    if heads_to_sequence:
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)
    return received.transpose(0, 1).reshape(batch, size * heads, length // size, dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, heads_to_sequence):
        ctx.args = (group, size, heads_to_sequence)
        return _all_to_all(x, group, size, heads_to_sequence)

    @staticmethod
    def backward(ctx, grad):
        group, size, heads_to_sequence = ctx.args
        return _all_to_all(grad.contiguous(), group, size, not heads_to_sequence), None, None, None


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    if times == 1:
        return x
    batch, heads, length, dim = x.shape
    return x[:, :, None].expand(batch, heads, times, length, dim).reshape(batch, heads * times, length, dim)


# -- the attention and mask functions -----------------------------------------------------------
def ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function registered as NAME: Ulysses inside `active` around torch's
    SDPA, else transformers' sdpa function."""
    return _attention("sdpa", module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def ulysses_eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function registered as EAGER_NAME: Ulysses inside `active` around the
    family's own eager function, else that function."""
    return _attention("eager", module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def family_eager_attention(module):
    """The eager attention function of `module`'s family: `eager_attention_forward` of the
    Python module that defines its class (transformers' convention), or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _eager_or_fail(module):
    function = family_eager_attention(module)
    if function is None:
        raise ValueError(f"sequence parallelism on eager attention runs the family's own eager_attention_forward, "
                         f"which {type(module).__module__} does not define (set model.attn_implementation: sdpa)")
    return function


class _RankHeads:
    """The attention module as the family's eager function sees it on one rank: its heads
    are this rank's group (KV heads repeated to match, so no further grouping), and its
    per-head parameters (e.g. attention sinks) are cut to that group. Everything else
    reads through to the module."""

    def __init__(self, module, per_head: dict):
        self._module = module
        self.num_key_value_groups = 1
        self.__dict__.update(per_head)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _rank_heads(value, heads: int, start: int, stop: int):
    """`value` cut to heads [start, stop) where it holds one float per head, else as is."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == heads and value.is_floating_point():
        return value[start:stop]
    return value


def _attention(base, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    ctx = _CONTEXT
    if ctx is None:
        if base == "eager":
            return _eager_or_fail(module)(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    size = ctx.size
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise ValueError(f"sequence parallelism over {size} ranks needs attention heads divisible by {size}, "
                         f"got {heads}")
    eager = _eager_or_fail(module) if base == "eager" else None
    if eager is None and (kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None):
        raise ValueError("sequence-parallel attention does not support position biases or attention sinks on sdpa "
                         "(set model.attn_implementation: eager)")
    length = query.shape[2] * size
    mask = attention_mask
    if mask is not None and tuple(mask.shape[-2:]) != (length, length):
        raise ValueError(f"sequence-parallel attention got a mask of shape {tuple(mask.shape)}, not one over the "
                         f"whole sequence ({length}); was it made by another attention implementation?")
    if kv_heads % size or eager is not None:  # e.g. one KV head: give every rank its copy
        key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
    query, key, value = (_AllToAll.apply(t, ctx.group, size, True) for t in (query, key, value))
    if eager is not None:
        local = heads // size
        start, stop = ctx.rank * local, (ctx.rank + 1) * local
        per_head = {name: _rank_heads(p, heads, start, stop) for name, p in module.named_parameters(recurse=False)
                    if _rank_heads(p, heads, start, stop) is not p}
        kwargs = {name: _rank_heads(v, heads, start, stop) for name, v in kwargs.items()}
        if mask is None and getattr(module, "is_causal", True):
            mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()[None, None]
        if mask is not None and mask.dtype == torch.bool:  # eager functions add the mask to the scores
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        out, _ = eager(_RankHeads(module, per_head), query, key, value, mask, dropout=dropout, scaling=scaling,
                       **kwargs)
        out = out.transpose(1, 2)  # eager functions return (B, S, H, D)
    else:
        groups = query.shape[1] // key.shape[1]
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
        is_causal = mask is None and getattr(module, "is_causal", True)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                             scale=scaling, is_causal=is_causal)
    out = _AllToAll.apply(out.contiguous(), ctx.group, size, False)
    return out.transpose(1, 2).contiguous(), None


def ulysses_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, config=None, **kwargs):
    """The mask function registered as NAME: inside `active`, a boolean (B, 1, S, S) mask
    over the whole sequence padded to a multiple of P (the rows of padding attend to
    themselves only, so no row is empty); else sdpa's mask."""
    return _mask("sdpa", batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                 config, **kwargs)


def ulysses_eager_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                       attention_mask=None, config=None, **kwargs):
    """The mask function registered as EAGER_NAME: `ulysses_mask`'s inside `active` (the
    eager attention makes it additive), else eager's mask."""
    return _mask("eager", batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                 config, **kwargs)


def _mask(base, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, config,
          **kwargs):
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
        sdpa_mask,
    )

    mask_function = mask_function or causal_mask_function
    ctx = _CONTEXT
    if ctx is None:
        return ALL_MASK_ATTENTION_FUNCTIONS[base](
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, config=config, **kwargs)
    if q_offset or kv_offset:
        raise ValueError("sequence-parallel forwards take no KV cache")
    # Before the pre-hook (a wrapper building masks for its decoder) the lengths are the
    # whole sequence; after it, the hook keeps a 2-D mask of the whole sequence.
    length = attention_mask.shape[-1] if attention_mask is not None else kv_length
    if ctx.packed is not None:
        mask_function = and_masks(mask_function, packed_sequence_mask_function(ctx.packed[:, :length]))
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
    mask = sdpa_mask(batch_size=batch_size, q_length=length, kv_length=length, mask_function=mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                     use_vmap=kwargs.get("use_vmap", False), device=device)
    if mask is None:
        return None
    mask = mask.expand(batch_size, 1, length, length)
    padded = ctx.padded(length)
    if padded == length:
        return mask
    full = torch.zeros(batch_size, 1, padded, padded, dtype=torch.bool, device=mask.device)
    full[:, :, :length, :length] = mask
    tail = torch.arange(length, padded, device=mask.device)
    full[:, :, tail, tail] = True
    return full


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ulysses_attention)
    AttentionMaskInterface.register(NAME, ulysses_mask)
    AttentionInterface.register(EAGER_NAME, ulysses_eager_attention)
    AttentionMaskInterface.register(EAGER_NAME, ulysses_eager_mask)


# -- installing on a model ----------------------------------------------------------------------
def install(model: torch.nn.Module, adapter) -> torch.nn.Module:
    """Select Ulysses attention for the text decoder of `model` and hook its decoder
    stack; returns the stack. Idempotent."""
    if adapter.sequence_parallel is None:
        raise ValueError(f"{adapter.family}: the adapter opts out of sequence parallelism "
                         "(sequence_parallel = None)")
    _register()
    base = unwrapped(model)
    text_config = base.config.get_text_config()
    current_name = text_config._attn_implementation
    stack = decoder_stack(model, adapter)
    if current_name not in BASES:
        attention_free = _attention_free_layer_kinds(model, adapter, stack)
        if attention_free is not None:
            raise ValueError(f"sequence parallelism (Ulysses) splits the attention heads of the text decoder over "
                             f"the processes, in transformers' attention interface, which no layer of this decoder "
                             f"calls: its layers ({attention_free}) have no attention heads to split (recurrent, "
                             "state-space or convolution layers) or compute attention their own way; declare "
                             "SequenceParallel(gather_mixers=True) (mmrl/parallel/gathered.py) or keep "
                             "sequence_parallel = None for this family")
        names = {base: name for name, base in BASES.items()}
        if current_name not in names:
            raise ValueError(f"sequence parallelism runs on the text decoder's sdpa or eager attention, not "
                             f"{current_name!r} (set model.attn_implementation: sdpa)")
        text_config._attn_implementation = names[current_name]
    if getattr(stack.config, "_attn_implementation", NAME) not in BASES:
        raise ValueError(f"{type(stack).__name__} does not read its attention from the text config")
    if not getattr(stack, "_mmrl_ulysses_hooked", False):
        stack.register_forward_pre_hook(_splitter(adapter.sequence_parallel), with_kwargs=True)
        stack._mmrl_ulysses_hooked = True
    return stack


@functools.lru_cache(maxsize=None)
def _calls_attention(cls: type) -> bool:
    """Whether a module class's forward calls transformers' attention interface, the call
    Ulysses takes over (read from the model code, never from a family name)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _attention_free_layer_kinds(model, adapter, stack: torch.nn.Module) -> str | None:
    """The text decoder's layer kinds ("MambaBlock: MambaMixer") when none of its modules
    calls the attention interface (a pure recurrent or convolution decoder), else None."""
    if any(_calls_attention(type(module)) for module in stack.modules()):
        return None
    kinds: dict[str, list[str]] = {}
    for layer in decoder_layers(model, adapter):
        inner = kinds.setdefault(type(layer).__name__, [])
        for child in layer.children():
            name = type(child).__name__
            if "norm" not in name.lower() and any(True for _ in child.parameters()) and name not in inner:
                inner.append(name)
    return "; ".join(f"{name}: {', '.join(inner)}" if inner else name for name, inner in kinds.items()) or "none found"


_NOT_SPLIT = ("attention_mask", "past_key_values", "use_cache", "return_dict", "output_hidden_states",
              "output_attentions")


def _splitter(spec):
    split_inputs = tuple(spec.split_inputs)
    masked = dict(spec.masked_inputs)

    def cut(tensor: torch.Tensor, dim: int, start: int, stop: int, padded: int) -> torch.Tensor:
        length = tensor.shape[dim]
        if padded > length:
            if tensor.is_floating_point():
                shape = list(tensor.shape)
                shape[dim] = padded - length
                tensor = torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)
            else:  # ids and positions: repeat the last one
                last = tensor.narrow(dim, length - 1, 1)
                tensor = torch.cat([tensor, last.expand(*[padded - length if d == dim % tensor.dim() else -1
                                                           for d in range(tensor.dim())])], dim=dim)
        return tensor.narrow(dim, start, stop - start)

    def hook(module, args, kwargs):
        ctx = _CONTEXT
        if ctx is None:
            return None
        if args:  # a family that calls its decoder positionally (`self.transformer(input_ids, ...)`)
            args, kwargs = (), _as_keywords(module, args, kwargs)
        source = kwargs.get("inputs_embeds")
        if source is None:
            source = kwargs.get("input_ids")
        if source is None:
            raise ValueError("sequence parallelism needs input_ids or inputs_embeds")
        length = source.shape[1]
        padded = ctx.padded(length)
        start, stop = owned_range(length, ctx.rank, ctx.size)
        kwargs = dict(kwargs)
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise ValueError("sequence-parallel forwards take no KV cache (pass use_cache=False)")
        positions = kwargs.get("position_ids")
        mask = kwargs.get("attention_mask")
        if mask is None:
            if positions is not None:
                from transformers.masking_utils import find_packed_sequence_indices

                text_positions = positions[0] if positions.dim() == 3 else positions
                text_positions = text_positions.expand(source.shape[0], -1)
                ctx.packed = find_packed_sequence_indices(text_positions)
            kwargs["attention_mask"] = torch.ones(source.shape[:2], dtype=torch.bool, device=source.device)
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] != length:
            raise ValueError(f"attention mask covers {mask.shape[-1]} positions, the inputs {length}")
        if positions is None:
            positions = torch.arange(length, device=source.device).unsqueeze(0)
            kwargs["position_ids"] = positions
        for name in dict.fromkeys(("inputs_embeds", "input_ids", *split_inputs)):
            value = kwargs.get(name)
            if name == "attention_mask" or not isinstance(value, torch.Tensor):
                continue
            dim = -1 if name == "position_ids" else 1
            if value.shape[dim] != length:
                raise ValueError(f"{name} has {value.shape[dim]} positions, the inputs {length}")
            kwargs[name] = cut(value, dim, start, stop, padded)
        for mask_name, row_inputs in masked.items():
            chosen = kwargs.get(mask_name)
            if chosen is None:
                continue
            if chosen.shape != source.shape[:2]:
                raise ValueError(f"{mask_name} has shape {tuple(chosen.shape)}, the inputs {tuple(source.shape[:2])}")
            mine = torch.zeros_like(chosen, dtype=torch.bool)
            mine[:, start:min(stop, length)] = True
            rows = mine[chosen.bool()]  # per row of the row inputs: does this rank own it?
            for name in row_inputs:
                value = kwargs.get(name)
                if isinstance(value, torch.Tensor):
                    kwargs[name] = value[rows]
                elif isinstance(value, (list, tuple)):
                    kwargs[name] = type(value)(v[rows] for v in value)
            kwargs[mask_name] = F.pad(chosen, (0, padded - length)).narrow(1, start, stop - start)
        for name, value in kwargs.items():
            if (name not in _NOT_SPLIT and name not in split_inputs and name not in masked
                    and name not in ("inputs_embeds", "input_ids")
                    and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length):
                raise ValueError(f"the decoder gets {name} {tuple(value.shape)} over the whole sequence, which "
                                 "sequence parallelism does not know how to cut (adapter.sequence_parallel."
                                 "split_inputs or masked_inputs)")
        return args, kwargs

    return hook


def _as_keywords(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """`module.forward`'s arguments as keywords, bound by its signature; a forward whose
    positional arguments have no names (`*args`, positional-only) cannot be split."""
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as error:
        raise ValueError(f"sequence parallelism needs keyword arguments for {type(module).__name__} ({error})") from None
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise ValueError(f"sequence parallelism needs keyword arguments for {type(module).__name__} "
                             f"({name} is positional only)")
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def heads_problem(text_config, heads_attrs: tuple[str, ...], size: int) -> str | None:
    """Why `size` ranks cannot split the heads of `text_config`, or None. The first of
    `heads_attrs` (the query heads) must be divisible by `size`; the others (KV heads)
    must be divisible too, or divide the query heads (then they are repeated)."""
    if size == 1:
        return None
    values = [(attr, getattr(text_config, attr, None)) for attr in heads_attrs]
    values = [(attr, value) for attr, value in values if isinstance(value, int)]
    if not values:
        return f"the text config has none of {list(heads_attrs)}"
    query_attr, query_heads = values[0]
    if query_heads % size:
        return f"{size} does not divide {query_attr} = {query_heads} of the text config"
    for attr, value in values[1:]:
        if value % size and query_heads % value:
            return f"{size} does not divide {attr} = {value}, which does not divide {query_attr} = {query_heads}"
    return None
