"""Evaluation (issue 32): mean reward beside accuracy, a configurable notion of correct,
sampled pass@k / mean@k, the shuffled-images control as an option, validation before the
first step, and `mmrl eval RECIPE --checkpoint DIR` on an export and on a step checkpoint.

    .venv/bin/python -m pytest -q tests/test_evaluation.py
"""

import itertools
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mmrl.cli import app
from mmrl.config import EvalConfig, load_recipe
from mmrl.evaluation import Evaluator, pass_at_k, pass_k_values
from mmrl.parallel import Dist
from mmrl.rollout import RolloutResult
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "tiny_vlm_count.yaml")
# The tiny recipe, made cheap (as tests/test_bad_inputs.py's CHEAP): one step, small held-out sets.
CHEAP = ["trainer.steps=1", "trainer.progress=false", "trainer.export=false",
         "data.validation=synthetic:count_shapes?n=4&seed=2&image_size=56",
         "data.eval=synthetic:count_shapes?n=6&seed=1&image_size=56", "data.prompts_per_step=2",
         "rollout.samples_per_prompt=2"]
ONE_PROCESS = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


def half_reward(completions, answers, **fields):
    """A graded reward: 0.5 for everything, so "reward >= 1" never counts it correct."""
    return [0.5] * len(completions)


# -- the estimator ---------------------------------------------------------------------------------
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_response():
    for n in range(1, 7):
        for correct in range(n + 1):
            outcomes = [True] * correct + [False] * (n - correct)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, correct, k) == pytest.approx(expected, abs=1e-12), (n, correct, k)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(1000, 0, 500) == 0.0 and pass_at_k(1000, 1, 1000) == 1.0  # no overflow
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 1, 5)


def test_reported_k_are_powers_of_two_and_the_sample_count():
    assert pass_k_values(1) == [1]
    assert pass_k_values(2) == [1, 2]
    assert pass_k_values(6) == [1, 2, 4, 6]
    assert pass_k_values(8) == [1, 2, 4, 8]


# -- the evaluator, on a stand-in policy ---------------------------------------------------------------
class StandIn:
    """A policy whose response to sample i (greedy) scores `greedy[i]`, and whose j-th
    sampled response scores `sampled[i][j]`; responses come back in reverse order, as a
    backend is free to return them (grouped by `prompt_index`)."""

    def __init__(self, greedy, sampled=None):
        self.greedy, self.sampled, self.calls = greedy, sampled, []

    def generate(self, samples, rows, dataset, params, context):
        self.calls.append((len(samples), params.n, params.temperature))
        index = torch.arange(len(samples)).repeat_interleave(params.n).flip(0)
        slot = torch.arange(params.n).repeat(len(samples)).flip(0)
        ids = torch.stack([torch.tensor([s["id"] for s in samples])[index], slot], -1)
        return RolloutResult(response_ids=ids, response_mask=torch.ones(len(index), 2), finish_reasons=[],
                             prompt_index=index)

    def score(self, samples, result, rows, dataset, context):
        greedy = self.calls[-1][2] == 0.0
        return torch.tensor([self.greedy[i] if greedy else self.sampled[i][slot]
                             for i, slot in result.response_ids.tolist()])


def _evaluator(policy, **settings):
    return Evaluator(EvalConfig(**settings), ONE_PROCESS, generate=policy.generate, score=policy.score,
                     max_new_tokens=1)


def test_accuracy_counts_by_the_threshold_and_mean_reward_is_always_there():
    samples = [{"id": i, "answer": "1"} for i in range(4)]
    policy = StandIn(greedy=[1.0, 0.5, 0.2, 0.0])
    assert _evaluator(policy).run(samples) == pytest.approx({"accuracy": 0.25, "mean_reward": 0.425})
    assert _evaluator(policy, correct_threshold=0.5).run(samples)["accuracy"] == pytest.approx(0.5)
    assert _evaluator(policy, correct_threshold=0.0).run(samples)["accuracy"] == pytest.approx(1.0)
    assert policy.calls == [(4, 1, 0.0)] * 3  # greedy only, one call of 4 prompts each time


def test_sampled_evaluation_gives_pass_at_k_and_mean_at_k():
    samples = [{"id": i, "answer": "1"} for i in range(3)]
    sampled = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0.5, 1]]
    policy = StandIn(greedy=[0.0, 0.0, 1.0], sampled=sampled)
    metrics = _evaluator(policy, samples=4, temperature=1.0, batch_size=2).run(samples)
    correct = [1, 0, 3]
    for k in (1, 2, 4):
        assert metrics[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in correct) / 3), k
    assert metrics["pass@1"] == pytest.approx(4 / 12)
    assert metrics["mean@4"] == pytest.approx(sum(map(sum, sampled)) / 12)
    assert metrics["accuracy"] == pytest.approx(1 / 3)  # still the greedy figure
    # Batches of 2 prompts: greedy 2 + 1, then sampled 2 + 1 at eval.temperature.
    assert policy.calls == [(2, 1, 0.0), (1, 1, 0.0), (2, 4, 1.0), (1, 4, 1.0)]


def test_controls_and_the_shuffled_images_option():
    samples = [{"id": i, "answer": a, "images": [f"{i}.png"]} for i, a in enumerate("1123")]
    policy = StandIn(greedy=[1.0, 1.0, 0.0, 0.0])
    metrics = _evaluator(policy).run(samples, controls=True)
    assert metrics["majority_baseline"] == pytest.approx(0.5)
    assert "shuffled_images_accuracy" in metrics and len(policy.calls) == 2  # the control doubles the work
    policy.calls.clear()
    metrics = _evaluator(policy, shuffled_images=False).run(samples, controls=True)
    assert "shuffled_images_accuracy" not in metrics and len(policy.calls) == 1
    assert "majority_baseline" in metrics


def test_the_readme_recipe_keeps_its_shuffled_images_control():
    """README.md and tests/test_recipe.py read eval/shuffled_images_accuracy of this recipe."""
    assert load_recipe(RECIPE).eval.shuffled_images is True


def test_validation_before_training_needs_a_set():
    from mmrl.config import RecipeError

    with pytest.raises(RecipeError, match=r"trainer: val_before_train is true, but there is nothing to validate on"):
        load_recipe(RECIPE, ["trainer.val_before_train=true", "data.validation=null", "data.eval=null"])


# -- through the trainer -----------------------------------------------------------------------------
def test_graded_reward_counts_by_the_threshold_in_training_and_evaluation(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    recipe = load_recipe(RECIPE, [*CHEAP, f"trainer.output_dir={tmp_path / 'run'}",
                                  "reward.name=test_evaluation:half_reward", "reward.options={}",
                                  "eval.correct_threshold=0.5", "eval.shuffled_images=false", "data.validation=null"])
    summary = Trainer(recipe).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward/accuracy"] == 1.0 and rows[0]["reward/mean"] == 0.5
    assert summary["eval/accuracy"] == 1.0 and summary["eval/mean_reward"] == 0.5
    assert "eval/shuffled_images_accuracy" not in summary and "eval/majority_baseline" in summary


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One step of the tiny recipe with validation before training, sampled evaluation,
    an export and a step checkpoint: (overrides, run folder, summary)."""
    run = tmp_path_factory.mktemp("evaluation") / "run"
    overrides = [*CHEAP, f"trainer.output_dir={run}", "trainer.export=true", "trainer.save_every=1",
                 "trainer.val_before_train=true", "trainer.eval_every=1", "eval.samples=4"]
    summary = Trainer(load_recipe(RECIPE, overrides)).fit()
    return overrides, run, summary


def test_validation_before_training_and_sampled_metrics_are_logged(trained):
    _, run, summary = trained
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "reward/mean" not in rows[0]  # before any step
    names = {"accuracy", "mean_reward", "pass@1", "pass@2", "pass@4", "mean@4"}
    assert {f"validation/{n}" for n in names} <= rows[0].keys() <= {"step"} | {f"validation/{n}" for n in names}
    assert rows[1]["step"] == 1 and "validation/accuracy" in rows[1]
    assert {f"eval/{n}" for n in names} | {"eval/majority_baseline", "eval/shuffled_images_accuracy"} <= summary.keys()
    for name in names:
        assert 0.0 <= summary[f"eval/{name}"] <= 1.0, name
    assert summary["eval/pass@1"] <= summary["eval/pass@2"] <= summary["eval/pass@4"]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.parametrize("which", ["final", "checkpoints/step_000001"])
def test_eval_command_repeats_the_final_evaluation_and_writes_nothing_in_the_run(trained, tmp_path, which):
    """`mmrl eval` of the export and of the step checkpoint (the same weights after one step)
    gives the trainer's final figures, sampled ones included (their generator is seeded)."""
    overrides, run, summary = trained
    before = _snapshot(run)
    out = tmp_path / "metrics.json"
    result = CliRunner().invoke(app, ["eval", RECIPE, "--checkpoint", str(run / which), "--out", str(out), *overrides])
    assert result.exit_code == 0, (result.output, result.exception)
    written = json.loads(out.read_text())
    assert written["checkpoint"] == str(run / which) and written["rows"] == 6
    for name, value in summary.items():
        if name.startswith("eval/"):
            assert written[name] == pytest.approx(value, abs=1e-6), name
    assert _snapshot(run) == before


def test_eval_command_on_validation_without_the_control(trained, tmp_path):
    overrides, run, _ = trained
    result = CliRunner().invoke(app, ["eval", RECIPE, "--checkpoint", str(run / "final"), "--split", "validation",
                                      *overrides, "eval.shuffled_images=false", "eval.samples=1"])
    assert result.exit_code == 0, (result.output, result.exception)
    metrics = json.loads(result.output[result.output.index("{"):])
    assert {"validation/accuracy", "validation/mean_reward", "validation/majority_baseline"} <= metrics.keys()
    assert not any("shuffled" in k or "pass@" in k for k in metrics)
    assert metrics["rows"] == 4


@pytest.mark.parametrize("given, words", [
    (["--checkpoint", "{run}"], "--checkpoint: {run} is a run folder; give its final/ or checkpoints/step_N/ folder"),
    (["--checkpoint", "{run}/nothing"], "--checkpoint: no folder {run}/nothing"),
    (["--checkpoint", "{run}/checkpoints"], "holds neither an exported model"),
    (["--checkpoint", "{run}/final", "data.eval=null"], "data.eval: not set; give one (data.eval=...) or pass "
                                                        "--split validation"),
    (["--checkpoint", "{run}/final", "--split", "train"], "--split: 'train' is not one of eval, validation"),
    (["--checkpoint", "{run}/final", "eval.samples=0"], "eval.samples: Input should be greater than 0"),
    (["--checkpoint", "{run}/checkpoints/step_000001", "model.lora_scope=language"],
     "does not fit the model the recipe's model section builds"),
])
def test_eval_command_errors_are_one_line(trained, given, words):
    overrides, run, _ = trained
    before = _snapshot(run)
    fill = lambda text: text.replace("{run}", str(run))  # noqa: E731
    result = CliRunner().invoke(app, ["eval", RECIPE, *overrides, *map(fill, given)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fill(words) in " ".join(result.output.split()), \
        result.output
    assert _snapshot(run) == before


def test_eval_command_refuses_a_step_checkpoint_that_does_not_verify(trained, tmp_path):
    import shutil

    overrides, run, _ = trained
    broken = tmp_path / "step_000001"
    shutil.copytree(run / "checkpoints" / "step_000001", broken)
    with open(broken / "actor" / "model.safetensors", "ab") as handle:
        handle.write(b"\0")
    result = CliRunner().invoke(app, ["eval", RECIPE, "--checkpoint", str(broken), *overrides])
    assert result.exit_code == 2 and "is a step checkpoint that does not verify" in result.output, result.output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_eval_command_under_torchrun_splits_the_rows_and_exits_cleanly(trained, tmp_path):
    """`mmrl eval` on 2 gloo processes: rank 0 writes the metrics of all rows, the launch
    exits 0 (each rank leaves through `exit_cleanly`; a teardown abort would be retried
    once by `cpu_processes.run`, with a warning), and the export's greedy figures are the
    one-process ones."""
    from cpu_processes import run as run_processes
    from cpu_processes import torchrun

    overrides, run, _ = trained
    out = tmp_path / "metrics.json"
    one = json.loads(CliRunner().invoke(app, ["eval", RECIPE, "--checkpoint", str(run / "final"), *overrides,
                                              "eval.samples=1"]).output)
    run_processes(torchrun(2, "-m", "mmrl.cli", "eval", RECIPE, "--checkpoint", run / "final", "--out", out,
                           *overrides, "eval.samples=1"), timeout=600)
    written = json.loads(out.read_text())
    assert written["rows"] == 6 and written.keys() == one.keys()
    assert written["eval/accuracy"] == pytest.approx(one["eval/accuracy"])


@pytest.mark.parametrize("progress", [True, False])
def test_an_evaluation_of_several_batches_shows_a_progress_bar_when_asked(progress, capsys):
    samples = [{"id": i, "answer": "1"} for i in range(6)]
    policy = StandIn(greedy=[1.0] * 6)
    evaluator = Evaluator(EvalConfig(batch_size=2), ONE_PROCESS, generate=policy.generate, score=policy.score,
                          max_new_tokens=1, progress=progress)
    assert evaluator.run(samples, context="evaluation")["accuracy"] == 1.0 and len(policy.calls) == 3
    err = capsys.readouterr().err
    assert ("evaluation:" in err and "/3 [" in err) == progress
