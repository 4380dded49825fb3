"""Variable-length attention for packed batches, where the mask allows it.

A packed batch (`mmrl.engine.packing`) reaches attention as rows of several sequences and
a boolean (K, 1, T, T) mask that transformers builds from the position ids. SDPA's masked
kernels compute every block of it, T^2 per row, although a sequence only sees itself.
Installed on a model's text decoder (`install`), the "mmrl_varlen" attention function
looks at that mask: when it is exactly document-causal (each token sees the tokens of its
own sequence up to itself, and nothing else) it runs torch's flash varlen kernel
(`torch.nn.attention.varlen.varlen_attn`) over the sequences the mask delimits; any
other call (a padded batch, sliding windows shorter than a sequence, bidirectional media
blocks, fp32 outside autocast, CPU, dropout, soft-capping, attention sinks) goes to transformers' SDPA
function unchanged. The mask itself decides, so no family is named and the result is
the masked attention's by construction (up to the kernels' rounding).

    install(model, layers)   # once; idempotent. varlen_calls() counts the kernel's uses.

For a packed batch transformers composes its causal mask with a packed-sequence mask; the
mask function registered beside the attention function (`packed_mask`) recognizes exactly
that composition, writes the same mask band by band instead of by T x T comparisons, and
remembers its segments, so they need not be read back from it.

Given the decoder's layers, `install` also hooks each of them (`segments_hook`): the mask's
segments are found before the layer runs, eagerly, and reach the attention function as a
keyword argument. Inside the layer nothing then depends on the mask's values, so a
compiled layer (`mmrl.engine.compiled_layers`) traces it as one graph, kernel and all.
"""

from __future__ import annotations

import inspect

import torch

from mmrl.wrappers import unwrapped

NAME = "mmrl_varlen"
BASE = "sdpa"
_CACHE: list[tuple[torch.Tensor, tuple[torch.Tensor, int] | None]] = []  # (mask, its segments)
_CACHE_SIZE = 4
_CALLS = {"varlen": 0, "sdpa": 0, "packed_mask": 0}
SEGMENTS = "mmrl_segments"  # the keyword `segments_hook` passes a layer's segments under


def available() -> bool:
    """Whether torch's variable-length attention kernel runs here (it needs CUDA); the
    one check the decoder's and the vision tower's varlen paths share."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _starts_and_first(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """From (K, T) sequence starts: cu_seqlens over the K * T tokens, the longest segment,
    and each token's first visible key (the start of its own sequence)."""
    rows, length = starts.shape
    flat_starts = starts.flatten().nonzero().flatten()
    ends = torch.cat([flat_starts, flat_starts.new_tensor([rows * length])])
    longest = int((ends[1:] - ends[:-1]).max())
    position = torch.arange(length, device=starts.device)
    first = torch.where(starts, position, torch.zeros_like(position)).cummax(-1).values
    return ends.to(torch.int32), longest, first, position


def _bands(row: torch.Tensor, first: torch.Tensor, position: torch.Tensor, longest: int):
    """(view, what document-causal puts there) for the parts of a (T, T) `row` that hold
    every entry a document-causal mask allows, given each token's first visible key: the
    band of columns q - top .. q of rows q >= top (top = longest - 1, a strided view) and
    the top-left corner above it."""
    length = row.shape[0]
    top = longest - 1
    offsets = torch.arange(longest, device=row.device)
    band = row.as_strided((length - top, longest), (length + 1, 1), row.storage_offset() + top * length)
    parts = [(band, offsets[None, :] >= (first[top:] - position[top:] + top)[:, None])]
    if top:
        corner = position[None, :top]
        parts.append((row[:top, :top], (corner >= first[:top, None]) & (corner <= position[:top, None])))
    return parts


def document_segments(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens over the flattened K * T tokens, longest segment) when the boolean
    (K, 1, T, T) `mask` is document-causal, else None.

    Exact, without building the expected T x T mask: the segments come from the
    sub-diagonal (a token starts a sequence where it cannot see the token before it). With
    `top` = longest - 1, every entry document-causal allows lies in the band of columns
    q - top .. q of each row q (rows above `top`: in the top-left corner). The band and the
    corner are compared with what they should be (`_bands`); everything else must be
    False, and is read as strided views with `any` (no cast: a bool `sum` first copies the
    mask to int64). Flattened, what lies between row q's band and row q + 1's is one run of
    T - top entries (the rest of row q, then the start of row q + 1), so those runs form a
    (rows, T - top) view with row stride T + 1. Less than half the time of comparing
    with the whole expected mask (docs/performance.md, "Packing and compiled layers")."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        return None
    rows, _, length, _ = mask.shape
    square = mask[:, 0]
    before = torch.diagonal(square, offset=-1, dim1=1, dim2=2)  # (K, T - 1): q sees q - 1
    starts = torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=mask.device), ~before], dim=1)
    cu_seqlens, longest, first, position = _starts_and_first(starts)
    top = longest - 1
    wrong = []
    for k in range(rows):
        row = square[k] if square[k].is_contiguous() else square[k].contiguous()
        wrong += [(view != expected).any() for view, expected in _bands(row, first[k], position, longest)]
        # Between the bands: from row q0 = max(top - 1, 0) to T - 2.
        q0 = max(top - 1, 0)
        if length - 1 - q0 > 0 and length - top > 0:
            between = row.as_strided((length - 1 - q0, length - top), (length + 1, 1),
                                     row.storage_offset() + q0 * (length + 1) + 1)
            wrong.append(between.any())
        if top >= 2:
            wrong.append(row[:top - 1, top:].any())  # above the corner, right of it
    if torch.stack(wrong).any():
        return None
    return cu_seqlens, longest


def document_mask(ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, int]] | None:
    """The boolean (K, 1, T, T) document-causal mask of packed-sequence ids (K, T) (equal
    ids: one sequence; non-decreasing along a row), written band by band into zeros, and
    its segments; None where the ids decrease somewhere (a sequence in several pieces)."""
    rows, length = ids.shape
    starts = torch.ones(rows, length, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    if bool((ids[:, 1:] < ids[:, :-1]).any()):
        return None
    cu_seqlens, longest, first, position = _starts_and_first(starts)
    mask = torch.zeros(rows, 1, length, length, dtype=torch.bool, device=ids.device)
    for k in range(rows):
        for view, expected in _bands(mask[k, 0], first[k], position, longest):
            view.copy_(expected)
    return mask, (cu_seqlens, longest)


_AND_CODE = None


def _packed_ids(mask_function) -> torch.Tensor | None:
    """The packed-sequence ids when `mask_function` is exactly transformers' causal mask
    ANDed with its packed-sequence mask (what `create_causal_mask` composes for packed
    position ids and nothing else), else None."""
    from transformers import masking_utils as mu

    global _AND_CODE
    if _AND_CODE is None:
        _AND_CODE = (mu.and_masks(mu.causal_mask_function).__code__,
                     mu.packed_sequence_mask_function(torch.zeros(1, 1)).__code__)
    and_code, packed_code = _AND_CODE

    def captured(function) -> dict:
        return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))

    if getattr(mask_function, "__code__", None) is not and_code:
        return None
    parts = captured(mask_function).get("mask_functions", ())
    if len(parts) != 2 or parts[0] is not mu.causal_mask_function or getattr(parts[1], "__code__", None) is not packed_code:
        return None
    ids = captured(parts[1]).get("packed_sequence_mask")
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def packed_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, **kwargs):
    """The mask function registered for "mmrl_varlen": for a packed batch's causal mask
    (no padding, no cache, no other mask function: `_packed_ids`) the document-causal mask
    written band by band (`document_mask`), its segments remembered for `segments_hook`;
    anything else is transformers' SDPA mask. The mask is the one SDPA's function would
    build, so any other reader of it sees the same values, without transformers' broadcast
    comparisons over T x T (bench/results/varlen_segments_ab_gpu.json holds the timing)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    ids = None
    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length \
            and not torch.compiler.is_compiling():
        ids = _packed_ids(mask_function)
    built = None
    if ids is not None and tuple(ids.shape) == (batch_size, q_length):
        built = document_mask(ids)
    if built is None:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    mask, segments = built
    _CALLS["packed_mask"] += 1
    _remember(mask, segments)
    return mask


def _segments(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """`document_segments`, computed once per mask tensor (every layer of a forward, and
    its checkpointed recomputation, gets the same one)."""
    for cached, segments in _CACHE:
        if cached is mask:
            return segments
    segments = document_segments(mask)
    _remember(mask, segments)
    return segments


def _remember(mask: torch.Tensor, segments: tuple[torch.Tensor, int] | None) -> None:
    _CACHE.append((mask, segments))
    del _CACHE[:-_CACHE_SIZE]


def segments_hook(module, args, kwargs):
    """Forward pre-hook of a decoder layer: the segments of its `attention_mask` keyword,
    when that mask is document-causal, join its keywords as `mmrl_segments` (which the
    layer hands down to its attention function, as transformers' layers do)."""
    mask = kwargs.get("attention_mask")
    # Only a square mask can be document-causal (not a decode step's); under a compile of
    # the whole model (the compiled rollout) the attention function reads the mask itself.
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2] \
            or torch.compiler.is_compiling():
        return None
    segments = _segments(mask)
    return None if segments is None else (args, {**kwargs, SEGMENTS: segments})


_OPTIONS: list[frozenset[str]] = []


def kernel_keywords() -> frozenset[str]:
    """The keyword options of this torch's `varlen_attn`. Each `install` reads them eagerly,
    so a compiled layer finds a plain value here (dynamo warns about `functools.cache` wrappers)."""
    if not _OPTIONS:
        from torch.nn.attention.varlen import varlen_attn

        _OPTIONS.append(frozenset(inspect.signature(varlen_attn).parameters))
    return _OPTIONS[0]


def kernel_options(grouped: bool, *, causal: bool) -> dict[str, object]:
    """The keyword options this torch's `varlen_attn` needs for causal (decoder) or
    bidirectional (vision) attention, over `grouped` key/value heads or one per query head:
    the one reading of the kernel's signature, which changed between torch versions."""
    keywords = kernel_keywords()
    extra: dict[str, object] = {}
    if causal:
        extra.update({"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True})
    # Without the flag this torch hands key and value to the flash kernel as they are, and the
    # kernel shares each key/value head among its query heads itself: the same output and
    # gradients as with the heads repeated, and faster (docs/performance.md, "Packing and
    # compiled layers").
    if grouped and "enable_gqa" in keywords:
        extra["enable_gqa"] = True
    return extra


def kernel_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half precision the kernel runs in: the inputs', or autocast's where fp32 inputs
    come from rotary embeddings applied in fp32 (fp32 weights under autocast); None: fp32
    (no kernel)."""
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return None


def _usable(module, query, key, attention_mask, dropout, kwargs) -> bool:
    if attention_mask is None or not query.is_cuda or kernel_dtype(query) is None:
        return False
    if dropout or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        return False
    softcap = getattr(module, "attn_logit_softcapping", None) or getattr(
        getattr(module, "config", None), "attn_logit_softcapping", None)
    if softcap or query.shape[-1] > 256 or query.shape[2] != key.shape[2]:
        return False
    return tuple(attention_mask.shape) == (query.shape[0], 1, query.shape[2], key.shape[2])


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The registered attention function: (K, T, H, D) output, as transformers' SDPA's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    given = kwargs.pop(SEGMENTS, None)  # from `segments_hook`, for this same mask
    segments = None
    if _usable(module, query, key, attention_mask, dropout, kwargs):
        # Inside a compiled graph the layer's hook has already looked (eagerly) and found
        # no segments: the mask is not document-causal, and reading the cache there would
        # guard on it.
        if given is not None:
            segments = given
        elif not torch.compiler.is_compiling():
            segments = _segments(attention_mask)
    if segments is None:
        _count("sdpa")
        return ALL_ATTENTION_FUNCTIONS[BASE](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    _count("varlen")
    cu_seqlens, longest = segments
    rows, heads, length, dim = query.shape
    extra = {"scale": scaling, **kernel_options(key.shape[1] != heads, causal=True)}
    dtype = kernel_dtype(query)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).transpose(1, 2).reshape(rows * length, t.shape[1], dim)

    out = varlen_attn(flat(query), flat(key), flat(value), cu_seqlens, cu_seqlens, longest, longest, **extra)
    return out.reshape(rows, length, heads, dim), None


def _count(kind: str) -> None:
    # Not inside a compiled graph: a counter read there becomes a guard on its value, and
    # every call would recompile (then, past the recompile limit, run eagerly).
    if not torch.compiler.is_compiling():
        _CALLS[kind] += 1


def varlen_calls() -> dict[str, int]:
    """How many eager attention calls ran the varlen kernel, how many fell back to SDPA
    (calls inside a compiled layer are not counted), and how many packed masks
    `packed_mask` wrote itself."""
    return dict(_CALLS)


def install(model: torch.nn.Module, layers=()) -> bool:
    """Select the varlen-where-possible attention for `model`'s text decoder (whose
    attention is SDPA) and hook its `layers` with `segments_hook`; False, changing
    nothing, where it does not apply."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    base = unwrapped(model)
    text_config = base.config.get_text_config()
    if text_config._attn_implementation not in (BASE, NAME):
        return False
    if available():
        kernel_keywords()
    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, packed_mask)  # the same masks SDPA gets
    text_config._attn_implementation = NAME
    for layer in layers:
        takes_keywords = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(layer.forward).parameters.values())
        if takes_keywords and not getattr(layer, "_mmrl_segments_hook", False):
            layer.register_forward_pre_hook(segments_hook, with_kwargs=True)
            layer._mmrl_segments_hook = True
    return True
