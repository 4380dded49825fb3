"""The text decoder's layers through `torch.compile` in the engine's forwards.

Eagerly, each decoder layer's norms, rotary embedding, gated activation, residual adds
and dtype casts are dozens of small elementwise kernels, forward and backward; at a
0.5B model's width they took more GPU time than the matrix products. Compiled, inductor
fuses them into a few. bench/packing.py measures it (`compiled_16384` against
`varlen_16384`, same run); the figures: docs/performance.md, "Packing and compiled layers".

    layers = CompiledLayers(decoder_layers(model, adapter))
    with layers.active():     # the engine's log-prob and value forwards
        model(**inputs)       # each layer's forward runs compiled

Each layer's `forward` becomes a wrapper; the module's hooks (FSDP2's, checkpointing's,
`mmrl.engine.varlen`'s segments hook) stay eager around it, so the varlen kernel's
data-dependent setup happens before the compiled graph and nothing breaks it. Outside
`active()`, e.g. in generation, whose growing caches would recompile at every step, the
eager forward runs; the engine also keeps them eager under activation checkpointing. A
compile that fails warns once and leaves every layer eager.

Micro-batches differ in rows and length (and packed ones in their documents). Left to
dynamo, the first call compiles for its exact shapes, the first new length recompiles with
the length dynamic, and the first change of another size (rows, documents, the longest
document) once more, seconds each on a GPU, in the middle of a run (issue 28). So every
call marks, before the compiled function runs, the dims that vary (`mark_varying_dims`:
rows and length wherever they occur, the packed documents' cumulative lengths), and the
longest packed document (an int in `mmrl.engine.varlen`'s segments) is a dynamic source
(`LONGEST_SEGMENT_SOURCES`): the first compile of each grad mode serves every later
micro-batch. Still new graphs: the first call with gradients (or without), one row after
several (size 1 is specialized). A padded batch without any padding would be one more:
transformers skips an all-visible causal mask for SDPA's `is_causal` and the layers get None
where other batches give a tensor; the engine's forwards keep the mask
(`active(keep_masks=True)`, `masks_kept`). Dims of model constants (hidden size, heads, head dim) are not marked:
the weights they meet would specialize them again, and a length that happened to equal
one would be tied to it and specialized with it (dynamo gives equal sizes one symbol).
tests/test_compiled_layers_shapes.py counts the graphs over varied micro-batches.

Three more guards that compiled a layer again in a run (issue 28), each answered here:
- autocast's weight cache: the decode step records with it off, the engine's forwards run
  with it on, and dynamo guards on it; every compiled call runs with it off
  (`uncached_autocast`), which changes no value;
- on CUDA, SDPA's mask alignment: padded micro-batches are widened to a multiple of
  `ALIGNED_LENGTH` where the layers run compiled (the `Padded` layout);
- the attention's layer index in the decode step's graphs (`LAYER_INDEX_SOURCES`).
The decode step's graphs (one token a row, a static cache) stay graphs of their own. In
them each layer is given its own view of the cache (`cache_views`, from the recorded step
in `mmrl.rollout.graphs`): the cache write is traced inside the layer's graph, one graph
for every layer, where the cache itself would pick the layer by index and break it.
tests/test_compiled_layers_stalls.py counts the graphs of each.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch

from mmrl.engine.varlen import SEGMENTS
from mmrl.errors import one_line


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this could not be compiled" (not "this failed to run")."""
    errors: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    if hasattr(torch._dynamo.exc, "FailOnRecompileLimitHit"):  # not a TorchDynamoException
        errors.append(torch._dynamo.exc.FailOnRecompileLimitHit)
    inductor = getattr(getattr(torch, "_inductor", None), "exc", None)
    if inductor is not None and hasattr(inductor, "InductorError"):
        errors.append(inductor.InductorError)
    return tuple(errors)


RECOMPILE_LIMIT = 64


def _recompile_limit() -> dict[str, int | bool]:
    """The dynamo settings of a compiled layer call: its per-code-object graph limit raised
    to RECOMPILE_LIMIT (never lowered), and reaching it raised as an error where this torch
    can, so the layer goes eager with a warning (`_compile_errors`).

    One layer forward (a code object all layers of all engines share) meets several graphs
    in a run: with and without grad, one packed row and several (size 1 is specialized),
    padded and packed. dynamo's default limit of 8 was reached on an H200 by
    bench/packing.py, after which the layers silently ran eager. Set for the engine's
    forwards (`CompiledLayers.active`), not for the whole pass, so other compiled code in
    the pass keeps the user's settings. Read once per engine: reading dynamo's config
    takes about a millisecond of CPU, which per layer call left the GPU waiting between
    layers (bench/packing.py --profile shows the idle GPU time in the layers' forwards)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    fail = {"fail_on_recompile_limit_hit": True} if hasattr(config, "fail_on_recompile_limit_hit") else {}
    return {name: max(RECOMPILE_LIMIT, getattr(config, name)), **fail}


def _tensors(value) -> Iterator[torch.Tensor]:
    """The tensors in a layer call's argument, through tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def mark_varying_dims(args: tuple, kwargs: dict) -> None:
    """Mark the dims of a decoder layer call's tensors that change between micro-batches
    as dynamic (`torch._dynamo.maybe_mark_dynamic`), so that the layer's first compile
    already serves every micro-batch (the module docstring says why).

    The hidden states (the first positional tensor, or `hidden_states`) are (rows, length,
    hidden). A dim of any tensor of the call whose size is those rows or that length varies
    with them: masks (rows, 1, length, length), rotary cos/sin (rows, length, dim) or
    (3, rows, length, dim), position ids (rows, length) or (3, rows, length), cache positions
    (length,). So does the length of a 1-D integer tensor (the cumulative lengths of packed
    documents). The last dim of a floating-point tensor is a feature (hidden size, rotary or
    head dim), a model constant, unless the tensor is a 4-D mask square in its last two dims
    (an additive mask), so a length that happens to equal a feature size does not tie the
    two. Sizes 0 and 1 are left alone (dynamo specializes them anyway). A tensor already
    marked (the mask and cos/sin, shared by all layers of a forward) is passed over."""
    hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return
    varying = {size for size in hidden.shape[:-1] if size > 1}
    for tensor in _tensors((args, kwargs)):
        if hasattr(tensor, "_dynamo_weak_dynamic_indices"):  # marked at an earlier layer's call
            continue
        shape = tensor.shape
        if tensor.dim() == 1 and not tensor.is_floating_point():
            dims = [0] if shape[0] > 1 else []
        else:
            mask = tensor.dim() == 4 and shape[-1] == shape[-2]  # (rows, 1, length, length)
            features = tensor.is_floating_point() and not mask
            dims = [dim for dim, size in enumerate(shape[:-1] if features else shape) if size in varying]
        if dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dims)


# Where dynamo finds the longest packed document of a layer call (`mmrl.engine.varlen`'s
# segments keyword, (cu_seqlens, longest)): a python int, which no mark can reach. The exact
# name is the one transformers' layers give it (`**kwargs`); the pattern, where this torch
# takes patterns, also covers another name for the layer's keywords.
LONGEST_SEGMENT_SOURCES = (f"L['kwargs']['{SEGMENTS}'][1]", rf".*\['{SEGMENTS}'\]\[1\]")

# Where dynamo finds a decoder layer's attention index in a decode step through the compiled
# layers, for a layer not given a view of the cache (`cache_views`): the attention's own
# frame (the cache write, kept eager there, breaks the layer's graph, so the attention
# forward is a frame of its own) passes `self.layer_idx` to that write. The decode step lets
# ints on modules be symbols (`allow_unspec_int_on_nn_module`), but dynamo still specializes
# the first one it meets and makes it a symbol only at the first other index: one more
# compile of the attention frame at layer 1 (issue 28). Named here, it is a symbol from the
# first compile.
LAYER_INDEX_SOURCES = ("L['self'].layer_idx",)


def _dynamic_sources() -> dict[str, str]:
    """torch.compiler.config's `dynamic_sources` for a compiled layer call: the user's, plus
    `LONGEST_SEGMENT_SOURCES`, so the packed rows' longest document is a symbol from the first
    compile (it changes with nearly every packed micro-batch), and `LAYER_INDEX_SOURCES`;
    nothing where this torch has no such setting (then they are constants, and the first
    change of each recompiles once)."""
    config = torch.compiler.config
    if not hasattr(config, "dynamic_sources"):
        return {}
    sources = (config.dynamic_sources, *LONGEST_SEGMENT_SOURCES, *LAYER_INDEX_SOURCES)
    return {"dynamic_sources": ",".join(filter(None, sources))}


def uncached_autocast(device_type: str):
    """The autocast in force on `device_type` with its cache of cast weights off, where it is
    on; else a no-op. Every compiled layer call runs in it, so every call meets one global
    state: the decode step records under autocast without the cache (a CUDA graph must not
    read casts that the cache frees when autocast closes), the engine's forwards run under
    the cached one, and dynamo guards on the difference (issue 28). Inside a compiled graph
    the casts are traced as operations either way, so values do not change; in the eager
    code between graphs a cast is made again rather than taken from the cache: the same
    values."""
    if torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled():
        return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
    return contextlib.nullcontext()


# The mask builders' keywords that let transformers return None for a mask that hides
# nothing (SDPA's is_causal, or no mask, then runs instead).
_MASK_SKIPS = ("allow_is_causal_skip", "allow_is_bidirectional_skip")


def _keeping(build_mask):
    """`build_mask` (a transformers mask interface function) told never to skip its mask."""

    @functools.wraps(build_mask)
    def build(*args, **kwargs):
        for skip in _MASK_SKIPS:
            if skip in kwargs:
                kwargs[skip] = False
        return build_mask(*args, **kwargs)

    build.mmrl_keeps_masks = True
    return build


@contextlib.contextmanager
def masks_kept() -> Iterator[None]:
    """Within the block, transformers' attention masks are built even where nothing is
    hidden: a micro-batch without padding gives the compiled layers a mask tensor, as a
    padded one does, not None, which would compile a second graph of each layer (issue 28).

    Every registered mask function is wrapped for the block (`AttentionMaskInterface`'s
    class mapping, which `create_causal_mask` reads by the model's attention implementation,
    in transformers 5.17 as in 5.19) and put back after it. The values are the ones SDPA's
    is_causal computes; SDPA then takes its masked kernel for such a batch, as for a padded
    one: equal up to rounding, and the rows x length x length mask a padded batch already
    costs."""
    from transformers.masking_utils import AttentionMaskInterface

    mapping = AttentionMaskInterface._global_mapping
    originals = {name: build for name, build in mapping.items() if not getattr(build, "mmrl_keeps_masks", False)}
    wrapped = {name: _keeping(build) for name, build in originals.items()}
    mapping.update(wrapped)
    try:
        yield
    finally:
        for name, build in wrapped.items():
            if mapping.get(name) is build:  # not re-registered inside the block
                mapping[name] = originals[name]


# The multiple of 8 that padded micro-batches' lengths are widened to where the layers run
# compiled (`mmrl.engine.sequences.left_padded`, the `Padded` layout). On CUDA, inductor
# lays out SDPA's attention mask (rows, 1, length, length) with the kernel's 8-element
# alignment, and checks it on the symbolic length: the first graph holds for lengths that
# are (or are not) multiples of 8, and the first length of the other kind compiles the
# layer again, seconds on a GPU, in the middle of a run (issue 28). Always aligned, the
# lengths meet one graph; the cost is at most 7 masked columns a row.
ALIGNED_LENGTH = 8


def cache_index(layer: torch.nn.Module) -> int | None:
    """The cache index a decoder layer writes: the `layer_idx` its attention passes to the
    cache (transformers' attention modules keep it), where the layer's modules name one;
    None where they name none or several (a layer with self- and cross-attention)."""
    found = {index for module in layer.modules() if isinstance(index := getattr(module, "layer_idx", None), int)}
    return found.pop() if len(found) == 1 else None


class CompiledLayers:
    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = list(layers)
        self.enabled = True  # False: the eager forwards everywhere (benchmarks compare both)
        self.failed: str | None = None  # why compiling was given up, once it was
        self.compiled_calls = 0  # layer calls that went through the compiled forward
        self._active = False
        # (index, cache) -> what the layer is given as its cache, while `cache_views` is open.
        self._cache_view = None
        self._limits = torch._dynamo.config.patch(**_recompile_limit())
        sources = _dynamic_sources()
        self._sources = torch.compiler.config.patch(**sources) if sources else contextlib.nullcontext()
        for layer in self.layers:
            self._wrap(layer)

    def _wrap(self, layer: torch.nn.Module) -> None:
        eager = layer.forward
        compiled = torch.compile(eager)
        index = cache_index(layer)

        def forward(*args, **kwargs):
            if not (self._active and self.enabled) or self.failed is not None:
                return eager(*args, **kwargs)
            view = self._cache_view
            if view is not None and index is not None and kwargs.get("past_key_values") is not None:
                kwargs["past_key_values"] = view(index, kwargs["past_key_values"])
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            uniform = contextlib.nullcontext()
            if not torch.compiler.is_compiling():  # inside an outer compile, dynamo sizes them
                mark_varying_dims(args, kwargs)
                if isinstance(hidden, torch.Tensor):
                    uniform = uncached_autocast(hidden.device.type)
            try:
                with uniform:
                    out = compiled(*args, **kwargs)
            except _compile_errors() as error:
                self.failed = one_line(error, typed=True)
                warnings.warn(f"compiled decoder layers: off, eager from now on ({self.failed})"[:300], stacklevel=2)
                return eager(*args, **kwargs)
            self.compiled_calls += 1
            return out

        layer.forward = forward

    @property
    def length_multiple(self) -> int:
        """What padded micro-batches' lengths are widened to a multiple of: `ALIGNED_LENGTH`
        while the layers run compiled, else 1."""
        return ALIGNED_LENGTH if self.enabled and self.failed is None else 1

    @contextlib.contextmanager
    def cache_views(self, view) -> Iterator[None]:
        """Within the block, a layer called with a cache (`past_key_values`) runs on
        `view(index, cache)` instead, `index` being the cache index its attention writes
        (`cache_index`; a layer without one gets the cache itself)."""
        before, self._cache_view = self._cache_view, view
        try:
            yield
        finally:
            self._cache_view = before

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Within the block, the layers run their eager forwards: for a one-off no-grad pass
        (the trainer's step-0 media check) that would otherwise compile a no-grad graph that
        no later call of a run without no-grad passes uses, seconds on a GPU (issue 28)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    @contextlib.contextmanager
    def active(self, keep_masks: bool = False) -> Iterator[None]:
        """Within the block, layer forwards run compiled (where enabled and not failed);
        with `keep_masks`, under `masks_kept` too (the engine's forwards, whose batches may
        or may not be padded; not a decode step, whose masks the caller arranges)."""
        if self._active:  # nested: the outer block holds the settings
            yield
            return
        self._active = True
        masks = masks_kept() if keep_masks and self.enabled and self.failed is None else contextlib.nullcontext()
        try:
            with self._limits, self._sources, masks:
                yield
        finally:
            self._active = False
