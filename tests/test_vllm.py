"""The vLLM rollout backend against the HF reference and the training engine.

- greedy generation gives the same tokens, masks and finish reasons as `HFRollout`, for
  the tiny `qwen2` and `qwen2_vl` (images of two sizes, two images in one prompt, a video
  of frames beside an image);
- vLLM's log-probs of its sampled tokens, and of given tokens, equal `Engine.log_probs`
  at temperature 1 (fp32 on both sides, atol 1e-4; measured ~1e-5);
- `sync` pushes perturbed weights, plain and LoRA-merged, into the running engine;
- the trainer runs with `rollout.backend=vllm`; marked slow, the counting recipe learns.

    VLLM_CPU_KVCACHE_SPACE=1 pytest tests/test_vllm.py           # fast tests, ~1-2 min
    VLLM_CPU_KVCACHE_SPACE=1 pytest tests/test_vllm.py -m slow   # the recipe learns (minutes)

- under torchrun (2 processes) every rank runs its own engine: its log-probs equal the
  FSDP2-sharded engine's before and after a sync, and a 2-step training run works;
- marked slow, the vLLM probe verifies families `mmrl add-model` scaffolds for types the
  zoo lacks: one vLLM serves with its Transformers backend (which rewrites transformers'
  classes while the trainer uses them) and a tied lm_head, one with vLLM's own class
  that has no lm_head at all, one with per-layer head sizes, and a VLM
  (bench/vllm_scaffolded.py measures the probe over every such type); and `mmrl add-model
  --columns vllm` runs it in a process of its own and declares vllm where it verifies.

vLLM's CPU attention has no head size below 32 (and some of its decoder layers take
hidden_size / heads as the head size), which the tiny models' heads of 32 satisfy;
`VLLMRollout` refuses a model it cannot run with `UnsupportedByVLLM`.
"""

import json
import os
import time

import pytest
import torch
from cpu_processes import REPO, run, torchrun
from PIL import Image, ImageDraw

from mmrl import build_model
from mmrl.config import OptimConfig, load_recipe
from mmrl.engine import Engine, join
from mmrl.parallel import init_distributed
from mmrl.probes import Status, Subject, probe
from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout.hf import HFRollout

# Read when an engine starts: a 1 GiB KV cache on CPU (vLLM would take a share of RAM).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ATOL = 1e-4  # fp32 on both sides; measured differences are ~1e-5

# A larger init than the tiny default, so greedy responses vary from token to token
# instead of repeating one token. (The tiny shapes already use heads of 32, which vLLM's
# CPU kernels need.)
OVERRIDES = {
    "qwen2": {"initializer_range": 0.2},
    "qwen2_vl": {"text_config": {"initializer_range": 0.2}, "vision_config": {"initializer_range": 0.2}},
}


def shape_image(size: int, color: str) -> Image.Image:
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).rectangle([size // 4, size // 4, size // 2, size // 2], fill=color)
    return image


def user(*parts):
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


def image(size: int, color: str) -> dict:
    return {"type": "image", "image": shape_image(size, color)}


CONVERSATIONS = {
    "qwen2": [[{"role": "user", "content": "What is 1+2?"}], [{"role": "user", "content": "hello there"}],
              [{"role": "user", "content": "1+1?"}]],
    "qwen2_vl": [user(image(56, "red"), "How many?"), user(image(112, "blue"), "What colour?"),
                 user(image(56, "green"), image(84, "red"), "Which is bigger?"),
                 user({"type": "video", "video": [shape_image(56, c) for c in ("red", "green", "blue", "red")]},
                      image(56, "blue"), "What moves?")],
}


def _stop_sometimes(engine, processing, conversations):
    """Scale the end-of-turn token's (tied) embedding until greedy responses include
    both stopped and length-capped ones, so the tests see both finish reasons."""
    weight = engine.model.get_output_embeddings().weight
    params = SamplingParams(n=1, max_new_tokens=12, temperature=0)
    for _ in range(8):
        reasons = set(HFRollout(engine, processing).generate(conversations, params).finish_reasons)
        if reasons == {"stop", "length"}:
            return
        with torch.no_grad():
            weight[processing.stop_token_ids] *= 0.7 if reasons == {"stop"} else 1.5


@pytest.fixture(scope="module", params=["qwen2", "qwen2_vl"])
def served(request):
    """A tiny model, its training engine, and a vLLM rollout started from its weights."""
    family = request.param
    built = build_model(family, random_init=True, config_overrides=OVERRIDES[family])
    engine = Engine(built, init_distributed(), optim=OptimConfig(lr=1e-2))
    _stop_sometimes(engine, built.processing, CONVERSATIONS[family])
    rollout = make_rollout("vllm", engine, built.processing)
    yield family, built, engine, rollout
    rollout.close()


def engine_log_probs(engine, processing, conversations, ids, mask):
    """The training engine's log-probs (temperature 1) of given responses."""
    seqs = join(dict(processing(conversations)), ids, mask, engine.adapter, engine.model,
                processing.tokenizer.pad_token_id)
    with torch.no_grad():
        return engine.log_probs(seqs, with_entropy=False)[0] * mask


def expand(conversations, result):
    return [conversations[i] for i in result.prompt_index.tolist()]


@pytest.mark.slow
def test_greedy_matches_the_hf_backend(served):
    family, built, engine, rollout = served
    conversations = CONVERSATIONS[family]
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0)
    ours = rollout.generate(conversations, params)
    reference = HFRollout(engine, built.processing).generate(conversations, params)
    assert ours.prompt_inputs is None
    assert torch.equal(ours.prompt_index, reference.prompt_index)
    assert ours.finish_reasons == reference.finish_reasons
    assert set(ours.finish_reasons) == {"stop", "length"}
    width = int(reference.lengths.max())
    assert torch.equal(ours.response_mask[:, :width], reference.response_mask[:, :width])
    assert torch.equal(ours.response_ids[:, :width], reference.response_ids[:, :width])
    pad = built.processing.tokenizer.pad_token_id
    for row, reason in zip(ours.response_ids.tolist(), ours.finish_reasons):
        length = len([t for t in row if t != pad])
        if reason == "stop":  # the stop token is kept, padding follows it
            assert row[length - 1] in built.processing.stop_token_ids
    # The sampler's log-probs of its tokens, and vLLM's scores of given tokens, are the engine's.
    expanded = expand(conversations, ours)
    truth = engine_log_probs(engine, built.processing, expanded, ours.response_ids, ours.response_mask)
    torch.testing.assert_close(ours.logprobs, truth, atol=ATOL, rtol=0)
    scored = rollout.log_probs(expanded, ours.response_ids, ours.response_mask)
    torch.testing.assert_close(scored, truth, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_sampling_is_seeded_and_never_draws_blocked_tokens(served):
    family, built, engine, rollout = served
    conversations = CONVERSATIONS[family]
    params = SamplingParams(n=4, max_new_tokens=10, temperature=0.7, seed=7)
    first = rollout.generate(conversations, params)
    again = rollout.generate(conversations, params)
    other = rollout.generate(conversations, SamplingParams(n=4, max_new_tokens=10, temperature=0.7, seed=8))
    assert torch.equal(first.response_ids, again.response_ids)
    assert not torch.equal(first.response_ids, other.response_ids)
    assert first.response_ids.shape[0] == len(conversations) * 4
    assert first.prompt_index.tolist() == [i for i in range(len(conversations)) for _ in range(4)]
    # The n samples of a prompt differ (each has its own seed).
    assert len({tuple(r) for r in first.response_ids[:4].tolist()}) > 1
    sampled = first.response_ids[first.response_mask.bool()]
    assert not torch.isin(sampled, torch.tensor(built.processing.blocked_token_ids)).any()
    # Log-probs at temperature 1 over the whole vocabulary, whatever shaped the draw.
    expected = engine_log_probs(engine, built.processing, expand(conversations, first), first.response_ids,
                                first.response_mask)
    torch.testing.assert_close(first.logprobs, expected, atol=ATOL, rtol=0)


def _one_update(engine, processing, conversations, result):
    """One optimizer step that raises the log-prob of `result`'s responses."""
    seqs = join(dict(processing(conversations)), result.response_ids, result.response_mask, engine.adapter,
                engine.model, processing.tokenizer.pad_token_id)
    logp, _ = engine.log_probs(seqs, with_entropy=False)
    (-(logp * seqs.response_mask).sum() / seqs.response_mask.sum()).backward()
    engine.step()


def _gap(rollout, engine, processing, conversations, result):
    scored = rollout.log_probs(conversations, result.response_ids, result.response_mask)
    truth = engine_log_probs(engine, processing, conversations, result.response_ids, result.response_mask)
    return float((scored - truth).abs().max())


@pytest.mark.slow
def test_sync_pushes_updated_weights(served):
    family, built, engine, rollout = served
    conversations = CONVERSATIONS[family]
    result = rollout.generate(conversations, SamplingParams(n=2, max_new_tokens=8, seed=0))
    expanded = expand(conversations, result)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        _one_update(engine, built.processing, expanded, result)
        assert _gap(rollout, engine, built.processing, expanded, result) > 1e-2  # vLLM still has the old weights
        start = time.perf_counter()
        rollout.sync(engine)
        print(f"{family}: sync {time.perf_counter() - start:.3f}s")
        assert _gap(rollout, engine, built.processing, expanded, result) < ATOL
        # Generation (encoder outputs and prefixes cached before the sync) uses the new weights.
        params = SamplingParams(n=1, max_new_tokens=12, temperature=0)
        theirs = HFRollout(engine, built.processing).generate(conversations, params)
        ours = rollout.generate(conversations, params)
        width = int(theirs.lengths.max())
        assert torch.equal(ours.response_ids[:, :width], theirs.response_ids[:, :width])
    finally:
        engine.model.load_state_dict(original)
        rollout.sync(engine)


@pytest.mark.slow
def test_sync_pushes_merged_lora_weights():
    from mmrl.lora import apply_lora

    family = "qwen2_vl"
    conversations = CONVERSATIONS[family]
    built = build_model(family, random_init=True, config_overrides=OVERRIDES[family])
    built.model = apply_lora(built.model, scope="all", rank=4, adapter=built.adapter)
    engine = Engine(built, init_distributed(), optim=OptimConfig(lr=1e-2))
    rollout = make_rollout("vllm", engine, built.processing)
    try:
        result = rollout.generate(conversations, SamplingParams(n=2, max_new_tokens=8, seed=0))
        expanded = expand(conversations, result)
        assert _gap(rollout, engine, built.processing, expanded, result) < ATOL
        with torch.no_grad():  # LoRA starts as a no-op (B = 0): give it weight, language and vision
            for name, param in engine.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.2)
        assert any("lora_B" in n and "visual" in n for n, _ in engine.model.named_parameters())
        assert _gap(rollout, engine, built.processing, expanded, result) > 1e-2
        rollout.sync(engine)
        assert _gap(rollout, engine, built.processing, expanded, result) < ATOL
    finally:
        rollout.close()


@pytest.mark.slow
def test_head_size_vllm_cannot_run_is_refused_up_front():
    heads_of_16 = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    built = build_model("qwen2", random_init=True, config_overrides=heads_of_16)
    engine = Engine(built, init_distributed())
    from mmrl.rollout.vllm import UnsupportedByVLLM

    with pytest.raises(UnsupportedByVLLM, match="head sizes"):
        make_rollout("vllm", engine, built.processing)


def test_vllm_reads_the_head_dim_transformers_derives():
    """A config class without `head_dim` (its attention takes hidden_size / heads): the
    config vLLM reads carries the attention modules' head_dim, as published ones do."""
    import copy

    import transformers

    from mmrl.adapter import Parts
    from mmrl.rollout.vllm import _derived_fields, _language_head_sizes

    class Adapter:
        parts = Parts(language="transformer", lm_head="lm_head")

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, n_positions=32,
                                                                 vocab_size=50, bos_token_id=0, eos_token_id=0))
    assert not hasattr(model.config, "head_dim")
    config = copy.deepcopy(model.config)
    _derived_fields(config, model, Adapter)
    assert config.head_dim == 32 and _language_head_sizes(model, Adapter) == {32}
    model.config.head_dim = 16  # a config that states it is left as it is
    config = copy.deepcopy(model.config)
    _derived_fields(config, model, Adapter)
    assert config.head_dim == 16


def _reworded_refusal():
    try:
        raise NotImplementedError("Sparse Attention is not supported on CPU.")
    except NotImplementedError as exc:
        raise RuntimeError("sparse attention was requested, but no backend is available") from exc


def test_platform_limits_are_told_apart_from_failures():
    """A kernel vLLM lacks here (probe: not run here) is not a model vLLM loads wrongly (failed)."""
    from mmrl.rollout.vllm import platform_limit

    with pytest.raises(RuntimeError) as refused:
        _reworded_refusal()
    assert platform_limit(refused.value)
    assert platform_limit(AttributeError("'_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'"))
    assert not platform_limit(ValueError("Following weights were not initialized from checkpoint: {'a.weight'}"))
    assert not platform_limit(AttributeError("'Lfm2Config' object has no attribute 'block_dim'"))
    # Raised where vLLM calls a kernel (a CPU op wrapper), or in a model's own code.
    for place, limit in (("model_executor/layers/mamba/ops/cpu/gdn_attention.py", True),
                         ("model_executor/models/clip.py", False)):
        with pytest.raises(AssertionError) as raised:
            exec(compile("raise AssertionError('needs bf16')", f"/site-packages/vllm/{place}", "exec"))
        assert platform_limit(raised.value) is limit, place


def test_a_failed_vllm_start_is_named_in_one_line():
    from mmrl.probes.training import _vllm_start_failure

    reason = _vllm_start_failure(AttributeError("'Lfm2Config' object has no attribute 'block_dim'"))
    assert "config.block_dim" in reason and "Lfm2Config" in reason and "tiny()" in reason
    try:
        raise AssertionError  # what a bare `assert` in vLLM raises (pytest rewrites the ones here)
    except AssertionError as bare:
        reason = _vllm_start_failure(bare)
    assert reason.startswith("vLLM did not load the model: AssertionError at ") and "(raise AssertionError" in reason
    assert "\n" not in reason
    # vLLM's config validation (pydantic): the first error's message, not only its count,
    # and not the list of every architecture vLLM supports.
    import pydantic

    class Config(pydantic.BaseModel):
        architecture: str

        @pydantic.field_validator("architecture")
        @classmethod
        def served(cls, value):
            raise ValueError(f"Model architectures [{value!r}] are not supported for now. Supported architectures: "
                             + "x" * 5000)

    with pytest.raises(pydantic.ValidationError) as raised:
        Config(architecture="GPTNeoForCausalLM")
    reason = _vllm_start_failure(raised.value)
    assert reason == ("vLLM did not load the model: Value error, Model architectures ['GPTNeoForCausalLM'] are not "
                      "supported for now.")


def _count_recipe(tmp_path, *overrides):
    return load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [
        "rollout.backend=vllm", f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false",
        *overrides,
    ])


TORCHRUN_PARITY = '''
import json, os, sys, torch
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.parallel import init_distributed
from mmrl.rollout import SamplingParams, make_rollout

out, overrides = sys.argv[1], json.loads(sys.argv[2])
dist = init_distributed("cpu")
params = SamplingParams(n=1, max_new_tokens=4, temperature=0.0)
gaps, rollouts = {}, []
for family, override in overrides.items():  # each family's engine beside the last
    built = build_model(family, random_init=True, config_overrides=override)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-2), total_steps=2)
    rollout = make_rollout("vllm", engine, built.processing)
    rollouts.append(rollout)
    # Each rank rolls out its own prompts (the second rank the first one's, reversed).
    conversations = sample_conversations(built.adapter)[:: 1 if dist.rank == 0 else -1]

    def gap():
        result = rollout.generate(conversations, params)
        seqs = join(dict(built.processing(conversations)), result.response_ids, result.response_mask,
                    built.adapter, engine.model, built.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = engine.log_probs(seqs)
        mask = result.response_mask.bool()
        return (logp[mask] - result.logprobs[mask]).abs().max().item()

    before = gap()
    seqs = join(dict(built.processing(conversations)), torch.full((len(conversations), 3), 25),
                torch.ones(len(conversations), 3), built.adapter, engine.model, built.tokenizer.pad_token_id)
    logp, _ = engine.log_probs(seqs)
    (-logp.sum()).backward()
    engine.step()
    stale = gap()
    rollout.sync(engine)
    after = gap()
    gaps[family] = dist.all_gather_objects({"before": before, "stale": stale, "after": after})
if dist.is_main:
    json.dump(gaps, open(out, "w"))
dist.barrier()
for rollout in reversed(rollouts):  # under torchrun vLLM's shutdown also ends the process group
    rollout.close()
'''


@pytest.mark.multiprocess
@pytest.mark.slow
def test_each_rank_runs_its_own_engine_under_torchrun(tmp_path):
    """qwen2 and qwen2_vl in one launch (a launch costs each rank its imports of torch,
    transformers and vLLM): each rank's engine log-probs equal the FSDP2-sharded engine's
    before and after a sync."""
    script, out = tmp_path / "parity.py", tmp_path / "gaps.json"
    script.write_text(TORCHRUN_PARITY)
    run(torchrun(2, script, out, json.dumps(OVERRIDES)), timeout=600)
    gaps = json.loads(out.read_text())
    assert sorted(gaps) == ["qwen2", "qwen2_vl"]
    for family, ranks in gaps.items():
        assert len(ranks) == 2, gaps
        for rank in ranks:
            assert rank["before"] < ATOL and rank["after"] < ATOL, (family, gaps)
            assert rank["stale"] > 1e-2, (family, gaps)  # the step moved the weights; the sync carried them over


@pytest.mark.multiprocess
@pytest.mark.slow
def test_training_under_torchrun_with_the_vllm_backend(tmp_path):
    out = tmp_path / "run"
    run(torchrun(2, "-m", "mmrl.cli", "train", REPO / "recipes" / "tiny_vlm_count.yaml", "rollout.backend=vllm",
                 "trainer.steps=2", f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_every=0",
                 "data.eval=synthetic:count_shapes?n=8&seed=1", "data.prompts_per_step=4",
                 "rollout.samples_per_prompt=2", "trainer.threads=1"), timeout=400)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[-1]["final"]
    assert all(line["time/sync"] > 0 for line in lines[:2])


@pytest.mark.slow
def test_count_recipe_learns_with_the_vllm_backend(tmp_path):
    """The recipe learns with vLLM sampling, and the run's own record shows the trainer
    drove vLLM each step: a weight sync and a rollout timed in every step's row, the
    validation rows at `eval_every`, and, after the last update and sync, vLLM scoring
    tokens with the trained weights. (These checks had a 3-step run of their own, which
    paid a second vLLM engine start and Trainer build; every step here is such a step.)"""
    from mmrl.data import load_prompts, to_conversation
    from mmrl.rollout.vllm import VLLMRollout
    from mmrl.trainer import Trainer

    start = time.perf_counter()
    recipe = _count_recipe(tmp_path, "trainer.export=false")
    trainer = Trainer(recipe)
    assert isinstance(trainer.rollout, VLLMRollout)
    try:
        summary = trainer.fit()
        conversations = [to_conversation(s) for s in list(load_prompts(recipe.data.eval, split="test"))[:4]]
        result = trainer.rollout.generate(conversations, SamplingParams(n=2, max_new_tokens=1, seed=0))
        expanded = expand(conversations, result)
        assert _gap(trainer.rollout, trainer.actor, trainer.processing, expanded, result) < ATOL
    finally:
        trainer.rollout.close()
    print(f"count recipe with vLLM: {summary} in {time.perf_counter() - start:.0f}s")
    assert 0.9 <= summary["eval/accuracy"] <= 1.0
    assert summary["eval/shuffled_images_accuracy"] < 0.6
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if not r.get("final")]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)) and rows[-1]["final"]
    assert all(r["time/sync"] > 0 and r["time/rollout"] > 0 for r in steps)
    every = recipe.trainer.eval_every
    assert len(steps) >= every and all(("validation/accuracy" in r) == (r["step"] % every == 0)
                                       for r in steps[:-1]), "validation rows at eval_every"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [
    "starcoder2",  # vLLM's Transformers backend; lm_head tied to the embedding
    "gemma2",  # vLLM's own class, which has no lm_head (logits from the embedding)
    "gemma4_text",  # per-layer head_dim (a heterogeneous config refuses a global config.head_dim)
    "llava",  # a vision-language type: vLLM's own class, its processor on the scaffold's tiny one
    "ovis2",  # vLLM's Transformers backend, with a processor that does not count its image tokens
])
def test_vllm_probe_verifies_a_scaffolded_family(plugin_path, model_type):
    from typer.testing import CliRunner

    from mmrl.cli import app
    from mmrl.registry import get_adapter, load_plugin

    scaffold = CliRunner().invoke(app, ["add-model", model_type, "--out", str(plugin_path), "--no-verify"])
    assert scaffold.exit_code == 0, scaffold.output
    load_plugin(f"mmrl_{model_type}.{model_type}")
    adapter = get_adapter(model_type)
    model_class = type(build_model(adapter.family, random_init=True).model.get_decoder())
    bases = model_class.__bases__
    result = probe("vllm").run(Subject(adapter=adapter, source=adapter.family))
    assert result.status is Status.VERIFIED, (result.reason, result.evidence.get("traceback"))
    # vLLM's Transformers backend decorates the decoder class it builds from; the
    # trainer's classes are given back as they were, and a model built now runs.
    assert model_class.__bases__ == bases and "do_not_compile" not in vars(model_class)
    built = build_model(adapter.family, random_init=True)
    assert torch.isfinite(built.model(input_ids=torch.tensor([[5, 6, 7]])).logits).all()


@pytest.mark.slow
def test_mixture_of_experts_weights_sync_into_vllm_on_cpu_step_after_step(plugin_path):
    """vLLM on CPU packs a mixture-of-experts layer's experts for its kernel when it loads
    them; its weight reload copied new experts in unpacked, so after a sync the tiny OLMoE's
    vLLM log-probs were 1.5e-2 off the trainer's. The rollout has each reload pack them
    anew (`_repack_experts_on_reload`): equal after each of two updates and syncs."""
    from typer.testing import CliRunner

    from mmrl.checks import sample_conversations
    from mmrl.cli import app
    from mmrl.probes.training import _sequences
    from mmrl.registry import load_plugin

    scaffold = CliRunner().invoke(app, ["add-model", "olmoe", "--out", str(plugin_path), "--no-verify"])
    assert scaffold.exit_code == 0, scaffold.output
    load_plugin("mmrl_olmoe.olmoe")
    built = build_model("olmoe", random_init=True)
    engine = Engine(built, init_distributed(), optim=OptimConfig(lr=1e-2), total_steps=3)
    conversations = sample_conversations(built.adapter)
    params = SamplingParams(n=1, max_new_tokens=4, temperature=0.0)
    rollout = make_rollout("vllm", engine, built.processing)
    prompts = dict(built.processing(conversations))

    def gap() -> float:
        result = rollout.generate(conversations, params)
        seqs = join(prompts, result.response_ids, result.response_mask, built.adapter, engine.model,
                    built.tokenizer.pad_token_id)
        with torch.no_grad():
            trainer, _ = engine.log_probs(seqs)
        mask = result.response_mask.bool()
        return float((trainer[mask] - result.logprobs[mask]).abs().max())

    try:
        assert gap() < ATOL
        for _ in range(2):
            seqs = _sequences(built, engine)
            logp, _ = engine.log_probs(seqs)
            (-(logp * seqs.response_mask).sum()).backward()
            engine.step()
            rollout.sync(engine)
            assert gap() < ATOL
    finally:
        rollout.close()


@pytest.mark.slow
def test_add_model_declares_vllm_where_its_probe_verifies_in_a_process_of_its_own(plugin_path):
    """`mmrl add-model TYPE --columns vllm`: the depth stage's vllm probe, for real, in a
    fresh process (vLLM's engine and memory go with it); the adapter written declares
    vllm, and the written family loads with the claim."""
    from typer.testing import CliRunner

    from mmrl.cli import app
    from mmrl.registry import get_adapter, load_plugin

    scaffold = CliRunner().invoke(app, ["add-model", "gpt2", "--out", str(plugin_path), "--columns", "vllm"])
    assert scaffold.exit_code == 0, scaffold.output
    source = (plugin_path / "mmrl_gpt2" / "gpt2.py").read_text()
    assert "vllm=True" in source and "Not declared: vllm" not in source
    load_plugin("mmrl_gpt2.gpt2")
    adapter = get_adapter("gpt2")
    assert adapter.capabilities.vllm and adapter.rollout.vllm_architecture == "GPT2LMHeadModel"


def test_a_vocabulary_lookup_that_fails_in_vllm_names_the_missing_token():
    from mmrl.probes.training import _vllm_start_failure

    vocab = {"\n": 0}
    try:
        vocab["\n\n"]  # what vLLM's processor does with the checkpoint's vocabulary
    except KeyError as missing:
        reason = _vllm_start_failure(missing)
    assert reason.startswith("vLLM's processor for this model looks up '\\n\\n' in the tokenizer's vocabulary")
    assert "\n" not in reason
    assert _vllm_start_failure(KeyError("other")).startswith("vLLM did not load the model: KeyError")


def test_media_attention_check_finds_a_backend_that_attends_causally_among_image_tokens():
    """vLLM's multimodal prefix LMs (bidirectional attention among an image's tokens) on a
    backend without it: flagged, as on vLLM's CPU backend, where such a model starts and
    samples from other log-probs than the trainer's."""
    from mmrl.rollout.vllm import _attends_causally_in_media

    def layer(prefix: bool, supported: bool):
        backend = type("Backend", (), {"supports_mm_prefix": classmethod(lambda cls: supported)})
        module = torch.nn.Module()
        module.use_mm_prefix, module.attn_backend = prefix, backend
        return module

    def model(*layers):
        return torch.nn.Sequential(torch.nn.Linear(2, 2), *layers)

    assert _attends_causally_in_media(model(layer(True, False)))
    assert not _attends_causally_in_media(model(layer(True, True)))  # FlashAttention on a GPU
    assert not _attends_causally_in_media(model(layer(False, False)))  # a causal model
    assert not _attends_causally_in_media(model())


def test_packed_weight_check_finds_a_multihead_attention_whose_weight_vllm_took():
    """vLLM on CPU packs a linear layer's weight for its kernels and leaves the layer an
    empty one; torch's MultiheadAttention reads its output projection's weight directly."""
    from mmrl.rollout.vllm import _reads_packed_weight

    pooling = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), pooling)
    assert not _reads_packed_weight(model)
    pooling.out_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # what vLLM leaves
    assert _reads_packed_weight(model)
    with pytest.raises(RuntimeError, match="must be a matrix, got 1-D"):  # the failure it stands for
        pooling(torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8))


@pytest.mark.slow
def test_a_prefix_lm_is_refused_where_vllm_attends_causally_among_image_tokens():
    """The tiny Gemma 3 on vLLM's CPU backend: with images its log-probs differ from the
    trainer's by ~5e-3, and with the trainer made causal among image tokens (its
    token_type_ids zeroed) they agree, so it is the attention, and the rollout refuses."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from mmrl.rollout.vllm import UnsupportedByVLLM

    # Where vLLM's CPU backend learns this attention, the family's vllm cell should verify instead.
    assert not CPUAttentionBackend.supports_mm_prefix()
    built = build_model("gemma3", random_init=True)
    engine = Engine(built, init_distributed())
    with pytest.raises(UnsupportedByVLLM, match="attends causally among an image's tokens"):
        make_rollout("vllm", engine, built.processing)
