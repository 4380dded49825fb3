"""The chunked head's fused arithmetic compiled ahead in a thread, as the trainer does while the
model builds on a GPU (`mmrl.engine.logprobs.precompile_head` in a
`mmrl.compile_watch.BackgroundCompile`; issue 28): the engine's log-probs and update afterwards
find its graphs and compile nothing more, and those compiles are counted apart from the run's.
On the CPU through conftest's `fused_graphs` (the fused functions compiled here too, by a
backend that counts graphs); the GPU twin is in tests/test_gpu.py."""

import pytest
import torch

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.compile_watch import BackgroundCompile, watch
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.engine.logprobs import candidates, head_dtype, precompile_head
from mmrl.parallel import init_distributed

TEMPERATURE = 0.7


def _seqs(built, engine, repeat=1):
    rows = sample_conversations(built.adapter) * repeat + sample_conversations(built.adapter)[:1]
    prompts = dict(built.processing(rows))
    vocab = built.model.config.get_text_config().vocab_size
    responses = torch.randint(vocab // 2, vocab, (len(rows), 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(responses)
    mask[0, 4:] = 0
    return join(prompts, responses, mask, built.adapter, engine.model, built.tokenizer.pad_token_id)


@pytest.mark.parametrize("family, overrides, entropy_in_loss", [
    ("qwen2", None, False),
    ("qwen2", None, True),
    # Two candidate post-processings (the cap, none): the first call runs both.
    ("gemma3_text", {"final_logit_softcapping": 0.05}, False),
])
def test_the_engine_finds_the_graphs_compiled_ahead_in_a_thread(fused_graphs, family, overrides, entropy_in_loss):
    built = build_model(family, random_init=True, seed=0, config_overrides=overrides)
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3))
    config, device = built.model.config, torch.device("cpu")
    vocab = config.get_text_config().vocab_size
    compile_watch = watch()
    before = compile_watch.graphs, compile_watch.background_graphs

    ahead = BackgroundCompile(lambda: precompile_head(vocab, head_dtype(torch.float32, device), device,
                                                      candidates(config), TEMPERATURE, entropy_in_loss),
                              "the head", compile_watch)
    ahead.wait()
    assert ahead.error is None
    assert ahead.result == 2 * len(candidates(config)) == len(fused_graphs)
    # Counted as the background's compiles, not the run's.
    assert (compile_watch.graphs, compile_watch.background_graphs) == (before[0], before[1] + ahead.result)
    assert 0.0 < ahead.compiled <= ahead.ran  # the wait's line: the thread's compiling within its run
    compiled_ahead = len(fused_graphs)

    seqs = _seqs(built, engine)
    logp, entropy = engine.log_probs(seqs, temperature=TEMPERATURE)
    loss = (logp * seqs.response_mask).sum() + (0.3 * entropy.sum() if entropy_in_loss else 0.0)
    loss.backward()
    assert engine.logit_transform is not None  # the first call's check ran through the fused stats
    assert any(p.grad is not None for p in engine.model.parameters())
    assert len(fused_graphs) == compiled_ahead, [graph.code for graph in fused_graphs[compiled_ahead:]]


def test_a_different_temperature_compiles_again(fused_graphs):
    """The graphs are specific to what the run calls them with: precompiled for another
    temperature, the engine's call compiles its own (so the trainer passes the recipe's)."""
    built = build_model("qwen2", random_init=True, seed=0)
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3))
    config, device = built.model.config, torch.device("cpu")
    precompile_head(config.vocab_size, torch.float32, device, candidates(config), 1.0)
    compiled_ahead = len(fused_graphs)
    engine.log_probs(_seqs(built, engine), temperature=TEMPERATURE)
    assert len(fused_graphs) > compiled_ahead


def test_nothing_compiles_ahead_where_the_calls_run_eagerly():
    device = torch.device("cpu")  # the fused functions compile on CUDA only
    assert precompile_head(64, torch.float32, device, [candidates(object())[-1]], 1.0) == 0


def test_head_dtype_follows_the_engines_mixed_precision():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert head_dtype(torch.float32, cuda) == torch.bfloat16  # autocast / FSDP2's policy
    assert head_dtype(torch.float32, cuda, mixed_precision=False) == torch.float32
    assert head_dtype(torch.bfloat16, cuda) == torch.bfloat16
    assert head_dtype(torch.float32, cpu) == torch.float32


def test_a_failed_background_compile_is_one_line_and_its_wait_counts_as_compile_time(capsys):
    compile_watch = watch()
    seconds = compile_watch.seconds

    def work():
        raise RuntimeError("inductor\nfailed")

    ahead = BackgroundCompile(work, "the head", compile_watch)
    waited = ahead.wait()
    assert ahead.error.startswith("RuntimeError: inductor")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiling the head ahead failed" in err
    assert compile_watch.seconds == pytest.approx(seconds + waited)
    assert ahead.wait() == 0.0  # joined once


def test_the_wait_line_gives_the_threads_timeline(capsys):
    """The line of a wait says how long the thread ran, how much of it compiled and how long
    the caller's own work beside it took: what tells a slow thread from a short build."""
    import threading

    compile_watch = watch()
    announce, compile_watch.announce = compile_watch.announce, True
    go = threading.Event()
    ahead = BackgroundCompile(lambda: go.wait(5), "the stand-in", compile_watch)
    try:
        # Well over the line's 0.1 s threshold, so a stalled caller still waits long enough.
        threading.Timer(1.0, go.set).start()
        waited = ahead.wait()
    finally:
        compile_watch.announce = announce
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("waited")][-1]
    # The thread ends after the event, set 1.0 s after it began, and before the join returns
    # (its run may be shorter than the wait by the join's own latency on a busy machine).
    assert waited >= 0.1 and 1.0 <= ahead.ran <= ahead.overlapped + waited and ahead.compiled == 0.0
    assert 0.0 <= ahead.overlapped < ahead.ran
    assert line == (f"waited {waited:.1f} s for the stand-in (its thread ran {ahead.ran:.1f} s, 0.0 s of it compiling, "
                    f"beside {ahead.overlapped:.1f} s of the caller's work)")


def _recipe(tmp_path, *overrides):
    from pathlib import Path

    from mmrl.config import load_recipe

    return load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml", [
        f"trainer.output_dir={tmp_path / 'run'}", "model.compile_layers=true", *overrides])


@pytest.fixture
def layer_graphs(monkeypatch):
    """Dynamo's count of distinct graphs, the layers compiled with `aot_eager` on the CPU."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    yield lambda: counters["stats"]["unique_graphs"]
    torch._dynamo.reset()


def test_the_update_compiled_ahead_on_an_empty_one_layer_model_serves_the_run(tmp_path, layer_graphs):
    """`CompileAhead` in a thread compiles the layer's forward and backward on a one-layer model
    of the recipe's config built empty (no random draw); the run's own engine, built after it
    with its real weights and layers, then compiles no graph in its first update and gives the
    log-probs and gradients of the eager engine on the same weights (nothing of the zero model
    is kept in the graph)."""
    from test_compiled_layers_shapes import _assert_same_gradients

    from mmrl.build import build_recipe_model, recipe_config
    from mmrl.compile_ahead import CompileAhead
    from mmrl.data import load_prompts
    from mmrl.settle import resolve

    recipe = _recipe(tmp_path, "algo.micro_batch_size=12", "rollout.max_new_tokens=3")
    dist = init_distributed("cpu")
    settled = resolve(recipe, dist)
    processor, config = recipe_config(recipe.model)
    random_state = torch.get_rng_state()
    dataset = load_prompts(recipe.data.train)
    ahead = BackgroundCompile(CompileAhead(recipe, settled, config, processor, dist, dataset=dataset), "the update",
                              watch())
    ahead.wait()
    assert ahead.error is None and ahead.result["layers"] > 0, (ahead.error, ahead.result)
    assert torch.equal(torch.get_rng_state(), random_state)
    compiled_ahead = layer_graphs()
    assert compiled_ahead > 0

    engines = []
    for compile_layers in (True, False):
        built = build_recipe_model(recipe.model, seed=0, device="cpu", processor=processor)
        engines.append(Engine(built, dist, optim=recipe.optim, compile_layers=compile_layers,
                              **{k: v for k, v in settled.engine_options().items() if k != "compile_layers"}))
    compiled, eager = engines
    assert len(compiled.compiled_layers.layers) > 1  # the run's layers, not the one-layer model's
    seqs = _seqs(compiled.built, compiled, repeat=2)  # 5 rows, where the stand-in had 2
    logp, _ = compiled.log_probs(seqs, 0.7)
    logp_eager, _ = eager.log_probs(seqs, 0.7)
    torch.testing.assert_close(logp, logp_eager, atol=1e-5, rtol=1e-4)
    _assert_same_gradients(compiled, eager, logp, logp_eager, seqs.response_mask)
    assert compiled.compiled_layers.compiled_calls > 0
    assert layer_graphs() == compiled_ahead  # the run's first update compiled nothing


@pytest.mark.parametrize("override", ["model.lora_scope=language", "model.compile_layers=false"])
def test_nothing_is_compiled_ahead_where_a_one_layer_model_cannot_match_the_run(tmp_path, override):
    from mmrl.build import recipe_config
    from mmrl.compile_ahead import CompileAhead
    from mmrl.settle import resolve

    recipe = _recipe(tmp_path, override)
    dist = init_distributed("cpu")
    processor, config = recipe_config(recipe.model)
    work = CompileAhead(recipe, resolve(recipe, dist), config, processor, dist)
    assert not work.layers_match() and work.prompts is None
    assert work() == {"head": 0, "layers": 0}  # and on the CPU the head's arithmetic runs eagerly


def test_the_stand_in_micro_batch_is_the_runs_first_one(tmp_path):
    """The stand-in's prompts are the run's first prompts in the run's order, each repeated
    `samples_per_prompt` times, up to `algo.micro_batch_size` rows: it packs as the run's
    first micro-batch does (one row or several)."""
    from mmrl.build import recipe_config
    from mmrl.compile_ahead import CompileAhead
    from mmrl.data import load_prompts
    from mmrl.data.schema import to_conversation
    from mmrl.settle import resolve

    recipe = _recipe(tmp_path, "algo.micro_batch_size=20")
    dist = init_distributed("cpu")
    processor, config = recipe_config(recipe.model)
    dataset = load_prompts(recipe.data.train)
    work = CompileAhead(recipe, resolve(recipe, dist), config, processor, dist, dataset=dataset)
    conversations = work.stand_in_conversations(dataset)
    first = next(dataset.batches(recipe.data.prompts_per_step, seed=recipe.data.shuffle_seed)).samples
    samples = recipe.rollout.samples_per_prompt
    assert len(conversations) == 20 and work.prompts["input_ids"].shape[0] == 20
    for index, conversation in enumerate(conversations):
        expected = to_conversation(first[index // samples], max_pixels=recipe.model.max_pixels)
        assert conversation[-1]["content"][-1] == expected[-1]["content"][-1]
    assert work.stand_in_conversations(None) == sample_conversations(work.adapter)
