"""The concurrent one-step-off schedule (mmrl/buffer/overlap.py, `algo.overlap: thread`):
the same batches, behaviour log-probs, metrics and weights as the sequential schedule bit
for bit, an error in the rollout thread raised in the main thread with its traceback, a
failed run not waiting on the thread, the recipe's one-line refusals, and the compiled
rollout's own generator (`SamplingParams.generator_seed`)."""

import json
import sys
import threading
import traceback
from pathlib import Path

import pytest
import torch

from mmrl.buffer import ConcurrentSteps
from mmrl.buffer.overlap import PHASE_METRICS
from mmrl.buffer.store import read_batch
from mmrl.config import RecipeError, load_recipe
from mmrl.engine.compiled_layers import CompiledLayers
from mmrl.engine.surgery import decoder_layers
from mmrl.summary import run_summary
from mmrl.trainer import Trainer
from stopped_runs import interrupted_before
from test_trainer import TEXT

REPO = Path(__file__).resolve().parents[1]

ONE_STEP_OFF = [*TEXT, "data.eval=null", "trainer.export=false", "reward.name=test_buffer:length_reward",
                "rollout.backend=hf_compiled", "algo.max_staleness=1", "algo.behaviour=sampler", "optim.lr=1e-2"]


def _trainer(run, *extra) -> Trainer:
    return Trainer(load_recipe(None, [*ONE_STEP_OFF, f"trainer.output_dir={run}", *extra]))


def _drawing_update(trainer: Trainer) -> Trainer:
    """The trainer with an update that draws from the default generator as it runs, as
    dropout does (training engines switch the model's own dropout off; a LoRA copy is
    merged, so its samples differ from the live adapters' in the last bits)."""
    update = trainer.update.run

    def run(plan):
        for _ in range(20):
            torch.rand(64)
            torch.randn(8, 8) @ torch.randn(8, 8)
        return update(plan)

    trainer.update.run = run
    return trainer


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "overlap/"))
             and k not in ("tokens_per_s", "train_seconds")} for r in rows]


def _batches(run) -> dict[int, dict]:
    """Each batch file's columns by batch number, and the version that sampled it."""
    out = {}
    for path in sorted((Path(run) / "buffer").glob("batch_*.parquet")):
        table, metadata = read_batch(path)
        out[metadata["batch"]] = {"sampled_by": metadata["version"], **table.to_pydict()}
    return out


def _rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("mmrl-rollout-batch-")]


def test_concurrent_one_step_off_equals_the_sequential_schedule_bit_for_bit(tmp_path):
    """Batches 3 to 5 are sampled in the thread while steps 2 to 4 update (drawing random
    numbers meanwhile): the same tokens, behaviour log-probs, rewards, metrics and final
    weights as the sequential schedule."""
    sequential = _drawing_update(_trainer(tmp_path / "sequential", "trainer.steps=5"))
    sequential.fit()
    concurrent = _drawing_update(_trainer(tmp_path / "concurrent", "trainer.steps=5", "algo.overlap=thread"))
    concurrent.fit()
    assert isinstance(concurrent.trajectories, ConcurrentSteps)
    assert not isinstance(sequential.trajectories, ConcurrentSteps)
    assert [line for line in run_summary(concurrent) if line.startswith("overlap ")] == [
        "overlap   thread (algo.overlap=thread): the next batch sampled beside the update on an inference copy "
        "0.3 MiB in float32, kept between rollouts"]
    assert not [line for line in run_summary(sequential) if line.startswith("overlap ")]
    rows = _rows(tmp_path / "concurrent")
    assert _untimed(rows) == _untimed(_rows(tmp_path / "sequential"))
    # Steps 3 to 5 collected a batch sampled beside the previous update.
    assert [r["overlap/rollout_s"] > 0 for r in rows if not r.get("final")] == [False, False, True, True, True]
    batches = _batches(tmp_path / "concurrent")
    assert batches == _batches(tmp_path / "sequential")
    assert [batches[n]["sampled_by"] for n in sorted(batches)] == [0, 0, 1, 2, 3]
    expected = sequential.actor.model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in concurrent.actor.model.state_dict().items())
    assert not _rollout_threads()


def _fails_in_the_thread(completions, answers, **fields):
    """A reward that fails when scored in the rollout thread only."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("scored in the rollout thread")
    return [len(c) / 3 for c in completions]


def test_an_error_in_the_rollout_thread_is_raised_in_the_main_thread_with_its_traceback(tmp_path):
    trainer = _trainer(tmp_path / "run", "trainer.steps=4", "algo.overlap=thread",
                       "reward.name=test_overlap:_fails_in_the_thread")
    with pytest.raises(Exception, match="scored in the rollout thread") as caught:
        trainer.fit()
    error = caught.value
    assert any("raised in the rollout thread (algo.overlap=thread), sampling batch 3" in note
               for note in getattr(error, "__notes__", []))
    frames = traceback.extract_tb(error.__traceback__)
    assert any(frame.name == "_work" and frame.filename.endswith("overlap.py") for frame in frames)
    assert any(frame.name == "_fails_in_the_thread" for frame in frames) or error.__cause__ is not None \
        or "_fails_in_the_thread" in str(error)
    assert trainer.step == 2  # raised when step 3 collects the batch it trains on
    assert not _rollout_threads()


_RELEASE = threading.Event()


def _waits_in_the_thread(completions, answers, **fields):
    """A reward that, scored in the rollout thread, waits until the test releases it."""
    if threading.current_thread() is not threading.main_thread():
        _RELEASE.wait(timeout=300)
    return [len(c) / 3 for c in completions]


def test_a_run_that_fails_beside_a_rollout_does_not_wait_for_it(tmp_path):
    """The update of step 2 fails while batch 3 is still being scored: the error reaches
    the caller while the thread, a daemon (it keeps no process alive), is still busy;
    released, it ends with its batch."""
    trainer = _trainer(tmp_path / "run", "trainer.steps=4", "algo.overlap=thread",
                       "reward.name=test_overlap:_waits_in_the_thread")
    update = trainer.update.run

    def failing_update(plan):
        if trainer.step == 2:
            raise RuntimeError("update failed")
        return update(plan)

    trainer.update.run = failing_update
    _RELEASE.clear()
    try:
        with pytest.raises(RuntimeError, match="update failed"):
            trainer.fit()
        busy = [thread for thread in _rollout_threads() if thread.is_alive()]
        assert len(busy) == 1 and busy[0].daemon
    finally:
        _RELEASE.set()
    busy[0].join()  # bounded: the rest of one batch
    assert not _rollout_threads()


@pytest.mark.parametrize("extra, words", [
    (["algo.max_staleness=0"], "needs algo.max_staleness >= 1"),
    (["algo.behaviour=recomputed"], "needs algo.behaviour=sampler"),
    (["rollout.backend=hf"], "rollout.backend 'hf' is not it"),
    (["rollout.partial_tokens=2"], "rollout.partial_tokens=2 cannot be combined"),
])
def test_what_the_thread_cannot_run_is_refused_in_one_line(tmp_path, extra, words):
    with pytest.raises(RecipeError) as caught:
        _trainer(tmp_path / "run", "algo.overlap=thread", *extra)
    message = str(caught.value)
    assert message.startswith("algo.overlap=thread") and words in message and "\n" not in message


def test_auto_runs_sequentially_off_a_gpu_and_an_unknown_mode_is_refused(tmp_path):
    assert not isinstance(_trainer(tmp_path / "auto", "algo.overlap=auto").trajectories, ConcurrentSteps)
    with pytest.raises(RecipeError, match=r"^algo.overlap=thread .*settled on 'hf'"):
        _trainer(tmp_path / "settled", "algo.overlap=thread", "rollout.backend=auto")
    with pytest.raises(RecipeError, match=r"^algo.overlap: Input should be 'off', 'thread' or 'auto'"):
        _trainer(tmp_path / "bad", "algo.overlap=sometimes")


def test_a_concurrent_run_stopped_and_resumed_ends_as_one_never_stopped(tmp_path):
    """The checkpoint of step 2 waits for batch 3, sampled beside update 2, and records it
    as the sequential schedule would: the resumed run trains it and ends with the same
    weights and batches as a run never stopped."""
    common = ["trainer.steps=4", "trainer.save_every=2", "algo.overlap=thread"]
    straight = _trainer(tmp_path / "straight", *common)
    straight.fit()
    interrupted_before(_trainer(tmp_path / "run", *common), 3)
    assert (tmp_path / "run" / "buffer" / "batch_000003.parquet").is_file()
    resumed = _trainer(tmp_path / "run", *common, "trainer.resume=true")
    resumed.fit()
    expected = straight.actor.model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in resumed.actor.model.state_dict().items())
    assert _batches(tmp_path / "run") == _batches(tmp_path / "straight")


def test_a_vision_run_concurrent_equals_sequential_and_its_media_check_reads_the_training_path(tmp_path, capfd):
    """Images by dataset row through the thread's own processing and inference copy: the
    same metrics and weights; the step-0 media check does not hook the copy (the thread
    samples there), so it raises no false alarm about the actor's vision tower."""
    vlm = ["trainer.eval_every=0", "data.eval=null", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
           "trainer.progress=false", "trainer.export=false", "trainer.summary=false", "trainer.steps=3",
           "rollout.backend=hf_compiled", "algo.max_staleness=1", "algo.behaviour=sampler"]

    def run(name, *extra):
        trainer = Trainer(load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml",
                                      [*vlm, f"trainer.output_dir={tmp_path / name}", *extra]))
        trainer.fit()
        return trainer

    sequential, concurrent = run("sequential"), run("concurrent", "algo.overlap=thread")
    assert isinstance(concurrent.trajectories, ConcurrentSteps)
    assert _untimed(_rows(tmp_path / "concurrent")) == _untimed(_rows(tmp_path / "sequential"))
    expected = sequential.actor.model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in concurrent.actor.model.state_dict().items())
    assert "media check" not in capfd.readouterr().err


@pytest.mark.parametrize("decode", ["graphs", "compiled"])
def test_a_generator_seed_fixes_the_compiled_rollouts_samples_whatever_the_default_generator(decode):
    """`SamplingParams.generator_seed`: the draws come from a generator of the rollout's
    own (each decode step's noise an input of the step, recorded or compiled), so the
    default generator's state changes nothing and another seed changes the samples."""
    from widened_models import prompt_conversations, widened_engine

    from mmrl.rollout import SamplingParams, make_rollout

    built, engine = widened_engine("qwen2")
    conversations = prompt_conversations(built)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, decode=decode)

    def sample(default_seed: int, generator_seed: int):
        torch.manual_seed(default_seed)
        params = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, logprobs=True, generator_seed=generator_seed)
        return rollout.generate(conversations, params)

    first, second, other = sample(0, 7), sample(1, 7), sample(0, 8)
    assert rollout.fallback_reason is None
    assert torch.equal(first.response_ids, second.response_ids)
    assert torch.equal(first.logprobs, second.logprobs)
    assert not torch.equal(first.response_ids, other.response_ids)


_SWITCH_SEEN: list[float] = []


def _notes_the_switch_interval(completions, answers, **fields):
    """A reward that notes Python's switch interval where it is scored in the rollout thread."""
    if threading.current_thread() is not threading.main_thread():
        _SWITCH_SEEN.append(sys.getswitchinterval())
    return [len(c) / 3 for c in completions]


def test_the_thread_samples_under_the_switch_interval_asked_and_reports_where_its_time_went(tmp_path):
    """`algo.overlap_switch_interval_ms` holds while the thread samples (batches 3 and 4)
    and Python's own is back after; each step reports the thread's phases (0 in steps that
    collected no batch)."""
    before = sys.getswitchinterval()
    _SWITCH_SEEN.clear()
    trainer = _trainer(tmp_path / "run", "trainer.steps=4", "algo.overlap=thread",
                       "algo.overlap_switch_interval_ms=0.5", "reward.name=test_overlap:_notes_the_switch_interval")
    trainer.fit()
    assert _SWITCH_SEEN == [0.0005, 0.0005]
    assert sys.getswitchinterval() == before
    rows = [r for r in _rows(tmp_path / "run") if not r.get("final")]
    assert all(set(PHASE_METRICS) <= set(r) for r in rows)
    assert all(r["overlap/decode_s"] == 0 and r["overlap/switch_interval_ms"] == 0 for r in rows[:2])
    for r in rows[2:]:
        assert r["overlap/switch_interval_ms"] == 0.5
        assert r["overlap/decode_steps"] >= 1 and r["overlap/decode_s"] > 0 and r["overlap/score_s"] > 0
        assert r["overlap/decode_host_s"] + r["overlap/decode_wait_s"] == pytest.approx(r["overlap/decode_s"])
        assert r["overlap/decode_s"] + r["overlap/prefill_s"] <= r["overlap/generate_s"] <= r["overlap/rollout_s"]
        assert r["overlap/decode_graphs"] == 0 and r["overlap/graphs_recorded"] == 0  # CPU: nothing recorded
    with pytest.raises(RecipeError, match="overlap_switch_interval_ms"):
        load_recipe(None, [*ONE_STEP_OFF, "algo.overlap_switch_interval_ms=0"])


def test_the_threads_copy_decodes_through_compiled_layers_of_its_own(tmp_path):
    """Where the engine compiles its decoder layers, the thread's recorded decode step runs
    through the inference copy's layers compiled the same way (its graphs replayed the
    copy's eager kernels before): never the engine's layers, which the update runs."""
    trainer = _trainer(tmp_path / "run", "trainer.steps=2", "algo.overlap=thread", "rollout.decode=graphs")
    sampler = trainer.trajectories.sampler
    assert sampler._step_layers() is None  # the engine compiles none on the CPU
    trainer.actor.compiled_layers = CompiledLayers(decoder_layers(trainer.actor.model, trainer.actor.adapter))
    layers = sampler._step_layers()
    assert [id(layer) for layer in layers.layers] == [
        id(layer) for layer in decoder_layers(sampler.copy.model, trainer.actor.adapter)]
    assert not {id(layer) for layer in layers.layers} & {id(layer) for layer in trainer.actor.compiled_layers.layers}
    assert sampler._step_layers() is layers and sampler._compiled_step().layers is layers
    assert sampler.decode_path() == "eager step (no capture) through compiled layers, 0 recorded"
