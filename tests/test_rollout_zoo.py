"""Every zoo family on the static-cache rollout (issue 28): greedy tokens, finish reasons and
log-probs equal plain `generate`'s over the same prompts (images of several sizes for the
VLMs), fp32. On CPU the decode loop runs eagerly (`compile=False`, what the CPU can afford);
on CUDA (`-m gpu`) it runs through `torch.compile` and CUDA graphs, the path `auto` takes
there, and must not fall back.
"""

import warnings

import pytest
import torch
from test_rollout_fast import _assert_same
from widened_models import prompt_conversations, widened_engine

from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout.graphs import GraphedStep

ZOO = ["qwen2", "qwen3", "llama", "mistral", "gemma3_text", "phi3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
       "idefics3", "smolvlm", "llava_onevision", "gemma3", "internvl"]


def _compare(family: str, device: str, compile: bool, decode: str = "compiled"):
    built, engine = widened_engine(family, device)  # Gemma's at its own spread (widened_models.SPREAD)
    conversations = prompt_conversations(built, count=3)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=compile, decode=decode)
    for _ in range(2 if compile else 1):  # compiled: the second call replays the captured graph
        fast = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None, rollout.fallback_reason
        assert len(set(plain.response_ids.flatten().tolist())) > 3  # not one token repeated everywhere
        _assert_same(plain, fast)
    return rollout


def _recordable(family: str) -> bool:
    """Whether the family's decode step takes the recorded-graph path (`mmrl.rollout.graphs`:
    full-attention layers only; sliding-window families use the compiled step)."""
    return family not in ("gemma3_text", "gemma3")


def test_the_list_is_the_zoo():
    from mmrl import registry

    assert sorted(ZOO) == sorted(adapter.family for adapter in registry.families())


@pytest.mark.parametrize("family", ZOO)
def test_every_zoo_familys_static_cache_loop_equals_plain_generate(family):
    _compare(family, "cpu", compile=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ZOO)
def test_every_zoo_family_on_cuda_takes_the_compiled_path_and_equals_plain_generate(family):
    _compare(family, "cuda", compile=True)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text", "qwen2_5_vl", "qwen3_vl", "idefics3", "llava_onevision"])
def test_the_recorded_graphs_step_equals_plain_generate(family):
    """`rollout.decode: graphs` on CPU runs the step the GPU records (masks and cache slots
    built inside the step, no host reads) eagerly; a family whose layers are not all full
    attention gives the step up for the other one, with one warning, and still equals
    plain generate."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout = _compare(family, "cpu", compile=False, decode="graphs")
    step = rollout._step
    assert isinstance(step, GraphedStep)
    if _recordable(family):
        assert step.fallback is None and not caught
    else:
        assert "layer kinds" in step.fallback_reason
        assert sum("rollout.decode=graphs" in str(w.message) for w in caught) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ZOO)
def test_every_zoo_family_on_cuda_records_the_decode_step_and_equals_plain_generate(family):
    """The CUDA graphs recorded without compiling (`rollout.decode: graphs`) give plain
    generate's tokens and log-probs, the second rollout replaying the first's graphs."""
    rollout = _compare(family, "cuda", compile=True, decode="graphs")
    step = rollout._step
    if _recordable(family):
        assert step.fallback is None, step.fallback_reason
        assert step.recordings >= 1


@pytest.mark.slow
def test_the_recorded_step_runs_the_engines_compiled_layers_as_one_graph_set():
    """Where the engine compiles its decoder layers (one GPU process; forced here on CPU),
    the recorded decode step runs through them: every layer shares one compiled graph (each
    layer writes the cache through a view of its own layer, `graphs.LayerCache`, traced in
    the graph without a break), so six layers compile no more graphs than two, and the
    tokens and log-probs are still plain generate's."""
    from torch._dynamo.utils import counters
    from widened_models import widened_model

    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed

    def decode_graphs(layers: int) -> int:
        torch._dynamo.reset()
        counters.clear()
        built = widened_model("qwen2", "cpu", config_overrides={"num_hidden_layers": layers})
        engine = Engine(built, init_distributed("cpu"), mixed_precision=False, share_media=False,
                        compile_layers=True)
        conversations = prompt_conversations(built, count=2)
        params = SamplingParams(n=2, max_new_tokens=8, temperature=0, logprobs=True)
        plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
        rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, decode="graphs")
        before = engine.compiled_layers.compiled_calls
        fast = rollout.generate(conversations, params)
        _assert_same(plain, fast)
        assert rollout._step.fallback is None and rollout._step.layers is engine.compiled_layers
        # Every decode step went through the compiled layers.
        assert engine.compiled_layers.compiled_calls - before >= 7 * layers
        return counters["stats"]["unique_graphs"]

    assert decode_graphs(6) == decode_graphs(2) == 1
    assert not counters["graph_break"]
