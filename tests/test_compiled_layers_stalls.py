"""Guards that compiled the decoder layers again in the middle of a run (issue 28), each
counted here on the CPU with dynamo's `aot_eager` backend (dynamo decides what recompiles):

- autocast's weight cache: the decode step runs the layers under autocast without its cache,
  the engine's forwards under the cached one; every compiled call now meets one state
  (`uncached_autocast`), with bitwise the same log-probs and gradients (CPU bf16 autocast
  stands in for the GPU's);
- the attention's layer index in the decode step's graphs: one graph for every layer;
- SDPA's mask alignment on CUDA (inductor's guard exists only there): padded micro-batches
  reach the compiled layers at lengths that are multiples of `ALIGNED_LENGTH`, with the
  eager engine's log-probs and gradients on the unwidened batch;
- the step-0 media check runs the layers eagerly: no no-grad graph for a one-off pass.

    .venv/bin/python -m pytest -q tests/test_compiled_layers_stalls.py
"""

import contextlib
import functools

import pytest
import torch
from test_compiled_layers_shapes import _assert_same_gradients, _engines, _micro_batch
from torch._dynamo.utils import counters
from widened_models import prompt_conversations, widened_model

from mmrl.config import OptimConfig
from mmrl.engine import Engine, compiled_layers
from mmrl.engine.compiled_layers import ALIGNED_LENGTH
from mmrl.engine.sequences import left_padded
from mmrl.media_check import training_logprobs
from mmrl.parallel import init_distributed
from mmrl.parts import decoder_layers
from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout import graphs


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture
def cpu_autocast(monkeypatch):
    """The engine's bf16 autocast and the decode step's uncached one on the CPU, as on a GPU."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(Engine, "autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16))

    def uncached():
        if torch.is_autocast_enabled("cpu"):
            return torch.autocast("cpu", dtype=torch.get_autocast_dtype("cpu"), cache_enabled=False)
        return contextlib.nullcontext()

    monkeypatch.setattr(graphs, "_uncached_autocast", uncached)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _decode_graphs(layers: int) -> tuple[int, int]:
    """(graphs of the first decode step, graphs of the later ones) of a compiled-layers
    qwen2 with `layers` decoder layers, decoding with `rollout.decode: graphs` (no capture on
    the CPU: its first step runs under the uncached autocast, the later ones under the engine's)."""
    torch._dynamo.reset()
    counters.clear()
    built = widened_model("qwen2", config_overrides={"num_hidden_layers": layers})
    engine = Engine(built, init_distributed("cpu"), compile_layers=True, share_media=False)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=True, decode="graphs")
    conversations = prompt_conversations(built, count=2)
    with torch.no_grad():
        rollout.generate(conversations, SamplingParams(n=1, max_new_tokens=2, temperature=0))  # one decode step
        first = _graphs()
        rollout.generate(conversations, SamplingParams(n=1, max_new_tokens=4, temperature=0))
    assert engine.compiled_layers.failed is None and engine.compiled_layers.compiled_calls > 0
    return first, _graphs() - first


def test_decode_steps_compile_once_for_every_layer_and_autocast_cache(cpu_autocast):
    one_layer, _ = _decode_graphs(1)
    assert one_layer == 1 and not counters["graph_break"]  # the cache write is in the layer's graph
    first, later = _decode_graphs(2)
    assert later == 0  # steps under the engine's cached autocast recompiled every frame of the layer
    assert first == one_layer  # layer 1's attention frame recompiled on its index
    assert not counters["graph_break"]


def test_decode_layers_share_one_graph_where_static_addresses_guard(cpu_autocast, monkeypatch):
    """On torch versions whose `mark_static_address` guards by default, transformers' marks
    on each cache layer's keys, values and fill counter would tie a layer's graph to its
    layer (one compile per layer through the views); the rollout marks them unguarded."""
    mark = torch._dynamo.mark_static_address
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: mark(t, guard=guard))
    first, later = _decode_graphs(3)
    assert (first, later) == (1, 0) and not counters["graph_break"]


def test_without_views_the_cache_write_breaks_the_layer_graph(cpu_autocast, monkeypatch):
    """`MMRL_DECODE_LAYER_VIEWS=0` (the bench's `noviews` mode) keeps the write eager: the
    layer's graph breaks there (more graphs, still one set for every layer)."""
    monkeypatch.setenv(graphs.VIEWS_ENV, "0")
    first, later = _decode_graphs(2)
    assert first > 1 and later == 0 and counters["graph_break"]


def test_the_decode_steps_caches_are_freed_when_the_rollout_lets_them_go(cpu_autocast, collector_off):
    """The decode step keeps the cache write out of dynamo's graphs by the cache's class (a
    subclass whose `update` dynamo leaves alone), not by an `update` set on the cache that
    would refer to the cache itself: a cache the rollout lets go is freed at once, with
    Python's collector off (not at its next full collection)."""
    import gc
    import weakref

    built = widened_model("qwen2", config_overrides={"num_hidden_layers": 2})
    engine = Engine(built, init_distributed("cpu"), compile_layers=True, share_media=False)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=True, decode="graphs")
    with torch.no_grad():
        rollout.generate(prompt_conversations(built, count=2), SamplingParams(n=1, max_new_tokens=3, temperature=0))
    assert engine.compiled_layers.compiled_calls > 0 and rollout.caches
    kept = [weakref.ref(layer.keys) for cache in rollout.caches.values() for layer in cache.layers]
    assert all("update" not in vars(cache) for cache in rollout.caches.values())
    gc.collect()  # the tracing's own garbage, whose cycles refer to the caches (dynamo's, not ours)
    with collector_off():
        rollout.caches.clear()
        assert kept and all(ref() is None for ref in kept)


def test_each_layer_writes_its_own_view_of_a_filled_static_cache():
    """`layer_cache` gives a decoder layer the view of its own cache layer where that layer
    is filled, and the cache itself where no view applies; `cache_index` reads the index
    a layer writes from its attention."""
    from transformers import StaticCache

    built = widened_model("qwen2", config_overrides={"num_hidden_layers": 2})
    layers = decoder_layers(built.model, built.adapter)
    assert [compiled_layers.cache_index(layer) for layer in layers] == [0, 1]
    layers[1].self_attn.extra = torch.nn.Linear(1, 1)
    layers[1].self_attn.extra.layer_idx = 0  # two indices in one layer: none is chosen
    assert compiled_layers.cache_index(layers[1]) is None

    cache = StaticCache(config=built.model.config, max_cache_len=8)
    keys = torch.randn(2, 2, 3, 16)
    cache.layers[0].lazy_initialization(keys, keys)
    view = graphs.layer_cache(0, cache)
    assert isinstance(view, graphs.LayerCache) and view.layer is cache.layers[0]
    written, _ = view.update(keys, keys, 1)  # the index passed is not the one written
    assert written is cache.layers[0].keys and torch.equal(written[:, :, :3], keys)
    assert graphs.layer_cache(1, cache) is cache  # not filled yet
    assert graphs.layer_cache(5, cache) is cache
    cache.offloading = True
    assert graphs.layer_cache(0, cache) is cache


def test_uncached_autocast_changes_no_log_prob_or_gradient(cpu_autocast, monkeypatch):
    results = []
    for uniform in (True, False):
        torch._dynamo.reset()
        if not uniform:  # the engine's cached autocast inside the compiled calls, as before
            monkeypatch.setattr(compiled_layers, "uncached_autocast", lambda device_type: contextlib.nullcontext())
        built = widened_model("qwen2_5_vl")
        engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), compile_layers=True,
                        share_media=False, pack=False)
        seqs = _micro_batch(built, 3, 7, 6)
        logp, entropy = engine.log_probs(seqs)
        (logp * seqs.response_mask).sum().backward()
        assert engine.compiled_layers.failed is None and engine.compiled_layers.compiled_calls > 0
        grads = {name: p.grad.clone() for name, p in built.model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), entropy.detach(), grads))
    (logp, entropy, grads), (logp_before, entropy_before, grads_before) = results
    assert logp.dtype == torch.float32 and torch.equal(logp, logp_before) and torch.equal(entropy, entropy_before)
    assert grads.keys() == grads_before.keys() and all(torch.equal(grads[n], grads_before[n]) for n in grads)


def _lengths_seen(engine) -> list[int]:
    """Records the sequence length each decoder layer call of `engine` gets."""
    seen = []

    def note(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append(hidden.shape[1])

    for layer in decoder_layers(engine.built.model, engine.built.adapter):
        layer.register_forward_pre_hook(note, with_kwargs=True)
    return seen


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_padded_micro_batches_reach_the_compiled_layers_aligned(family, monkeypatch):
    """On CUDA inductor guards on SDPA's mask alignment (the length a multiple of 8 or not):
    a run's first length of the other kind compiled the layer again (the H200's step 4). The
    compiled engine widens its padded micro-batches; the eager one runs them as they are, and
    both give the same log-probs and gradients."""
    torch._dynamo.reset()
    compiled, eager = _engines(family, "padded", monkeypatch)
    seen, seen_eager = _lengths_seen(compiled), _lengths_seen(eager)
    for shape in [(2, 3, 4), (2, 7, 6), (3, 10, 5)]:
        seqs = _micro_batch(compiled.built, *shape)
        logp, entropy = compiled.log_probs(seqs)
        logp_eager, entropy_eager = eager.log_probs(seqs)
        torch.testing.assert_close(logp, logp_eager, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(entropy, entropy_eager, atol=1e-5, rtol=1e-4)
        _assert_same_gradients(compiled, eager, logp, logp_eager, seqs.response_mask)
    assert any(length % ALIGNED_LENGTH for length in seen_eager)  # the batches are not aligned themselves
    assert seen and all(length % ALIGNED_LENGTH == 0 for length in seen), seen
    assert compiled.compiled_layers.failed is None and compiled.compiled_layers.compiled_calls == len(seen)


def test_a_critic_on_widened_micro_batches_gives_the_eager_values(monkeypatch):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    values = []
    for compile_layers in (True, False):
        built = widened_model("qwen2_5_vl")
        torch.manual_seed(0)  # the value head's init
        critic = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), value_head=True,
                        compile_layers=compile_layers, share_media=False, pack=False)
        seen = _lengths_seen(critic)
        values.append(critic.values(_micro_batch(built, 2, 7, 6)))  # 69 columns
        assert seen and all(length % ALIGNED_LENGTH == 0 for length in seen) == compile_layers, seen
    torch.testing.assert_close(values[0], values[1], atol=1e-5, rtol=1e-4)


def test_left_padding_keeps_the_last_columns_and_the_media():
    rows, length, extra = 2, 13, 3
    ids = torch.arange(rows * length).view(rows, length) + 10
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, :4] = 0
    positions = torch.arange(length).expand(3, rows, length).clone()
    pixels = torch.randn(5, 6)
    grid = torch.tensor([[1, 2, 2]])
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "mm_token_type_ids": mask.clone(),
              "pixel_values": pixels, "image_grid_thw": grid}
    padded = left_padded(inputs, 8, pad_token_id=7)
    assert padded["input_ids"].shape == (rows, length + extra) and padded["position_ids"].shape == (3, rows, 16)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        assert torch.equal(padded[key][:, extra:], inputs[key])
    assert torch.equal(padded["position_ids"][..., extra:], positions)
    assert (padded["input_ids"][:, :extra] == 7).all() and not padded["attention_mask"][:, :extra].any()
    assert not padded["mm_token_type_ids"][:, :extra].any()
    assert torch.equal(padded["position_ids"][..., :extra], positions[..., :1].expand(3, rows, extra))
    assert padded["pixel_values"] is pixels and padded["image_grid_thw"] is grid
    assert left_padded(padded, 8, pad_token_id=7) is padded


def test_the_media_check_runs_the_layers_eagerly(monkeypatch):
    """The step-0 media check's no-grad log-probs compiled a no-grad graph of the layers that
    a run without other no-grad passes never used again (seconds on the H200's first step)."""
    torch._dynamo.reset()
    counters.clear()
    compiled, eager = _engines("qwen2_5_vl", "padded", monkeypatch)
    built = compiled.built
    conversations = prompt_conversations(built, count=2)
    vocab = built.model.config.get_text_config().vocab_size
    ids = torch.randint(50, vocab, (2, 3), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    logp = training_logprobs(compiled, built.processing, conversations, ids, mask)
    logp_eager = training_logprobs(eager, eager.built.processing, conversations, ids, mask)
    assert torch.equal(logp, logp_eager)
    layers = compiled.compiled_layers
    assert layers.compiled_calls == 0 and _graphs() == 0 and layers.enabled and layers.failed is None
