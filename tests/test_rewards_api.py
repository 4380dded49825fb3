"""Rewards from a user's folder and the Python API: `path/to/file.py:fn` and modules beside
the recipe (mmrl/imports.py), what a reward may take (prompts, images, completion_ids, the
TRL calling convention), per-part metrics of `weighted`, no silent default reward, and
`mmrl.train(recipe, reward=fn, train_dataset=Dataset)` as docs/training.md shows it.

    .venv/bin/python -m pytest -q tests/test_rewards_api.py
"""

import json
import re
import shutil
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from mmrl.config import RecipeError, load_recipe
from mmrl.recipe_checks import recipe_reward, unset_toy_defaults
from mmrl.rewards import accepts, call_reward, combine, get_reward, score, score_parts
from mmrl.rewards.fields import trainer_fields

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny_vlm_count.yaml"
TRAINING = (REPO / "docs" / "training.md").read_text()


def _unique(stem: str) -> str:
    """A module name no other test has imported (sys.modules outlives a test)."""
    return f"{stem}_{uuid.uuid4().hex[:8]}"


def _experiment(tmp_path, reward_name: str, files: dict[str, str], **sections) -> Path:
    """A user's folder: a recipe naming `reward_name` and the files beside it."""
    folder = tmp_path / "experiment"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    recipe = {"model": {"path": "qwen2_vl", "random_init": True},
              "data": {"train": "synthetic:count_shapes?n=8&image_size=56", "prompts_per_step": 2},
              "reward": {"name": reward_name}, **sections}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


GRADED = """
    def graded(completions, answers):
        return [float(c == a) for c, a in zip(completions, answers)]
"""


# -- 1. file paths and modules beside the recipe ---------------------------------------------

@pytest.mark.parametrize("form", ["./{m}.py:graded", "{m}.py:graded", "sub/{m}.py:graded", "{m}:graded",
                                  "sub.{m}:graded", "ABSOLUTE"])
def test_a_reward_beside_the_recipe_resolves_from_any_folder(tmp_path, monkeypatch, form):
    module = _unique("my_rewards")
    files = {f"{module}.py": GRADED, f"sub/{module}.py": GRADED, "sub/__init__.py": ""}
    spec = form.format(m=module)
    if form == "ABSOLUTE":
        spec = f"{tmp_path / 'experiment' / (module + '.py')}:graded"
    recipe_path = _experiment(tmp_path, spec, files)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the recipe's folder counts, not the current one
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    reward = recipe_reward(load_recipe(recipe_path))
    assert reward(["1", "2"], ["1", "1"]) == [1.0, 0.0]


def test_a_file_reward_can_import_the_files_beside_it(tmp_path, monkeypatch):
    helper, module = _unique("helper"), _unique("rewards")
    recipe_path = _experiment(tmp_path, f"./{module}.py:graded", {
        f"{helper}.py": "BONUS = 0.5\n",
        f"{module}.py": f"from {helper} import BONUS\n\ndef graded(completions, answers):\n"
                        "    return [BONUS for _ in completions]\n"})
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    assert recipe_reward(load_recipe(recipe_path))(["x"], ["y"]) == [0.5]


@pytest.mark.parametrize("spec, files, message", [
    ("./nope.py:graded", {}, r"^reward\.name: reward './nope\.py:graded': no file .*experiment/nope\.py or "),
    ("./r.py:grade", {"r.py": GRADED},
     r"^reward\.name: reward './r\.py:grade': .*experiment/r\.py has no function 'grade' \(it defines graded\)$"),
    ("./r.py", {"r.py": GRADED}, r"^reward\.name: reward './r\.py': name the function in the file: './r\.py:NAME'$"),
    ("./broken.py:graded", {"broken.py": "import no_such_dependency_xyz\n"},
     r"^reward\.name: reward './broken\.py:graded': importing .*broken\.py raised ModuleNotFoundError: "
     r"No module named 'no_such_dependency_xyz'$"),
    ("no_such_module_xyz:graded", {}, r"^reward\.name: reward 'no_such_module_xyz:graded': cannot import module "
                                      r"'no_such_module_xyz' \(no such module in .*experiment"),
    ("./r.py:VALUE", {"r.py": "VALUE = 3\n"}, r"^reward\.name: reward './r\.py:VALUE': int is not a function$"),
])
def test_a_reward_that_does_not_resolve_is_one_line_naming_field_file_and_what(tmp_path, monkeypatch, spec, files,
                                                                                message):
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    recipe = load_recipe(_experiment(tmp_path, spec, files))
    with pytest.raises(RecipeError) as info:
        recipe_reward(recipe)
    assert re.search(message, str(info.value)), str(info.value)
    assert "\n" not in str(info.value)


def test_an_environment_file_resolves_against_the_recipe_folder(tmp_path, monkeypatch):
    from mmrl.trainer import environment_factory as _environment

    module = _unique("maze")
    recipe_path = _experiment(tmp_path, "counting", {f"{module}.py": """
        class Maze:
            def __init__(self, size=3):
                self.size = size
            def reset(self, row):
                return row["prompt"]
            def step(self, messages):
                return [], True, None
    """}, rollout={"env": f"./{module}.py:Maze", "env_options": {"size": 5}})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    factory = _environment(load_recipe(recipe_path))
    assert factory().size == 5
    bad = load_recipe(recipe_path, ["rollout.env=./maze_missing.py:Maze"])
    with pytest.raises(RecipeError, match=r"^rollout\.env: environment './maze_missing\.py:Maze': no file "):
        _environment(bad)


# -- 2. what a reward may take ----------------------------------------------------------------

def test_a_reward_gets_the_fields_it_names_and_all_with_kwargs():
    seen = {}

    def plain(completions, answers):  # a dataset column it does not name is not passed
        return [1.0] * len(completions)

    def with_prompts(completions, answers, prompts, level):
        seen["prompts"], seen["level"] = prompts, level
        return [1.0] * len(completions)

    def everything(completions, answers, **fields):
        seen["fields"] = sorted(fields)
        return [1.0] * len(completions)

    fields = {"level": [1, 2], "prompts": ["p0", "p1"], "completion_ids": [[1], [2]]}
    for fn in (plain, with_prompts, everything):
        assert score(fn, ["a", "b"], ["a", "a"], **fields) == [1.0, 1.0]
    assert seen["prompts"] == ["p0", "p1"] and seen["level"] == [1, 2]
    assert seen["fields"] == ["completion_ids", "level", "prompts"]
    assert not accepts(plain, "images") and accepts(with_prompts, "prompts") and accepts(everything, "images")


def test_trl_reward_functions_are_called_as_trl_calls_them():
    def trl_style(prompts, completions, completion_ids, **kwargs):  # TRL passes everything by keyword
        return [float(len(ids) == 2 and kwargs["answers"][i] == "a") for i, ids in enumerate(completion_ids)]

    def accuracy(completions, solution, **kwargs):  # a TRL reward naming a dataset column second
        return [float(c == s) for c, s in zip(completions, solution)]

    fields = {"prompts": ["p", "p"], "completion_ids": [[1, 2], [1]], "solution": ["a", "x"]}
    assert call_reward(trl_style, ["a", "b"], ["a", "a"], **fields) == [1.0, 0.0]
    assert call_reward(accuracy, ["a", "b"], ["zzz", "zzz"], **fields) == [1.0, 0.0]
    # The old convention holds whatever the second parameter is called.
    assert call_reward(lambda outs, golds: [float(o == g) for o, g in zip(outs, golds)], ["a"], ["a"],
                       **fields) == [1.0]


def _image(shade: int) -> Image.Image:
    return Image.new("RGB", (8, 8), (shade, 0, 0))


def test_trainer_fields_give_each_completion_its_prompt_images_and_tokens():
    samples = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}],
                "answer": "1", "images": [_image(shade)]} for shade in (10, 200)]
    rows = [0, 0, 1, 1]

    def judge(completions, answers, prompts, images, completion_ids):
        return [0.0] * len(completions)

    ids = torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 4], [1, 2, 3]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    fields = trainer_fields(judge, samples, rows, response_ids=ids, response_mask=mask)
    assert [images[0].getpixel((0, 0))[0] for images in fields["images"]] == [10, 10, 200, 200]
    assert fields["prompts"][2][0]["content"][0]["image"].getpixel((0, 0))[0] == 200
    assert fields["completion_ids"] == [[5, 6], [7], [8, 9, 4], [1, 2, 3]]
    # Decoded media are built only for a reward that takes them.
    assert trainer_fields(lambda completions, answers: [], samples, rows) == {}
    # The rollout's decoded conversations are reused, not decoded again.
    conversations = [[{"role": "user", "content": [{"type": "image", "image": "decoded"}]}]] * 2
    assert trainer_fields(judge, samples, rows, conversations=conversations)["images"][0] == ["decoded"]


# -- 3. per-part metrics ----------------------------------------------------------------------

def test_weighted_parts_are_scored_apart_and_named(tmp_path, monkeypatch):
    module = _unique("parts")
    recipe_path = _experiment(tmp_path, "weighted", {f"{module}.py": GRADED})
    recipe = load_recipe(recipe_path, [
        "reward.options={components: [{name: ./%s.py:graded, weight: 0.5}, {name: counting, weight: 0.5}, "
        "{name: counting, weight: 1, options: {partial: 0}}]}" % module])
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    reward = recipe_reward(recipe)
    scores, parts = score_parts(reward, ["3", "4"], ["3", "3"])
    assert parts == {"graded": [1.0, 0.0], "counting": [1.0, 0.2], "counting_2": [1.0, 0.0]}
    assert scores == pytest.approx([2.0, 0.1])
    assert score_parts(get_reward("counting"), ["3"], ["3"]) == ([1.0], {})
    assert score_parts(combine([("exact_match", 1.0), ("exact_match", 2.0)]), ["a"], ["a"])[1] == {
        "exact_match": [1.0], "exact_match_2": [1.0]}
    bad = load_recipe(recipe_path, ["reward.options={components: [{name: counting}]}"])
    with pytest.raises(RecipeError, match=r"^reward\.options: weighted: components\[0\] must be a mapping"):
        recipe_reward(bad)


# -- 5. no silent defaults ---------------------------------------------------------------------

def test_a_recipe_without_a_reward_stops_and_toy_defaults_are_named(tmp_path):
    from mmrl.recipe_checks import check_before_build

    recipe = load_recipe(None, ["model.path=qwen2_vl", "model.random_init=true",
                                "data.train=synthetic:count_shapes?n=8&image_size=56", "data.prompts_per_step=2"])
    with pytest.raises(RecipeError, match=r"^reward\.name: not set; name what scores the completions: a built-in "
                                          r"\(exact_match, .*\), path/to/file\.py:function"):
        check_before_build(recipe)
    notice = unset_toy_defaults(recipe)
    assert "optim.lr=0.0003" in notice and "model.dtype=float32" in notice and "\n" not in notice
    assert unset_toy_defaults(load_recipe(TINY)) is None  # the README's recipe states its choices
    assert "optim.lr" not in unset_toy_defaults(load_recipe(None, ["model.path=x", "data.train=x",
                                                                   "optim.lr=1e-6"]))


# -- 4. the Python API -------------------------------------------------------------------------

def _python_blocks(heading: str) -> list[str]:
    section = TRAINING.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


@pytest.mark.slow
def test_the_python_api_example_of_the_docs_trains(tmp_path, monkeypatch, capsys):
    """docs/training.md#training-from-python as written: a callable reward reading the
    images, an in-memory datasets.Dataset, the README's tiny recipe, 2 steps."""
    (blocks,) = [_python_blocks("## Training from Python")]
    assert len(blocks) == 1
    (tmp_path / "recipes").mkdir()
    shutil.copy(TINY, tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks[0], "docs/training.md python block", "exec"), namespace)  # noqa: S102
    assert namespace["summary"]["steps"] == 2
    out = capsys.readouterr()
    assert "2" in out.out and "reward.name 'counting' and its options are not used" in out.err
    records = [json.loads(line) for line in (tmp_path / "runs" / "counted" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("final")] == [1, 2]
    assert records[-1]["final"] and "eval/accuracy" in records[-1]


def test_train_takes_a_dict_recipe_a_weighted_file_reward_and_rows_in_their_own_layout(tmp_path, monkeypatch):
    """A recipe as a dict whose data.train maps columns (no path), the rows a list in
    their own layout, a weighted reward with a file part: parts land in metrics.jsonl."""
    import mmrl

    module = _unique("scoring")
    (tmp_path / f"{module}.py").write_text(textwrap.dedent("""
        def answered(completions, answers, prompts, difficulty):
            assert prompts[0][0]["role"] == "user" and isinstance(difficulty[0], int)
            return [float(c.strip().isdigit()) for c in completions]
    """))
    monkeypatch.chdir(tmp_path)  # a dict recipe has no folder: paths resolve against the current one
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    rows = [{"question": f"What is {a} + {b} ?", "solution": f"#### {a + b}", "difficulty": a}
            for a in range(4) for b in range(2)]
    recipe = {
        "model": {"path": "qwen2", "random_init": True, "dtype": "float32",
                  "tiny_vocabulary": {"characters": "0123456789+ ?", "words": ["What", "is", "user", "assistant"]}},
        "data": {"train": {"columns": {"prompt": "question", "answer": "solution"}, "answer_pattern": "####\\s*(.+)"},
                 "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 2},
        "reward": {"name": "weighted", "options": {"components": [
            {"name": f"./{module}.py:answered", "weight": 0.2}, {"name": "numeric", "weight": 1.0}]}},
        "optim": {"lr": 1e-4},
        "trainer": {"steps": 1, "output_dir": str(tmp_path / "run"), "export": False, "progress": False,
                    "threads": 2},
    }
    summary = mmrl.train(recipe, train_dataset=rows)
    assert summary["steps"] == 1
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"reward/answered", "reward/numeric"} <= set(record)
    assert record["reward/mean"] == pytest.approx(0.2 * record["reward/answered"] + record["reward/numeric"])
    saved = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert saved["data"]["train"]["path"] == "memory:train_dataset"


def test_train_refuses_what_it_cannot_use(tmp_path):
    import mmrl

    with pytest.raises(RecipeError, match=r"^reward: expected a function, got str"):
        mmrl.train(TINY, reward="counting", train_dataset=[])
    with pytest.raises(RecipeError, match=r"^train_dataset: expected a datasets\.Dataset or a list of rows, got int"):
        mmrl.train(TINY, train_dataset=3)
    with pytest.raises(RecipeError, match=r"^train_dataset: row 0: "):
        mmrl.train(TINY, train_dataset=[{"prompt": "not a conversation", "answer": "1"}])
    with pytest.raises(RecipeError, match=r"^recipe: expected a path, a mapping or a Recipe, got int"):
        mmrl.train(3)


def test_a_reward_needing_a_column_the_data_lacks_stops_before_the_build(tmp_path, monkeypatch):
    from mmrl.recipe_checks import check_reward_and_data

    module = _unique("needs")
    recipe_path = _experiment(tmp_path, f"./{module}.py:graded", {f"{module}.py": """
        def graded(completions, answers, solution, prompts):
            return [0.0 for _ in completions]
    """})
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    with pytest.raises(RecipeError, match=r"^reward\.name: graded needs 'solution', which is no column of "
                                          r"data\.train \(its other columns: task\) nor one of prompts, images"):
        check_reward_and_data(load_recipe(recipe_path))
    rows = [{"prompt": [{"role": "user", "content": "q"}], "answer": "1", "solution": "1"}] * 2
    from mmrl.api import in_memory_dataset

    check_reward_and_data(load_recipe(recipe_path), loaded={"train": in_memory_dataset(rows, None, "rows")})


# -- 6. a judge: a second model through the rollout backends ------------------------------------

def test_parse_score_reads_the_last_number_or_falls_back():
    from mmrl.rewards.judge import DEFAULT_PATTERN, parse_score

    assert parse_score("reasoning 3 ... Score: 8", DEFAULT_PATTERN, 0.1, 0.0) == pytest.approx(0.8)
    assert parse_score("no number", DEFAULT_PATTERN, 0.1, -1.0) == -1.0
    assert parse_score("[[7.5]]", r"\[\[(\d+(?:\.\d+)?)\]\]", 1.0, 0.0) == 7.5


def test_a_tiny_judge_model_scores_through_the_rollout_and_sees_the_images(monkeypatch):
    from mmrl.rewards import judge as judge_module

    monkeypatch.setattr(judge_module, "_JUDGES", {})
    reward = get_reward("judge", model="qwen2_vl", random_init=True, max_new_tokens=3, default=0.25,
                        tiny_vocabulary={"characters": "0123456789 \n", "words": ["Score", "user", "assistant"]})
    assert accepts(reward, "prompts")
    image = Image.new("RGB", (56, 56), "red")
    prompts = [[{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "How many?"}]}]] * 3
    seen = {}
    scores = None
    original = judge_module.Judge.replies

    def spy(self, conversations, max_new_tokens):
        generate = self.rollout.generate

        def recording(batch, params):
            result = generate(batch, params)
            seen["inputs"], seen["greedy"] = set(result.prompt_inputs), params.greedy
            return result

        self.rollout.generate = recording
        seen["conversation"] = conversations[0]
        return original(self, conversations, max_new_tokens)

    monkeypatch.setattr(judge_module.Judge, "replies", spy)
    scores = score(reward, ["1", "2", "3"], ["1", "1", "1"], prompts=prompts)
    assert len(scores) == 3 and all(s == 0.25 or 0 <= s <= 100 for s in scores)
    assert "pixel_values" in seen["inputs"] and seen["greedy"]
    content = seen["conversation"][0]["content"]
    assert content[0]["image"] is image and "Response: 1" in content[-1]["text"]
    assert len(judge_module._JUDGES) == 1  # built once, reused by the next call
    score(reward, ["4"], ["1"], prompts=prompts[:1])
    assert len(judge_module._JUDGES) == 1


# -- the command line: the user's folder, as issue 32 tells it -----------------------------------

@pytest.mark.slow
def test_cli_trains_with_a_reward_module_beside_the_recipe_without_pythonpath(tmp_path, monkeypatch):
    """`reward.name: my_rewards:graded` with my_rewards.py beside the recipe, run from
    another folder without PYTHONPATH: trains; a recipe without a reward is one line."""
    import os
    import subprocess
    import sys

    from typer.testing import CliRunner

    from mmrl.cli import app

    experiment, elsewhere = tmp_path / "experiment", tmp_path / "elsewhere"
    experiment.mkdir()
    elsewhere.mkdir()
    (experiment / "my_rewards.py").write_text(textwrap.dedent("""
        def graded(completions, answers, images):
            assert images[0][0].size == (56, 56)
            return [float(c.strip() == a) for c, a in zip(completions, answers)]
    """))
    recipe = yaml.safe_load(TINY.read_text())
    recipe["reward"] = {"name": "my_rewards:graded"}
    (experiment / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cheap = ["trainer.steps=1", "trainer.progress=false", "trainer.export=false", "data.validation=null",
             "data.eval=null", "data.prompts_per_step=2", "rollout.samples_per_prompt=2",
             f"trainer.output_dir={tmp_path / 'run'}"]
    result = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", "../experiment/recipe.yaml", *cheap],
                            capture_output=True, text=True, cwd=elsewhere, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "reward/mean" in (tmp_path / "run" / "metrics.jsonl").read_text()
    # The recipe without a reward: in this process through the CLI's own `app`, from the
    # same folder (the one-line error is the CLI's, found before any import path matters;
    # a second process paid ~5-10 s of interpreter start and imports for it).
    monkeypatch.chdir(elsewhere)
    unset = CliRunner().invoke(app, ["train", "../experiment/recipe.yaml", *cheap, "reward.name=null",
                                     "trainer.overwrite=true"])
    assert unset.exit_code == 2, (unset.output, unset.exception)
    assert [line for line in unset.stderr.splitlines() if line.strip()] == [
        line for line in unset.stderr.splitlines() if line.startswith("error: reward.name: not set; ")]
    assert unset.stderr.startswith("error: reward.name: not set; ")


def test_a_saved_recipe_of_an_in_memory_run_says_what_is_missing(tmp_path):
    from mmrl.recipe_checks import check_reward_and_data

    recipe = load_recipe(TINY, ["data.train=memory:train_dataset"])
    with pytest.raises(RecipeError, match=r"^data\.train: memory:train_dataset was a dataset given to mmrl\.train"):
        check_reward_and_data(recipe)
