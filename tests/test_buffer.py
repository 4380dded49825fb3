"""The trajectory buffer (mmrl/buffer): staleness 0 is the synchronous loop bit for bit,
one-step-off trains each batch one update after it was sampled with its tokens weighted
against the recorded behaviour log-probs, too-stale batches are dropped and counted, the
batch files round-trip, and a run killed with SIGKILL and resumed trains on every batch
once, on the same data as a run never stopped."""

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mmrl.buffer import BufferedSteps, RolloutBatch, TrajectoryBuffer
from mmrl.buffer.disaggregated import RunnableTrainer
from mmrl.buffer.store import read_batch, rebuild_batch, write_batch
from mmrl.config import RecipeError, load_recipe
from mmrl.rollout.base import RolloutResult
from mmrl.trainer import Trainer
from stopped_runs import interrupted_before
from test_trainer import TEXT

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# Rewards of every length, so every step updates the weights.
RUN = [*TEXT, "data.eval=null", "trainer.export=false", "reward.name=test_buffer:length_reward"]
_CALLS = [0]


def length_reward(completions, answers, **fields):
    """A dense reward; with MMRL_TEST_KILL_AT=K set, the process SIGKILLs itself at the Kth
    call (a rollout being scored: the batch it scores is never written)."""
    _CALLS[0] += 1
    if _CALLS[0] == int(os.environ.get("MMRL_TEST_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [len(c) / 3 for c in completions]


def _recipe(run, *extra):
    return load_recipe(None, [*RUN, f"trainer.output_dir={run}", *extra])


def _rows(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in ("tokens_per_s", "train_seconds")}
            for r in rows]


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}


def _trained_data(run):
    """The dataset indices each step trained on, from the batch files and state.json."""
    folder = Path(run) / "buffer"
    log = json.loads((folder / "state.json").read_text())["log"]
    by_batch = {}
    for path in folder.glob("batch_*.parquet"):
        table, metadata = read_batch(path)
        by_batch[metadata["batch"]] = table.column("index").to_pylist()
    return [(entry["step"], entry["batch"], entry["version"], by_batch[entry["batch"]]) for entry in log]


def _named(protocol) -> set[str]:
    """The members a `Protocol` (and the protocols it extends) names."""
    return {name for klass in protocol.__mro__ if getattr(klass, "_is_protocol", False)
            for name in [*vars(klass).get("__annotations__", {}), *vars(klass)]
            if not name.startswith("_")}


def _trainer_members_reached() -> set[str]:
    """`X` of each `trainer.X`, `self.trainer.X` and `self._trainer.X` in mmrl/buffer."""
    reached = set()
    for path in (REPO / "mmrl" / "buffer").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "trainer") or (
                    isinstance(owner, ast.Attribute) and owner.attr in ("trainer", "_trainer")
                    and isinstance(owner.value, ast.Name) and owner.value.id == "self"):
                reached.add(node.attr)
    return reached


def test_the_schedules_reach_only_what_trainer_view_names_and_a_trainer_has_it(tmp_path):
    """The buffer types the trainer as `TrainerView` (no import of mmrl.trainer, which imports
    the buffer): it names exactly the trainer members the schedules use, and a built
    `Trainer` has every one."""
    named, reached = _named(RunnableTrainer), _trainer_members_reached()
    assert {"roll_out_batch", "next_prompts", "score", "timed", "trajectories", "fit"} <= named
    assert reached == named, f"used, not named: {reached - named}; named, not used: {named - reached}"
    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=1"))
    assert [name for name in sorted(named) if not hasattr(trainer, name)] == []


# -- the loop --------------------------------------------------------------------------------------
def test_staleness_zero_is_the_loop_without_the_buffer_bit_for_bit(tmp_path):
    """max_staleness 0 through the buffer (put, persist, take) against the rollout handed
    straight to the update, as the loop ran before the buffer."""
    buffered = Trainer(_recipe(tmp_path / "buffered", "trainer.steps=3"))
    buffered.fit()
    direct = Trainer(_recipe(tmp_path / "direct", "trainer.steps=3"))
    direct.trajectories.next = lambda done: (direct.roll_out_batch(), {})
    direct.fit()
    assert _untimed(_rows(tmp_path / "buffered")) == _untimed(_rows(tmp_path / "direct"))
    assert not any(k.startswith(("off_policy/", "buffer/")) for k in _rows(tmp_path / "buffered")[0])
    expected = _weights(direct)
    assert all(torch.equal(v, expected[k]) for k, v in _weights(buffered).items())
    assert [(step, batch, version) for step, batch, version, _ in _trained_data(tmp_path / "buffered")] == \
        [(1, 1, 0), (2, 2, 1), (3, 3, 2)]
    assert not (tmp_path / "direct" / "buffer").exists()


def test_one_step_off_trains_each_batch_one_update_after_it_was_sampled(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(_recipe(run, "trainer.steps=4", "algo.max_staleness=1"))
    trainer.fit()
    rows = [r for r in _rows(run) if not r.get("final")]
    assert [r["off_policy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["buffer/dropped"] for r in rows] == [0.0] * 4
    # Two batches sampled by the first weights; none for a step past the last.
    assert [(step, batch, version) for step, batch, version, _ in _trained_data(run)] == \
        [(1, 1, 0), (2, 2, 0), (3, 3, 1), (4, 4, 2)]
    files = sorted(p.name for p in (run / "buffer").glob("*.parquet"))
    assert files == [f"batch_00000{i}.parquet" for i in range(1, 5)]
    # The first step trains on the weights that sampled it: no correction; the later
    # ones weigh their tokens, and the weights moved in between.
    assert "off_policy/ratio_mean" not in rows[0]
    for row in rows[1:]:
        assert 0.0 <= row["off_policy/capped_fraction"] <= 1.0
        assert row["off_policy/ratio_min"] <= row["off_policy/ratio_mean"] <= row["off_policy/ratio_max"]
    assert any(row["off_policy/ratio_max"] != 1.0 for row in rows[1:])
    table, _ = read_batch(run / "buffer" / "batch_000002.parquet")
    behaviour, mask = table.column("behaviour_logp").to_pylist(), table.column("response_mask").to_pylist()
    assert all(len(b) == len(m) and all(x <= 0 for x in b) for b, m in zip(behaviour, mask))


def test_behaviour_log_probs_match_the_weights_that_sampled_them(tmp_path):
    """With lr 1e-30 the weights do not move: every stale token's ratio pi_old / b is 1 (up to
    the forward's own rounding), so the recorded log-probs belong to these tokens."""
    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=3", "algo.max_staleness=1", "optim.lr=1e-30"))
    trainer.fit()
    for row in _rows(tmp_path / "run")[1:3]:
        assert abs(row["off_policy/ratio_max"] - 1) < 1e-5 and abs(row["off_policy/ratio_min"] - 1) < 1e-5


@pytest.mark.parametrize("algo", [
    ["algo.advantage=gae", "algo.off_policy=mask"],
    ["algo.advantage=reinforce_pp", "algo.kl_coef=0.1", "algo.kl_in=reward", "algo.kl_estimator=k1",
     "algo.mini_batches=2", "algo.epochs_per_rollout=2", "algo.off_policy=none"],
])
def test_one_step_off_runs_with_other_algorithms(tmp_path, algo):
    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=2", "algo.max_staleness=1", *algo))
    trainer.fit()
    second = _rows(tmp_path / "run")[1]
    assert second["off_policy/staleness_max"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in second.values() if isinstance(v, float))
    if "algo.off_policy=none" in algo:
        assert second["off_policy/capped_fraction"] == 0.0


# -- the store -------------------------------------------------------------------------------------
def _batch(version, size=4, prompts=2, behaviour=True):
    ids = torch.arange(size * 3).reshape(size, 3) + 5
    mask = torch.tensor([[1.0, 1.0, 1.0]] + [[1.0, 1.0, 0.0]] * (size - 1))
    result = RolloutResult(response_ids=ids.masked_fill(mask == 0, 0), response_mask=mask,
                           finish_reasons=["length"] + ["stop"] * (size - 1),
                           prompt_index=torch.arange(prompts).repeat_interleave(size // prompts))
    samples = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "images": [f"img/{i}.png"]}
               for i in range(prompts)]
    return RolloutBatch(samples=samples, rows=[10 + i for i in range(prompts)], indices=list(range(prompts)),
                        conversations=None, result=result, rewards=torch.linspace(0, 1, size),
                        reward_parts={"format": [0.5] * size}, outcomes=torch.linspace(0, 0.5, size),
                        version=version, data_end=(0, 2 * prompts),
                        behaviour_logp=-torch.rand(size, 3) * mask if behaviour else None)


def test_a_batch_file_reads_back_as_the_batch(tmp_path):
    batch = _batch(version=3)
    batch.batch_id = 7
    write_batch(tmp_path / "batch_000007.parquet", batch)
    table, metadata = read_batch(tmp_path / "batch_000007.parquet")
    assert metadata["batch"] == 7 and metadata["version"] == 3 and metadata["data_end"] == [0, 4]
    assert table.column("media").to_pylist() == [["img/0.png"]] * 2 + [["img/1.png"]] * 2
    dataset = [{"prompt": "x", "answer": str(i)} for i in range(2)]
    back = rebuild_batch(table, metadata, dataset=dataset, pad_id=0, conversations=None)
    assert torch.equal(back.result.response_ids, batch.result.response_ids)
    assert torch.equal(back.result.response_mask, batch.result.response_mask)
    assert torch.equal(back.result.prompt_index, batch.result.prompt_index)
    assert torch.equal(back.behaviour_logp, batch.behaviour_logp)
    assert torch.equal(back.rewards, batch.rewards) and torch.equal(back.outcomes, batch.outcomes)
    assert back.reward_parts == {"format": [0.5] * 4} and back.rows == [10, 11] and back.samples == dataset
    assert back.result.finish_reasons == batch.result.finish_reasons and back.version == 3


def test_batches_older_than_max_staleness_are_dropped_and_counted(tmp_path):
    store = TrajectoryBuffer(tmp_path / "buffer")
    for version in (0, 0, 2):
        store.put(_batch(version))
    taken, dropped = store.take(version=2, max_staleness=1)
    assert taken.version == 2 and dropped == 8
    assert [e["dropped"] for e in store.log] == [True, True, False]
    assert store.state() == {"produced": 3, "taken": 3}
    # Through the schedule: a step whose batches all went stale gets a fresh one, and says so.
    made = iter([_batch(0), _batch(0), _batch(5)])
    steps = BufferedSteps(TrajectoryBuffer(None), max_staleness=1, total_steps=lambda: 100,
                          produce=lambda: next(made))
    steps.next(done=0)
    batch, metrics = steps.next(done=5)
    assert batch.version == 5 and metrics["buffer/dropped"] == 4.0 and metrics["off_policy/staleness_max"] == 0.0


def test_a_missing_waiting_batch_file_stops_the_resume_in_one_line(tmp_path):
    store = TrajectoryBuffer(tmp_path / "buffer")
    store.put(_batch(0))
    store.put(_batch(0))
    (tmp_path / "buffer" / "batch_000002.parquet").unlink()
    with pytest.raises(ValueError) as err:
        TrajectoryBuffer(tmp_path / "buffer").restore({"produced": 2, "taken": 1}, lambda table, meta: None)
    assert "batch_000002.parquet is missing" in str(err.value) and "\n" not in str(err.value)


# -- kill and resume --------------------------------------------------------------------------------
_TRAIN = ("import sys; from mmrl.config import load_recipe; from mmrl.trainer import train; "
          "train(load_recipe(None, sys.argv[1:]))")


@pytest.mark.slow  # a training process started and killed, then two 6-step runs: out of the quick tier
def test_sigkill_then_resume_trains_every_batch_once_on_the_uninterrupted_runs_data(tmp_path):
    """One-step-off, a checkpoint every 2 steps, SIGKILL while step 4 scores its lookahead
    batch 5: batch 3 waited at the checkpoint and was trained at step 3 (that update is
    lost), batch 4 was sampled after it. The resumed run reads batch 3 back, samples batch
    4 again and trains each batch once: the same data, step by step, and the same
    weights as a run never stopped."""
    run = tmp_path / "run"
    common = ["algo.max_staleness=1", "trainer.save_every=2"]
    env = {**os.environ, "MMRL_TEST_KILL_AT": "5", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), *(p for p in sys.path if p)])}
    killed = subprocess.run([sys.executable, "-c", _TRAIN, *RUN, f"trainer.output_dir={run}", "trainer.steps=6",
                             *common], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert [b for _, b, _, _ in _trained_data(run)] == [1, 2, 3]  # batch 3 trained, then the kill
    assert (run / "buffer" / "batch_000004.parquet").is_file()
    resumed = Trainer(_recipe(run, "trainer.steps=6", "trainer.resume=true", *common))
    resumed.fit()
    reference = Trainer(_recipe(tmp_path / "reference", "trainer.steps=6", *common))
    reference.fit()
    trained = _trained_data(run)
    assert [(step, batch) for step, batch, _, _ in trained] == [(i, i) for i in range(1, 7)]
    assert trained == _trained_data(tmp_path / "reference")
    expected = _weights(reference)
    assert all(torch.equal(v, expected[k]) for k, v in _weights(resumed).items())
    assert _untimed(_rows(run)) == _untimed(_rows(tmp_path / "reference"))


def test_a_vision_run_resumed_with_a_waiting_batch_ends_as_one_never_stopped(tmp_path):
    """The waiting batch is read back (images by dataset row) and trains as the one in
    memory did: the same weights, bit for bit."""
    vlm = ["trainer.eval_every=0", "data.eval=null", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
           "trainer.progress=false", "trainer.export=false", "algo.max_staleness=1", "trainer.steps=4",
           "trainer.save_every=2"]

    def trainer(run, *extra):
        return Trainer(load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [*vlm, f"trainer.output_dir={run}",
                                                                             *extra]))

    straight = trainer(tmp_path / "straight")
    straight.fit()
    interrupted_before(trainer(tmp_path / "run"), 3)
    assert [b for _, b, _, _ in _trained_data(tmp_path / "run")] == [1, 2]  # batch 3 waits in its file
    resumed = trainer(tmp_path / "run", "trainer.resume=true")
    resumed.fit()
    expected = _weights(straight)
    assert all(torch.equal(v, expected[k]) for k, v in _weights(resumed).items())


# -- the recipe and the command line ------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [("-1", "greater than or equal to 0"), ("1.5", "fractional part"),
                                          ("true", "got a boolean")])
def test_max_staleness_must_be_a_whole_number_of_updates(tmp_path, value, words):
    with pytest.raises(RecipeError) as err:
        _recipe(tmp_path, f"algo.max_staleness={value}")
    assert str(err.value).startswith("algo.max_staleness: ") and words in str(err.value)
    assert "\n" not in str(err.value)


def test_stale_multi_turn_rollouts_are_refused_in_one_line(tmp_path):
    with pytest.raises(RecipeError, match=r"^algo: max_staleness 1 .*multi-turn rollout \(rollout\.env\)"):
        _recipe(tmp_path, "algo.max_staleness=1", "rollout.env=single_turn")


def test_buffer_show_prints_trajectories_by_version(tmp_path):
    from mmrl.buffer.show import summarize
    from mmrl.cli import app

    store = TrajectoryBuffer(tmp_path / "run" / "buffer")
    for version in (0, 0, 1):
        store.put(_batch(version))
    store.take(version=1, max_staleness=1)
    result = CliRunner().invoke(app, ["buffer", "show", str(tmp_path / "run")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    # The console may be narrower than COLUMNS (a console made earlier in the process): the
    # line may wrap, its words may not change.
    assert "3 batch files, 12 trajectories; trained 4, waiting 8, dropped as too stale 0" in " ".join(
        result.output.split())
    lines = [line for line in result.output.splitlines() if line.startswith("│")]
    assert [line.split("│")[1].strip() for line in lines] == ["0", "1"]
    assert "1.00/1" in lines[0]  # batch 1, sampled by version 0, trained at step 2
    # A long run's versions are shown in ranges.
    grouped = summarize(tmp_path / "run", rows=1)["versions"]
    assert [(g["version"], g["trajectories"], g["trained"]) for g in grouped] == [("0-1", 12, 4)]
    # A narrow or piped console wraps values within their cells, never cuts them short.
    narrow = CliRunner().invoke(app, ["buffer", "show", str(tmp_path / "run")], env={"COLUMNS": "50"})
    assert narrow.exit_code == 0 and "…" not in narrow.output
    missing = CliRunner().invoke(app, ["buffer", "show", str(tmp_path)])
    assert missing.exit_code == 2 and "has no buffer/" in missing.output


@pytest.mark.multiprocess
def test_two_process_one_step_off_run_writes_each_ranks_share(tmp_path):
    from cpu_processes import run as run_processes
    from cpu_processes import torchrun

    out = tmp_path / "run"
    run_processes(torchrun(
        2, "-m", "mmrl.cli", "train", str(REPO / "recipes" / "tiny_vlm_count.yaml"),
        "trainer.steps=3", f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_every=0",
        "data.eval=null", "data.prompts_per_step=4", "rollout.samples_per_prompt=2", "trainer.threads=1",
        "trainer.export=false", "algo.max_staleness=1",
    ), timeout=600)
    rows = [r for r in _rows(out) if not r.get("final")]
    assert [r["off_policy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    files = sorted(p.name for p in (out / "buffer").glob("*.parquet"))
    assert files == [f"batch_00000{i}-rank{r}.parquet" for i in range(1, 4) for r in range(2)]
    shares = [read_batch(out / "buffer" / f"batch_000002-rank{r}.parquet")[0].column("index").to_pylist()
              for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 4 and not set(shares[0]) & set(shares[1])


def test_buffer_show_ends_its_last_version_range_at_the_last_version(tmp_path):
    from mmrl.buffer.show import summarize

    store = TrajectoryBuffer(tmp_path / "run" / "buffer")
    for version in (0, 1, 2):
        store.put(_batch(version))
    # Three versions in two rows: ranges of two, the second holding version 2 only.
    assert [g["version"] for g in summarize(tmp_path / "run", rows=2)["versions"]] == ["0-1", "2"]
