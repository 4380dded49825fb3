"""docs/datasets.md runs as written: its Python blocks in order in one namespace (each
`print(...)  # shown output` must print that output), its YAML recipe snippet validates
and loads through the layout loader, and its `mmrl` command prints what the page shows."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "datasets.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE, re.DOTALL)


def shown_outputs(code: str) -> list[str]:
    """The outputs the page claims, written as `print(...)  # output` on one line."""
    return [m.group(1).strip() for m in re.finditer(r"^[ \t]*print\(.*\)[ \t]+#[ \t]*(.+)$", code, re.MULTILINE)]


def test_page_has_examples_of_each_kind():
    assert len(blocks("python")) >= 8
    assert len(blocks("yaml")) == 1 and len(blocks("bash")) == 1


def test_python_examples_run_in_order_and_print_what_they_show(monkeypatch):
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    for index, code in enumerate(blocks("python")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/datasets.md python block {index}", "exec"), namespace)  # noqa: S102
        for expected in shown_outputs(code):
            assert expected in out.getvalue(), f"block {index}: printed {out.getvalue()!r}, page shows {expected!r}"
    # The examples built what the page says they build.
    assert namespace["image_tokens"] == 10
    assert namespace["first"]["answer"] == "5.8"


def test_yaml_snippet_is_a_valid_data_section_that_loads(monkeypatch):
    from mmrl.config import DataConfig
    from mmrl.data import load_prompts

    monkeypatch.chdir(REPO)
    config = DataConfig.model_validate(yaml.safe_load(blocks("yaml")[0])["data"])
    assert config.train.columns.prompt == "problem" and config.eval.split == "test"
    assert config.train.template == "{{ prompt | trim }} Put the final answer in \\boxed{}."
    # The hub id replaced by the bundled copy in the same layout, as --smoke does.
    for source, split, rows in ((config.train, "train", 4), (config.eval, "test", 2)):
        local = source.model_copy(update={"path": "recipes/data/geometry3k"})
        loaded = load_prompts(local, split)
        assert len(loaded) == rows
        assert loaded[0]["prompt"][0]["content"][0] == {"type": "image"}


@pytest.mark.slow
def test_the_command_prints_what_the_page_shows(monkeypatch):
    command = blocks("bash")[0].strip()
    assert command.startswith("mmrl ")
    # In this process through the CLI's own `app` (the `mmrl` script's entry point), from
    # the repository root: the page shows what the command prints, not its process, and a
    # process paid ~5-10 s of interpreter start and imports.
    from typer.testing import CliRunner

    from mmrl.cli import app

    monkeypatch.chdir(REPO)
    done = CliRunner().invoke(app, command.split()[1:])
    assert done.exit_code == 0, (done.output[-2000:], done.exception)
    shown = re.search(r"```bash\n.*?```\s*```\n(.*?)```", PAGE, re.DOTALL).group(1)
    first, *_, last = [line for line in shown.splitlines() if line and line != "..."]
    assert done.stdout.startswith(first), done.stdout[:300]
    assert done.stdout.rstrip().endswith(last)
