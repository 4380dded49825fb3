"""LoRA done right (issue 32): with a KL term the reference of a LoRA actor is the actor
with its adapters disabled (no second model), and `model.lora_alpha`, `lora_dropout` and
`lora_targets` reach peft, checked before the model is built.

    .venv/bin/python -m pytest -q tests/test_lora_reference.py
"""

import json
from pathlib import Path

import pytest
import torch

import mmrl.trainer as trainer_module
from mmrl.build import build_recipe_model, load_model
from mmrl.config import OptimConfig, RecipeError, load_recipe
from mmrl.data import to_conversation
from mmrl.engine import Engine
from mmrl.lora import AdapterFreeReference
from mmrl.parallel import Dist
from mmrl.rollout import SamplingParams
from mmrl.rollout_batch import rollout_sequences
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "tiny_vlm_count.yaml")
CHEAP = ["trainer.steps=1", "trainer.progress=false", "trainer.export=false", "data.validation=null",
         "data.eval=null", "data.prompts_per_step=2", "rollout.samples_per_prompt=2"]
ONE_PROCESS = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


def _lora_modules(model):
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def test_kl_reference_is_the_actor_without_adapters_and_no_second_model(tmp_path, monkeypatch):
    built, engines = [], []

    def counting_build(*args, **kwargs):
        built.append(kwargs)
        return build_recipe_model(*args, **kwargs)

    class CountingEngine(Engine):
        def __init__(self, *args, **kwargs):
            engines.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_recipe_model", counting_build)
    monkeypatch.setattr(trainer_module, "Engine", CountingEngine)
    recipe = load_recipe(RECIPE, [*CHEAP, f"trainer.output_dir={tmp_path / 'run'}", "model.lora_scope=language",
                                  "algo.kl_coef=0.1"])
    trainer = Trainer(recipe)
    assert len(built) == 1 and engines == [trainer.actor], "a LoRA actor's reference builds no second model"
    assert isinstance(trainer.ref, AdapterFreeReference) and trainer.ref.actor is trainer.actor
    layers = _lora_modules(trainer.actor.model)
    assert layers and all(layer.scaling["default"] == 2.0 for layer in layers.values())  # alpha 2 x rank

    trainer.fit()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # LoRA's B starts at zero: the actor is its reference at the first step.
    assert first["kl/loss"] == pytest.approx(0.0, abs=1e-7)

    # Adapters that change the policy, then the same sequences three ways.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers.values():
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    samples = [trainer.train_set[i] for i in range(2)]
    conversations = [to_conversation(s, max_pixels=recipe.model.max_pixels) for s in samples]
    result = trainer.rollout.generate(conversations, SamplingParams(n=2, max_new_tokens=1, temperature=1.0))
    seqs = rollout_sequences([conversations[i] for i in result.prompt_index.tolist()], result.response_ids,
                             result.response_mask, trainer.processing, trainer.built.adapter, trainer.actor.model)
    actor_before = trainer.actor.log_probs(seqs, 1.0, with_entropy=False)[0]
    reference = trainer.ref.log_probs(seqs, 1.0, with_entropy=False)[0]
    actor_after = trainer.actor.log_probs(seqs, 1.0, with_entropy=False)[0]
    base = Engine(build_recipe_model(recipe.model, seed=recipe.trainer.seed), ONE_PROCESS)
    separate = base.log_probs(seqs, 1.0, with_entropy=False)[0]
    mask = seqs.response_mask.bool()
    assert torch.allclose(reference[mask], separate[mask], atol=1e-5), (reference, separate)
    assert (actor_before[mask] - separate[mask]).abs().max() > 1e-3, "the adapters should change the policy"
    assert torch.equal(actor_before, actor_after), "the adapters are back on after the reference pass"


@pytest.mark.slow
def test_lora_alpha_dropout_and_targets_reach_peft(tmp_path):
    recipe = load_recipe(RECIPE, [*CHEAP, f"trainer.output_dir={tmp_path / 'run'}", "model.lora_scope=language",
                                  "model.lora_rank=2", "model.lora_alpha=8", "model.lora_dropout=0.1",
                                  "model.lora_targets=[q_proj, v_proj]"])
    trainer = Trainer(recipe)
    layers = _lora_modules(trainer.actor.model)
    assert {name.rsplit(".", 1)[-1] for name in layers} == {"q_proj", "v_proj"}
    assert all("language_model" in name for name in layers)  # the scope still holds
    for layer in layers.values():
        assert layer.r["default"] == 2 and layer.scaling["default"] == 4.0
        # The engine switches every dropout off; the adapters' is the one the recipe asks for.
        assert layer.lora_dropout["default"].p == 0.1
    assert trainer.ref is None  # no KL term, no reference
    trainer.folder.release()


@pytest.mark.parametrize("overrides, words", [
    (["model.lora_alpha=4"], "model.lora_alpha: set, but lora_scope is none"),
    (["model.lora_dropout=0.1"], "model.lora_dropout: set, but lora_scope is none"),
    (["model.lora_scope=language", "model.lora_dropout=1"], "model.lora_dropout: Input should be less than 1"),
    (["model.lora_scope=language", "model.lora_alpha=0"], "model.lora_alpha: Input should be greater than 0"),
    (["model.lora_scope=language", "model.lora_targets=[model.q_proj]"],
     "model.lora_targets: give leaf module names such as q_proj"),
    (["model.lora_scope=language", "model.lora_targets=[q_proj, qkv]"],
     "model.lora_targets: qkv names no linear module in the 'language' scope of family 'qwen2_vl' "
     "(its linear leaf names there: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"),
    (["model.lora_scope=vision", "model.lora_targets=[q_proj]"],
     "model.lora_targets: q_proj names no linear module in the 'vision' scope"),
])
def test_lora_settings_are_checked_before_the_build(tmp_path, monkeypatch, overrides, words):
    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the recipe was checked")

    monkeypatch.setattr(trainer_module, "build_recipe_model", no_build)
    with pytest.raises(RecipeError) as err:
        Trainer(load_recipe(RECIPE, [*CHEAP, f"trainer.output_dir={tmp_path / 'run'}", *overrides]))
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


def test_lora_dropout_acts_on_a_loaded_checkpoint_and_the_reference_does_not_see_it(tmp_path):
    """A checkpoint comes back from `from_pretrained` in eval mode, where HF skips LoRA's
    dropout and activation checkpointing; the training engine puts it in training mode."""
    recipe = load_recipe(RECIPE, [*CHEAP, f"trainer.output_dir={tmp_path / 'seed'}"])
    build_recipe_model(recipe.model, seed=0).save(tmp_path / "checkpoint")
    recipe = load_recipe(RECIPE, [*CHEAP, f"trainer.output_dir={tmp_path / 'run'}", "model.random_init=false",
                                  f"model.path={tmp_path / 'checkpoint'}", "model.config_overrides={}",
                                  "model.tiny_vocabulary={}", "model.lora_scope=language", "model.lora_dropout=0.5",
                                  "algo.kl_coef=0.1", "model.gradient_checkpointing=true"])
    trainer = Trainer(recipe)
    # Every module, not only peft's wrapper (whose own flag is True either way).
    assert all(module.training for module in trainer.actor.model.modules()) and trainer.actor.checkpointing
    plain = Engine(load_model(tmp_path / "checkpoint"), ONE_PROCESS, optim=OptimConfig())
    assert all(module.training for module in plain.model.modules())
    with torch.no_grad():
        for layer in _lora_modules(trainer.actor.model).values():
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    conversations = [to_conversation(trainer.train_set[i], max_pixels=recipe.model.max_pixels) for i in range(2)]
    result = trainer.rollout.generate(conversations, SamplingParams(n=2, max_new_tokens=1, temperature=1.0))
    assert trainer.actor.model.training, "the rollout gives the training mode back"
    seqs = rollout_sequences([conversations[i] for i in result.prompt_index.tolist()], result.response_ids,
                             result.response_mask, trainer.processing, trainer.built.adapter, trainer.actor.model)
    with torch.no_grad():
        actor = [trainer.actor.log_probs(seqs, 1.0, with_entropy=False)[0] for _ in range(2)]
        reference = [trainer.ref.log_probs(seqs, 1.0, with_entropy=False)[0] for _ in range(2)]
    assert not torch.equal(actor[0], actor[1]), "LoRA dropout 0.5 should make two passes differ"
    assert torch.equal(reference[0], reference[1]), "the adapters, their dropout included, are off in the reference"
    trainer.folder.release()
