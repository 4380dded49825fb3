"""`rollout.decode: graphs` records its decode step through the engine's compiled decoder
layers (issue 28): the checked eager runs went through them, and so must the recording, or
the graph replays the layers' eager kernels. CPU has no CUDA graphs, so a stand-in for
`torch.cuda.graph` notes whether the layers were active while the step was recorded; a
one-step rollout (the step that records) still gives plain generate's tokens.

    .venv/bin/python -m pytest -q tests/test_graphs_recording.py
"""

import contextlib
import warnings

import pytest
import torch
from test_rollout_fast import _assert_same
from widened_models import prompt_conversations, widened_engine

from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout import graphs
from mmrl.rollout.compiled import DECODE_ATTENTION, decode_step, choose_tokens


class StandInLayers:
    """The engine's `CompiledLayers` as the step uses them: a context in which the layers
    would run compiled (`active_now`), how often it was entered, and the cache view given
    to the layers (`view`)."""

    failed = None

    def __init__(self):
        self.active_now = False
        self.entered = 0

    @contextlib.contextmanager
    def active(self):
        self.active_now, self.entered = True, self.entered + 1
        try:
            yield
        finally:
            self.active_now = False

    @contextlib.contextmanager
    def cache_views(self, view):
        self.view = view
        yield


class StandInGraph:
    """`torch.cuda.CUDAGraph` on CPU: the one-step rollouts here never replay it."""

    def replay(self):
        raise AssertionError("a one-step rollout does not replay its graph")


@pytest.fixture
def recorded(monkeypatch):
    """(run, layers, captures): `run(fail_through_layers)` rolls out one decode step on a
    CPU qwen2 through a capturing GraphedStep with stand-in layers; `captures` lists, per
    recording attempt, whether the layers were active."""
    layers, captures = StandInLayers(), []

    @contextlib.contextmanager
    def capture(graph, fail_through_layers=False):
        captures.append(layers.active_now)
        if fail_through_layers and layers.active_now:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(graphs, "_sync_raises", contextlib.nullcontext)  # CUDA's sync debug mode needs a GPU

    def run(fail_through_layers: bool = False):
        monkeypatch.setattr(torch.cuda, "graph", lambda graph, **options: capture(graph, fail_through_layers))
        built, engine = widened_engine("qwen2")
        conversations = prompt_conversations(built, count=2)
        params = SamplingParams(n=2, max_new_tokens=2, temperature=0, logprobs=True)
        plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
        rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, decode="graphs")
        rollout._step = step = graphs.GraphedStep(choose_tokens, capture=True, fallback=lambda: decode_step,
                                                  attention=DECODE_ATTENTION, layers=layers)
        fast = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None and step.fallback is None, step.fallback_reason
        _assert_same(plain, fast)
        return step

    return run, layers, captures


def test_thedecode_step_is_recorded_through_the_compiled_layers(recorded):
    run, layers, captures = recorded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = run()
    assert captures == [True]  # eager layers here would replay dozens of small kernels per layer
    assert step.recordings == 1 and step.layers is layers
    assert layers.entered == 3  # the step's run, its sync-checked twin and the recording


def test_a_recording_that_fails_through_the_layers_records_them_eagerly_once(recorded):
    run, layers, captures = recorded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = run(fail_through_layers=True)
    assert captures == [True, False]
    assert step.recordings == 1 and step.layers is None  # later recordings go eager at once
    messages = [str(w.message) for w in caught if "rollout.decode=graphs" in str(w.message)]
    assert len(messages) == 1 and "through the compiled layers failed" in messages[0]


def test_with_update_gives_a_subclass_once_and_takes_it_back(collector_off):
    """`graphs.with_update`: the object's class becomes one subclass per class and purpose
    (isinstance holds, two objects share it, a second call changes nothing), its `update` is
    the given one over the class's own, nothing refers from the object to itself (freed at
    once with the collector off), and `without_update` gives the class back."""
    import weakref

    class Layer:
        def update(self, value):
            return value + 1

    def doubled(base):
        return lambda self, value: 2 * base.update(self, value)

    first, second = Layer(), Layer()
    assert graphs.with_update(first, "double", doubled) and graphs.with_update(second, "double", doubled)
    assert type(first) is type(second) is not Layer and isinstance(first, Layer)
    assert not graphs.with_update(first, "double", doubled)  # already: not doubled twice
    assert first.update(1) == 4 and "update" not in vars(first)
    graphs.without_update(second, "other")  # not given that one: unchanged
    assert type(second) is type(first)
    graphs.without_update(second, "double")
    assert type(second) is Layer and second.update(1) == 2
    alive = weakref.ref(first)
    with collector_off():
        del first
        assert alive() is None
