"""FSDP2 across processes (gloo on CPU, under torchrun) against one process."""

import json

import pytest
import torch
from cpu_processes import REPO, run, torchrun

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow
def test_two_process_fsdp2_update_equals_one_process(tmp_path):
    """The support matrix's FSDP2 probe script, on a text and a vision-language family
    in one launch: the sharded update equals the one-process update (its bounds are in
    mmrl.probes.fsdp_step: gradients 1e-5 relative, weights 5e-4 worst / 1e-6 mean)."""
    out = tmp_path / "fsdp.jsonl"
    subjects = [{"source": family, "random_init": True} for family in ("qwen2", "qwen2_vl")]
    run(torchrun(2, "-m", "mmrl.probes.fsdp_step", str(out), json.dumps(subjects)))
    records = {r["source"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"qwen2", "qwen2_vl"}
    for family, record in records.items():
        assert record["passed"], f"{family}: {record['reason']}"
        assert record["evidence"]["gradient_tensors"] > 0
        assert record["evidence"]["max_grad_diff"] < 1e-5


def test_update_comparison_catches_a_wrong_gradient_or_step():
    from mmrl.probes.fsdp_step import compare_updates

    grads = {"w": torch.ones(4, 4)}
    weights = {"w": torch.zeros(4, 4)}
    assert compare_updates((grads, weights), (grads, weights))[0] is None
    off_grad = {"w": grads["w"] + torch.eye(4) * 1e-3}
    assert "gradients differ" in compare_updates((grads, weights), (off_grad, weights))[0]
    off_step = {"w": weights["w"] + 1e-3}
    assert "differs from one process" in compare_updates((grads, weights), (grads, off_step))[0]
    assert "different parameters" in compare_updates((grads, weights), ({}, weights))[0]
    # Where the gradient is ~eps, Adam's step is noise: only the mean bound applies there.
    tiny, still = {"w": torch.full((200, 200), 1e-9)}, {"w": torch.zeros(200, 200)}
    one_noisy = {"w": still["w"].clone()}
    one_noisy["w"][0, 0] = 1e-2
    assert compare_updates((tiny, still), (tiny, one_noisy))[0] is None
    all_noisy = {"w": still["w"] + 1e-2}
    assert "on average" in compare_updates((tiny, still), (tiny, all_noisy))[0]


@pytest.mark.slow
def test_two_process_training_run(tmp_path):
    out = tmp_path / "run"
    run(torchrun(
        2, "-m", "mmrl.cli", "train", str(REPO / "recipes" / "tiny_vlm_count.yaml"),
        "trainer.steps=2", f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_every=0",
        "data.eval=synthetic:count_shapes?n=8&seed=1", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "trainer.threads=1", "trainer.save_every=2", "model.share_media=true",
    ), timeout=600)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # two steps and the final summary
    assert (out / "checkpoints" / "step_000002" / "actor" / "model.safetensors").is_file()
    assert (out / "final" / "model.safetensors").is_file()


SHARDED_GENERATION = '''
import json, sys, torch
from mmrl.config import load_recipe
from mmrl.data import to_conversation
from mmrl.parallel import Dist, init_distributed
from mmrl.rollout import SamplingParams
from mmrl.trainer import Trainer

out, recipe_path, *overrides = sys.argv[1:]
recipe = load_recipe(recipe_path, overrides)
dist = init_distributed("cpu")
trainer = Trainer(recipe, dist=dist)
samples = list(trainer.eval_set)
# A greedy "accuracy" that depends on the sample and on what the model generates.
def parity(chunk, result, rows, dataset, where, conversations=None):
    answers = torch.tensor([int(s["answer"]) for s in chunk])
    scores = ((result.response_ids[:, 0] + answers) % 2 == 0).float()
    return scores, scores, {}  # rewards, the reward function's part of them, reward parts
trainer.score = parity
record = {}
# Ranks whose generations stop at different lengths: rank 1 runs 4 more forwards.
params = SamplingParams(n=1, max_new_tokens=2 + 4 * dist.rank, temperature=0.0)
result = trainer.rollout.generate([to_conversation(s) for s in samples[:2]], params)
record[f"length_rank{dist.rank}"] = result.response_ids.shape[1]
shapes = dist.all_gather_objects(result.response_ids.shape[1])
sharded = trainer.evaluate(samples, batch_size=3)["accuracy"]  # 7 samples: shares of 4 and 3
if dist.rank == 0:
    alone = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    single = Trainer(recipe, dist=alone)
    single.score = parity
    record.update(lengths=shapes, sharded=sharded, single=single.evaluate(samples, batch_size=3)["accuracy"])
    json.dump(record, open(out, "w"))
dist.barrier()
torch.distributed.destroy_process_group()
from mmrl.parallel.mesh import exit_cleanly  # no interpreter teardown: gloo's threads can abort it
exit_cleanly()
'''


@pytest.mark.slow
def test_sharded_generation_and_evaluation(tmp_path):
    """Under FSDP every forward is collective: ranks whose generations stop at different
    lengths must keep stepping together (synced_gpus), and evaluation splits the eval set
    over the ranks (uneven shares included) and gives the one-process figure."""
    script, out = tmp_path / "gen.py", tmp_path / "gen.json"
    script.write_text(SHARDED_GENERATION)
    run(torchrun(2, str(script), str(out), str(REPO / "recipes" / "tiny_vlm_count.yaml"),
                   "data.eval=synthetic:count_shapes?n=7&seed=1", f"trainer.output_dir={tmp_path / 'run'}",
                   "trainer.threads=1", "rollout.max_new_tokens=3"), timeout=300)
    record = json.loads(out.read_text())
    assert record["lengths"] == [2, 6]
    assert record["sharded"] == record["single"]
    assert 0.0 < record["single"] < 1.0, "the parity score should split the samples"


def test_more_processes_than_gpus_is_a_one_line_error(monkeypatch):
    from mmrl.parallel import init_distributed

    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(ValueError, match="GPU\\(s\\) are visible: start one process per GPU"):
        init_distributed("cuda")
