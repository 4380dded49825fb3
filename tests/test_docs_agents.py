"""docs/agents.md runs as written: its Python blocks in order in one namespace, each
`print(...)  # shown output` printing that output; its YAML snippet is a valid rollout section."""

import contextlib
import io
import re
from pathlib import Path

import yaml

from mmrl.config import RolloutConfig

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "agents.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE, re.DOTALL)


def test_python_examples_run_and_print_what_they_show(monkeypatch):
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    codes = blocks("python")
    assert len(codes) >= 5
    for index, code in enumerate(codes):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/agents.md python block {index}", "exec"), namespace)  # noqa: S102
        shown = [m.group(1).strip() for m in re.finditer(r"^[ \t]*print\(.*\)[ \t]+#[ \t]*(.+)$", code, re.M)]
        printed = [line.strip() for line in out.getvalue().splitlines()]
        assert printed == shown, f"block {index} printed {printed}, the page shows {shown}"


def test_yaml_snippet_is_a_valid_rollout_section():
    (snippet,) = blocks("yaml")
    config = RolloutConfig.model_validate(yaml.safe_load(snippet)["rollout"])
    assert config.env == "tools" and config.max_turns == 3


def test_page_names_existing_files():
    for path in re.findall(r"`((?:recipes|tests|mmrl)/[\w/.]+)`", PAGE):
        assert (REPO / path).exists(), path
