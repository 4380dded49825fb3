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
