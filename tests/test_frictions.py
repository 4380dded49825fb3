"""Small frictions of a first session (issue 32, item 9): a second `--smoke` of the same
recipe runs in its own scratch folder again; `data.train=PATH` over a mapped dataset
source says what it dropped; a run prints what it is about to train before its first step.

The work is bounded by two 2-step smoke runs of the tiny text model and one 1-step run of
the tiny VLM."""

import json
from pathlib import Path

import pytest

from mmrl.smoke import load_smoke_recipe

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "recipes" / "qwen2_5_3b_gsm8k_grpo.yaml"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder holding the checkout's recipes (smoke data paths are relative to it)."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_a_second_smoke_run_of_a_recipe_replaces_the_first(project):
    from mmrl.trainer import train

    for _ in range(2):
        recipe = load_smoke_recipe(GSM8K, ["trainer.progress=false"])
        assert train(recipe)["steps"] == 2
    folder = project / "runs" / "smoke" / GSM8K.stem
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()
             if not json.loads(line).get("final")]
    assert steps == [1, 2]  # the second run's only


def test_a_smoke_run_replaces_only_its_own_folder(project):
    from mmrl.runs import RunFolderError
    from mmrl.trainer import train

    # A folder the user names keeps the usual rules: results are replaced only when asked.
    chosen = load_smoke_recipe(GSM8K, ["trainer.output_dir=mine"])
    assert not chosen.trainer.overwrite
    assert load_smoke_recipe(GSM8K, ["trainer.output_dir=mine", "trainer.overwrite=true"]).trainer.overwrite
    # The scratch folder holding a file mmrl did not write is refused, as any run folder.
    folder = project / "runs" / "smoke" / GSM8K.stem
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match="holds files mmrl did not write"):
        train(load_smoke_recipe(GSM8K, ["trainer.progress=false"]))
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_plain_path_over_a_mapped_source_says_what_it_dropped(capsys, monkeypatch):
    from mmrl.config import load_recipe

    recipe = load_recipe(GSM8K, ["data.train=rows.jsonl"])
    assert recipe.data.train == "rows.jsonl"  # what was asked: the file may have its own layout
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: data.train=rows.jsonl replaces")
    assert "columns" in err and "template" in err and "data.train.path=rows.jsonl keeps the mapping" in err
    # `data.train.path=` keeps the mapping, silently.
    kept = load_recipe(GSM8K, ["data.train.path=rows.jsonl"])
    assert kept.data.train.path == "rows.jsonl" and kept.data.train.columns == load_recipe(GSM8K).data.train.columns
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "1")  # one note per run, from rank 0
    load_recipe(GSM8K, ["data.train=rows.jsonl"])
    assert capsys.readouterr().err == ""


def test_a_section_given_whole_says_which_settings_went_back_to_defaults(capsys, monkeypatch):
    from mmrl.config import load_recipe

    recipe = load_recipe(GSM8K, ["trainer={steps: 2}"])
    assert recipe.trainer.steps == 2  # what was asked: the section as given
    assert recipe.trainer.output_dir == type(recipe.trainer)().output_dir != load_recipe(GSM8K).trainer.output_dir
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: trainer={...} replaces the recipe's trainer section")
    assert "output_dir" in err and "trainer.steps=... changes that setting alone" in err
    # One setting, or a section that names every setting it had, is silent.
    load_recipe(GSM8K, ["trainer.steps=2"])
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "1")
    load_recipe(GSM8K, ["trainer={steps: 2}"])
    assert capsys.readouterr().err == ""


def _tiny_vlm(tmp_path, *overrides):
    from mmrl.config import load_recipe

    return load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [
        "trainer.steps=1", "trainer.progress=false", "trainer.export=false", "data.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "data.validation=synthetic:count_shapes?n=4&seed=2&image_size=56",
        "data.eval=synthetic:count_shapes?n=4&seed=1&image_size=56", f"trainer.output_dir={tmp_path / 'run'}",
        *overrides])


def test_a_run_prints_what_it_trains_before_its_first_step(tmp_path, capsys):
    from mmrl.trainer import Trainer

    trainer = Trainer(_tiny_vlm(tmp_path, "model.freeze=[vision]", "model.lora_scope=language",
                                "model.lora_rank=4", "algo.mini_batches=2", "algo.micro_batch_size=2"))
    assert capsys.readouterr().err == ""  # not before the build: a bad input stays one line
    trainer.fit()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert [line.split()[0] for line in lines[:12]] == ["model", "weights", "rows", "step", *["settled"] * 7, "output"]
    total = sum(p.numel() for p in trainer.actor.model.parameters())
    trainable = sum(p.numel() for p in trainer.actor.model.parameters() if p.requires_grad)
    assert 0 < trainable < total
    assert f"trainable ({100 * trainable / total:.1f}%); frozen: vision; LoRA: language, rank 4" in lines[1]
    assert lines[0].startswith(f"model     {trainer.actor.adapter.family} (")
    assert lines[2] == "rows      train 8192, validation 4, eval 4"
    assert lines[3] == "step      2 prompts x 2 samples = 4 sequences; 2 mini-batches, micro-batch 2"
    # One line per setting a recipe may leave to auto, as `mmrl.settle.resolve` settled it.
    assert lines[4:11] == [
        "settled   model.pack false (auto: cpu, 1 process; packs in one GPU process only)",
        "settled   model.pack_tokens 16384 (auto: the default)",
        "settled   model.compile_layers false (auto: cpu, 1 process; compiles in one GPU process only)",
        "settled   model.gradient_checkpointing after_oom (auto: cpu, 1 process; off until an update runs out of "
        "memory)",
        "settled   model.attn_implementation sdpa (auto: Qwen2VLForConditionalGeneration supports SDPA)",
        "settled   rollout.backend hf (set in the recipe)",
        "settled   rollout.decode graphs (auto: unused by rollout.backend hf)"]
    assert lines[11] == f"output    {tmp_path / 'run'}"
    assert err.count("model     ") == 1  # once


def test_the_summary_can_be_turned_off(tmp_path, capsys):
    from mmrl.trainer import train

    train(_tiny_vlm(tmp_path, "trainer.summary=false"))
    assert "weights   " not in capsys.readouterr().err


def test_parameter_counts_read_at_a_glance():
    from mmrl.summary import _count

    assert [_count(n) for n in (7, 12_345, 494_032_768, 3_085_938_688)] == ["7", "12.3K", "494.0M", "3.09B"]


def test_smoke_takes_the_family_of_the_checkpoint_the_recipe_trains(tmp_path):
    """A recipe that trains a checkpoint needs no smoke.family: the checkpoint's config
    names it (here a local folder; a hub id in the HF cache the same way)."""
    from mmrl import build_model
    from mmrl.config import load_recipe
    from mmrl.smoke import smoke_values

    build_model("qwen2", random_init=True).save(tmp_path / "ckpt")
    recipe = load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml",
                         [f"model.path={tmp_path / 'ckpt'}", "model.random_init=false", "model.tiny_vocabulary={}",
                          "model.config_overrides={}", "smoke.family=null"])
    assert smoke_values(recipe)["model"]["path"] == "qwen2"
