"""float16 weights train with dynamic loss scaling (`Engine.backward`, `Engine.step`,
`mmrl.engine.master_weights.LossScaler`): scaled gradients survive where fp16 underflows,
an overflowing step is skipped and the scale backs off, good steps grow it, the scaler
state survives a checkpoint, fp32 and bf16 engines are untouched, and sharded ranks skip
together.

CPU: `pytest -q tests/test_loss_scaling.py` (the two-process test is marked multiprocess).
"""

import json
import math

import pytest
import torch
from cpu_processes import run, torchrun
from test_engine import _sequences

from mmrl import build_model
from mmrl.config import OptimConfig
from mmrl.engine import Engine
from mmrl.engine.master_weights import LossScaler
from mmrl.parallel import init_distributed

START = 2.0**16


def _engine(dtype: str = "float16", seed: int = 0, **kwargs):
    built = build_model("qwen2", random_init=True, seed=seed, dtype=dtype)
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3, grad_clip=1e9), total_steps=20,
                    **kwargs)
    return engine, _sequences(built)


def _loss(engine, seqs, factor: float = 1.0) -> torch.Tensor:
    """The token-mean negative log-likelihood of the responses times `factor`: with
    factor 1 its fp16 gradients neither underflow nor overflow at the starting scale."""
    logp, _ = engine.log_probs(seqs)
    return -(logp * seqs.response_mask).sum() / seqs.response_mask.sum() * factor


def _optimizer_gradients(engine) -> dict[str, torch.Tensor]:
    """Filled at the optimizer step with the gradients it steps by (the fp32 masters'
    where the engine keeps them), i.e. after unscaling and clipping."""
    seen = {}
    masters = engine.master_state_dict()
    params = masters or dict(engine.model.named_parameters(remove_duplicate=False))  # tied: both names

    def record(optimizer, args, kwargs):
        seen.update({name: p.grad.detach().clone() for name, p in params.items()})

    engine.optimizer.register_step_pre_hook(record)
    return seen


def _gap(grads: dict, reference: dict) -> float:
    """|| grads - reference || / || reference || over all parameters."""
    gap = sum((grads[k] - reference[k]).norm() ** 2 for k in reference) ** 0.5
    return float(gap / sum(g.norm() ** 2 for g in reference.values()) ** 0.5)


def _zero_share(grads: dict) -> float:
    return sum(int((g == 0).sum()) for g in grads.values()) / sum(g.numel() for g in grads.values())


def _state(engine) -> dict[str, torch.Tensor]:
    """Masters (fp32 copies), model weights and AdamW moments, cloned."""
    out = {f"master.{k}": v.detach().clone() for k, v in engine.master_state_dict().items()}
    out.update({f"model.{k}": v.detach().clone() for k, v in engine.model.state_dict().items()})
    for i, state in enumerate(engine.optimizer.state.values()):
        out.update({f"adam.{i}.{k}": v.clone() for k, v in state.items()})
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_scaled_fp16_gradients_match_fp32_where_unscaled_ones_underflow():
    """A loss of 1e-6 x the token mean: its fp16 gradients round to zero almost
    everywhere (measured: 99.5% of them), while scaled by 2**16 and unscaled in fp32 they
    are the fp32 model's up to fp16's forward/backward rounding (measured: 1.0e-3 relative;
    the same loss at factor 1, where nothing underflows, gives 7e-4)."""
    factor = 1e-6
    built = build_model("qwen2", random_init=True, seed=0, dtype="float16")
    built.model.float()  # the same fp16 weights, upcast
    fp32 = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3, grad_clip=1e9))
    seqs = _sequences(built)
    reference = _optimizer_gradients(fp32)
    _loss(fp32, seqs, factor).backward()
    fp32.step()

    scaled, _ = _engine()
    assert scaled.loss_scale == START
    seen = _optimizer_gradients(scaled)
    scaled.backward(_loss(scaled, seqs, factor))
    scaled.step()
    assert seen.keys() == reference.keys() and all(g.dtype == torch.float32 for g in seen.values())
    assert _gap(seen, reference) < 5e-3
    assert _zero_share(seen) < 0.01

    plain, _ = _engine()
    unscaled = _optimizer_gradients(plain)
    _loss(plain, seqs, factor).backward()  # not through the engine: runs unscaled
    plain.step()
    assert _zero_share(unscaled) > 0.9
    assert _gap(unscaled, reference) > 0.5


def test_an_overflowing_step_is_skipped_the_scale_halves_and_the_next_step_proceeds():
    engine, seqs = _engine()
    engine.backward(_loss(engine, seqs))
    engine.step()  # optimizer state exists from here on
    before, schedule = _state(engine), engine.scheduler.last_epoch
    # 1e4 x 2**16 exceeds fp16's largest value (65504) in the backward.
    engine.backward(_loss(engine, seqs, 1e4))
    assert math.isnan(engine.step())
    assert engine.step_skipped and engine.skipped_steps == 1
    assert engine.loss_scale == START / 2
    assert _equal(_state(engine), before)  # masters, weights and AdamW moments untouched
    assert all(p.grad is None for p in engine.model.parameters())
    assert all(m.grad is None for m in engine.master_state_dict().values())
    assert engine.scheduler.last_epoch == schedule + 1  # the schedule advances, as with GradScaler

    engine.backward(_loss(engine, seqs))
    assert math.isfinite(engine.step())
    assert not engine.step_skipped and engine.loss_scale == START / 2
    after = _state(engine)
    assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith("master."))


def test_good_steps_double_the_scale_after_the_growth_interval():
    engine, seqs = _engine(loss_scale_growth_interval=3)
    for _ in range(2):
        engine.backward(_loss(engine, seqs))
        engine.step()
    assert engine.loss_scale == START
    engine.backward(_loss(engine, seqs, 1e4))
    engine.step()  # skipped: backs off and restarts the count
    assert engine.loss_scale == START / 2
    for _ in range(2):
        engine.backward(_loss(engine, seqs))
        engine.step()
    assert engine.loss_scale == START / 2
    engine.backward(_loss(engine, seqs))
    engine.step()
    assert engine.loss_scale == START and engine.loss_scaler.good_steps == 0
    with pytest.raises(ValueError, match="growth_interval must be a positive integer, got 0"):
        LossScaler(growth_interval=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp32_and_bf16_engines_scale_nothing(dtype):
    """`Engine.backward` is plain `loss.backward()` there: the same weights bit for bit."""
    weights = []
    for through_engine in (True, False):
        engine, seqs = _engine(dtype)
        assert engine.loss_scaler is None and engine.loss_scale == 1.0
        for _ in range(2):
            loss = _loss(engine, seqs)
            engine.backward(loss) if through_engine else loss.backward()
            engine.step()
            assert not engine.step_skipped
        weights.append(_state(engine))
    assert _equal(*weights)


def test_fp16_without_masters_is_not_scaled():
    """Unscaled gradients would be fp16 again (torch's GradScaler refuses them too)."""
    engine, _ = _engine(master_weights=False)
    assert engine.loss_scaler is None


def test_a_checkpoint_keeps_the_scale_and_the_good_step_count(tmp_path):
    engine, seqs = _engine(loss_scale_growth_interval=5)
    for factor in (1.0, 1e4, 1.0, 1.0):  # the second overflows
        engine.backward(_loss(engine, seqs, factor))
        engine.step()
    saved = engine.loss_scaler.state_dict()
    assert saved == {"scale": START / 2, "good_steps": 2, "skipped_steps": 1}
    engine.save_checkpoint(tmp_path / "ckpt")
    resumed, _ = _engine(seed=3, loss_scale_growth_interval=5)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.loss_scaler.state_dict() == saved
    # A checkpoint from before loss scaling loads with the starting scale.
    rest = torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=True)
    del rest["loss_scaler"]
    torch.save(rest, tmp_path / "ckpt" / "optimizer.pt")
    older, _ = _engine(seed=3)
    older.load_checkpoint(tmp_path / "ckpt")
    assert older.loss_scaler.state_dict() == {"scale": START, "good_steps": 0, "skipped_steps": 0}


@pytest.mark.slow
def test_a_float16_run_logs_the_loss_scale_and_ends_with_finite_weights(tmp_path):
    from pathlib import Path

    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml"
    trainer = Trainer(load_recipe(recipe, [
        f"trainer.output_dir={tmp_path}", "trainer.steps=2", "trainer.eval_every=0", "trainer.export=false",
        "trainer.progress=false", "data.eval=null", "data.validation=null", "model.dtype=float16",
    ]))
    assert trainer.actor.loss_scaler is not None
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if "update/loss_scale" in r]
    assert len(updates) == 2 and all(r["update/loss_scale"] > 0 and r["update/skipped_steps"] >= 0 for r in updates)
    weights = trainer.actor.model.state_dict().values()
    assert all(w.dtype == torch.float16 and torch.isfinite(w).all() for w in weights)


SHARDED_FP16_STEPS = '''
import json, sys, torch
from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.parallel import Dist, init_distributed

torch.set_num_threads(1)
dist = init_distributed("cpu")

def setup(dist):
    built = build_model("qwen2", random_init=True, seed=0, dtype="float16")
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-3, grad_clip=1e9), total_steps=4)
    conversations = sample_conversations(built.adapter)  # 2 prompts: one a rank
    responses = torch.randint(50, built.model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(responses)
    rows = list(range(dist.rank, 2, dist.world_size))
    prompts = dict(built.processing([conversations[i] for i in rows]))
    mine = join(prompts, responses[rows], mask[rows], built.adapter, built.model, built.tokenizer.pad_token_id)
    return engine, mine, float(mask.sum())

def backward(engine, mine, tokens, world_size):
    logp, _ = engine.log_probs(mine)
    engine.backward(-(logp * mine.response_mask).sum() / tokens * world_size)

if dist.is_main:
    alone = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    engine, mine, tokens = setup(alone)
    backward(engine, mine, tokens, 1)
    reference_norm = engine.step()
engine, mine, tokens = setup(dist)
start = {n: p.to_local().clone() for n, p in engine.model.named_parameters()}
# An inf in one shard of rank 1 only: every rank has to skip.
backward(engine, mine, tokens, dist.world_size)
if dist.rank == 1:
    grad = next(p.grad.to_local() for p in engine.model.parameters() if p.grad.to_local().numel())
    grad.view(-1)[0] = float("inf")
engine.step()
record = {"skipped": engine.step_skipped, "scale_after_skip": engine.loss_scale,
          "unchanged": all(torch.equal(p.to_local(), start[n]) for n, p in engine.model.named_parameters())}
backward(engine, mine, tokens, dist.world_size)
record["norm"] = engine.step()
record["taken"] = not engine.step_skipped
records = dist.all_gather_objects(record)
if dist.is_main:
    json.dump({"ranks": records, "reference_norm": reference_norm}, open(sys.argv[1], "w"))
dist.barrier()
torch.distributed.destroy_process_group()
from mmrl.parallel.mesh import exit_cleanly  # no interpreter teardown: gloo's threads can abort it
exit_cleanly()
'''


@pytest.mark.multiprocess
def test_two_fsdp2_ranks_skip_together_and_unscale_their_shards(tmp_path):
    """An inf in one rank's gradient shard skips the step on both ranks (the found-inf
    decision is all-reduced), both back off alike; the next step's unscaled grad norm is
    the one-process engine's (fp16 rounding apart: 1e-2 relative is generous)."""
    script, out = tmp_path / "fp16_fsdp.py", tmp_path / "fp16_fsdp.json"
    script.write_text(SHARDED_FP16_STEPS)
    # Ranks that disagree on skipping hang in the grad-norm collective: fail sooner.
    run(torchrun(2, script, out), timeout=120)
    result = json.loads(out.read_text())
    for rank in result["ranks"]:
        assert rank["skipped"] and rank["unchanged"] and rank["scale_after_skip"] == START / 2, rank
        assert rank["taken"]
        assert rank["norm"] == pytest.approx(result["reference_norm"], rel=1e-2)
