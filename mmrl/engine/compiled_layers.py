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
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

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


class CompiledLayers:
    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = list(layers)
        self.enabled = True  # False: the eager forwards everywhere (benchmarks compare both)
        self.failed: str | None = None  # why compiling was given up, once it was
        self.compiled_calls = 0  # layer calls that went through the compiled forward
        self._active = False
        self._limits = torch._dynamo.config.patch(**_recompile_limit())
        for layer in self.layers:
            self._wrap(layer)

    def _wrap(self, layer: torch.nn.Module) -> None:
        eager = layer.forward
        compiled = torch.compile(eager)

        def forward(*args, **kwargs):
            if not (self._active and self.enabled) or self.failed is not None:
                return eager(*args, **kwargs)
            try:
                out = compiled(*args, **kwargs)
            except _compile_errors() as error:
                self.failed = one_line(error, typed=True)
                warnings.warn(f"compiled decoder layers: off, eager from now on ({self.failed})"[:300], stacklevel=2)
                return eager(*args, **kwargs)
            self.compiled_calls += 1
            return out

        layer.forward = forward

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, layer forwards run compiled (where enabled and not failed)."""
        if self._active:  # nested: the outer block holds the settings
            yield
            return
        self._active = True
        try:
            with self._limits:
                yield
        finally:
            self._active = False
