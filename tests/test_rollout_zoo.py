"""Every zoo family on the static-cache rollout (issue 28): greedy tokens, finish reasons and
log-probs equal plain `generate`'s over the same prompts (images of several sizes for the
VLMs), fp32. On CPU the decode loop runs eagerly (`compile=False`, what the CPU can afford);
on CUDA (`-m gpu`) it runs through `torch.compile` and CUDA graphs, the path `auto` takes
there, and must not fall back.
"""

import pytest
import torch
from test_rollout_fast import _assert_same
from widened_models import prompt_conversations, widened_engine

from mmrl.rollout import SamplingParams, make_rollout

ZOO = ["qwen2", "qwen3", "llama", "mistral", "gemma3_text", "phi3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
       "idefics3", "smolvlm", "llava_onevision", "gemma3", "internvl"]


def _compare(family: str, device: str, compile: bool):
    built, engine = widened_engine(family, device)  # Gemma's at its own spread (widened_models.SPREAD)
    conversations = prompt_conversations(built, count=3)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=compile)
    for _ in range(2 if compile else 1):  # compiled: the second call replays the captured graph
        fast = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None, rollout.fallback_reason
        assert len(set(plain.response_ids.flatten().tolist())) > 3  # not one token repeated everywhere
        _assert_same(plain, fast)


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
