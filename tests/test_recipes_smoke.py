"""Every recipe in recipes/ runs `--smoke`: 2 steps on its family's tiny random-init model
and the rows bundled under recipes/data/ in the dataset's real layout, through the
recipe's own column mapping, template, reward, algorithm, freezing and LoRA.

The work is bounded by 2 steps of 2 prompts x 2 samples x 8 tokens per recipe."""

import json
import math
from pathlib import Path

import pytest
import yaml

from mmrl.config import RecipeError, load_recipe
from mmrl.smoke import describe_rows, load_smoke_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# Recipes that train a real checkpoint (not a family's random init) and so follow a published run.
REAL = [r for r in RECIPES if not yaml.safe_load(r.read_text())["model"].get("random_init")]


def test_there_are_at_least_six_recipes_for_real_checkpoints_each_naming_its_source():
    assert len(REAL) >= 6
    for path in REAL:
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        text = " ".join(header)
        assert len(header) >= 3, f"{path.name}: no header comment"
        assert "EasyR1" in text or "verl" in text, f"{path.name}: the header names no published run"
        recipe = load_recipe(path)
        assert "/" in recipe.model.path, f"{path.name}: model.path should be a hub id as users write it"
        assert recipe.smoke.family and recipe.smoke.data, f"{path.name}: no smoke section"
        assert (REPO / recipe.smoke.data).exists(), f"{path.name}: {recipe.smoke.data} is missing"
        assert not isinstance(recipe.data.train, str), f"{path.name}: the train data has no column mapping"


def test_bundled_samples_are_small():
    files = [f for f in (REPO / "recipes" / "data").rglob("*") if f.suffix in (".parquet", ".jsonl")]
    assert len(files) >= 10
    assert all(f.stat().st_size < 16 * 1024 for f in files), [f.name for f in files if f.stat().st_size >= 16384]


@pytest.mark.parametrize("path", RECIPES, ids=[r.stem for r in RECIPES])
@pytest.mark.slow
def test_recipe_smoke_run(path, tmp_path, monkeypatch):
    from mmrl.trainer import train

    monkeypatch.chdir(REPO)  # smoke data paths are relative to the checkout
    recipe = load_smoke_recipe(path, [f"trainer.output_dir={tmp_path}", "trainer.progress=false"])
    full = load_recipe(path)
    # What the smoke run keeps of the recipe, and what it makes small.
    assert recipe.reward == full.reward and recipe.algo.kl_coef == full.algo.kl_coef
    assert (recipe.model.lora_scope, recipe.model.freeze) == (full.model.lora_scope, full.model.freeze)
    assert recipe.model.random_init and recipe.trainer.steps == 2 and recipe.rollout.backend == "hf"
    if not isinstance(full.data.train, str):
        assert recipe.data.train.columns == full.data.train.columns
        assert recipe.data.train.template == full.data.train.template
        assert recipe.data.train.path == full.smoke.data

    summary = train(recipe)

    assert summary["steps"] == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if not line.get("final")]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        assert math.isfinite(line["reward/mean"]) and math.isfinite(line["grad_norm"])
        assert line["response/length"] > 0


@pytest.mark.slow
def test_data_check_renders_the_mapped_rows_with_the_template_and_image_tokens(monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_smoke_recipe(REPO / "recipes" / "qwen2_5_vl_7b_multi_image.yaml")
    rows = describe_rows(recipe, rows=2)
    assert len(rows) == 2
    first = rows[0]
    assert first["images"] == ["56x56", "56x56"]
    assert first["media_tokens"] > 0 and first["tokens"] > first["media_tokens"]
    # Both images sit where the row's text put them, and the template followed the text.
    text = first["text"]
    assert text.index("Image 1:") < text.index("Image 2:") < text.index("MUST BE put in \\boxed{}")
    assert first["answer"] in ("1", "2")


def test_gsm8k_recipe_reads_the_answer_after_hashes(monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_smoke_recipe(REPO / "recipes" / "qwen2_5_3b_gsm8k_grpo.yaml")
    rows = describe_rows(recipe, rows=4)
    assert [r["answer"] for r in rows] == ["27", "150", "8", "2"]
    assert all('final answer after "####"' in r["text"] for r in rows)


@pytest.mark.slow
def test_cli_smoke_and_data_check(tmp_path, monkeypatch):
    """Both commands in this process through the CLI's own `app` (the `mmrl` script's
    entry point), from the repository root: what is checked is what they print, not the
    process; a process each paid ~5-10 s of interpreter start and imports."""
    from typer.testing import CliRunner

    from mmrl.cli import app

    monkeypatch.chdir(REPO)
    recipe = "recipes/qwen2_5_vl_3b_clevr_count_grpo.yaml"
    done = CliRunner().invoke(app, ["data", "check", recipe, "--smoke", "--rows", "1"])
    assert done.exit_code == 0, (done.output[-2000:], done.exception)
    assert "--- row 0:" in done.stdout and "images: 56x56" in done.stdout and "answer: '3'" in done.stdout

    bad = tmp_path / "no_smoke.yaml"
    values = yaml.safe_load((REPO / recipe).read_text())
    del values["smoke"]
    bad.write_text(yaml.safe_dump(values))
    done = CliRunner().invoke(app, ["train", str(bad), "--smoke"])
    assert done.exit_code != 0
    assert "smoke.family: the family of Qwen/Qwen2.5-VL-3B-Instruct cannot be told" in done.stderr


def test_smoke_caps_the_mini_batches_at_its_sequences(tmp_path):
    """A recipe with more mini-batches than a smoke step has sequences (2 prompts x 2
    samples) still smoke-runs: one mini-batch per sequence."""
    import yaml

    values = yaml.safe_load((REPO / "recipes" / "tiny_vlm_count.yaml").read_text())
    values.setdefault("algo", {})["mini_batches"] = 16
    path = tmp_path / "many_mini_batches.yaml"
    path.write_text(yaml.safe_dump(values))
    recipe = load_smoke_recipe(path, [f"trainer.output_dir={tmp_path / 'run'}"])
    assert recipe.algo.mini_batches == recipe.data.prompts_per_step * recipe.rollout.samples_per_prompt == 4


def test_smoke_errors_name_the_field(tmp_path):
    with pytest.raises(RecipeError, match=r"\(smoke\): trainer.steps"):
        load_smoke_recipe(REPO / "recipes" / "qwen2_5_7b_math12k_grpo.yaml", ["trainer.steps=0"])
    with pytest.raises(RecipeError, match="data.train: columns.promt: Extra inputs are not permitted"):
        load_recipe(REPO / "recipes" / "qwen2_5_7b_math12k_grpo.yaml", ["data.train.columns.promt=x"])
