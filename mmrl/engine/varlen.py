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

    install(model)   # once; idempotent. varlen_calls() counts the kernel's uses.
"""

from __future__ import annotations

import inspect

import torch

NAME = "mmrl_varlen"
BASE = "sdpa"
_CACHE: list[tuple[torch.Tensor, tuple[torch.Tensor, int] | None]] = []  # (mask, its segments)
_CACHE_SIZE = 4
_CALLS = {"varlen": 0, "sdpa": 0}


def available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def document_segments(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens over the flattened K * T tokens, longest segment) when the boolean
    (K, 1, T, T) `mask` is document-causal, else None."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        return None
    rows, _, length, _ = mask.shape
    square = mask[:, 0]
    # A token starts a sequence where it cannot see the token before it.
    before = torch.diagonal(square, offset=-1, dim1=1, dim2=2)  # (K, T - 1): q sees q - 1
    starts = torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=mask.device), ~before], dim=1)
    document = starts.cumsum(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    expected = (document[:, :, None] == document[:, None, :]) & causal
    if not torch.equal(square, expected):
        return None
    flat_starts = starts.flatten().nonzero().flatten()
    ends = torch.cat([flat_starts, flat_starts.new_tensor([rows * length])])
    cu_seqlens = ends.to(torch.int32)
    return cu_seqlens, int((ends[1:] - ends[:-1]).max())


def _segments(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """`document_segments`, computed once per mask tensor (every layer of a forward, and
    its checkpointed recomputation, gets the same one)."""
    for cached, segments in _CACHE:
        if cached is mask:
            return segments
    segments = document_segments(mask)
    _CACHE.append((mask, segments))
    del _CACHE[:-_CACHE_SIZE]
    return segments


def _kernel_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half precision the kernel runs in: the inputs', or autocast's where fp32 inputs
    come from rotary embeddings applied in fp32 (fp32 weights under autocast); None: fp32."""
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return None


def _usable(module, query, key, attention_mask, dropout, kwargs) -> bool:
    if attention_mask is None or not query.is_cuda or _kernel_dtype(query) is None:
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

    segments = _segments(attention_mask) if _usable(module, query, key, attention_mask, dropout, kwargs) else None
    if segments is None:
        _CALLS["sdpa"] += 1
        return ALL_ATTENTION_FUNCTIONS[BASE](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    _CALLS["varlen"] += 1
    cu_seqlens, longest = segments
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    options = inspect.signature(varlen_attn).parameters
    extra = {"scale": scaling}
    if "window_size" in options:
        extra["window_size"] = (-1, 0)
    else:
        extra["is_causal"] = True
    if kv_heads != heads:
        if "enable_gqa" in options:
            extra["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)

    dtype = _kernel_dtype(query)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).transpose(1, 2).reshape(rows * length, t.shape[1], dim)

    out = varlen_attn(flat(query), flat(key), flat(value), cu_seqlens, cu_seqlens, longest, longest, **extra)
    return out.reshape(rows, length, heads, dim), None


def varlen_calls() -> dict[str, int]:
    """How many attention calls ran the varlen kernel, and how many fell back to SDPA."""
    return dict(_CALLS)


def install(model: torch.nn.Module) -> bool:
    """Select the varlen-where-possible attention for `model`'s text decoder (whose
    attention is SDPA); False, changing nothing, where it does not apply."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text_config = base.config.get_text_config()
    if text_config._attn_implementation not in (BASE, NAME):
        return False
    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks SDPA gets
    text_config._attn_implementation = NAME
    return True
