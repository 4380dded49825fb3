"""docs/tutorial.md runs as written. In a temporary folder the test writes each block marked
`<!-- tutorial: file PATH -->`, runs each `<!-- tutorial: run -->` command and each
`<!-- tutorial: python -->` block in page order (an `mmrl` command in this process through
the CLI's `app`, other commands in a shell process), with the two substitutions the page states:

- the checkpoint id the page names is a tiny random-init Qwen2-VL (the zoo's tiny config)
  saved by the test into a stand-in HF cache under that id, read with `HF_HUB_OFFLINE=1`;
- `mmrl train` and `mmrl eval` commands and `mmrl.train(...)` get CHEAP appended to their
  overrides (two steps of 2 prompts x 2 samples, 4 new tokens, a checkpoint each step).

The small PNG files the page's JSONL rows name are drawn by the test (the user has their own).

    .venv/bin/python -m pytest -q tests/test_tutorial.py
"""

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import traceback
from pathlib import Path

import pytest
from huggingface_hub import constants
from PIL import Image, ImageDraw
from typer.testing import CliRunner

from mmrl.cli import app

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "tutorial.md").read_text()
MARKED = re.compile(r"<!-- tutorial: (run|python|file ([\w./-]+)) -->\n```\w*\n(.*?)```", re.DOTALL)
HUB_ID = "Qwen/Qwen2-VL-2B-Instruct"
CHEAP = ["trainer.steps=2", "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
         "trainer.save_every=1", "trainer.progress=false", "trainer.threads=2"]


def marked_blocks() -> list[tuple[str, str, str]]:
    """(kind, file path or "", text) of each marked block, in page order."""
    return [(kind.split()[0], path or "", text) for kind, path, text in MARKED.findall(PAGE)]


def test_page_marks_every_step():
    kinds = [kind for kind, _, _ in marked_blocks()]
    assert kinds.count("file") == 4 and kinds.count("python") == 2
    commands = [text.split()[1] for kind, _, text in marked_blocks() if kind == "run" and text.startswith("mmrl")]
    assert commands == ["models", "data", "train", "train", "eval", "export"]
    assert HUB_ID in PAGE
    for path in (path for kind, path, _ in marked_blocks() if kind == "file"):
        before = PAGE.split(f"<!-- tutorial: file {path} -->", 1)[0].rsplit("```", 1)[-1]
        assert f"`{path}`" in before, f"the page does not say in its text that the block after it is {path}"


def _stand_in_checkpoint(cache: Path) -> None:
    """A tiny random Qwen2-VL in `cache` as huggingface_hub lays out a snapshot of HUB_ID."""
    import mmrl

    storage = cache / f"models--{HUB_ID.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text("0" * 40)
    mmrl.build_model("qwen2_vl", random_init=True, seed=0).save(storage / "snapshots" / ("0" * 40))


def _draw_images(folder: Path) -> None:
    """Each PNG the page's rows name (`images/<fruit>_<count>.png`): that many red discs."""
    names = {name for line in PAGE.splitlines() for name in re.findall(r'"(images/\w+\.png)"', line)}
    assert names
    for name in names:
        count = int(name.rsplit("_", 1)[1].removesuffix(".png"))
        image = Image.new("RGB", (56, 56), "white")
        for i in range(count):
            ImageDraw.Draw(image).ellipse((2 + 13 * i, 20, 12 + 13 * i, 30), fill="red")
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        image.save(folder / name)


def _run(command: str, env: dict, cwd: Path) -> str:
    """An `mmrl` command runs in this process through the CLI's own `app` (the `mmrl`
    script's entry point: the same options, the same code) in the page's folder and
    environment, which the test has made this process's; each one in a process of its own
    paid ~5-10 s of interpreter start and imports on 2 busy cores, and the page is about
    what the commands do, not about the process they start in. Other commands (`tail`)
    run in a shell process."""
    words = shlex.split(command)
    if words[0] != "mmrl":
        done = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout
    args = [*words[1:], *(CHEAP if words[1] in ("train", "eval") else [])]
    result = CliRunner().invoke(app, args)
    failure = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else ""
    assert result.exit_code == 0, f"{command}\n{result.output[-3000:]}\n{failure[-3000:]}"
    return result.output


@pytest.mark.slow
def test_the_tutorial_runs_as_written(tmp_path, monkeypatch):
    import mmrl

    cache = tmp_path / "hf-cache"
    _stand_in_checkpoint(cache)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # huggingface_hub read the environment when it was imported; the page's Python blocks run here.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    train = mmrl.train
    monkeypatch.setattr(mmrl, "train", lambda *args, overrides=(), **kwargs:
                        train(*args, overrides=[*overrides, *CHEAP], **kwargs))

    outputs, python_blocks = {}, []
    for kind, path, text in marked_blocks():
        if kind == "file":
            (work / path).parent.mkdir(parents=True, exist_ok=True)
            (work / path).write_text(text)
            if path.startswith("data/"):
                _draw_images(work / "data")
        elif kind == "run":
            outputs[text.strip()] = _run(text.strip(), env, work)
        else:
            printed, namespace = io.StringIO(), {"__name__": "tutorial"}
            with contextlib.redirect_stdout(printed):
                exec(compile(text, "docs/tutorial.md python block", "exec"), namespace)  # noqa: S102
            python_blocks.append((namespace, printed.getvalue()))

    # What the page says each step leaves behind.
    assert "qwen2_vl" in outputs[f"mmrl models --for {HUB_ID}"]
    assert "apples" in outputs["mmrl data check recipe.yaml --rows 2"]
    assert (work / "runs/smoke/recipe/metrics.jsonl").is_file()
    samples = [json.loads(line) for line in (work / "runs/fruit/samples.jsonl").read_text().splitlines()]
    assert {"step", "prompt", "answer", "completion", "reward", "advantage"} <= set(samples[0])
    assert sorted(p.name for p in (work / "runs/fruit/checkpoints").iterdir()) == ["step_000001", "step_000002"]
    metrics = json.loads((work / "eval.json").read_text())
    assert {"eval/accuracy", "eval/mean_reward", "eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/pass@8",
            "eval/mean@8"} <= set(metrics), metrics
    assert {p.name for p in (work / "exports/fruit-lora").iterdir()} >= {"adapter_config.json",
                                                                        "adapter_model.safetensors"}
    # PEFT put the exported adapter on the base and generated (a random model's answer is noise).
    (peft, _), (_, printed) = python_blocks
    assert peft["model"].peft_config["default"].r == 16
    trained = [w for name, w in peft["model"].named_parameters() if "lora_B" in name]
    assert trained and all(w.abs().sum() > 0 for w in trained), "PEFT left adapters at their zero init"
    assert peft["output"].shape[1] > peft["inputs"]["input_ids"].shape[1]
    steps, accuracy = printed.split()
    assert steps == "2" and 0 <= float(accuracy) <= 1
    assert (work / "runs/fruit-python/metrics.jsonl").is_file()
