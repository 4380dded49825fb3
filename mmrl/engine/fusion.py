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
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from mmrl.errors import one_line


def on_cuda(what: str, enabled: Callable[[], bool] = lambda: True):
    """Decorator: `fn(tensor, ...)` compiled where `tensor` is on CUDA and `enabled()`;
    the wrapper's `state` holds "compiled" once compiled, "failed" once given up."""

    def wrap(fn):
        state: dict = {}

        @functools.wraps(fn)
        def call(tensor, *args):
            if not (tensor.is_cuda and enabled()) or state.get("failed"):
                return fn(tensor, *args)
            if "compiled" not in state:
                state["compiled"] = torch.compile(fn)
            try:
                return state["compiled"](tensor, *args)
            except Exception as error:  # noqa: BLE001 - any compile failure keeps the eager path
                state["failed"] = True
                warnings.warn(f"{what}: {fn.__name__} runs eagerly ({one_line(error, typed=True)})"[:300],
                              stacklevel=2)
                return fn(tensor, *args)

        call.state = state
        return call

    return wrap
