"""The compiled rollout under FSDP2 (mmrl/rollout/inference_copy.py): each rank decodes its
own prompts on an unsharded copy of the full weights, gathered from the shards.

2 processes under torchrun (gloo, fp32 on CPU, the decode loop eager or through dynamo):
greedy tokens, masks and log-probs equal a 1-process run's on the same full weights,
before and after the shards change (as an update changes them) and the rollout syncs, for
a text and a vision-language family; a copy that is freed after each rollout gives the
same and holds no memory between rollouts; when the loop fails on one rank, every rank
falls back to plain generate together. A 2-process LoRA training run decodes on exactly
the trained (merged) weights. One process: every zoo family's copy computes the engine's
logits, the auto choice, the one-line message where the copy does not fit, the error
when `hf_compiled` was asked for. On a GPU (`-m gpu`): a sharded engine of one process
takes the compiled path and matches its plain `generate`, in fp32 and in bf16.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import FAMILIES
from cpu_processes import run, torchrun

SHARDED_ROLLOUT = '''
import json, sys, torch
from mmrl.parallel import Dist, init_distributed
from mmrl.registry import get_adapter
from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout.compiled import CompiledHFRollout
from widened_models import prompt_conversation, widened_engine

out, cases = sys.argv[1], json.loads(sys.argv[2])  # cases: [[family, keep, mode], ...], one after the other
torch.set_num_threads(1)
dist = init_distributed("cpu")
params = SamplingParams(n=2, max_new_tokens=12, temperature=0, logprobs=True)


def rows(result):
    """Each response as (tokens, log-probs) up to its mask's end."""
    lengths = result.response_mask.sum(-1).long().tolist()
    return [(result.response_ids[r, :n].tolist(), result.logprobs[r, :n].tolist()) for r, n in enumerate(lengths)]


def case(family, keep, mode):
    multimodal = get_adapter(family).is_multimodal
    built, engine = widened_engine(family, dist=dist)  # the same weights on every rank (seeded)
    options = {"compile": False} if mode == "eager" else {"compile_options": {"backend": "eager", "fullgraph": True}}
    rollout = make_rollout("hf_compiled", engine, built.processing, inference_copy=keep, **options)
    assert isinstance(rollout, CompiledHFRollout) and rollout.copy is not None
    mine = [prompt_conversation(multimodal, i) for i in range(dist.rank, 4, 2)]  # rank r: prompts r, r + 2
    record = {"kept": rollout.copy.keep}
    states, results = [], []
    for phase in ("before", "after"):
        if phase == "after":
            # The shards change as an update changes them (each rank its own part), then sync.
            generator = torch.Generator().manual_seed(10 + dist.rank)
            engine.model.reshard()  # the root's weights too are shards again (a rollout gathers them)
            with torch.no_grad():
                for parameter in engine.model.parameters():
                    local = parameter.to_local()
                    if local.dim() == 2:
                        local.add_(torch.randn(local.shape, generator=generator) * 0.1)
            rollout.sync(engine)
            record["fresh_after_sync"] = rollout.copy.fresh
        states.append(engine.full_state_dict())  # rank 0 gets the full weights
        result = rollout.generate(mine, params)
        assert rollout.fallback_reason is None, rollout.fallback_reason
        record[f"resident_{phase}"] = rollout.copy.resident_bytes()
        results.append(dist.all_gather_objects(rows(result)))
    # The decode loop fails on rank 1 only: both ranks take plain generate (collective) together.
    if dist.rank == 1:
        def broken(*args):
            raise RuntimeError("out of luck")
        rollout._fast_sample = broken
    failing = rows(rollout.generate(mine, params))
    record["fallbacks"] = dist.all_gather_objects(rollout.fallback_reason)
    record["fallback_rows"] = dist.all_gather_objects(failing)
    if dist.rank == 0:
        alone = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
        single, reference = widened_engine(family, dist=alone)
        conversations = [prompt_conversation(multimodal, i) for i in range(4)]
        for phase, state, gathered in zip(("before", "after"), states, results):
            single.model.load_state_dict(state)
            plain = rows(make_rollout("hf", reference, single.processing).generate(conversations, params))
            fast = rows(make_rollout("hf_compiled", reference, single.processing, compile=False)
                        .generate(conversations, params))
            record[phase] = {"plain": plain, "fast": fast, "sharded": gathered}
    return record


records = {"-".join(c): case(*c) for c in cases}
if dist.rank == 0:
    json.dump(records, open(out, "w"))
dist.barrier()
torch.distributed.destroy_process_group()
from mmrl.parallel.mesh import exit_cleanly  # no interpreter teardown: gloo's threads can abort it
exit_cleanly()
'''

SHARDED_TRAINING = '''
import json, sys, torch
from mmrl.config import load_recipe
from mmrl.parallel import init_distributed
from mmrl.trainer import Trainer

out, recipe_path, *overrides = sys.argv[1:]
dist = init_distributed("cpu")
trainer = Trainer(load_recipe(recipe_path, overrides), dist=dist)
rollout = trainer.rollout
rollout.compile = False  # the decode loop eagerly: compiling on the CPU costs more than it saves
before = {name: p.detach().clone() for name, p in rollout.copy.model.named_parameters()}
trainer.fit()
state = trainer.actor.full_state_dict()  # rank 0 gets the full weights
if dist.rank == 0:
    copy = dict(rollout.copy.model.named_parameters())
    json.dump({"backend": rollout.backend, "fallback": rollout.fallback_reason, "fresh": rollout.copy.fresh,
               "decode_steps": rollout.stats.get("steps", 0),
               "copy_is_trained": all(torch.equal(copy[name], state[name]) for name in copy),
               "changed": any(not torch.equal(before[name], state[name]) for name in copy)}, open(out, "w"))
dist.barrier()
torch.distributed.destroy_process_group()
from mmrl.parallel.mesh import exit_cleanly  # no interpreter teardown: gloo's threads can abort it
exit_cleanly()
'''


def _in_prompt_order(rows_by_rank):
    """The rows of both ranks in the 1-process order: rank r answered prompts r and r + 2,
    two rows each."""
    rows = [None] * 8
    for rank, rank_rows in enumerate(rows_by_rank):
        for j, row in enumerate(rank_rows):
            rows[2 * (rank + 2 * (j // 2)) + j % 2] = row
    return rows


def _close(rows_a, rows_b, atol=1e-4):
    for (tokens_a, logp_a), (tokens_b, logp_b) in zip(rows_a, rows_b, strict=True):
        assert tokens_a == tokens_b
        torch.testing.assert_close(torch.tensor(logp_a), torch.tensor(logp_b), atol=atol, rtol=0)


ROLLOUT_CASES = [("qwen2", "keep", "dynamo"), ("qwen2_vl", "free", "eager")]


@pytest.fixture(scope="module")
def sharded_rollouts(tmp_path_factory):
    """Every case of ROLLOUT_CASES in one torchrun launch (the processes start, import and
    join their group once), by case: "family-keep-mode"."""
    folder = tmp_path_factory.mktemp("sharded_rollout")
    script, out = folder / "rollout.py", folder / "rollout.json"
    script.write_text(SHARDED_ROLLOUT)
    run(torchrun(2, script, out, json.dumps(ROLLOUT_CASES)), timeout=600)
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("family, keep, mode", ROLLOUT_CASES)
def test_two_process_compiled_rollout_equals_one_process(sharded_rollouts, family, keep, mode):
    """The text case runs the decode step through dynamo (full graph, eager backend) on
    a kept copy; the VLM case runs it eagerly on a copy freed after each rollout."""
    record = sharded_rollouts[f"{family}-{keep}-{mode}"]
    for phase in ("before", "after"):
        plain, fast, sharded = (record[phase][k] for k in ("plain", "fast", "sharded"))
        assert len(set(map(str, plain))) > 2  # the rows differ: a row out of place would show
        _close(plain, fast)
        _close(plain, _in_prompt_order(sharded))
    # One rank's failure: every rank fell back (none waits in a collective alone), with the same rows.
    assert record["fallbacks"] == ["on another rank: RuntimeError: out of luck", "RuntimeError: out of luck"]
    _close(record["after"]["plain"], _in_prompt_order(record["fallback_rows"]))
    # The update changed what the model says: the copy was gathered again.
    assert [t for t, _ in record["before"]["plain"]] != [t for t, _ in record["after"]["plain"]]
    assert record["kept"] == (keep == "keep")
    if keep == "keep":
        assert record["fresh_after_sync"] and record["resident_after"] > 0
    else:
        assert not record["fresh_after_sync"] and record["resident_before"] == record["resident_after"] == 0


@pytest.mark.multiprocess
def test_two_process_training_run_decodes_on_the_copy_of_the_updated_weights(tmp_path):
    """A 2-process LoRA run of the trainer with `rollout.backend: hf_compiled`: every
    rollout and evaluation takes the compiled path, and after the last update the kept copy
    holds exactly the trained weights with the adapters merged in (what the run's full
    state dict gives), gathered by the sync."""
    from cpu_processes import REPO

    script, out = tmp_path / "train.py", tmp_path / "train.json"
    script.write_text(SHARDED_TRAINING)
    run(torchrun(2, script, out, REPO / "recipes" / "tiny_vlm_count.yaml", "rollout.backend=hf_compiled",
                 "rollout.inference_copy=keep", "rollout.max_new_tokens=3", "model.lora_scope=language",
                 "model.lora_rank=4", "trainer.steps=2", "trainer.eval_every=0",
                 "trainer.progress=false", "trainer.export=false", "trainer.threads=1", "data.prompts_per_step=4",
                 "rollout.samples_per_prompt=2", "data.eval=synthetic:count_shapes?n=4&seed=1&image_size=56",
                 "data.validation=synthetic:count_shapes?n=4&seed=2&image_size=56",
                 f"trainer.output_dir={tmp_path / 'run'}"), timeout=400)
    record = json.loads(out.read_text())
    assert record["backend"] == "hf_compiled" and record["fallback"] is None
    assert record["decode_steps"] >= 2  # the last rollout (the final evaluation's) ran the decode loop
    assert record["fresh"] and record["changed"] and record["copy_is_trained"]


def _engine(device="cpu", sharded=True, left_padding=True):
    adapter = SimpleNamespace(left_padding=left_padding, family="fake")
    dist = SimpleNamespace(device=torch.device(device), is_main=True, world_size=2 if sharded else 1,
                           distributed=sharded)
    return SimpleNamespace(dist=dist, sharded=sharded,
                           adapter=adapter)


def test_auto_takes_the_compiled_rollout_under_fsdp2_on_a_gpu():
    from mmrl.rollout import choose_backend

    assert choose_backend("auto", _engine("cuda", sharded=True)) == "hf_compiled"
    assert choose_backend("auto", _engine("cuda", sharded=True, left_padding=False)) == "hf"
    assert choose_backend("auto", _engine("cpu", sharded=True)) == "hf"


def _tiny_engine():
    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed

    built = build_model("qwen2", random_init=True, seed=0)
    return built, Engine(built, init_distributed("cpu"), mixed_precision=False)


def test_the_copy_is_sized_in_the_sharded_forwards_dtype():
    from mmrl.rollout.inference_copy import copy_bytes, copy_dtype

    built, engine = _tiny_engine()
    assert copy_dtype(engine) == torch.float32  # the training dtype on the CPU: exact comparisons
    unique = {id(p): p for p in built.model.parameters()}.values()  # tied embeddings once
    total, largest = copy_bytes(engine, torch.bfloat16)
    assert total == sum(p.numel() for p in unique) * 2
    assert largest == max(p.numel() for p in unique) * 4
    engine.dist, engine.mixed_precision = SimpleNamespace(device=torch.device("cuda")), True
    assert copy_dtype(engine) == torch.bfloat16  # FSDP2's mixed-precision param dtype


def test_a_copy_that_does_not_fit_says_so_in_one_line_or_fails_when_asked_for(monkeypatch, capsys):
    """auto: one line on stderr, then plain generate; hf_compiled named: a one-line error
    naming rollout.backend. The copy is measured against the fullest rank's free memory."""
    from mmrl.rollout import inference_copy, make_rollout
    from mmrl.rollout.hf import HFRollout
    from mmrl.rollout.inference_copy import CopyDoesNotFit

    built, engine = _tiny_engine()
    engine.sharded = True
    total, largest = inference_copy.copy_bytes(engine, torch.float32)
    monkeypatch.setattr(inference_copy, "free_memory", lambda device: total + largest - 1)
    monkeypatch.setattr("mmrl.rollout.choose_backend", lambda backend, engine, multi_turn=False:
                        "hf_compiled" if backend == "auto" else backend)
    rollout = make_rollout("auto", engine, built.processing, compile=False)
    assert type(rollout) is HFRollout
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "does not fit" in line and line.endswith("plain generate instead")
    with pytest.raises(CopyDoesNotFit, match=r"^rollout.backend=hf_compiled: .*does not fit") as caught:
        make_rollout("hf_compiled", engine, built.processing, compile=False)
    assert "\n" not in str(caught.value)
    # Room for the copy and one gathered tensor, but not for twice the copy: it is freed
    # after each rollout.
    monkeypatch.setattr(inference_copy, "free_memory", lambda device: total + largest)
    rollout = make_rollout("auto", engine, built.processing, compile=False)
    assert rollout.copy is not None and not rollout.copy.keep
    monkeypatch.setattr(inference_copy, "free_memory", lambda device: 2 * total + largest)
    assert make_rollout("auto", engine, built.processing, compile=False).copy.keep
    with pytest.raises(ValueError, match="rollout.inference_copy must be one of auto, keep, free"):
        inference_copy.InferenceCopy(engine, keep="sometimes")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_copy_computes_the_engines_logits(family):
    """The copy of each zoo family's tiny model (built from its class and config on the
    meta device, buffers copied, the surgery's attention names given back, the family's
    on_load fix-ups, tied weights kept tied) gives the engine's model's logits to the bit
    in fp32, on the family's sample prompts (images of two sizes for VLMs)."""
    from mmrl import build_model
    from mmrl.checks import sample_conversations
    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed
    from mmrl.rollout.inference_copy import InferenceCopy

    built = build_model(family, random_init=True, seed=0)
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False, share_media=False)
    copy = InferenceCopy(engine, keep="free")
    model = copy.refresh(engine)
    assert model is not engine.model and not any(p.is_meta for p in model.parameters())
    inputs = dict(built.processing(sample_conversations(built.adapter)))
    with torch.no_grad():
        expected = engine.model.eval()(**inputs).logits
        torch.testing.assert_close(model(**inputs).logits, expected, atol=0, rtol=0)
    tied = engine.model.get_output_embeddings().weight is engine.model.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    copy.release()
    assert copy.resident_bytes() == 0 and not copy.fresh


def test_the_memory_the_first_update_will_take_counts_against_the_copy(monkeypatch):
    """Measured before the first step, free memory does not yet hold AdamW's moments (kept
    from the first update on) nor the gradients (during each update): the copy must fit
    beside the moments, and "auto" keeps it only with room beside the gradients too."""
    from mmrl import build_model
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed
    from mmrl.rollout import inference_copy
    from mmrl.rollout.inference_copy import CopyDoesNotFit, InferenceCopy, pending_training_bytes

    built = build_model("qwen2", random_init=True, seed=0)
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False, optim=OptimConfig())
    trainable = sum(p.numel() for p in {id(p): p for p in built.model.parameters() if p.requires_grad}.values())
    moments, gradients = pending_training_bytes(engine)
    assert (moments, gradients) == (8 * trainable, 4 * trainable)
    total, largest = inference_copy.copy_bytes(engine, torch.float32)
    monkeypatch.setattr(inference_copy, "free_memory", lambda device: total + largest + moments - 1)
    with pytest.raises(CopyDoesNotFit):
        InferenceCopy(engine)
    monkeypatch.setattr(inference_copy, "free_memory", lambda device: 2 * total + moments + gradients - 1)
    assert not InferenceCopy(engine).keep
    monkeypatch.setattr(inference_copy, "free_memory", lambda device: 2 * total + moments + gradients)
    assert InferenceCopy(engine).keep
    frozen = Engine(build_model("qwen2", random_init=True, seed=0), init_distributed("cpu"))
    assert pending_training_bytes(frozen) == (0, 0)


def test_the_recipe_field_reaches_the_compiled_rollout():
    from mmrl.config import load_recipe

    assert load_recipe("recipes/tiny_vlm_count.yaml", []).rollout.inference_copy == "auto"
    recipe = load_recipe("recipes/tiny_vlm_count.yaml", ["rollout.inference_copy=free"])
    assert recipe.rollout.inference_copy == "free"
    with pytest.raises(ValueError, match="inference_copy"):
        load_recipe("recipes/tiny_vlm_count.yaml", ["rollout.inference_copy=sometimes"])


class _OneRankFSDP2:
    """A `Dist` of one CUDA process that the engine shards anyway (FSDP2 over a mesh of
    one rank, NCCL): the sharded engine's code paths on a one-GPU machine."""

    def __init__(self, folder):
        import torch.distributed as torch_dist
        from torch.distributed.device_mesh import init_device_mesh

        from mmrl.parallel import Dist

        class Sharded(Dist):
            @property
            def distributed(self) -> bool:
                return True

        torch.cuda.set_device(0)
        torch_dist.init_process_group("nccl", init_method=f"file://{folder}/group", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
        self.dist = Sharded(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), mesh=mesh)

    def close(self):
        torch.distributed.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("keep", ["keep", "free"])
def test_sharded_engine_on_cuda_takes_the_compiled_rollout_and_matches_plain_generate(tmp_path, keep):
    """One CUDA process, FSDP2 over one rank, fp32 (no mixed precision): `auto` builds the
    compiled rollout on an inference copy (inductor + CUDA graphs), whose greedy tokens,
    finish reasons and log-probs equal the sharded engine's plain `generate`; again after
    the shards change and the rollout syncs (a kept copy is refreshed in place, so the
    captured graphs replay on new weights; a freed one is allocated again)."""
    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.rollout import SamplingParams, choose_backend, make_rollout
    from mmrl.rollout.compiled import CompiledHFRollout

    group = _OneRankFSDP2(tmp_path)
    try:
        shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=8, num_attention_heads=14,
                     num_key_value_heads=2, head_dim=64, vocab_size=151936)
        with torch.device("cuda"):
            built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape)
        engine = Engine(built, group.dist, mixed_precision=False)
        assert engine.sharded and choose_backend("auto", engine) == "hf_compiled"
        rollout = make_rollout("auto", engine, built.processing, inference_copy=keep)
        assert isinstance(rollout, CompiledHFRollout) and rollout.copy is not None
        assert rollout.copy.dtype == torch.float32 and rollout.copy.keep == (keep == "keep")
        conversations = [[{"role": "user", "content": text}] for text in
                         ("What is it?", "And this one here, a longer one?", "no", "Say something about the sea")]
        params = SamplingParams(n=2, max_new_tokens=32, temperature=0, logprobs=True)
        answers = []
        for phase in ("before", "after"):
            if phase == "after":
                engine.model.reshard()
                generator = torch.Generator(device="cuda").manual_seed(3)
                with torch.no_grad():
                    for parameter in engine.model.parameters():
                        local = parameter.to_local()
                        if local.dim() == 2:
                            local.add_(torch.randn(local.shape, generator=generator, device="cuda") * 0.02)
                rollout.sync(engine)
            plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
            fast = rollout.generate(conversations, params)
            assert rollout.fallback_reason is None
            assert torch.equal(fast.response_ids, plain.response_ids), phase
            assert fast.finish_reasons == plain.finish_reasons
            torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-3, rtol=0)
            assert (rollout.copy.resident_bytes() > 0) == (keep == "keep")
            answers.append(plain.response_ids)
        assert not torch.equal(*answers)  # the new weights changed the answers
    finally:
        group.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sharded_engine_on_cuda_decodes_a_bf16_copy_under_mixed_precision(tmp_path):
    """FSDP2's bf16 mixed precision: the copy is bf16 (what the sharded forward computes
    in) and half the fp32 weights' bytes; its greedy tokens follow the sharded engine's
    plain `generate` (bf16 kernels may part after a few tokens, as for one process)."""
    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.rollout import SamplingParams, make_rollout

    group = _OneRankFSDP2(tmp_path)
    try:
        shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=8, num_attention_heads=14,
                     num_key_value_heads=2, head_dim=64, vocab_size=151936)
        with torch.device("cuda"):
            built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape)
        full_bytes = sum(p.numel() * 4 for p in {id(p): p for p in built.model.parameters()}.values())
        engine = Engine(built, group.dist)
        rollout = make_rollout("auto", engine, built.processing)
        assert rollout.copy.dtype == torch.bfloat16 and rollout.copy.bytes == full_bytes // 2
        conversations = [[{"role": "user", "content": text}] for text in
                         ("What is it?", "And this one here, a longer one?", "no", "Say something about the sea")]
        params = SamplingParams(n=2, max_new_tokens=32, temperature=0, logprobs=True)
        plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
        fast = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None
        same = (fast.response_ids == plain.response_ids).int().cumprod(-1).bool()
        assert int(same.sum(-1).min()) >= 4, same.sum(-1)
        torch.testing.assert_close(fast.logprobs[same], plain.logprobs[same], atol=0.1, rtol=0)
    finally:
        group.close()
