"""Issue 30's second suite: hostile but realistic inputs and faults, grouped as the issue
groups them. Each case checks the exit code, that the user sees one line and no traceback,
that nothing outside what mmrl owns changed, and what the run folder holds before and after.

    .venv/bin/python -m pytest -q tests/test_faults.py

Group "security": a recipe is shared as data, so nothing in it that is not an import path
(`reward.name`, `rollout.env`) may run code; docs/datasets.md#what-a-recipe-can-run says so.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmrl.cli import app

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "tiny_vlm_count.yaml")
CHEAP = ["trainer.steps=1", "trainer.progress=false", "trainer.export=false", "data.prompts_per_step=2",
         "rollout.samples_per_prompt=2"]


def _one_clean_line(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def _text_rows(folder: Path) -> Path:
    path = folder / "questions.jsonl"
    path.write_text("".join(json.dumps({"q": f"How many {i}?", "answer": "1"}) + "\n" for i in range(4)))
    return path


def _no_build(*args, **kwargs):
    raise AssertionError("the model was built before the bad input was found")


# A template that would create PWNED (in the test's folder) if the sandbox let it reach Python.
HOSTILE = [
    ("globals-of-a-helper", "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}"),
    ("subclasses-walk", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    ("mutate-a-value", "{% set xs = [] %}{{ xs.append(1) }}{{ prompt }}"),
    ("memory-bomb", "{{ prompt * 100000000 }}"),
]


@pytest.mark.parametrize("command", ["train", "data check"])
@pytest.mark.parametrize("case, template", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_security_a_recipe_template_cannot_run_code(tmp_path, monkeypatch, command, case, template):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mmrl.build_model", _no_build)
    rows = _text_rows(tmp_path)
    source = json.dumps({"path": str(rows), "columns": {"prompt": "q"}, "template": template})
    run = tmp_path / "run"
    overrides = [f"data.train={source}", f"trainer.output_dir={run}"]
    args = ["train", RECIPE, *CHEAP, *overrides] if command == "train" else ["data", "check", RECIPE, *overrides]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    line = _one_clean_line(result.output)
    assert "template" in line and "row 0" in line, line
    assert not (tmp_path / "PWNED").exists()
    assert not run.exists()  # nothing written


def test_security_the_docs_say_what_a_recipe_can_run():
    text = (REPO / "docs" / "datasets.md").read_text()
    section = text.split("## What a recipe can run", 1)[1].split("\n## ", 1)[0]
    for words in ("sandbox", "reward.name", "rollout.env", "Import paths run code", "trust_remote_code"):
        assert words in section, words
