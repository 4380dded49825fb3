"""Vision-tower attention over all images (or windows) of a batch in one call.

Vision towers that pack a batch's images into one sequence (transformers' Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, GLM-4V and their relatives) run attention within each image, or
each window for windowed blocks. Unless the attention implementation is a flash one,
their model code splits q/k/v at `cu_seqlens` and calls attention once per chunk in a
Python loop: thousands of small kernel launches per step. With a flash implementation the
same code passes `cu_seq_lens_q/k` and `max_length_q/k` to one call instead.

`install(model)` registers an attention function under a name that transformers'
`is_flash_attention_requested` accepts (it contains "flash") and selects it for each
sub-config whose attention modules take that one-call branch, so the model code passes
the chunk boundaries. The function then runs every chunk in one kernel:
- CUDA, half precision (or fp32 under autocast): torch's varlen flash kernel
  (`torch.nn.attention.varlen.varlen_attn`), the kernel flash-attn's varlen call would be;
- anything else (CPU, fp32, dropout, head dims the kernel lacks): the chunks padded to
  the longest one, in one SDPA call with a key-padding mask (exact: padded keys get zero
  weight, padded queries are dropped).
Which sub-configs qualify is read from transformers' model code, never from a family
name: the modules bound to the config that call the attention interface must all take
`cu_seqlens` and pass `cu_seq_lens_q` on their flash branch, and nothing else bound to
it may read the implementation name (a mask builder would change meaning under "flash").
A family whose tower does not qualify is left as it was (install returns False).

    install(model)       # once, before sharding; idempotent. calls() counts the kernels.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch

from mmrl.engine.varlen import available as varlen_available, kernel_dtype, kernel_keywords, kernel_options
from mmrl.wrappers import unwrapped

NAME = "mmrl_flash_vision"  # "flash" selects the model code's cu_seqlens branch; no digit after it
BASE = "sdpa"
_CALLS = {"varlen": 0, "padded": 0, "sdpa": 0}
_LAYOUTS: list[tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]]] = []  # (cu_seqlens, longest, layout)
_LAYOUTS_SIZE = 4
# Model code that reads the implementation's name (and would change meaning under one
# containing "flash") outside the attention modules' cu_seqlens branch.
_READS_NAME = re.compile(r"is_flash_attention_requested|_attn_implementation|create_\w*mask")


@functools.lru_cache(maxsize=None)
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _calls_attention(cls: type) -> bool:
    return "ALL_ATTENTION_FUNCTIONS" in _source(cls)


def _passes_chunk_boundaries(cls: type) -> bool:
    """The module's forward takes `cu_seqlens` and, under a flash implementation, hands
    them to one attention call as `cu_seq_lens_q/k`."""
    try:
        takes = "cu_seqlens" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    source = _source(cls)
    return takes and "is_flash_attention_requested" in source and "cu_seq_lens_q" in source


def _configs(config) -> list:
    """`config` and its sub-configs, depth first, each once."""
    found, stack = [], [config]
    while stack:
        current = stack.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        stack.extend(getattr(current, key, None) for key in getattr(current, "sub_configs", {}) or {})
    return found


def applies_to(model: torch.nn.Module, config) -> bool:
    """Whether the modules of `model` bound to `config` take the one-call branch under a
    flash name, and nothing else bound to it reads the name."""
    bound = [m for m in model.modules() if getattr(m, "config", None) is config]
    attention = [m for m in bound if _calls_attention(type(m))]
    if not attention or not all(_passes_chunk_boundaries(type(m)) for m in attention):
        return False
    return not any(_READS_NAME.search(_source(type(m))) for m in bound if m not in attention)


def install(model: torch.nn.Module, use_varlen: bool = True) -> bool:
    """Run the vision attention of `model` in one call per layer where its model code
    allows it (see the module docstring); False, changing nothing, where it does not.
    `use_varlen=False` keeps the padded single-SDPA call even where the varlen kernel
    could run (to measure one against the other)."""
    from transformers import AttentionInterface

    base = unwrapped(model)
    chosen = [c for c in _configs(base.config)
              if c._attn_implementation in (BASE, NAME) and applies_to(base, c)]
    if not chosen:
        return False
    if use_varlen and varlen_available():
        kernel_keywords()  # read eagerly, as `mmrl.engine.varlen.install` does
    AttentionInterface.register(NAME, vision_attention)
    for config in chosen:
        # The dict form leaves the config's own sub-configs (if any) as they are.
        config._attn_implementation = {"": NAME}
        for module in base.modules():
            if getattr(module, "config", None) is config and _calls_attention(type(module)):
                module._mmrl_vision_varlen = use_varlen
    return True


def calls() -> dict[str, int]:
    """How many attention calls ran the varlen kernel, the padded SDPA call, or (calls
    without chunk boundaries) plain SDPA."""
    return dict(_CALLS)


def _varlen_usable(module, query, dropout) -> bool:
    return (getattr(module, "_mmrl_vision_varlen", True) and query.is_cuda and not dropout
            and query.shape[-1] <= 256 and query.shape[-1] % 8 == 0 and kernel_dtype(query) is not None
            and varlen_available())


def _layout(cu_seqlens: torch.Tensor, longest: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For chunks at `cu_seqlens`: each token's row in the (chunks * longest) padded layout,
    and the (chunks, 1, 1, longest) mask of real keys. Cached per boundary tensor (every
    layer with the same chunks, and a checkpointed recomputation, reuse it)."""
    for cached, cached_longest, layout in _LAYOUTS:
        if cached is cu_seqlens and cached_longest == longest:
            return layout
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks = lengths.shape[0]
    chunk = torch.repeat_interleave(torch.arange(chunks, device=cu_seqlens.device), lengths.long(),
                                    output_size=total)
    token = torch.arange(total, device=cu_seqlens.device)
    rows = chunk * longest + token - cu_seqlens[:-1].long()[chunk]
    real = torch.arange(longest, device=cu_seqlens.device) < lengths[:, None]
    layout = (rows, real[:, None, None, :])
    _LAYOUTS.append((cu_seqlens, longest, layout))
    del _LAYOUTS[:-_LAYOUTS_SIZE]
    return layout


def _padded(query, key, value, cu_seqlens, longest, dropout, scaling) -> torch.Tensor:
    """(T, H, D) inputs -> (T, H, D): every chunk in one SDPA call over padded chunks."""
    total, heads, dim = query.shape
    chunks = cu_seqlens.shape[0] - 1
    gqa = key.shape[1] != heads
    if chunks * longest == total:  # equal chunks (same-size images, full windows): a plain batch
        def batch(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(chunks, longest, t.shape[1], dim).transpose(1, 2)

        out = torch.nn.functional.scaled_dot_product_attention(
            batch(query), batch(key), batch(value), dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(total, heads, dim)
    rows, real = _layout(cu_seqlens, longest, total)

    def pad(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros(chunks * longest, t.shape[1], dim).index_copy(0, rows, t)
        return padded.view(chunks, longest, t.shape[1], dim).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        pad(query), pad(key), pad(value), attn_mask=real, dropout_p=dropout, scale=scaling,
        enable_gqa=gqa)
    return out.transpose(1, 2).reshape(chunks * longest, heads, dim).index_select(0, rows)


def vision_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """The registered attention function: (1, H, T, D) inputs whose chunks are delimited
    by `cu_seq_lens_q`, (1, T, H, D) output, as transformers' SDPA function returns."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if cu_seq_lens_q is None:
        # A call without chunk boundaries means what it means under SDPA.
        _CALLS["sdpa"] += 1
        return ALL_ATTENTION_FUNCTIONS[BASE](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, is_causal=is_causal, **kwargs)
    same_chunks = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q or torch.equal(cu_seq_lens_k, cu_seq_lens_q)
    if attention_mask is not None or is_causal or query.shape[0] != 1 or not same_chunks:
        raise NotImplementedError(
            f"{NAME}: only bidirectional attention within the chunks of one packed row is supported "
            f"(mask={attention_mask is not None}, is_causal={is_causal}, batch={query.shape[0]})")
    cu_seqlens = cu_seq_lens_q
    longest = int(max_length_q if max_length_q is not None else (cu_seqlens[1:] - cu_seqlens[:-1]).max())
    flat = [t[0].transpose(0, 1) for t in (query, key, value)]  # (T, H, D)
    if _varlen_usable(module, query, dropout):
        from torch.nn.attention.varlen import varlen_attn

        _CALLS["varlen"] += 1
        dtype = kernel_dtype(query)
        q, k, v = (t.to(dtype).contiguous() for t in flat)
        extra = kernel_options(k.shape[1] != q.shape[1], causal=False)
        cu = cu_seqlens.to(torch.int32)
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)
    else:
        _CALLS["padded"] += 1
        out = _padded(*flat, cu_seqlens, longest, dropout, scaling)
    return out.unsqueeze(0), None
