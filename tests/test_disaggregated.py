"""Disaggregated ranks (`parallel.rollout_ranks`, mmrl/buffer/disaggregated.py): the
recipe's and the launch's one-line errors, the weights checksum, and a 2-process CPU run
(gloo) with one train rank and one rollout rank."""

import json

import pytest
import torch
from cpu_processes import REPO, run, torchrun

from mmrl.buffer.disaggregated import Layout, checksum, layout_problem
from mmrl.config import RecipeError, load_recipe

RECIPE = REPO / "recipes" / "tiny_vlm_count.yaml"


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.rollout_ranks=1"],
     "parallel: rollout_ranks 1 needs algo.max_staleness >= 1 (the rollout ranks sample ahead of the update), got 0"),
    (["parallel.rollout_ranks=1", "algo.max_staleness=1", "parallel.sequence_parallel=2"],
     "parallel: rollout_ranks 1 and sequence_parallel 2 cannot be combined yet"),
    (["parallel.rollout_ranks=-1", "algo.max_staleness=1"], "parallel.rollout_ranks: Input should be greater than"),
])
def test_recipe_refuses_rollout_ranks_it_cannot_run(overrides, message):
    with pytest.raises(RecipeError) as caught:
        load_recipe(RECIPE, overrides)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_recipe_takes_rollout_ranks_with_staleness():
    recipe = load_recipe(RECIPE, ["parallel.rollout_ranks=2", "algo.max_staleness=1"])
    assert recipe.parallel.rollout_ranks == 2
    assert load_recipe(RECIPE).parallel.rollout_ranks == 0  # today's behaviour by default


def test_launch_needs_more_processes_than_rollout_ranks():
    assert layout_problem(1, 1) == ("parallel.rollout_ranks: 1 leaves no train rank among the 1 process(es) "
                                    "(torchrun --nproc_per_node): start more than 1")
    assert "2 rollout ranks for 1 train rank(s)" in layout_problem(3, 2)
    assert layout_problem(2, 1) is None and layout_problem(5, 2) is None


def test_layout_splits_the_train_ranks_between_the_rollout_ranks():
    layout = Layout(world_size=5, rollout_ranks=2)
    assert layout.train_ranks == 3
    assert [layout.is_rollout(rank) for rank in range(5)] == [False, False, False, True, True]
    assert layout.served_by(3) == [0, 2] and layout.served_by(4) == [1]


def test_checksum_is_exact_and_order_free_within_a_tensor():
    weights = [torch.randn(7, 5), torch.randn(3).to(torch.bfloat16), torch.arange(4)]
    assert checksum(weights) == checksum([w.clone() for w in weights])
    assert checksum(weights) == checksum([weights[0].t().contiguous().t(), *weights[1:]])  # a layout, same values
    nudged = weights[0].clone()
    nudged[2, 3] = torch.nextafter(nudged[2, 3], torch.tensor(float("inf")))
    assert checksum([nudged, *weights[1:]]) != checksum(weights)  # one bit of one weight
    assert checksum(weights[::-1]) != checksum(weights)  # tensors in another order


@pytest.mark.multiprocess
def test_one_rollout_rank_and_one_train_rank_and_a_resumed_run_trains_each_batch_once(tmp_path):
    """The rollout rank samples every batch, the train rank trains on each within the
    staleness bound, and each weights version the rollout rank loads has the bits the
    train rank sent. Resumed from its checkpoint at step 2 (batch 3 already written ahead
    by the rollout rank, not yet received): the resumed run sends the checkpoint's
    weights, samples batch 3 again from the checkpoint's data position, and trains every
    batch once. (One run for both: each launch of 2 processes costs ~17 s, mostly
    starting them; the first run's checks hold for any staleness bound, here 2, which
    the resume needs to show batch 3 sampled again by newer weights.)"""
    out, steps, staleness_bound = tmp_path / "run", 3, 2
    common = [str(RECIPE), f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_every=0",
              "data.eval=synthetic:count_shapes?n=4&seed=1", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
              "trainer.threads=1", "trainer.export=false", "trainer.save_every=2", "trainer.summary=false",
              "parallel.rollout_ranks=1", f"algo.max_staleness={staleness_bound}"]
    run(torchrun(2, "-m", "mmrl.cli", "train", *common, f"trainer.steps={steps}"), timeout=600)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if not r.get("final")]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert records[-1]["final"] and "eval/accuracy" in records[-1]
    for record in trained:
        staleness = record["step"] - 1 - record["buffer/version"]
        assert 0 <= staleness <= staleness_bound and record["off_policy/staleness_max"] == staleness
        assert record["buffer/dropped"] == 0 and "loss/policy" in record
    versions = [r["buffer/version"] for r in trained]
    assert versions[0] == 0 and versions == sorted(versions)  # the rollout rank loads each version in turn
    sent = [json.loads(line) for line in (out / "buffer" / "weights_sent.jsonl").read_text().splitlines()]
    loaded = [json.loads(line) for line in (out / "buffer" / "weights_rank1.jsonl").read_text().splitlines()]
    assert [r["version"] for r in sent] == list(range(steps + 1))  # the start and after every update
    assert loaded == sent
    assert len({r["checksum"] for r in sent}) == steps + 1  # every update changed the weights
    state = json.loads((out / "buffer" / "state.json").read_text())
    assert state["produced"] == state["taken"] == steps
    assert sorted(p.name for p in (out / "buffer").glob("batch_*.parquet")) == [
        f"batch_{n:06d}.parquet" for n in range(1, steps + 1)]

    run(torchrun(2, "-m", "mmrl.cli", "train", *common, "trainer.steps=4", "trainer.resume=true"), timeout=600)
    state = json.loads((out / "buffer" / "state.json").read_text())
    assert [entry["batch"] for entry in state["log"]] == [1, 2, 3, 4]
    versions = [entry["version"] for entry in state["log"]]
    assert versions[:3] == [0, 0, 2] and versions[3] in (2, 3)  # batch 3 sampled again by step 2's weights
    sent = [json.loads(line) for line in (out / "buffer" / "weights_sent.jsonl").read_text().splitlines()]
    loaded = [json.loads(line) for line in (out / "buffer" / "weights_rank1.jsonl").read_text().splitlines()]
    assert loaded == sent and [r["version"] for r in sent] == [0, 1, 2, 3, 2, 3, 4]
    assert sent[4] == sent[2]  # the checkpoint's weights are step 2's, bit for bit
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4]  # metrics cut back to the checkpoint, then steps 3 and 4 and the summary


def test_train_ranks_refuse_plain_generate_under_fsdp_with_evaluation():
    from types import SimpleNamespace

    from mmrl.buffer.disaggregated import refuse_synchronized_generate
    from mmrl.parallel import Dist

    def trainer(world_size, backend, eval_set=object()):
        dist = Dist(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), mesh=None)
        return SimpleNamespace(dist=dist, validation_set=None, eval_set=eval_set,
                               settled=SimpleNamespace(rollout_backend=backend))

    with pytest.raises(RecipeError, match="^parallel.rollout_ranks: the 2 train ranks validate with plain generate"):
        refuse_synchronized_generate(trainer(2, "hf"))
    for fine in (trainer(1, "hf"), trainer(2, "hf_compiled"), trainer(2, "hf", eval_set=None)):
        refuse_synchronized_generate(fine)


@pytest.mark.multiprocess
def test_two_train_ranks_shard_over_their_own_group(tmp_path):
    """Three processes: FSDP2 over train ranks 0 and 1 alone (a mesh over all three would
    wait for the rollout rank forever), the weights gathered from both shards reach rollout
    rank 2 bit for bit, and each train rank gets its own share of every batch."""
    out, steps = tmp_path / "run", 2
    run(torchrun(
        3, "-m", "mmrl.cli", "train", str(RECIPE), f"trainer.steps={steps}", f"trainer.output_dir={out}",
        "trainer.progress=false", "trainer.eval_every=0", "data.eval=synthetic:count_shapes?n=4&seed=1",
        "data.prompts_per_step=4", "rollout.samples_per_prompt=2", "trainer.threads=1", "trainer.export=false",
        f"trainer.save_every={steps}", "trainer.summary=false", "rollout.backend=hf_compiled",
        "parallel.rollout_ranks=1", "algo.max_staleness=1",
    ), timeout=600)
    checkpoint = out / "checkpoints" / f"step_{steps:06d}"
    assert sorted(p.name for p in checkpoint.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert sorted(p.name for p in (out / "buffer").glob("batch_*.parquet")) == [
        f"batch_{n:06d}-rank{rank}.parquet" for n in range(1, steps + 1) for rank in (0, 1)]
    sent = [json.loads(line) for line in (out / "buffer" / "weights_sent.jsonl").read_text().splitlines()]
    loaded = [json.loads(line) for line in (out / "buffer" / "weights_rank2.jsonl").read_text().splitlines()]
    assert loaded == sent and [r["version"] for r in sent] == list(range(steps + 1))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 2]
    assert all(0 <= r["step"] - 1 - r["buffer/version"] <= 1 for r in records[:-1])
