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


@pytest.mark.slow
def test_run_writes_metrics_plot_and_a_loadable_export(tmp_path):
    trainer = Trainer(_recipe(tmp_path, "trainer.steps=3"))
    summary = trainer.fit()
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if not r.get("final")] == [1, 2, 3]
    for key in ("reward/mean", "reward/std", "entropy", "clip_fraction", "response/length", "tokens_per_s",
                "time/rollout", "time/update", "time/compile", "compile/graphs", "time/gc", "grad_norm"):
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


def _gradients_of_first_step(trainer) -> tuple[dict, dict]:
    """The actor's gradients just before its first optimizer step, and that step's metrics."""
    seen = {}
    take_step = trainer.actor.step

    def step():
        if "grads" not in seen:
            seen["grads"] = {n: p.grad.detach().clone() for n, p in trainer.actor.model.named_parameters()
                             if p.grad is not None}
        return take_step()

    trainer.actor.step = step
    metrics = trainer.train_step()
    return seen["grads"], metrics


VLM = REPO / "recipes" / "tiny_vlm_count.yaml"
VLM_CHEAP = ["trainer.eval_every=0", "data.eval=null", "data.validation=null", "data.prompts_per_step=4",
             "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3", "model.tiny_vocabulary={}",
             "reward.options={}"]


@pytest.mark.parametrize("family", ["text", "vlm"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.slow
def test_micro_batches_by_tokens_give_the_same_loss_and_gradients(tmp_path, family, aggregation):
    """algo.micro_batch_tokens splits the step into uneven micro-batches (a KL reference and
    an entropy term in the loss, and for the VLM packed rows); the loss and the gradients
    of the update equal those of one micro-batch of every row."""
    common = ["trainer.steps=1", "trainer.export=false", "trainer.progress=false", "algo.kl_coef=0.1",
              "algo.entropy_coef=0.01", f"algo.loss_aggregation={aggregation}",
              "reward.name=test_trainer:length_reward"]
    runs = []
    for name, extra in (("rows", ["algo.micro_batch_size=64"]),
                        ("tokens", ["algo.micro_batch_tokens=40", "model.pack=true", "model.pack_tokens=40"])):
        out = [f"trainer.output_dir={tmp_path / name}", *common, *extra]
        recipe = _recipe(tmp_path / name, *out) if family == "text" else load_recipe(VLM, [*VLM_CHEAP, *out])
        trainer = Trainer(recipe)
        grads, metrics = _gradients_of_first_step(trainer)
        runs.append((grads, metrics))
    (plain, plain_metrics), (split, split_metrics) = runs
    assert plain_metrics["update/micro_batches"] == 1 and split_metrics["update/micro_batches"] >= 3
    assert split_metrics["reward/mean"] == plain_metrics["reward/mean"]  # the same rollout
    assert split_metrics["loss/policy"] == pytest.approx(plain_metrics["loss/policy"], abs=1e-6)
    assert plain.keys() == split.keys()
    scale = max(g.abs().max().item() for g in plain.values())
    assert scale > 0
    for name, grad in plain.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_one_mini_batch_is_the_plain_update(tmp_path):
    """algo.mini_batches=1 takes one step per rollout with the ratio exactly 1: no old
    log-probs are estimated, and the weights equal a run without the field, bit for bit."""
    weights = []
    for name, extra in (("default", []), ("one", ["algo.mini_batches=1"])):
        trainer = Trainer(_recipe(tmp_path / name, "trainer.steps=2", "trainer.export=false",
                                  "reward.name=test_trainer:length_reward", *extra))
        calls = []
        estimate = trainer.actor.log_probs
        trainer.actor.log_probs = lambda *a, **k: (calls.append(torch.is_grad_enabled()), estimate(*a, **k))[1]
        trainer.fit()
        assert calls and all(calls)  # only the update's (grad-enabled) passes
        weights.append(_weights(trainer))
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


@pytest.mark.slow
def test_auto_checkpointing_redoes_an_update_that_ran_out_of_memory(tmp_path):
    """gradient_checkpointing: auto starts without checkpointing; when an update runs out
    of memory (here: raised on its second micro-batch, after the first one's gradients
    were accumulated) checkpointing turns on and the mini-batch is redone from zeroed
    gradients: the weights equal a run with checkpointing from the start."""
    common = ("trainer.steps=2", "trainer.export=false", "reward.name=test_trainer:length_reward",
              "algo.micro_batch_size=6")
    reference = Trainer(_recipe(tmp_path / "on", *common, "model.gradient_checkpointing=true"))
    assert reference.actor.checkpointing
    reference.fit()
    trainer = Trainer(_recipe(tmp_path / "auto", *common))
    assert trainer.recipe.model.gradient_checkpointing == "auto" and not trainer.actor.checkpointing
    passes = []
    log_probs = trainer.actor.log_probs

    def short_of_memory(*args, **kwargs):
        if torch.is_grad_enabled():
            passes.append(trainer.actor.checkpointing)
            if passes == [False, False]:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return log_probs(*args, **kwargs)

    trainer.actor.log_probs = short_of_memory
    trainer.fit()
    assert passes[:2] == [False, False] and all(passes[2:]) and len(passes) == 2 + 2 * 3
    theirs = _weights(reference)
    for name, value in _weights(trainer).items():
        assert torch.allclose(value, theirs[name], atol=1e-6), name
    # Without "auto" the error is the user's to see.
    fixed = Trainer(_recipe(tmp_path / "off", *common, "model.gradient_checkpointing=false"))
    fixed.actor.log_probs = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("simulated"))
    with pytest.raises(torch.OutOfMemoryError):
        fixed.fit()


def test_mini_batches_step_against_the_log_probs_before_the_first_update(tmp_path, monkeypatch):
    """algo.mini_batches=2 takes 2 optimizer steps per rollout; both steps' ratios are taken
    against the log-probs computed before the first, so the first step's ratio is 1 and the
    second's is not, and at a large learning rate the clip acts there."""
    import mmrl.update

    calls = []
    plain_loss = mmrl.update.policy_loss

    def recording_loss(logp, old_logp, *args, **kwargs):
        loss, stats = plain_loss(logp, old_logp, *args, **kwargs)
        calls.append((logp.detach().clone(), old_logp.detach().clone(), args[1].bool(), float(stats["clip_fraction"])))
        return loss, stats

    monkeypatch.setattr(mmrl.update, "policy_loss", recording_loss)  # as the update calls it
    trainer = Trainer(_recipe(tmp_path, "trainer.steps=1", "trainer.export=false", "algo.mini_batches=2",
                              "algo.micro_batch_size=3", "optim.lr=0.05", "reward.name=test_trainer:length_reward"))
    steps = []
    take_step = trainer.actor.step
    trainer.actor.step = lambda: (steps.append(len(calls)), take_step())[1]
    estimated = []
    plan = trainer.update.plan

    def planned(*args):
        made = plan(*args)
        estimated.extend(s.extras["old_logp"].clone() for s in made.batches)
        return made

    trainer.update.plan = planned
    metrics = trainer.train_step()
    assert metrics["update/optimizer_steps"] == 2 and len(steps) == 2
    # 16 rows in micro-batches of 3: two mini-batches of 8 rows, three micro-batches each.
    assert steps == [3, 6] and metrics["update/micro_batches"] == 6
    for (logp, old, mask, _), before in zip(calls, estimated):
        assert torch.equal(old, before)  # the pre-update log-probs, in both mini-batches
    first, second = calls[:3], calls[3:]
    for logp, old, mask, _ in first:
        torch.testing.assert_close(logp[mask], old[mask], rtol=0, atol=1e-5)
    ratios = torch.cat([(logp - old)[mask].exp() for logp, old, mask, _ in second])
    assert (ratios - 1).abs().max() > 0.2  # the first step moved the policy
    assert max(clip for *_, clip in second) > 0


def test_update_plan_splits_by_rows_tokens_and_mini_batches():
    from mmrl.engine.batching import Micro, even_out, update_plan

    rows = lambda plan: [[m.rows for m in mini] for mini in plan]  # noqa: E731
    assert rows(update_plan([5] * 5, micro_batch_size=2)) == [[(0, 1), (2, 3), (4,)]]
    assert rows(update_plan([5] * 5, mini_batches=2, micro_batch_size=2)) == [[(0, 1), (2,)], [(3, 4)]]
    assert rows(update_plan([30, 5, 5, 50, 10], micro_batch_tokens=40)) == [[(0, 1, 2), (3,), (4,)]]
    assert rows(update_plan([1, 1], mini_batches=5)) == [[(0,)], [(1,)]]
    evened = even_out(update_plan([5] * 3, micro_batch_size=4), [4])
    # Halved while a micro-batch has two rows, then a zero-weighted repeat.
    assert evened == [[Micro((0,)), Micro((1,)), Micro((2,)), Micro((2,), 0.0)]]
    assert even_out(update_plan([5] * 4, micro_batch_size=4), [2]) == [[Micro((0, 1)), Micro((2, 3))]]


def rank_skewed_reward(completions, answers, **fields):
    """Rewards that differ within every group on rank 0 and are uniform in the first half
    of rank 1's groups (which `filter_uniform_groups` then drops): the ranks keep unequal rows."""
    import os

    rank, half = int(os.environ.get("RANK", "0")), len(completions) // 2
    return [1.0 if rank == 1 and i < half else float(i % 2) for i in range(len(completions))]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_with_unequal_kept_rows_run_as_many_passes(tmp_path):
    """Under FSDP2 (2 processes, gloo) rank 1 keeps half as many rows as rank 0 and makes
    micro-batches of one row (a 1-token budget): it repeats micro-batches with weight 0 so
    both ranks run as many forward/backward passes, and the run finishes its steps."""
    from cpu_processes import run, torchrun

    out = tmp_path / "run"
    run(torchrun(2, "-m", "mmrl.cli", "train", REPO / "recipes" / "tiny_vlm_count.yaml", "trainer.steps=2",
                 f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_every=0", "trainer.export=false",
                 "data.eval=null", "data.validation=null", "data.train=synthetic:count_shapes?n=16&seed=0",
                 "data.prompts_per_step=8", "rollout.samples_per_prompt=2", "trainer.threads=1",
                 "algo.micro_batch_tokens=1", "algo.mini_batches=2", "algo.filter_uniform_groups=true",
                 "algo.kl_coef=0.1", "reward.name=test_trainer:rank_skewed_reward", "reward.options={}"), timeout=900)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if not line.get("final")]
    assert [line["step"] for line in steps] == [1, 2]
    # Rank 0 (which logs): 8 rows, in 2 mini-batches of 4 single-row micro-batches.
    assert all(line["update/optimizer_steps"] == 2 and line["update/micro_batches"] == 8 for line in steps)


@pytest.mark.parametrize("half", [True, False])
def test_rollout_half_weights_reaches_the_compiled_rollout(tmp_path, half):
    from mmrl.rollout.compiled import CompiledHFRollout

    trainer = Trainer(_recipe(tmp_path, "rollout.backend=hf_compiled", f"rollout.half_weights={str(half).lower()}"))
    assert isinstance(trainer.rollout, CompiledHFRollout) and trainer.rollout.half_weights is half


@pytest.mark.parametrize("extra, tokens", [((), 16384), (("algo.micro_batch_tokens=20000",), 20000),
                                           (("algo.micro_batch_tokens=400",), 16384),
                                           (("algo.micro_batch_tokens=20000", "model.pack_tokens=500"), 500)])
def test_pack_tokens_default_follows_a_larger_token_budget(tmp_path, extra, tokens):
    """Unset, `model.pack_tokens` is 16384 or `algo.micro_batch_tokens` where larger (a
    token-budget micro-batch in one row), in every engine; set, it stands."""
    trainer = Trainer(_recipe(tmp_path, "model.pack=true", "algo.kl_coef=0.1", "algo.advantage=gae", *extra))
    assert [e.pack_tokens for e in (trainer.actor, trainer.ref, trainer.critic)] == [tokens] * 3


@pytest.mark.parametrize("value, compiled", [("true", True), ("false", False), ("auto", False)])
def test_model_compile_layers_reaches_every_engine(tmp_path, value, compiled):
    """`model.compile_layers` reaches actor, reference and critic ("auto" compiles only on
    a GPU, so not here)."""
    trainer = Trainer(_recipe(tmp_path, f"model.compile_layers={value}", "algo.kl_coef=0.1", "algo.advantage=gae"))
    engines = [trainer.actor, trainer.ref, trainer.critic]
    assert all(engine is not None for engine in engines)
    assert [engine.compiled_layers is not None for engine in engines] == [compiled] * 3


def test_a_checkpoints_reference_and_critic_share_the_actors_processor(tmp_path, monkeypatch):
    """A run from a checkpoint with KL and a critic loads the checkpoint's processor once: the
    prompt-length check and the actor's build share one load, and the reference and the
    critic are built with the actor's processor (before: a tokenizer for the check and three
    loads of the processor, seconds each for a large vocabulary)."""
    from mmrl import build
    from mmrl.build import build_model

    checkpoint = build_model("qwen2", random_init=True, tiny_vocabulary={
        "characters": "0123456789+ ?", "words": ["What", "is", "user", "assistant"]}).save(tmp_path / "model")
    loads, tokenizers = [], []
    load_processor, load_tokenizer = build.load_processor, build._load_tokenizer
    monkeypatch.setattr(build, "load_processor", lambda *a, **k: loads.append(a[0]) or load_processor(*a, **k))
    monkeypatch.setattr(build, "_load_tokenizer", lambda *a, **k: tokenizers.append(a[0]) or load_tokenizer(*a, **k))
    trainer = Trainer(_recipe(tmp_path, f"model.path={checkpoint}", "model.random_init=false",
                              "model.tiny_vocabulary={}", "algo.kl_coef=0.1", "algo.advantage=gae"))
    assert trainer.ref is not None and trainer.critic is not None
    assert loads == [checkpoint]
    assert len(tokenizers) == build._own_tokenizer_class(checkpoint)  # only the processor's own, where mmrl loads it
    for engine in (trainer.ref, trainer.critic):  # the same weights, loaded from the checkpoint
        assert torch.equal(engine.model.get_input_embeddings().weight, trainer.actor.model.get_input_embeddings().weight)
    assert "reward/mean" in trainer.train_step()  # and a step runs with them
