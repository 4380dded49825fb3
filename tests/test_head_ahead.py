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


def _seqs(built, engine):
    rows = sample_conversations(built.adapter)
    prompts = dict(built.processing(rows))
    vocab = built.model.config.get_text_config().vocab_size
    responses = torch.randint(50, vocab, (len(rows), 6), generator=torch.Generator().manual_seed(1))
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
