"""Families that cannot take left padding (`ModelAdapter.left_padding = False`): a forward that
ignores the mask for the pads in front (a recurrent state, positions counted from the
tensor's start). Stand-in: a tiny Qwen2 whose decoder drops the attention mask and the
position ids, so it counts positions from the first column and attends to every earlier
token, pads included. Such a family's padded-batch check, training passes and HF rollout
run right-padded rows, and each equals every sequence run alone."""

import json

import pytest
import torch

from mmrl import build_model
from mmrl.checks import padded_vs_single, sample_conversations
from mmrl.engine import Engine, join
from mmrl.parallel import init_distributed
from mmrl.probes import TOLERANCE
from mmrl.rollout import SamplingParams, make_rollout


def _drop_mask_and_positions(module, args, kwargs):
    return args, {k: v for k, v in kwargs.items() if k not in ("attention_mask", "position_ids")}


@pytest.fixture
def built(monkeypatch):
    built = build_model("qwen2", random_init=True, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # widened weights: greedy continuations differ from token to token
        for parameter in built.model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    built.model.model.register_forward_pre_hook(_drop_mask_and_positions, with_kwargs=True)
    monkeypatch.setattr(built.adapter, "left_padding", False)
    return built


def test_the_padded_batch_check_runs_the_layout_the_family_declares(built, monkeypatch):
    """One sequence a row, packed as the engine packs it, for a family that cannot take
    left padding; the left-padded batch for one that can."""
    from mmrl.engine import packing

    conversations = sample_conversations(built.adapter)
    calls = []
    plain = packing.pack_sequences
    monkeypatch.setattr(packing, "pack_sequences", lambda *a, **k: calls.append(k["row_tokens"]) or plain(*a, **k))
    assert padded_vs_single(built, conversations) < TOLERANCE
    assert calls == [1]
    monkeypatch.setattr(built.adapter, "left_padding", True)
    assert padded_vs_single(built, conversations) > 100 * TOLERANCE  # the pads in front change the logits


def _joined(built, conversations, responses):
    prompts = dict(built.processing(conversations))
    mask = (responses != 0).long()
    return join(prompts, responses, mask, built.adapter, built.model, built.tokenizer.pad_token_id)


def test_engine_passes_equal_each_sequence_alone(built):
    """Log-probs, entropy and values of a batch (prompts of two lengths, responses of two
    lengths) equal each sequence's alone; with left padding assumed they do not."""
    conversations = sample_conversations(built.adapter)
    responses = torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0]])
    engine = Engine(built, init_distributed("cpu"), value_head=True)
    seqs = _joined(built, conversations, responses)
    with torch.no_grad():
        logp, entropy = engine.log_probs(seqs)
        values = engine.values(seqs)
        for i, conversation in enumerate(conversations):
            alone = _joined(built, [conversation], responses[i:i + 1])
            logp_alone, entropy_alone = engine.log_probs(alone)
            real = alone.response_mask[0].bool()
            torch.testing.assert_close(logp[i][real], logp_alone[0][real], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(entropy[i][real], entropy_alone[0][real], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values[i][real], engine.values(alone)[0][real], atol=1e-5, rtol=1e-5)
        assert (logp[:, len(responses[1].nonzero()):][1] == 0).all()  # padding stays 0
        engine.right_padded = False  # the left-padded layout, which this forward cannot take
        left, _ = engine.log_probs(seqs)
    assert (left - logp).abs().max() > 1e-3


def test_engine_refuses_a_family_without_position_ids(built, monkeypatch):
    engine = Engine(built, init_distributed("cpu"))
    seqs = _joined(built, sample_conversations(built.adapter), torch.tensor([[11, 12], [21, 0]]))
    del seqs.inputs["position_ids"]
    with pytest.raises(ValueError, match="left_padding=False.*no position ids"):
        engine.log_probs(seqs)


def test_hf_rollout_generates_each_prompt_length_apart(built):
    """Greedy samples of prompts of two lengths (n=2) equal each prompt generated alone,
    with log-probs; the compiled backend falls back to the same path."""
    conversations = sample_conversations(built.adapter)
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.0, logprobs=True)
    result = make_rollout("hf", engine, built.processing).generate(conversations, params)
    assert result.prompt_index.tolist() == [0, 0, 1, 1]
    for i, conversation in enumerate(conversations):
        ids = dict(built.processing([conversation]))
        alone = built.model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=built.tokenizer.pad_token_id,
                                     eos_token_id=built.processing.stop_token_ids,
                                     suppress_tokens=built.processing.blocked_token_ids or None)
        alone = alone[0, ids["input_ids"].shape[1]:]
        for row in (2 * i, 2 * i + 1):
            length = int(result.response_mask[row].sum())
            assert result.response_ids[row, :length].tolist() == alone[:length].tolist()
    assert result.logprobs is not None and (result.logprobs[result.response_mask == 0] == 0).all()
    with pytest.warns(UserWarning, match="left_padding=False"):
        compiled = make_rollout("hf_compiled", engine, built.processing, compile=False).generate(conversations, params)
    assert torch.equal(compiled.response_ids, result.response_ids)


def test_hf_rollout_refuses_media_prompts_for_such_a_family(built):
    engine = Engine(built, init_distributed("cpu"))
    rollout = make_rollout("hf", engine, built.processing)
    batch = {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]]),
             "pixel_values": torch.zeros(4, 3)}
    with pytest.raises(ValueError, match="left_padding=False.*pixel_values"):
        rollout._sample(batch, None, SamplingParams(max_new_tokens=2))


def length_reward(completions, answers, **fields):
    """Unequal rewards within a group, so the update moves the weights."""
    return [len(c) / 3 for c in completions]


def test_the_trainer_runs_such_a_family_end_to_end(tmp_path, monkeypatch):
    """A GRPO run (2 steps, prompts of several lengths, 4 samples each) on the stand-in
    family: the rollout generates one prompt length at a time and the engines run
    right-padded rows; the steps train (finite loss, the weights move)."""

    from mmrl.config import load_recipe
    from mmrl.registry import get_adapter
    from mmrl.trainer import Trainer

    adapter_class = type(get_adapter("qwen2"))
    monkeypatch.setattr(adapter_class, "left_padding", False)
    original = adapter_class.on_load

    def on_load(self, model):
        model = original(self, model)
        model.model.register_forward_pre_hook(_drop_mask_and_positions, with_kwargs=True)
        return model

    monkeypatch.setattr(adapter_class, "on_load", on_load)
    recipe = load_recipe(None, [
        "model.path=qwen2", "model.random_init=true",
        "model.tiny_vocabulary={characters: '0123456789+ ?', words: [What, is, user, assistant]}",
        "data.train=synthetic:arithmetic?n=32&seed=0&max_operand=40", "data.eval=null",
        "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3",
        "reward.name=test_left_padding:length_reward", "trainer.progress=false", "trainer.threads=2", "trainer.steps=2",
        "trainer.export=false", f"trainer.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(recipe)
    assert trainer.actor.right_padded and type(trainer.rollout).__name__ == "HFRollout"
    before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if not r.get("final")]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in steps)
    after = trainer.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


SHARDED_ROLLOUT = '''
import json, sys, torch
from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.engine import Engine
from mmrl.parallel import init_distributed
from mmrl.rollout import SamplingParams, make_rollout

def drop(module, args, kwargs):
    return args, {k: v for k, v in kwargs.items() if k not in ("attention_mask", "position_ids")}

def stand_in():
    built = build_model("qwen2", random_init=True, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in built.model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    built.model.model.register_forward_pre_hook(drop, with_kwargs=True)
    built.adapter.left_padding = False
    return built

out = sys.argv[1]
dist = init_distributed("cpu")
built = stand_in()
engine = Engine(built, dist, mixed_precision=False)
conversations = sample_conversations(built.adapter)
mine = conversations if dist.rank == 0 else conversations[:1]  # two prompt lengths on rank 0, one on rank 1
params = SamplingParams(n=1, max_new_tokens=5, temperature=0.0)
result = make_rollout("hf", engine, built.processing).generate(mine, params)
gathered = dist.all_gather_objects([(row[:int(m.sum())]).tolist() for row, m in zip(result.response_ids,
                                                                                     result.response_mask)])
if dist.rank == 0:
    plain = stand_in()
    alone = []
    for conversation in conversations:
        ids = dict(plain.processing([conversation]))
        tokens = plain.model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=plain.tokenizer.pad_token_id,
                                      eos_token_id=plain.processing.stop_token_ids,
                                      suppress_tokens=plain.processing.blocked_token_ids or None)
        alone.append(tokens[0, ids["input_ids"].shape[1]:].tolist())
    json.dump({"sharded": gathered, "alone": alone}, open(out, "w"))
dist.barrier()
torch.distributed.destroy_process_group()
from mmrl.parallel.mesh import exit_cleanly  # no interpreter teardown: gloo's threads can abort it
exit_cleanly()
'''


@pytest.mark.multiprocess
def test_sharded_rollout_keeps_ranks_with_different_prompt_lengths_in_step(tmp_path):
    """Under FSDP2 every forward is collective: rank 0 holds prompts of two lengths (two
    `generate` calls), rank 1 of one; rank 1 repeats a call so neither waits forever, and
    each greedy sample equals its prompt generated alone, unsharded."""
    from cpu_processes import run, torchrun

    script, out = tmp_path / "rollout.py", tmp_path / "rollout.json"
    script.write_text(SHARDED_ROLLOUT)
    run(torchrun(2, str(script), str(out)), timeout=300)
    record = json.loads(out.read_text())
    (first, second), (again,) = record["sharded"]
    for sampled, alone in ((first, record["alone"][0]), (second, record["alone"][1]), (again, record["alone"][0])):
        assert sampled == alone[:len(sampled)] and len(sampled) > 0
