"""The engine's parts on their own: `surgery.resolve` settles every "auto" per device and
process, `apply_all` freezes what does not train, `Engine.layout` picks the batch's layout.
The engine's numbers (log-probs, values, steps, checkpoints) are tests/test_engine.py's."""

import pytest
import torch

from mmrl import build_model
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.engine import surgery
from mmrl.engine.layouts import Packed, Padded
from mmrl.parallel import Dist, init_distributed


def _dist(device: str, world: int = 1) -> Dist:
    return Dist(rank=0, world_size=world, local_rank=0, device=torch.device(device), mesh=None)


def _resolve(built, dist, **options):
    settled = dict(trains=True, pack=False, dropout=False, gradient_checkpointing="auto", compile_layers="auto",
                   master_weights=True, mixed_precision=True)
    return surgery.resolve(built.model, built.adapter, dist, **{**settled, **options})


def test_resolve_settles_every_auto_for_the_device_and_the_process_count():
    built = build_model("qwen2", random_init=True)
    cpu, gpu, sharded_gpu = _resolve(built, _dist("cpu")), _resolve(built, _dist("cuda")), \
        _resolve(built, _dist("cuda", world=2))
    # Checkpointing "auto": only sharded GPU ranks start with it (one GPU process turns it on after an OOM).
    assert (cpu.checkpointing, gpu.checkpointing, sharded_gpu.checkpointing) == (False, False, True)
    assert cpu.checkpointing_auto and _resolve(built, _dist("cpu"), gradient_checkpointing=True).checkpointing
    # Compiled layers "auto": a GPU in one process; asked for, anywhere.
    assert (cpu.compile_layers, gpu.compile_layers, sharded_gpu.compile_layers) == (False, True, False)
    asked = _resolve(built, _dist("cpu"), compile_layers=True)
    assert asked.compile_layers and asked.compile_layers_asked and not gpu.compile_layers_asked
    # The varlen kernel: packed rows on a GPU.
    assert not gpu.varlen and _resolve(built, _dist("cuda"), pack=True).varlen
    assert not _resolve(built, _dist("cpu"), pack=True).varlen
    for option in ("gradient_checkpointing", "compile_layers"):
        with pytest.raises(ValueError, match=f"{option} must be true, false or auto, got 'yes'"):
            _resolve(built, _dist("cpu"), **{option: "yes"})


def test_resolve_names_the_half_dtype_only_where_masters_train():
    built = build_model("qwen2", random_init=True)
    built.model.to(torch.bfloat16)
    assert _resolve(built, _dist("cpu")).half_dtype == torch.bfloat16
    assert _resolve(built, _dist("cpu"), trains=False).half_dtype is None
    assert _resolve(built, _dist("cpu"), master_weights=False).half_dtype is None
    next(built.model.parameters()).data = next(built.model.parameters()).data.half()
    with pytest.raises(ValueError, match="trainable parameters mix half-precision dtypes"):
        _resolve(built, _dist("cpu"))


def test_an_engine_that_does_not_train_is_frozen_and_one_that_trains_has_its_optimizer():
    frozen = Engine(build_model("qwen2", random_init=True), init_distributed("cpu"))
    assert frozen.stepper is None and frozen.optimizer is None and not frozen.trains
    assert not frozen.model.training and not any(p.requires_grad for p in frozen.parameters())
    actor = Engine(build_model("qwen2", random_init=True), init_distributed("cpu"), optim=OptimConfig(lr=1e-3))
    assert actor.trains and actor.optimizer is actor.stepper.optimizer and actor.model.training
    assert all(p.requires_grad for p in actor.parameters())


@pytest.mark.parametrize("pack, layout", [(False, Padded), (True, Packed)])
def test_the_engine_runs_a_batch_in_the_layout_its_packing_says(pack, layout):
    built = build_model("qwen2", random_init=True)
    engine = Engine(built, init_distributed("cpu"), pack=pack)
    prompts = dict(built.processing([[{"role": "user", "content": "hi"}]] * 2))
    responses = torch.randint(50, 100, (2, 3))
    seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, engine.model,
                built.tokenizer.pad_token_id)
    assert type(engine.layout(seqs)) is layout
    logp, entropy = engine.log_probs(seqs)
    assert logp.shape == entropy.shape == (2, 3)
