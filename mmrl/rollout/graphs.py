"""The decode step as captured CUDA graphs, without compiling (`rollout.decode: graphs`).

    step = GraphedStep(capture=True, fallback=lambda: torch.compile(decode_step, ...))
    step.start(model, prompt_length, live_caches)      # once per rollout, after the prefill
    token, logprob, running, seen = step(model, ids, place, mask, cache, running, blocked, stops, seen, **pick)

A small model's decode step is bound by kernel launches, not by arithmetic: what
`torch.compile(mode="reduce-overhead")` gains there comes mostly from replaying the step as
a CUDA graph, and compiling it costs a run tens of seconds at its first steps
(docs/performance.md, "What compiling costs a run"). This step runs the model eagerly
once per (batch width, cache) and records that run as a CUDA graph; later steps copy
their inputs into the graph's and replay it. Recording takes a fraction of a second.
Where the engine compiles its decoder layers (`layers`), the step runs, and is recorded,
through them: the graph then replays inductor's fused kernels in the layers, and the rest
of the step (embedding, rotary tables, final norm, sampling) eagerly. Each layer writes
its keys and values through a view of the cache of its own (`LayerCache`), inside its
compiled graph: the cache itself picks the layer by its index, which dynamo would make one
graph per layer, or (kept eager) a graph break that splits the layer into four graphs.

What makes the eager step recordable (no host synchronisation, no Python-side state that
changes between steps):

- the attention mask is built inside the step from the cache slot the step writes
  (`slot`, a device counter shared by every graph of a rollout) and given to the model
  as a prepared 4-D mask, which transformers passes on as it is (its own mask code reads
  the mask on the host);
- `cache_position`, where the model's forward still takes one, is that same slot;
- the static cache's own fill counter is a device tensor in the transformers that
  tests run on.

Before the first recording the step runs once with CUDA's sync debug mode set to raise:
a model whose forward reads a value back to the host (dynamic rope, some families'
placeholder checks) or has layer kinds other than full attention (sliding windows keep
Python-side state) is not recorded; the step then hands over to `fallback` (the compiled
step) for the rest of the process, with one warning. On the CPU (`capture=False`) the
same step runs eagerly: the masks and slots that the graphs replay are what CPU tests
check against plain `generate`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch

from mmrl.errors import one_line
from mmrl.wrappers import unwrapped


class NotRecordable(Exception):
    """This model's decode step cannot be recorded as a CUDA graph (the message says why)."""


def layer_kinds(model) -> set[str]:
    """The attention kinds of the text decoder's layers (transformers' `layer_types`;
    full attention where the config names none)."""
    base = unwrapped(model)
    config = base.config.get_text_config()
    return set(getattr(config, "layer_types", None) or ["full_attention"])


class LayerCache:
    """One decoder layer's view of a static cache in the decode step: `update` writes
    that layer's keys and values, whatever layer index the attention passes. The layer's
    compiled graph traces the write (in place, one slot a row) instead of breaking at the
    cache's own `update`, which picks the layer by index; every layer meets one graph
    (dynamo guards the view's type and its tensors' shapes, not which layer it is)."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)


# Set to 0, the decode step leaves the cache write outside the layers' graphs, as before
# `LayerCache` (bench/decode_ab.sh's `noviews` mode: the compile time that the views save).
VIEWS_ENV = "MMRL_DECODE_LAYER_VIEWS"
# (a class, what its `update` does) -> the subclass with that `update` (`with_update`).
_SUBCLASSES: dict[tuple[type, str], type] = {}


def with_update(obj, what: str, update_of: Callable[[type], Callable]) -> bool:
    """Give `obj` (a cache or a cache layer) the subclass of its class, one per class and
    `what`, whose `update` is `update_of(its class)`; False where it has it already. Not an
    `update` set on the object: wrapping its own bound method, the object would refer to
    itself, and a cache let go would hold its tensors until Python's next full collection."""
    base = type(obj)
    if _SUBCLASSES.get((base.__bases__[0], what)) is base:
        return False
    subclass = _SUBCLASSES.get((base, what))
    if subclass is None:
        subclass = _SUBCLASSES[(base, what)] = type(base.__name__, (base,), {"update": update_of(base),
                                                                              "__module__": __name__})
    obj.__class__ = subclass
    return True


def without_update(obj, what: str) -> None:
    """`obj`'s own class again, where `with_update(obj, what, ...)` gave it a subclass."""
    base = type(obj).__bases__[0]
    if _SUBCLASSES.get((base, what)) is type(obj):
        obj.__class__ = base


def layer_cache(index: int, cache):
    """What the decoder layer writing cache index `index` is given in the decode step:
    its `LayerCache` where the cache is a plain static one already filled by the prefill,
    else the cache itself (an offloading cache, one without that layer yet)."""
    layers = getattr(cache, "layers", None)
    if getattr(cache, "offloading", False) or layers is None or index >= len(layers):
        return cache
    layer = layers[index]
    if not getattr(layer, "is_initialized", False) or getattr(layer, "is_sliding", False):
        return cache
    return LayerCache(layer)


def through_layers(layers):
    """While open, the decoder layers run their compiled forwards (`layers`, the engine's
    `CompiledLayers`; nothing where None or failed), each on its own view of the cache
    (`layer_cache`: the write traced in the layer's graph); a layer the view does not reach
    keeps its index a symbolic int (one graph serves every layer, not one per index)."""
    if layers is None or layers.failed:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(layers.active())
    if os.environ.get(VIEWS_ENV, "1") != "0":
        stack.enter_context(layers.cache_views(layer_cache))
    stack.enter_context(torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True))
    return stack


def viewed(cache) -> bool:
    """Whether every layer of `cache` is reached by its view (`layer_cache`): a plain static
    cache whose layers are all written already, none of them sliding."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer_cache(index, cache), LayerCache) for index in range(len(layers)))


def graph_step(model, input_ids, position_ids, attention_mask, cache, running, blocked, stops, seen, noise=None, *,
               slot: torch.Tensor, choose: Callable, takes_cache_position: bool, **pick):
    """One decode step with everything the model would derive on the host given to it:
    the mask of each row's visible cache slots (its prompt's real tokens and every slot up
    to `slot`, the one this step writes) and, where the forward takes it, the cache
    position. Advances `slot`."""
    length = attention_mask.shape[1]
    visible = attention_mask.bool() & (torch.arange(length, device=attention_mask.device) <= slot)
    extra = {"cache_position": slot.view(1)} if takes_cache_position else {}
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=visible[:, None, None],
                past_key_values=cache, use_cache=True, **extra)
    slot.add_(1)
    return choose(out.logits[:, -1].float(), running, blocked, stops, seen=seen, noise=noise, **pick)


class _Recorded:
    """One recorded step: its graph, the input tensors it reads and the outputs it writes.
    It holds the cache it was recorded on, so that cache's memory (which the graph reads by
    address) lives as long as the graph."""

    def __init__(self, graph, inputs: dict, outputs, cache):
        self.graph, self.inputs, self.outputs, self.cache = graph, inputs, outputs, cache


class GraphedStep:
    """The decode step, recorded as a CUDA graph per (batch width, cache, sampling settings)
    and replayed (see the module docstring). `fallback` builds the step to use where
    recording is not possible; `on_record(seconds, what)` hears of each recording."""

    def __init__(self, choose: Callable, capture: bool, fallback: Callable[[], Callable], attention: str,
                 on_record: Callable[[float, str], None] | None = None, layers=None):
        self.choose = choose
        self.attention = attention  # the attention function that reads the step's boolean masks
        # The engine's compiled decoder layers (`mmrl.engine.compiled_layers`), or None: the
        # recorded step then replays their fused kernels instead of eager ones.
        self.layers = layers
        self.capture = capture
        self._fallback_factory = fallback
        self.fallback: Callable | None = None
        self.fallback_reason: str | None = None
        self.on_record = on_record
        self.slot: torch.Tensor | None = None
        self._recorded: dict[tuple, _Recorded] = {}
        self._weights: tuple | None = None
        self._takes_cache_position: bool | None = None
        self.recordings = 0
        self._checked = False
        self._wrapped: list[weakref.ref] = []  # caches whose update `_eager_update` wrapped
        self._tried = False

    def start(self, model, prompt_length: int, live_caches: Iterable = ()) -> None:
        """Before a rollout's first decode step: the next slot is `prompt_length`. Graphs
        recorded on caches no longer in `live_caches`, or over weights that have moved since
        (a new inference copy), are dropped."""
        if self.fallback is not None:
            return
        device = next(model.parameters()).device
        if self.slot is None or self.slot.device != device:
            self.slot = torch.zeros((), dtype=torch.long, device=device)
        self.slot.fill_(prompt_length)
        weights = tuple(p.data_ptr() for p in model.parameters())
        live = {id(cache) for cache in live_caches}
        if weights != self._weights:
            self._recorded.clear()
            self._weights = weights
        self._recorded = {key: rec for key, rec in self._recorded.items() if id(rec.cache) in live}
        if self._takes_cache_position is None:
            self._takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def __call__(self, model, ids, place, mask, cache, running, blocked, stops, seen, noise=None, **pick):
        if self.fallback is None and not self._checked:
            self._checked = True
            reason = self._unrecordable(model)
            if reason:
                self._give_up(reason)
        if self.fallback is not None:
            return self.fallback(model, ids, place, mask, cache, running, blocked, stops, seen, noise=noise, **pick)
        if self.slot is None:
            raise RuntimeError("GraphedStep.start was not called before the first step")
        run = dict(slot=self.slot, choose=self.choose, takes_cache_position=self._takes_cache_position, **pick)
        inputs = {"ids": ids, "place": place, "mask": mask, "running": running, "blocked": blocked,
                  "stops": stops, "seen": seen, "noise": noise}
        if not self.capture:
            if not self._tried:  # the first step tries the model as the GPU's first step does
                self._tried = True
                return self._first(None, model, cache, inputs, run)
            self._eager_update(cache)
            with self._compiled_layers():
                return graph_step(model, *_args(inputs, cache), **run)
        key = (id(cache), ids.shape[0], mask.shape[1], place.shape, seen is None, noise is None,
               tuple(sorted((k, v) for k, v in pick.items())))
        recorded = self._recorded.get(key)
        if recorded is None:
            return self._first(key, model, cache, inputs, run)
        for name, value in inputs.items():
            if value is not None:
                recorded.inputs[name].copy_(value)
        recorded.graph.replay()
        return recorded.outputs

    def _first(self, key, model, cache, inputs: dict, run: dict):
        """Run the step (its result is this step's; the compiled layers compile their decode
        graphs here), run it again where nothing may read back to the host, and record it
        for the next step. The second run's effects (cache counters, `slot`, the random
        state) are undone; the keys and values it writes are the first run's again."""
        self._eager_update(cache)
        # A step given its noise draws nothing from the device's generator.
        rng = inputs["noise"] is None
        state = _State(cache, self.slot, rng)
        try:
            result = self._try(model, cache, inputs, run)
        except Exception as error:  # noqa: BLE001 - the fallback step runs it instead
            state.restore()
            self._give_up(f"the model's step fails as prepared here ({one_line(error)[:160]})")
            return self.fallback(model, *_args(inputs, cache), **_pick(run))
        if self.capture:
            # The graph reads its inputs from copies it keeps; the checked run takes the same
            # copies, so the recording meets the compiled layers' guards as that run left
            # them and nothing compiles while the stream is captured.
            static = {name: None if value is None else value.clone() for name, value in inputs.items()}
            state = _State(cache, self.slot, rng)
            try:
                with _sync_raises() if self._may_check_syncs() else contextlib.nullcontext():
                    self._try(model, cache, static, run)
            except Exception as error:  # noqa: BLE001
                self._give_up(f"the eager step reads back to the host ({one_line(error)[:160]})")
                return result
            finally:
                state.restore()
            self._record(key, model, cache, static, run)
        return result

    def _may_check_syncs(self) -> bool:
        """Whether the sync check may run now: CUDA's sync debug mode is the process's, so
        in a thread beside another (the concurrent one-step-off rollout, mmrl/buffer/overlap.py)
        it would fail that thread's own reads; there the check made by the first recording
        (in the main thread) stands for the model's later widths and caches."""
        return threading.current_thread() is threading.main_thread() or not self.recordings

    def _try(self, model, cache, inputs: dict, run: dict):
        """The eager step, through the engine's compiled layers where it compiles them; a
        layer compile that fails leaves the engine's layers as they were for its updates and
        the decode step eager from then on."""
        failed_before = None if self.layers is None else self.layers.failed
        with _uncached_autocast(), self._compiled_layers():
            out = graph_step(model, *_args(inputs, cache), **run)
        if self.layers is not None and self.layers.failed and not failed_before:
            self.layers.failed, self.layers = failed_before, None
        return out

    def _eager_update(self, cache) -> None:
        """With compiled layers, keep the cache write out of their graphs: it picks the
        layer's cache by index, which would make dynamo compile one graph per layer (the
        cache's class becomes a subclass whose `update` dynamo leaves alone: `with_update`)."""
        if self.layers is not None and with_update(cache, "eager", lambda base: torch.compiler.disable(base.update)):
            self._wrapped.append(weakref.ref(cache))

    def _compiled_layers(self):
        """While open, the decoder layers run the engine's compiled forwards on their views
        of the cache (`through_layers`); a layer the view does not reach keeps the cache
        write outside its graph (`_eager_update`)."""
        return through_layers(self.layers)

    def _unrecordable(self, model) -> str | None:
        kinds = layer_kinds(model)
        if kinds != {"full_attention"}:
            return f"layer kinds {', '.join(sorted(kinds))}: only full attention takes the step's masks"
        base = unwrapped(model)
        implementation = base.config.get_text_config()._attn_implementation
        if implementation != self.attention:
            return f"attention {implementation!r} does not read the step's boolean masks"
        return None

    def _give_up(self, reason: str) -> None:
        self.fallback_reason = reason
        self.fallback = self._fallback_factory()
        self._recorded.clear()
        for ref in self._wrapped:  # the compiled step traces the cache write as one graph
            cache = ref()
            if cache is not None:
                without_update(cache, "eager")
        self._wrapped.clear()
        warnings.warn(f"rollout.decode=graphs: using the compiled decode step ({reason})", stacklevel=4)

    def _record(self, key, model, cache, static: dict, run: dict) -> None:
        """Record the step on `static` (the inputs each replay copies into) through the
        compiled layers where the checked runs went through them: recorded without them,
        the graph would replay the layers' eager kernels (dozens of small ones per layer)
        whatever the checked runs compiled. A recording through them that fails records the
        eager layers instead, with one warning, and this step leaves them from then on."""
        started = time.perf_counter()
        try:
            graph, outputs = self._capture(model, cache, static, run, through_layers=True)
        except Exception as error:  # noqa: BLE001 - the eager layers record instead
            if self.layers is None or self.layers.failed:
                raise
            self.layers = None
            warnings.warn(f"rollout.decode=graphs: recording the decode step through the compiled layers failed "
                          f"({one_line(error)[:160]}); recording their eager forwards", stacklevel=4)
            graph, outputs = self._capture(model, cache, static, run, through_layers=False)
        self._recorded[key] = _Recorded(graph, static, outputs, cache)
        self.recordings += 1
        if self.on_record is not None:
            self.on_record(time.perf_counter() - started, f"decode graph (width {key[1]}, cache {key[2]})")

    def _capture(self, model, cache, static: dict, run: dict, through_layers: bool) -> tuple:
        """(graph, outputs) of the step recorded on `static`, through the compiled layers or
        not. Recording runs no kernel: the cache, its counters and `slot` are as the eager
        step left them, and the graph's in-place additions act on them at each replay."""
        graph = torch.cuda.CUDAGraph()
        layers = self._compiled_layers if through_layers else contextlib.nullcontext
        # "thread_local": another thread (the update beside a concurrent rollout) may go on
        # launching and allocating while this one records.
        with _uncached_autocast(), layers(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = graph_step(model, *_args(static, cache), **run)
        return graph, outputs


def _args(inputs: dict, cache) -> tuple:
    return (inputs["ids"], inputs["place"], inputs["mask"], cache, inputs["running"], inputs["blocked"],
            inputs["stops"], inputs["seen"], inputs["noise"])


def _pick(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("slot", "choose", "takes_cache_position")}


class _State:
    """What a step advances besides the cache contents, to put back: the layers' fill
    counters, `slot` and (`rng`: where the step draws from it) the device's random state."""

    def __init__(self, cache, slot: torch.Tensor, rng: bool = True):
        self.tensors = [*(counter for layer in cache.layers for counter in fill_counters(layer)), slot]
        self.values = [t.clone() for t in self.tensors]
        self.rng = torch.cuda.get_rng_state(slot.device) if slot.is_cuda and rng else None

    def restore(self) -> None:
        for tensor, value in zip(self.tensors, self.values, strict=True):
            tensor.copy_(value)
        if self.rng is not None:
            torch.cuda.set_rng_state(self.rng, self.tensors[-1].device)


def fill_counters(layer) -> list[torch.Tensor]:
    """A cache layer's device-side fill counters (transformers' `cumulative_length`)."""
    return [value for name, value in vars(layer).items()
            if name.startswith("cumulative_length") and isinstance(value, torch.Tensor)]


def _uncached_autocast():
    """The autocast in force, without its cache of cast weights: a recorded graph must not
    read casts that the cache frees when autocast closes (torch.cuda.graph's rule)."""
    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


class _sync_raises:
    """While open, a CUDA operation that waits for the device (an `.item()`, a blocking
    copy to the host) raises instead of running."""

    def __enter__(self):
        self._before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self._before)
        return False
