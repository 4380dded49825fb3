"""Partial rollouts (`rollout.partial_tokens`, mmrl/buffer/partial.py) and the sampler's
log-probs as the behaviour policy (`algo.behaviour`): a generation split in rounds of N
tokens is, greedy and with unchanged weights, the one-round generation token for token;
each token keeps the version and behaviour log-prob of the weights that sampled it; the
samples in flight survive SIGKILL and resume, neither lost nor continued twice; with
`algo.behaviour: sampler` the buffer holds the sampler's log-probs; with both settings at
their defaults a run is the loop without them, bit for bit."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from mmrl.buffer import TrajectoryBuffer
from mmrl.buffer.schedule import _check_partial, check_sampler_log_probs
from mmrl.buffer.show import summarize
from mmrl.buffer.store import InFlightGroup, InFlightResponse, read_batch, read_in_flight, write_in_flight
from mmrl.config import RecipeError, load_recipe
from mmrl.evaluation import conversations_of
from mmrl.parallel import Dist
from mmrl.rollout.base import SamplingParams, extend_prompts, right_padded
from mmrl.rollout.compiled import CompiledHFRollout
from mmrl.trainer import Trainer
from test_buffer import _TRAIN, REPO, RUN, TESTS, _rows, _trained_data, _untimed, _weights

# Responses of up to 6 tokens in rounds of 2: most samples span three rounds, and so
# three updates.
PARTIAL = ["rollout.max_new_tokens=6", "rollout.partial_tokens=2"]
# Greedy decoding and weights that do not move (an lr below every weight's last bit):
# the tokens depend on nothing but the prompt.
FIXED = ["algo.advantage=reinforce_pp", "rollout.temperature=0", "optim.lr=1e-30"]


def _recipe(run, *extra):
    return load_recipe(None, [*RUN, f"trainer.output_dir={run}", *extra])


def _responses(run):
    """{dataset index: its responses' tokens} of every batch file of the run, and each
    response's (tokens, versions, behaviour log-probs) in file order."""
    by_index, rows = {}, []
    for path in sorted((run / "buffer").glob("batch_*.parquet")):
        table = read_batch(path)[0].to_pydict()
        for index, ids, versions, behaviour in zip(table["index"], table["response_ids"], table["token_version"],
                                                    table["behaviour_logp"]):
            by_index.setdefault(index, []).append(ids)
            rows.append((ids, versions, behaviour))
    return by_index, rows


def _sharpen(trainer):
    """Weights drawn wider than the tiny model's own (std 1 for every matrix, seed 0):
    its greedy responses then differ from prompt to prompt, and some stop early (the
    model as built repeats one token whatever the prompt, which would prove little)."""
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in trainer.actor.model.parameters():
            if weight.dim() >= 2:
                weight.copy_(torch.randn(weight.shape, generator=draw))


# -- the rollout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["hf", "hf_compiled"])
def test_a_generation_continued_in_rounds_is_the_one_round_generation(tmp_path, backend):
    """Greedy, the same weights: rounds of 3 tokens through `continue_from` give the tokens
    and finish reasons of one `generate` call of 10, for responses that stop inside a
    round and ones that run to the end; on plain `generate` and on the compiled decode
    loop (run eagerly here, as its CPU tests run it)."""
    trainer = Trainer(_recipe(tmp_path / "run", "rollout.max_new_tokens=10"))
    rollout = trainer.rollout if backend == "hf" else CompiledHFRollout(trainer.actor, trainer.processing,
                                                                         compile=False)
    samples = [trainer.train_set[i] for i in range(6)]
    conversations = conversations_of(samples, list(range(6)), trainer.train_set, "test")
    _sharpen(trainer)
    whole = rollout.generate(conversations, SamplingParams(max_new_tokens=10, temperature=0))
    # Responses that stop inside the first round, at its last token, and run to the end.
    assert sorted(whole.response_mask.sum(-1).tolist()) == [2, 3, 10, 10, 10, 10]
    tokens, reasons = [[] for _ in conversations], [None] * len(conversations)
    rounds = 0
    while None in reasons:
        active = [i for i, reason in enumerate(reasons) if reason is None]
        part = rollout.continue_from([conversations[i] for i in active], [tokens[i] for i in active],
                                             SamplingParams(max_new_tokens=3, temperature=0))
        for row, i in enumerate(active):
            made = int(part.response_mask[row].sum())
            kept = min(made, 10 - len(tokens[i]))
            tokens[i] += part.response_ids[row, :kept].tolist()
            if part.finish_reasons[row] == "stop" and kept == made:
                reasons[i] = "stop"
            elif len(tokens[i]) == 10:
                reasons[i] = "length"
        rounds += 1
    assert rounds == 4 and "length" in reasons  # 3 + 3 + 3 + 1 for a response that runs to the end
    expected = [whole.response_ids[i, :int(whole.response_mask[i].sum())].tolist() for i in range(len(samples))]
    assert tokens == expected and reasons == whole.finish_reasons
    assert getattr(rollout, "fallback_reason", None) is None  # the compiled loop decoded every round
    # Only plain generate tempers its log-probs (`algo.behaviour: sampler` at a temperature other than 1).
    assert rollout.tempered_logprobs == (backend == "hf")


def test_a_vision_generation_continued_in_rounds_is_the_one_round_generation(tmp_path):
    """The same with images and 3-D (mrope) positions: the tiny Qwen2-VL of the CPU demo,
    rounds of 2 tokens against one call of 6; its responses differ by image only."""
    trainer = Trainer(load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [
        "trainer.eval_every=0", "data.eval=null", "trainer.progress=false", f"trainer.output_dir={tmp_path}"]))
    _sharpen(trainer)
    samples = [trainer.train_set[i] for i in range(3)]
    conversations = conversations_of(samples, list(range(3)), trainer.train_set, "test")
    whole = trainer.rollout.generate(conversations, SamplingParams(max_new_tokens=6, temperature=0))
    tokens = [[] for _ in conversations]
    for _ in range(3):
        part = trainer.rollout.continue_from(conversations, tokens, SamplingParams(max_new_tokens=2, temperature=0))
        for row in range(len(tokens)):
            tokens[row] += part.response_ids[row, :int(part.response_mask[row].sum())].tolist()
    assert tokens == whole.response_ids.tolist() and len({tuple(t) for t in tokens}) > 1


def test_extend_prompts_appends_each_rows_tokens_and_pads_on_the_left():
    inputs = {"input_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]]),
              "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
              "token_type_ids": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
              "pixel_values": torch.ones(3, 2)}
    out = extend_prompts(inputs, [[11, 12, 13], []], pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 11, 12, 13], [0, 7, 8, 9, 4]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert out["token_type_ids"].tolist() == [[1, 1, 0, 0, 0], [0, 1, 1, 1, 1]]
    assert out["pixel_values"] is inputs["pixel_values"]
    with pytest.raises(ValueError, match="1 prefixes for 2 prompts"):
        extend_prompts(inputs, [[1]], pad_id=0)



def test_right_padded_pads_each_rows_tokens_on_the_right():
    """The one right-padding of token lists (a carried response's tokens, a trajectory's last turn)."""
    ids, mask = right_padded([[3, 4, 5], [], [6]], pad_id=0)
    assert ids.dtype == torch.long and mask.dtype == torch.float32
    assert ids.tolist() == [[3, 4, 5], [0, 0, 0], [6, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 0, 0]]
    ids, mask = right_padded([[], []], pad_id=7)
    assert ids.tolist() == [[7], [7]] and mask.tolist() == [[0], [0]]
    assert right_padded([], pad_id=0)[0].shape == (0, 1)

# -- the loop ----------------------------------------------------------------------------------------
def test_partial_rollouts_train_the_one_round_tokens_with_each_tokens_version_and_behaviour(tmp_path):
    """Greedy with weights that do not move, every response a partial run trains on is the
    response of the run without partial rollouts, though its tokens came in rounds of 2
    across updates; each token records the update count of its round and the log-prob
    those weights gave it (so the update's ratio pi_old / b is 1 on every token)."""
    partial = Trainer(_recipe(tmp_path / "partial", "trainer.steps=4", *FIXED, *PARTIAL))
    _sharpen(partial)
    partial.fit()
    whole = Trainer(_recipe(tmp_path / "whole", "trainer.steps=6", "rollout.max_new_tokens=6", *FIXED))
    _sharpen(whole)
    whole.fit()
    trained, rows = _responses(tmp_path / "partial")
    expected, _ = _responses(tmp_path / "whole")
    assert trained and all(trained[index] == expected[index] for index in trained)
    metrics = [r for r in _rows(tmp_path / "partial") if not r.get("final")]
    # Each round draws 4 prompts; a step runs rounds until a group has finished.
    assert all(r["partial/drawn_prompts"] == 4 * r["partial/rounds"] for r in metrics)
    assert all(r["partial/carried_in"] > 0 for r in metrics[1:])
    assert metrics[1]["partial/token_staleness_max"] == 1.0 and metrics[2]["partial/token_staleness_max"] == 2.0
    for row in metrics:
        counts = sum(v for k, v in row.items() if k.startswith("partial/tokens_staleness_"))
        assert counts > 0
    for row in metrics[1:]:
        assert abs(row["off_policy/ratio_max"] - 1) < 1e-5 and abs(row["off_policy/ratio_min"] - 1) < 1e-5
    spans = 0
    for ids, versions, behaviour in rows:
        assert len(versions) == len(behaviour) == len(ids)
        assert versions == sorted(versions) and all(b <= 0 for b in behaviour)
        # Two tokens a round, one round a step: a version changes only at a round's edge.
        assert all(versions[i] == versions[i - 1] for i in range(1, len(versions)) if i % 2)
        spans += len(set(versions)) > 1
    assert spans > 0  # responses whose tokens two weights versions sampled
    assert not (tmp_path / "whole" / "buffer" / "in_flight_000001.parquet").exists()
    in_flight = summarize(tmp_path / "partial")["in_flight"]  # what `mmrl buffer show` prints
    assert in_flight["groups"] == metrics[-1]["partial/waiting_groups"]
    assert in_flight["generating"] == metrics[-1]["partial/carried_out"]


def test_partial_rollouts_run_one_step_off(tmp_path):
    """With `algo.max_staleness: 1` too, a batch made one update ahead carries tokens of
    up to three versions, each weighed against its own behaviour log-prob."""
    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=4", "algo.max_staleness=1", *PARTIAL))
    trainer.fit()
    metrics = [r for r in _rows(tmp_path / "run") if not r.get("final")]
    assert [r["off_policy/staleness_max"] for r in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert max(r["partial/token_staleness_max"] for r in metrics) >= 2
    assert all(0 < r["off_policy/ratio_min"] <= r["off_policy/ratio_max"] for r in metrics[1:])
    assert all(torch.isfinite(torch.tensor(v)) for r in metrics for v in r.values() if isinstance(v, float))


def test_sampler_behaviour_log_probs_are_the_samplers(tmp_path):
    """`algo.behaviour: sampler`, one-step-off: the stale batch's stored behaviour log-probs
    are those the rollout returned, and the trainer's forward gives the same up to its
    rounding (the recomputed run, same tokens)."""
    def run(name, behaviour):
        trainer = Trainer(_recipe(tmp_path / name, "trainer.steps=2", "algo.max_staleness=1", "optim.lr=1e-30",
                                  "rollout.temperature=0.7", f"algo.behaviour={behaviour}"))
        seen = []
        generate = trainer.rollout.generate

        def recording(conversations, params):
            result = generate(conversations, params)
            seen.append((params, result.logprobs))
            return result

        trainer.rollout.generate = recording
        trainer.fit()
        return seen, read_batch(tmp_path / name / "buffer" / "batch_000002.parquet")[0].to_pydict()

    seen, table = run("sampler", "sampler")
    params, logprobs = seen[1]
    assert params.logprobs and params.logprobs_temperature == 0.7
    assert table["behaviour_logp"] == [row[:len(ids)].tolist() for row, ids in zip(logprobs, table["response_ids"])]
    seen, recomputed = run("recomputed", "recomputed")
    assert seen[1][1] is None and recomputed["response_ids"] == table["response_ids"]
    gap = max(abs(a - b) for x, y in zip(table["behaviour_logp"], recomputed["behaviour_logp"]) for a, b in zip(x, y))
    assert gap < 1e-4


def test_partial_rollouts_with_sampler_behaviour_store_each_rounds_sampler_log_probs(tmp_path):
    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=3", "algo.behaviour=sampler", *PARTIAL))
    rounds = []
    continue_from = trainer.rollout.continue_from

    def recording(conversations, prefixes, params):
        result = continue_from(conversations, prefixes, params)
        for row, (conversation, prefix) in enumerate(zip(conversations, prefixes)):
            made = int(result.response_mask[row].sum())
            rounds.append((json.dumps(conversation, default=str), list(prefix),
                           result.response_ids[row, :made].tolist(), result.logprobs[row, :made].tolist()))
        return result

    trainer.rollout.continue_from = recording
    made = []
    produce = trainer.trajectories.produce
    trainer.trajectories.produce = lambda: made.append(produce()) or made[-1]
    stored = {}
    trainer.trajectories.buffer.put = _keeping(trainer.trajectories.buffer.put, stored)
    trainer.fit()
    checked = 0
    for batch in made:
        for row in range(batch.size):
            conversation = json.dumps(batch.conversations[int(batch.result.prompt_index[row])], default=str)
            tokens = batch.result.response_ids[row, :int(batch.result.response_mask[row].sum())].tolist()
            expected, done = [], 0
            while done < len(tokens):
                ids, logprobs = next((ids, lps) for c, prefix, ids, lps in rounds
                                     if c == conversation and prefix == tokens[:done]
                                     and ids[:len(tokens) - done] == tokens[done:done + len(ids)])
                kept = min(len(ids), len(tokens) - done)
                expected += logprobs[:kept]
                done += kept
            assert stored[batch.batch_id][row, :len(tokens)].tolist() == expected
            checked += 1
    assert checked > 0


def _keeping(put, stored):
    """`TrajectoryBuffer.put` that also keeps each batch's behaviour log-probs as put
    (the schedule drops them from a batch trained by the weights that sampled it)."""
    def keeping(batch):
        batch_id = put(batch)
        stored[batch_id] = batch.behaviour_logp.clone()
        return batch_id

    return keeping


@pytest.mark.parametrize("settings", [["rollout.partial_tokens=0", "algo.behaviour=recomputed"],
                                      ["rollout.partial_tokens=0", "algo.behaviour=sampler"]])
def test_partial_tokens_zero_is_the_loop_without_them_bit_for_bit(tmp_path, settings):
    """Off (0), with either behaviour source (only stale batches use one), the run is the
    loop that hands each rollout straight to the update."""
    buffered = Trainer(_recipe(tmp_path / "buffered", "trainer.steps=3", *settings))
    buffered.fit()
    direct = Trainer(_recipe(tmp_path / "direct", "trainer.steps=3"))
    direct.trajectories.next = lambda done: (direct.roll_out_batch(), {})
    direct.fit()
    assert _untimed(_rows(tmp_path / "buffered")) == _untimed(_rows(tmp_path / "direct"))
    assert not any(k.startswith("partial/") for k in _rows(tmp_path / "buffered")[0])
    expected = _weights(direct)
    assert all(torch.equal(v, expected[k]) for k, v in _weights(buffered).items())


# -- kill and resume -------------------------------------------------------------------------------------
@pytest.mark.slow  # a training process started and killed, then two 6-step runs: out of the quick tier
def test_samples_in_flight_survive_sigkill_and_resume_neither_lost_nor_duplicated(tmp_path):
    """A checkpoint at step 2 with samples in flight, SIGKILL while step 4 scores its batch
    (batch 3 trained, batch 4 never written): the resumed run reads the samples in flight
    after batch 2 back, drops those of batch 3, and trains what a run never stopped
    trains, step by step, to the same weights; no prompt is trained twice."""
    run = tmp_path / "run"
    common = [*PARTIAL, "trainer.save_every=2"]
    env = {**os.environ, "MMRL_TEST_KILL_AT": "4", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), *(p for p in sys.path if p)])}
    killed = subprocess.run([sys.executable, "-c", _TRAIN, *RUN, f"trainer.output_dir={run}", "trainer.steps=6",
                             *common], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    waiting = read_in_flight(run / "buffer" / "in_flight_000002.parquet")
    assert any(r.finish is None and r.tokens for g in waiting for r in g.responses)  # carried at the checkpoint
    assert (run / "buffer" / "in_flight_000003.parquet").is_file()
    assert not (run / "buffer" / "in_flight_000004.parquet").exists()
    resumed = Trainer(_recipe(run, "trainer.steps=6", "trainer.resume=true", *common))
    assert resumed.resume()  # (fit resumes again, to the same place)
    assert [(g.index, [r.tokens for r in g.responses]) for g in resumed.trajectories.buffer.in_flight] == \
        [(g.index, [r.tokens for r in g.responses]) for g in waiting]
    resumed.fit()
    reference = Trainer(_recipe(tmp_path / "reference", "trainer.steps=6", *common))
    reference.fit()
    trained = _trained_data(run)
    assert [(step, batch) for step, batch, _, _ in trained] == [(i, i) for i in range(1, 7)]
    assert trained == _trained_data(tmp_path / "reference")
    indices = [index for _, _, _, batch in trained for index in set(batch)]
    assert len(indices) == len(set(indices))
    assert _responses(run) == _responses(tmp_path / "reference")
    expected = _weights(reference)
    assert all(torch.equal(v, expected[k]) for k, v in _weights(resumed).items())
    assert _untimed(_rows(run)) == _untimed(_rows(tmp_path / "reference"))


def test_in_flight_samples_read_back_as_written(tmp_path):
    groups = [InFlightGroup(index=3, row=30, responses=[
        InFlightResponse(tokens=[5, 6], versions=[0, 1], behaviour=[-0.5, -0.25], finish=None),
        InFlightResponse(tokens=[7], versions=[1], behaviour=[-1.0], finish="stop")]),
        InFlightGroup(index=1, row=10, responses=[InFlightResponse(), InFlightResponse()])]
    write_in_flight(tmp_path / "in_flight_000001.parquet", groups)
    assert read_in_flight(tmp_path / "in_flight_000001.parquet") == groups
    store = TrajectoryBuffer(tmp_path, partial=True)
    with pytest.raises(ValueError) as err:
        store.restore({"produced": 2, "taken": 2}, lambda table, meta: None)
    assert "in_flight_000002.parquet is missing" in str(err.value) and "\n" not in str(err.value)


# -- what is refused -------------------------------------------------------------------------------------
def test_what_partial_rollouts_and_sampler_behaviour_need_is_said_in_one_line(tmp_path):
    with pytest.raises(RecipeError, match=r"^algo: rollout\.partial_tokens 2 carries single-turn samples only"):
        _recipe(tmp_path, "rollout.partial_tokens=2", "rollout.env=single_turn")
    with pytest.raises(RecipeError, match=r"^rollout\.partial_tokens: .*greater than or equal to 0"):
        _recipe(tmp_path, "rollout.partial_tokens=-1")
    with pytest.raises(RecipeError, match=r"^algo\.behaviour: "):
        _recipe(tmp_path, "algo.behaviour=trainer")
    recipe = _recipe(tmp_path, "algo.behaviour=sampler", "rollout.temperature=0.7")

    class RawOnly:
        backend = "vllm"

    with pytest.raises(RecipeError, match=r"^algo\.behaviour=sampler: rollout backend 'vllm' gives log-probs at "
                                          r"temperature 1 only, not at rollout\.temperature 0\.7"):
        check_sampler_log_probs(RawOnly(), recipe)
    check_sampler_log_probs(RawOnly(), _recipe(tmp_path, "algo.behaviour=sampler"))  # temperature 1: raw is right
    with pytest.raises(RecipeError, match=r"^rollout\.partial_tokens=2: rollout backend 'vllm' cannot continue a "
                                          r"sample from its tokens so far; use rollout\.backend=hf or hf_compiled"):
        _check_partial(RawOnly(), _dist(1), _recipe(tmp_path, "rollout.partial_tokens=2"))
    with pytest.raises(RecipeError, match=r"^rollout\.partial_tokens=2 runs in one process for now"):
        _check_partial(CompiledHFRollout, _dist(2), _recipe(tmp_path, "rollout.partial_tokens=2"))


def _dist(world_size):
    return Dist(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), mesh=None)
