"""The RL loop on tiny models: it runs for every algorithm, resumes exactly, exports a
loadable policy, and micro-batching does not change the update."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl import load_model
from mmrl.config import RecipeError, load_recipe
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]

TEXT = [
    "model.path=qwen2", "model.random_init=true",
    "model.tiny_vocabulary={characters: '0123456789+ ?', words: [What, is, user, assistant]}",
    "data.train=synthetic:arithmetic?n=64&seed=0&max_operand=4",
    "data.eval=synthetic:arithmetic?n=8&seed=1&max_operand=4",
    "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3",
    "reward.name=numeric", "algo.micro_batch_size=16", "trainer.progress=false", "trainer.threads=2",
]


def _recipe(tmp_path, *extra):
    return load_recipe(None, [*TEXT, f"trainer.output_dir={tmp_path / 'run'}", *extra])


def length_reward(completions, answers, **fields):
    """A dense user reward (by dotted path) so every algorithm sees unequal rewards."""
    return [len(c) / 3 for c in completions]


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}


def test_run_writes_metrics_plot_and_a_loadable_export(tmp_path):
    trainer = Trainer(_recipe(tmp_path, "trainer.steps=3"))
    summary = trainer.fit()
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if not r.get("final")] == [1, 2, 3]
    for key in ("reward/mean", "reward/std", "entropy", "clip_fraction", "response/length", "tokens_per_s",
                "time/rollout", "time/update", "grad_norm"):
        assert key in rows[0], key
    assert rows[-1]["final"] and 0.0 <= rows[-1]["eval/accuracy"] <= 1.0
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert any((run / "tensorboard").iterdir())
    assert (run / "recipe.yaml").is_file()
    exported = load_model(summary["export"])
    batch = exported.inputs([[{"role": "user", "content": "What is 1+2?"}]])
    with torch.no_grad():
        ours = trainer.actor.model(**batch).logits
        theirs = exported.model(**batch).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_resume_continues_exactly(tmp_path):
    straight = Trainer(_recipe(tmp_path / "a", "trainer.steps=4", "trainer.export=false"))
    straight.fit()
    first = Trainer(_recipe(tmp_path / "b", "trainer.steps=2", "trainer.save_every=2", "trainer.export=false"))
    first.fit()
    resumed = Trainer(_recipe(tmp_path / "b", "trainer.steps=4", "trainer.resume=true", "trainer.export=false"))
    resumed.fit()
    assert resumed.step == 4
    a, b = _weights(straight), _weights(resumed)
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name


def test_micro_batches_give_the_same_update(tmp_path):
    results = []
    for micro in (16, 3):
        trainer = Trainer(_recipe(tmp_path / str(micro), f"algo.micro_batch_size={micro}", "trainer.steps=1",
                                  "trainer.export=false"))
        trainer.fit()
        results.append(_weights(trainer))
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], atol=1e-6), name


@pytest.mark.parametrize("algo", [
    ["algo.advantage=gae"],
    ["algo.advantage=rloo", "algo.kl_coef=0.1", "algo.kl_in=loss"],
    ["algo.advantage=reinforce_pp", "algo.kl_coef=0.1", "algo.kl_in=reward", "algo.kl_estimator=k1"],
    ["algo.advantage=dr_grpo", "algo.loss_aggregation=seq_mean_token_sum_norm", "algo.clip_high=0.28",
     "algo.epochs_per_rollout=2", "algo.filter_uniform_groups=true"],
])
def test_every_algorithm_runs(tmp_path, algo):
    trainer = Trainer(_recipe(tmp_path, *algo, "trainer.steps=2", "trainer.export=false", "data.eval=null",
                              "reward.name=test_trainer:length_reward"))
    before = _weights(trainer)
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(v)) for r in rows for v in r.values() if isinstance(v, float))
    if "algo.advantage=gae" in algo:
        assert "loss/value" in rows[0]
    if any(a.startswith("algo.kl_coef") for a in algo):
        assert any(k.startswith("kl/") for k in rows[0])
    changed = any(not torch.equal(before[k], v) for k, v in _weights(trainer).items())
    kept = [r.get("groups/kept", 1.0) for r in rows]
    assert changed or all(k == 0.0 for k in kept)


def test_vision_recipe_with_lora_and_frozen_vision_runs(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2", "trainer.eval_every=0", "trainer.progress=false",
        "data.train=synthetic:count_shapes?n=32&seed=0", "data.eval=synthetic:count_shapes?n=8&seed=1",
        "data.prompts_per_step=4", "rollout.samples_per_prompt=2", "model.lora_scope=language",
        "model.freeze=[vision]", "trainer.export=true",
    ])
    trainer = Trainer(recipe)
    summary = trainer.fit()
    assert {"eval/accuracy", "eval/majority_baseline", "eval/shuffled_images_accuracy"} <= summary.keys()
    exported = load_model(summary["export"])
    assert not any("lora" in name for name in exported.model.state_dict())


def test_recipe_errors_name_the_field(tmp_path):
    with pytest.raises(RecipeError, match=r"optim\.lr: Input should be greater than 0"):
        load_recipe(None, ["model.path=qwen2", "data.train=x.jsonl", "optim.lr=-1"])
    with pytest.raises(RecipeError, match=r"algo\.bogus: Extra inputs are not permitted"):
        load_recipe(None, ["model.path=qwen2", "data.train=x.jsonl", "algo.bogus=1"])
    with pytest.raises(RecipeError, match="must read key=value"):
        load_recipe(None, ["model.path"])
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)


def test_cli_train_reports_bad_recipes_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", str(REPO / "recipes" / "tiny_vlm_count.yaml"),
                             "rollout.backend=sglang"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2
    assert "rollout.backend" in result.stderr and len(result.stderr.strip().splitlines()) == 1
