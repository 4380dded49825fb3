"""Bad inputs through the real command line (issue 9): each case runs `mmrl train RECIPE
overrides...` and checks exit code 2, exactly one line of output naming the field or the
file, no traceback, and that the output folder was left as it was (nothing written, nothing
lost). Inputs that the recipe, the data or the reward already show to be bad fail before
the model is built (the build is replaced by an assertion); the few that only a step can
find (a reward that raises or returns NaN) run one step of the tiny recipe.

    .venv/bin/python -m pytest -q tests/test_bad_inputs.py

Most cases run in process through typer's CliRunner (the same `app`, its own error
handling and exit codes); a few run `python -m mmrl.cli` in a subprocess to see the
real stderr. The same table runs through the Python API (`load_recipe`, `Trainer`), and
`mmrl doctor` gets unreadable checkpoints.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from mmrl.cli import app

REPO = Path(__file__).resolve().parents[1]
# Subprocesses are bounded by their work; this only stops a hung one (a busy shared machine
# made a 1-step run take minutes).
HANG_GUARD_S = 1800
RECIPE = str(REPO / "recipes" / "tiny_vlm_count.yaml")
# The tiny recipe, made cheap: one step, small held-out sets, no bars or summary, no export.
CHEAP = ["trainer.steps=1", "trainer.progress=false", "trainer.summary=false", "trainer.export=false",
         "data.validation=synthetic:count_shapes?n=4&seed=2&image_size=56",
         "data.eval=synthetic:count_shapes?n=4&seed=1&image_size=56", "data.prompts_per_step=2",
         "rollout.samples_per_prompt=2"]

GOOD_ROW = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
            "answer": "1", "images": ["shape.png"]}


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _write_inputs(tmp: Path) -> None:
    """Every file a case points at, in `tmp` (small: a few rows, 56x56 images)."""
    Image.new("RGB", (56, 56), "white").save(tmp / "shape.png")
    (tmp / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    (tmp / "empty.png").write_bytes(b"")
    (tmp / "text.png").write_text("not an image")
    good = [GOOD_ROW] * 4

    def rows_with(**change):
        return _jsonl([GOOD_ROW] * 3 + [{**GOOD_ROW, **change}])

    files = {
        "good.jsonl": _jsonl(good),
        "empty.jsonl": "",
        "blank.jsonl": "\n\n  \n",
        "badline.jsonl": _jsonl(good[:1]) + "{not json\n",
        "list_row.jsonl": _jsonl(good[:1]) + "[1, 2]\n",
        "no_answer.jsonl": rows_with(answer=None),
        "int_answer.jsonl": _jsonl([GOOD_ROW] * 3) + json.dumps({**GOOD_ROW, "answer": 3}) + "\n",
        "string_prompt.jsonl": rows_with(prompt="How many?"),
        "bad_role.jsonl": rows_with(prompt=[{"role": "robot", "content": "hi"}]),
        "ends_assistant.jsonl": rows_with(prompt=[{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": [{"type": "text", "text": "2"}]}]),
        "bad_part.jsonl": rows_with(prompt=[{"role": "user", "content": [{"type": "audio"}]}]),
        "missing_image.jsonl": rows_with(images=["nowhere.png"]),
        "corrupt_image.jsonl": rows_with(images=["corrupt.png"]),
        "empty_image.jsonl": rows_with(images=["empty.png"]),
        "text_image.jsonl": rows_with(images=["text.png"]),
        "extra_image.jsonl": rows_with(images=["shape.png", "shape.png"]),
        "no_image.jsonl": rows_with(images=[]),
        "images_not_list.jsonl": rows_with(images="shape.png"),
        "image_is_folder.jsonl": rows_with(images=["no_data_folder"]),
        "missing_video.jsonl": rows_with(prompt=[{"role": "user", "content": [{"type": "video"}]}], images=None,
                                         videos=["clip.mp4"]),
        "broken.parquet": "PAR1 not really",
        "data.csv": "prompt,answer\nx,1\n",
        "broken.json": '{"prompt": [',
        "bad_recipe.yaml": "model:\n  path: qwen2_vl\n  dtype: [unclosed\ndata: {}\n",
        "list_recipe.yaml": "- model\n- data\n",
        "unknown_section.yaml": "model: {path: qwen2_vl, random_init: true}\ndata: {train: x.jsonl}\nmodle: {}\n",
        "empty_recipe.yaml": "",
        "rewards_bad.py": ("def raises(completions, answers, **fields):\n    raise KeyError('oops')\n\n"
                           "def nan(completions, answers, **fields):\n    return [float('nan')] * len(completions)\n"),
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    (tmp / "latin.yaml").write_bytes(b"model:\n  path: caf\xe9\n")
    (tmp / "latin.jsonl").write_bytes(_jsonl(good).encode() + b'{"answer": "caf\xe9"}\n')
    (tmp / "no_data_folder").mkdir()
    (tmp / "a_file").write_text("x")
    (tmp / "bin_ckpt").mkdir()
    (tmp / "bin_ckpt" / "config.json").write_text('{"model_type": "qwen2_vl"}')
    (tmp / "bin_ckpt" / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    (tmp / "cut_ckpt").mkdir()
    (tmp / "cut_ckpt" / "config.json").write_text('{"model_type": "qwen2_vl"}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp / "cut_ckpt" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 7)
    # A finished run (the folder a second run must not touch).
    (tmp / "used").mkdir()
    (tmp / "used" / "recipe.yaml").write_text("model: {path: qwen2_vl}\n")
    (tmp / "used" / "metrics.jsonl").write_text('{"step": 1}\n')


# (case id, recipe (None: the tiny recipe), overrides, words the one line holds)
# `{tmp}` is the folder of `_write_inputs`. Every case fails before the model is built.
CASES = [
    # -- the recipe file --------------------------------------------------------------------
    ("recipe-missing", "{tmp}/nope.yaml", [], "recipe file not found: {tmp}/nope.yaml"),
    ("recipe-yaml-syntax", "{tmp}/bad_recipe.yaml", [], "bad_recipe.yaml: not valid YAML (line 4, column 5"),
    ("recipe-not-mapping", "{tmp}/list_recipe.yaml", [], "a recipe is a mapping of sections, got list"),
    ("recipe-not-utf8", "{tmp}/latin.yaml", [], "latin.yaml: not UTF-8 text"),
    ("recipe-empty", "{tmp}/empty_recipe.yaml", [], "model: Field required"),
    ("recipe-unknown-section", "{tmp}/unknown_section.yaml", [], "modle: Extra inputs are not permitted"),
    ("recipe-is-folder", "{tmp}", [], "recipe file not found"),
    # -- override syntax --------------------------------------------------------------------
    ("override-no-equals", None, ["optim.lr"], "override 'optim.lr' must read key=value"),
    ("override-empty-key", None, ["=3"], "override '=3' must read key=value"),
    ("override-into-scalar", None, ["optim.lr.x=1"], "'lr' is not a section"),
    ("override-bad-yaml-value", None, ["optim.lr=[1,"], "override 'optim.lr=[1,': the value is not valid YAML"),
    ("override-unknown-key", None, ["optim.lrr=1"], "optim.lrr: Extra inputs are not permitted"),
    ("override-unknown-section", None, ["optimiser.lr=1"], "optimiser: Extra inputs are not permitted"),
    # -- recipe fields ----------------------------------------------------------------------
    ("lr-not-number", None, ["optim.lr=abc"], "optim.lr: Input should be a valid number"),
    ("lr-negative", None, ["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
    ("steps-zero", None, ["trainer.steps=0"], "trainer.steps: Input should be greater than 0"),
    ("steps-fraction", None, ["trainer.steps=1.5"], "trainer.steps: Input should be a valid integer"),
    ("backend-unknown", None, ["rollout.backend=sglang"], "rollout.backend: Input should be 'auto', 'hf', 'hf_compiled' or 'vllm'"),
    ("top-p-above-1", None, ["rollout.top_p=2"], "rollout.top_p: Input should be less than or equal to 1"),
    ("advantage-unknown", None, ["algo.advantage=ppo"], "algo.advantage: Input should be"),
    ("mini-batches-above-sequences", None, ["algo.mini_batches=64"],
     "algo: mini_batches (64) is above the sequences of a step (4: data.prompts_per_step x"),
    ("micro-batch-tokens-zero", None, ["algo.micro_batch_tokens=0"],
     "algo.micro_batch_tokens: Input should be greater than 0"),
    ("dtype-unknown", None, ["model.dtype=float8"], "model.dtype: Input should be"),
    ("freeze-typo", None, ["model.freeze=[vison]"], "model.freeze.0: Input should be"),
    ("lora-rank-zero", None, ["model.lora_rank=0"], "model.lora_rank: Input should be greater than 0"),
    ("betas-one-value", None, ["optim.betas=[0.9]"], "optim.betas.1: Field required"),
    ("lr-multiplier-part", None, ["optim.lr_multipliers={vison: 10}"], "optim.lr_multipliers.vison: Input should be"),
    ("resume-and-overwrite", None, ["trainer.resume=true", "trainer.overwrite=true"],
     "resume and overwrite are both true"),
    ("output-dir-empty", None, ["trainer.output_dir="], "trainer: output_dir must not be empty"),
    ("pixels-out-of-order", None, ["model.min_pixels=9000", "model.max_pixels=100"],
     "min_pixels (9000) is above max_pixels (100)"),
    ("pixels-negative", None, ["model.min_pixels=null", "model.max_pixels=-1"],
     "model.max_pixels: Input should be greater than 0"),
    ("tiny-vocabulary-typo", None, ["model.tiny_vocabulary={charcters: abc}"],
     "model.tiny_vocabulary: unknown key 'charcters'"),
    ("config-override-type", None, ["model.config_overrides={text_config: {hidden_size: big}}"],
     "model.config_overrides.text_config.hidden_size: expected an integer"),
    ("config-override-typo", None, ["model.config_overrides={text_config: {hidden_sise: 32}}"],
     "model.config_overrides.text_config.hidden_sise: Qwen2VLTextConfig has no such field"),
    ("turn-above-token-budget", None, ["rollout.env=single_turn", "rollout.max_tokens=1", "rollout.max_new_tokens=2"],
     "rollout.max_tokens: 1 is smaller than one turn's rollout.max_new_tokens (2)"),
    ("settled-unknown-field", None, ["settled.model.dtype=float32"],
     "settled.model.dtype: Extra inputs are not permitted"),
    ("settled-auto", None, ["settled.rollout.backend=auto"],
     "settled.rollout.backend: Input should be 'hf', 'hf_compiled' or 'vllm'"),
    ("sequence-parallel-alone", None, ["parallel.sequence_parallel=2"],
     "parallel.sequence_parallel: sequence_parallel=2 must divide the world size 1"),
    ("prompts-per-step-above-rows", None, ["data.train={tmp}/good.jsonl", "data.prompts_per_step=16"],
     "data.prompts_per_step: 16 prompts per step, but {tmp}/good.jsonl has 4 rows"),
    # -- model paths ------------------------------------------------------------------------
    ("model-path-missing", None, ["model.path={tmp}/no_ckpt", "model.random_init=false", "model.tiny_vocabulary={}",
                                  "model.config_overrides={}"], "model.path: no checkpoint folder {tmp}/no_ckpt"),
    ("model-family-unknown", None, ["model.path=no_such_family"],
     "model.path: no registered model family for 'no_such_family'; known families: "),
    ("model-path-file", None, ["model.path={tmp}/a_file", "model.random_init=false", "model.tiny_vocabulary={}",
                               "model.config_overrides={}"], "model.path: {tmp}/a_file is a file"),
    ("model-bin-only", None, ["model.path={tmp}/bin_ckpt", "model.random_init=false", "model.tiny_vocabulary={}",
                              "model.config_overrides={}"], "holds only pickle-format weights"),
    ("model-truncated", None, ["model.path={tmp}/cut_ckpt", "model.random_init=false", "model.tiny_vocabulary={}",
                               "model.config_overrides={}"], "model.safetensors: truncated or padded"),
    # -- data files -------------------------------------------------------------------------
    ("data-missing", None, ["data.train={tmp}/nope.jsonl"], "dataset not found: {tmp}/nope.jsonl"),
    ("data-empty", None, ["data.train={tmp}/empty.jsonl"], "{tmp}/empty.jsonl: empty file (0 bytes)"),
    ("data-blank-lines", None, ["data.train={tmp}/blank.jsonl"], "{tmp}/blank.jsonl: no rows"),
    ("data-bad-line", None, ["data.train={tmp}/badline.jsonl"], "{tmp}/badline.jsonl:2: not valid JSON"),
    ("data-not-utf8", None, ["data.train={tmp}/latin.jsonl"], "{tmp}/latin.jsonl:5: not UTF-8 text"),
    ("data-row-is-list", None, ["data.train={tmp}/list_row.jsonl"], "list_row.jsonl:2: a row is a JSON object"),
    ("data-csv", None, ["data.train={tmp}/data.csv"], "{tmp}/data.csv: unsupported file type"),
    ("data-broken-json", None, ["data.train={tmp}/broken.json"], "{tmp}/broken.json:1: not valid JSON"),
    ("data-folder-without-files", None, ["data.train={tmp}/no_data_folder"], "no_data_folder: no train.jsonl"),
    ("data-no-answer", None, ["data.train={tmp}/no_answer.jsonl"], "no_answer.jsonl: row 3: answer: missing"),
    ("data-int-answer", None, ["data.train={tmp}/int_answer.jsonl"],
     "int_answer.jsonl: answer: values of several types across rows; every answer must be a string"),
    ("data-string-prompt", None, ["data.train={tmp}/string_prompt.jsonl"],
     "row 3: prompt: expected a list of messages, got a string"),
    ("data-bad-role", None, ["data.train={tmp}/bad_role.jsonl"], "row 3: prompt[0].role: expected one of"),
    ("data-ends-with-assistant", None, ["data.train={tmp}/ends_assistant.jsonl"],
     "row 3: prompt[1].role: the prompt ends with an assistant message"),
    ("data-unknown-part", None, ["data.train={tmp}/bad_part.jsonl"], "row 3: prompt[0].content[0].type: unknown"),
    ("data-image-missing", None, ["data.train={tmp}/missing_image.jsonl"],
     "row 3: images[0]: image file not found: {tmp}/nowhere.png"),
    ("data-image-corrupt", None, ["data.train={tmp}/corrupt_image.jsonl"],
     "row 3: images[0]: {tmp}/corrupt.png: not a readable image"),
    ("data-image-empty", None, ["data.train={tmp}/empty_image.jsonl"], "{tmp}/empty.png: empty image file (0 bytes)"),
    ("data-image-is-text", None, ["data.train={tmp}/text_image.jsonl"], "{tmp}/text.png: not a readable image"),
    ("data-image-extra", None, ["data.train={tmp}/extra_image.jsonl"], "row 3: images: 2 image(s) for 1 image part"),
    ("data-image-absent", None, ["data.train={tmp}/no_image.jsonl"],
     "row 3: prompt[0].content[0]: image part without an image"),
    ("data-images-not-list", None, ["data.train={tmp}/images_not_list.jsonl"], "row 3: images: expected a list"),
    ("data-image-is-folder", None, ["data.train={tmp}/image_is_folder.jsonl"],
     "row 3: images[0]: image file not found: {tmp}/no_data_folder"),
    ("data-video-missing", None, ["data.train={tmp}/missing_video.jsonl"],
     "row 3: videos[0]: video file not found: {tmp}/clip.mp4"),
    ("data-parquet-corrupt", None, ["data.train={tmp}/broken.parquet"],
     "{tmp}/broken.parquet: cannot be read as parquet"),
    ("data-synthetic-unknown", None, ["data.train=synthetic:no_such_task"],
     "data.train: unknown synthetic task 'no_such_task'; tasks: count_shapes"),
    ("data-synthetic-bad-query", None, ["data.train=synthetic:count_shapes?n"], "synthetic:count_shapes?n: cannot"),
    ("data-validation-missing", None, ["data.validation={tmp}/nope.jsonl"], "dataset not found: {tmp}/nope.jsonl"),
    ("data-eval-empty", None, ["data.eval={tmp}/empty.jsonl"], "{tmp}/empty.jsonl: empty file (0 bytes)"),
    # -- rewards ----------------------------------------------------------------------------
    ("reward-unknown", None, ["reward.name=no_such_reward"], "unknown reward 'no_such_reward'"),
    ("reward-module-missing", None, ["reward.name=no_such_module:fn"], "cannot import module 'no_such_module'"),
    ("reward-function-missing", None, ["reward.name=rewards_bad:nothing"], "has no function 'nothing'"),
    ("reward-option-typo", None, ["reward.options={parital: 0.2}"], "reward 'counting' has no option parital"),
    # -- output folders ---------------------------------------------------------------------
    ("output-dir-is-file", None, ["trainer.output_dir={tmp}/a_file"], "trainer.output_dir: {tmp}/a_file is a file"),
    ("output-dir-inside-file", None, ["trainer.output_dir={tmp}/a_file/run"], "which is a file"),
    ("output-dir-used", None, ["trainer.output_dir={tmp}/used"], "trainer.output_dir: {tmp}/used already holds a run"),
]


def _snapshot(folder: Path) -> dict[str, bytes] | None:
    if not folder.exists():
        return None
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*"))}


def _assert_one_clean_line(output: str, words: str) -> None:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert words in lines[0], lines[0]
    assert lines[0].startswith("error: ")


def _no_build(*args, **kwargs):
    raise AssertionError("the model was built before the bad input was found")


@pytest.mark.parametrize("case, recipe, overrides, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(tmp_path, monkeypatch, case, recipe, overrides, words):
    _write_inputs(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # rewards_bad.py
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    fill = lambda text: text.replace("{tmp}", str(tmp_path))  # noqa: E731
    output_dir = tmp_path / "run"
    given = [fill(o) for o in overrides]
    if not any(o.startswith("trainer.output_dir=") for o in given):
        given.append(f"trainer.output_dir={output_dir}")
    elif fill("trainer.output_dir={tmp}") in " ".join(given):
        output_dir = Path(next(o for o in given if o.startswith("trainer.output_dir=")).partition("=")[2])
    before = _snapshot(output_dir)
    result = CliRunner().invoke(app, ["train", fill(recipe) if recipe else RECIPE, *CHEAP, *given])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    _assert_one_clean_line(result.output, fill(words))
    assert _snapshot(output_dir) == before  # nothing written, nothing lost


@pytest.mark.parametrize("case, recipe, overrides, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_through_the_python_api_is_one_line(tmp_path, monkeypatch, case, recipe, overrides, words):
    """The same table through `load_recipe` and `Trainer`: the exception's message is the
    CLI's line (without "error: "), and nothing is written."""
    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    _write_inputs(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    fill = lambda text: text.replace("{tmp}", str(tmp_path))  # noqa: E731
    given = [fill(o) for o in overrides]
    if not any(o.startswith("trainer.output_dir=") for o in given):
        given.append(f"trainer.output_dir={tmp_path / 'run'}")
    def state():  # every path, and every file's modification time (a refused folder's lock comes and goes)
        return {p: p.is_file() and p.stat().st_mtime_ns for p in tmp_path.rglob("*")}

    before = state()
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        Trainer(load_recipe(fill(recipe) if recipe else RECIPE, [*CHEAP, *given]))
    message = str(err.value)
    assert fill(words) in message and "\n" not in message.strip(), message
    assert state() == before  # nothing written, nothing removed


# -- what only a step finds: the tiny recipe, one step -------------------------------------------
# The real process for one of the two (the same error path prints either line); the other
# runs through the CLI in this process, which saves an interpreter start, a build and a step.
@pytest.mark.parametrize("reward, words, real_process", [
    ("rewards_bad:raises", "reward 'raises' raised KeyError: 'oops' at step 1, row ", True),
    ("rewards_bad:nan", "reward 'nan' returned nan (a reward must be a finite number) at step 1, row ", False),
])
@pytest.mark.slow
def test_a_failing_reward_is_one_line_and_leaves_no_checkpoint(tmp_path, monkeypatch, reward, words, real_process):
    _write_inputs(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # rewards_bad.py, for a run in this process
    run = tmp_path / "run"
    command = ["train", RECIPE, *CHEAP, f"reward.name={reward}", "reward.options={}", "trainer.save_every=1",
               f"trainer.output_dir={run}"]
    if real_process:
        result = subprocess.run(
            [sys.executable, "-m", "mmrl.cli", *command], capture_output=True, text=True, cwd=REPO,
            timeout=HANG_GUARD_S,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
        code, stdout, stderr = result.returncode, result.stdout, result.stderr
    else:
        result = CliRunner().invoke(app, command)
        code, stdout, stderr = result.exit_code, result.stdout, result.stderr
    assert code == 2, stderr
    _assert_one_clean_line(stderr, words)
    assert not stdout.strip()
    # The run began (its recipe is saved) but no step completed: no checkpoint, no model,
    # no metrics row, and the lock is gone.
    assert sorted(p.name for p in run.iterdir()) == [".mmrl-run", "recipe.yaml"]  # and the folder's owner mark
    # So the same command may run again there (after the reward is fixed): not refused as
    # a folder holding a run. In process through the same `app` (what this run adds is that
    # the folder is taken again).
    again = CliRunner().invoke(app, ["train", RECIPE, *CHEAP, f"reward.name={reward}", "reward.options={}",
                                     f"trainer.output_dir={run}"])
    assert again.exit_code == 2 and words in again.output, (again.output, again.exception)


@pytest.mark.parametrize("overrides, words", [
    (["data.train={tmp}/corrupt_image.jsonl"], "row 3: images[0]: {tmp}/corrupt.png: not a readable image"),
    (["optim.lr=[1,"], "the value is not valid YAML"),
])
@pytest.mark.slow
def test_the_real_process_prints_one_line_on_stderr(tmp_path, overrides, words):
    _write_inputs(tmp_path)
    run = tmp_path / "run"
    given = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    result = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", RECIPE, *CHEAP, *given,
                             f"trainer.output_dir={run}"], capture_output=True, text=True, cwd=REPO,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 2, result.stderr
    _assert_one_clean_line(result.stderr, words.replace("{tmp}", str(tmp_path)))
    assert not result.stdout.strip() and not run.exists()




@pytest.mark.parametrize("folder, words", [
    ("bin_ckpt", "{tmp}/bin_ckpt holds only pickle-format weights (.bin/.pt); mmrl loads safetensors only"),
    ("cut_ckpt", "{tmp}/cut_ckpt/model.safetensors: truncated or padded"),
    ("no_data_folder", "no_data_folder: no config.json found"),
])
def test_doctor_on_an_unreadable_checkpoint_is_one_line(tmp_path, folder, words):
    _write_inputs(tmp_path)
    result = CliRunner().invoke(app, ["doctor", str(tmp_path / folder), "--workers", "0", "--no-progress"])
    assert result.exit_code == 2, (result.output, result.exception)
    _assert_one_clean_line(result.output, words.replace("{tmp}", str(tmp_path)))


def test_doctor_subject_resolves_a_family_and_refuses_a_bad_folder_without_the_cli(tmp_path):
    from mmrl.probes.doctor import DoctorTargetError, doctor_subject

    subject = doctor_subject("qwen2", "cpu")
    assert (subject.source, subject.random_init, subject.adapter.family) == ("qwen2", True, "qwen2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DoctorTargetError, match="empty: no config.json found"):
        doctor_subject(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(DoctorTargetError, match="no model_type"):
        doctor_subject(str(tmp_path / "empty"))


@pytest.mark.parametrize("words", [["--debug", "true"], ["--debug=on"], ["--debug", "FALSE"], ["--debug=0"]])
def test_debug_takes_a_boolean_word_as_recipes_write_them(tmp_path, words):
    """`mmrl --debug true train ...` is --debug (not a command named `true`), `--debug=0` none."""
    result = CliRunner().invoke(app, [*words, "train", RECIPE, "optim.lr=abc", f"trainer.output_dir={tmp_path}"])
    if words[-1].lower().rsplit("=")[-1] in ("true", "on"):
        assert type(result.exception).__name__ == "RecipeError", result.output
    else:
        assert result.exit_code == 2 and result.output.startswith("error: ")
        assert "optim.lr: Input should be a valid number" in result.output
    assert "No such command" not in result.output


@pytest.mark.slow
def test_debug_shows_the_traceback_instead_of_one_line(tmp_path):
    result = CliRunner().invoke(app, ["--debug", "train", RECIPE, "optim.lr=abc", f"trainer.output_dir={tmp_path}"])
    assert type(result.exception).__name__ == "RecipeError", result.exception
    assert "optim.lr: Input should be a valid number" in str(result.exception)
    result = subprocess.run([sys.executable, "-m", "mmrl.cli", "--debug", "train", RECIPE, "optim.lr"],
                            capture_output=True, text=True, cwd=REPO, timeout=HANG_GUARD_S)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "override 'optim.lr' must read key=value" in result.stderr.splitlines()[-1]
