"""Small tensor arithmetic that runs compiled on CUDA, eagerly elsewhere.

Some of the engine's arithmetic is a few cheap element-wise passes over one large tensor
(a chunk of logits). Eagerly each pass reads and writes the whole tensor, and those passes
can cost more than the matrix products around them; compiled (torch.compile, inductor) they
fuse into a kernel or two. Not every such pass gains: a packed row's T x T mask check,
compiled, was slower on the GPU than eagerly (inductor's any-reduction over T x T
elements; bench/packed_mask.py), so it stays eager. Measure before wrapping. `on_cuda` wraps such a function:

    @on_cuda("chunked log-probs", enabled=lambda: FUSE_ON_CUDA)
    def stats(raw, targets): ...

The first tensor argument decides: on CUDA (and while `enabled()`) the call runs the compiled
function, elsewhere the plain one, with the same results up to rounding. A compile that fails
warns once and leaves that function eager from then on.

The calls see varying rows (the chunked head's chunks: `chunk_tokens` rows, the last one
shorter), so before each compiled call dim 0 of every tensor argument as long as the first
tensor's is marked dynamic: the first compile serves every chunk, where dynamo would compile
a second graph at the first short chunk (issue 28). `compiles_here` decides where the
compiled function runs and `COMPILE_OPTIONS` how it compiles; tests set both to count the
graphs on the CPU (tests/test_fusion_shapes.py).

`precompile(fn, tensor, *args)` compiles such a function ahead, on stand-in arguments of the
shapes, dtypes and values a later call will have (the trainer does it in a thread while the
model builds, `mmrl.engine.logprobs.precompile_head`); the later call finds the graph. A
failed precompile leaves the function as it was: the call compiles it as before.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from mmrl.errors import one_line


def compiles_here(tensor: torch.Tensor) -> bool:
    """Whether a call whose first tensor is `tensor` runs the compiled function."""
    return tensor.is_cuda


COMPILE_OPTIONS: dict = {}  # torch.compile's keywords (a test's backend="aot_eager")


def mark_rows_dynamic(tensor: torch.Tensor, args: tuple) -> None:
    """Mark dim 0 of `tensor` and of the tensors in `args` with its size as dynamic."""
    rows = tensor.shape[0] if tensor.dim() else None
    if rows is None or rows < 2:  # sizes 0 and 1 dynamo specializes anyway
        return
    for item in (tensor, *args):
        if isinstance(item, torch.Tensor) and item.dim() and item.shape[0] == rows:
            torch._dynamo.maybe_mark_dynamic(item, 0)


def on_cuda(what: str, enabled: Callable[[], bool] = lambda: True):
    """Decorator: `fn(tensor, ...)` compiled where `tensor` is on CUDA and `enabled()`;
    the wrapper's `state` holds "compiled" once compiled, "failed" once given up."""

    def wrap(fn):
        state: dict = {}

        @functools.wraps(fn)
        def call(tensor, *args):
            if not (compiles_here(tensor) and enabled()) or state.get("failed"):
                return fn(tensor, *args)
            try:
                return _compiled_call(fn, state, tensor, args)
            except Exception as error:  # noqa: BLE001 - any compile failure keeps the eager path
                state["failed"] = True
                warnings.warn(f"{what}: {fn.__name__} runs eagerly ({one_line(error, typed=True)})"[:300],
                              stacklevel=2)
                return fn(tensor, *args)

        call.state = state
        call.enabled = enabled
        return call

    return wrap


def precompile(function, tensor: torch.Tensor, *args):
    """Compile `function` (an `on_cuda` wrapper) for a call with these arguments now, as the
    call would, and return what it returns; None (nothing compiled) where the call would run
    the plain function. An error is raised, not recorded as the function's failure."""
    state = function.state
    if not (compiles_here(tensor) and function.enabled()) or state.get("failed"):
        return None
    return _compiled_call(function.__wrapped__, state, tensor, args)


def _compiled_call(fn, state: dict, tensor: torch.Tensor, args: tuple):
    """`fn(tensor, *args)` through its compiled function (made on first use, kept in `state`),
    dim 0 of the arguments as long as `tensor`'s marked dynamic first."""
    if "compiled" not in state:
        state["compiled"] = torch.compile(fn, **COMPILE_OPTIONS)
    mark_rows_dynamic(tensor, args)
    return state["compiled"](tensor, *args)
