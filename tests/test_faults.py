"""Issue 30's second suite: hostile but realistic inputs and faults, grouped as the issue
groups them. Each case checks the exit code, that the user sees one line and no traceback,
that nothing outside what mmrl owns changed, and what the run folder holds before and after.

    .venv/bin/python -m pytest -q tests/test_faults.py

Group "security": a recipe is shared as data, so nothing in it that is not an import path
(`reward.name`, `rollout.env`) may run code; docs/datasets.md#what-a-recipe-can-run says so.
Group "run folder": the folder is mmrl's (files it did not write are refused, links are never
written through, overwrite removes only its own results, resume with nothing to resume is
one line). Groups "silent values" and "late checks": values refused as written (no
coercion, duplicate keys, ranges), before the build where the recipe or data shows them,
and the limits of docs/training.md#limits. Group "error boundary": every failure a user can
act on (disk full, read-only, permission, memory, bad weights, unreachable source, known
torch errors) is one line and exit 2; a full disk at the export keeps the weights.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmrl.cli import app

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "tiny_vlm_count.yaml")
CHEAP = ["trainer.steps=1", "trainer.progress=false", "trainer.summary=false", "trainer.export=false",
         "data.prompts_per_step=2", "rollout.samples_per_prompt=2"]


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
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
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


# -- group "run folder": the folder is mmrl's; it writes through no link and removes only its own ----
def _state(folder: Path) -> dict[str, object]:
    """Every entry under `folder` (links not followed): a file's bytes, a link's target."""
    out = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        out[name] = f"-> {path.readlink()}" if path.is_symlink() else path.read_bytes() if path.is_file() else "<dir>"
    return out


def _train(*overrides: str):
    return CliRunner().invoke(app, ["train", RECIPE, *CHEAP, *overrides])


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "recipe.yaml").write_text("# my own recipe\nmodel: {path: qwen2_vl}\n")
    (project / "notes.md").write_text("mine\n")
    return project


@pytest.mark.parametrize("extra", [[], ["trainer.overwrite=true"]], ids=["plain", "overwrite"])
@pytest.mark.slow
def test_run_folder_a_project_folder_is_refused_and_left_as_it_was(tmp_path, monkeypatch, extra):
    project = _project(tmp_path)
    monkeypatch.chdir(project)
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    before = _state(tmp_path)
    result = _train("trainer.output_dir=.", *extra)
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert "holds files mmrl did not write (notes.md, recipe.yaml)" in line, line
    assert _state(tmp_path) == before  # the user's recipe.yaml neither removed nor replaced


def test_run_folder_a_users_lone_recipe_is_not_taken_for_a_stopped_run(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "recipe.yaml").write_text("# my own recipe\n")
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    before = _state(tmp_path)
    result = _train(f"trainer.output_dir={folder}")
    assert result.exit_code == 2, (result.output, result.exception)
    assert "holds files mmrl did not write (recipe.yaml)" in _one_clean_line(result.output)
    assert _state(tmp_path) == before


def test_run_folder_overwrite_refuses_a_run_folder_holding_a_users_file(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    for name, text in (("recipe.yaml", "model: {path: qwen2_vl}\n"), ("metrics.jsonl", '{"step": 1}\n'),
                       (".mmrl-run", ""), ("my_analysis.ipynb", "{}")):
        (run / name).write_text(text)
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    before = _state(tmp_path)
    result = _train(f"trainer.output_dir={run}", "trainer.overwrite=true")
    assert result.exit_code == 2, (result.output, result.exception)
    assert "holds files mmrl did not write (my_analysis.ipynb)" in _one_clean_line(result.output)
    assert _state(tmp_path) == before  # nothing removed, the run's results included


def test_run_folder_a_planted_link_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    outside = tmp_path / "precious.png"
    outside.write_bytes(b"not mmrl's")
    run = tmp_path / "run"
    run.mkdir()
    (run / "reward_curve.png").symlink_to(outside)
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    before = _state(tmp_path)
    result = _train(f"trainer.output_dir={run}")
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"{run / 'reward_curve.png'} is a symbolic link" in line, line
    assert _state(tmp_path) == before


def test_run_folder_links_planted_during_a_run_are_replaced_not_followed(tmp_path):
    """What the checks at the start cannot see: a link planted while the run goes. The plot
    is renamed over the link; metrics.jsonl is never opened through one (O_NOFOLLOW)."""
    import errno

    from mmrl.run_log import RunLog, plot_rewards

    outside = tmp_path / "precious"
    outside.write_bytes(b"not mmrl's")
    run = tmp_path / "run"
    run.mkdir()
    (run / "reward_curve.png").symlink_to(outside)
    plot_rewards([{"step": 1, "reward/mean": 0.5}], run / "reward_curve.png")
    assert outside.read_bytes() == b"not mmrl's"
    assert not (run / "reward_curve.png").is_symlink() and (run / "reward_curve.png").stat().st_size > 0
    (run / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(OSError) as err:
        RunLog(run, main=True).write({"step": 1})
    assert err.value.errno == errno.ELOOP
    assert outside.read_bytes() == b"not mmrl's"
    # No temporary left (the TensorBoard backend starts before the first metrics line).
    assert sorted(p.name for p in run.iterdir() if p.name != "tensorboard") == ["metrics.jsonl", "reward_curve.png"]


@pytest.mark.parametrize("holds", ["nothing", "metrics"])
def test_run_folder_resume_with_nothing_to_resume_is_one_line(tmp_path, monkeypatch, holds):
    run = tmp_path / "run"
    if holds == "metrics":
        run.mkdir()
        (run / "recipe.yaml").write_text("model: {path: qwen2_vl}\n")
        (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
        (run / ".mmrl-run").write_text("")
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    before = _state(tmp_path)
    result = _train(f"trainer.output_dir={run}", "trainer.resume=true")
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"trainer.resume: no checkpoint to resume from in {run / 'checkpoints'}" in line, line
    assert _state(tmp_path) == before  # metrics.jsonl untouched; a folder that was not there is not made
    assert run.exists() == (holds == "metrics")


# -- groups "silent values" and "late checks": refused from the recipe alone, before the build ----
# (group, case id, overrides, words the one line holds)
RECIPE_VALUES = [
    ("silent values", "steps-true", ["trainer.steps=true"], "trainer.steps: expected a number, got a boolean (true)"),
    ("silent values", "lr-true", ["optim.lr=true"], "optim.lr: expected a number, got a boolean (true)"),
    ("silent values", "steps-string", ["trainer.steps='5'"], "trainer.steps: expected an integer, got a string ('5')"),
    ("silent values", "steps-float", ["trainer.steps=2.0"], "trainer.steps: expected an integer, got 2.0"),
    ("silent values", "switch-one", ["trainer.export=1"], "trainer.export: expected true or false, got 1"),
    ("silent values", "switch-word", ["model.share_media=on_gpu"], "model.share_media: expected true or false"),
    ("silent values", "lr-infinite", ["optim.lr=.inf"], "optim.lr: expected a finite number, got inf"),
    ("silent values", "lr-nan-string", ["optim.lr=nan"], "optim.lr: expected a finite number, got nan"),
    ("silent values", "lr-multiplier-negative", ["optim.lr_multipliers={vision: -1}"],
     "optim.lr_multipliers.vision: Input should be greater than or equal to 0"),
    ("silent values", "override-duplicate-key", ["optim.lr_multipliers={vision: 1, vision: 2}"],
     "key 'vision' appears twice"),
    ("silent values", "temperature-zero-grpo", ["rollout.temperature=0"],
     "algo: advantage 'grpo' compares the samples of a prompt, but rollout.temperature 0 (greedy)"),
    ("late checks", "one-sample-grpo", ["rollout.samples_per_prompt=1", "algo.advantage=rloo"],
     "algo: advantage 'rloo' compares the samples of a prompt, but rollout.samples_per_prompt is 1"),
    ("late checks", "beta-one", ["optim.betas=[0.9, 1.0]"], "optim.betas.1: Input should be less than 1"),
    ("late checks", "beta-negative", ["optim.betas=[-0.1, 0.99]"],
     "optim.betas.0: Input should be greater than or equal to 0"),
    ("late checks", "seed-negative", ["trainer.seed=-1"], "trainer.seed: Input should be greater than or equal to 0"),
    ("late checks", "seed-huge", ["trainer.seed=99999999999"], "trainer.seed: Input should be less than or equal to"),
    ("late checks", "shuffle-seed-negative", ["data.shuffle_seed=-3"], "data.shuffle_seed: Input should be greater"),
]


@pytest.mark.parametrize("group, case, overrides, words", RECIPE_VALUES, ids=[f"{c[0]}:{c[1]}" for c in RECIPE_VALUES])
def test_recipe_values_are_refused_before_the_build(tmp_path, monkeypatch, group, case, overrides, words):
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    run = tmp_path / "run"
    before = _state(tmp_path)
    result = _train(*overrides, f"trainer.output_dir={run}")
    assert result.exit_code == 2, (result.output, result.exception)
    assert words in _one_clean_line(result.output)
    assert _state(tmp_path) == before and not run.exists()


def test_silent_values_a_key_given_twice_in_a_recipe_file_names_both_lines(tmp_path, monkeypatch):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(Path(RECIPE).read_text() + "\noptim:\n  lr: 1.0e-3\n  lr: 1.0e-5\n")
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    before = _state(tmp_path)
    result = CliRunner().invoke(app, ["train", str(recipe), *CHEAP, f"trainer.output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert "twice.yaml: line " in line and "appears twice (first at line " in line, line
    assert _state(tmp_path) == before


def test_silent_values_numbers_written_as_yaml_reads_them_still_load():
    """YAML 1.1 reads `1e-6` as a string: a numeric string stays a number for a float field."""
    from mmrl.config import load_recipe

    recipe = load_recipe(RECIPE, ["optim.lr=1e-6", "optim.betas=[0.5, 0.9]", "trainer.seed=7",
                                  "model.gradient_checkpointing=auto", "algo.advantage=reinforce_pp",
                                  "rollout.temperature=0"])
    assert recipe.optim.lr == 1e-6 and recipe.trainer.seed == 7 and recipe.rollout.temperature == 0


# -- group "error boundary": every failure a user can act on is one line, exit 2 ------------------
def _raises(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc
    return fail


def _unreachable():
    from huggingface_hub.errors import LocalEntryNotFoundError

    return LocalEntryNotFoundError("Cannot find the requested files in the local cache")


def _bad_safetensors():
    from safetensors import SafetensorError

    return SafetensorError("Error while deserializing header: MetadataIncompleteBuffer")


# (case id, what replaces what, the exception, words the one line holds). Each fails before
# the build or in place of it: cheap.
BOUNDARY = [
    ("read-only-folder", "mmrl.runs.RunFolder._take_lock", lambda run: OSError(30, "Read-only file system",
                                                                                str(run / ".mmrl.lock")),
     "{run}/.mmrl.lock: read-only file system; choose a writable folder"),
    ("permission-denied", "mmrl.runs.RunFolder._take_lock", lambda run: PermissionError(13, "Permission denied",
                                                                                        str(run / ".mmrl.lock")),
     "{run}/.mmrl.lock: permission denied; choose a folder you may write to"),
    ("unreachable-hub", "mmrl.build.build_model", lambda run: _unreachable(),
     "a source cannot be reached (LocalEntryNotFoundError: Cannot find the requested files"),
    ("bad-safetensors", "mmrl.build.build_model", lambda run: _bad_safetensors(),
     "a safetensors file cannot be read (Error while deserializing header"),
    ("checkpoint-does-not-fit", "mmrl.build.build_model",
     lambda run: RuntimeError("Error(s) in loading state_dict for Qwen2VL:\n\tsize mismatch for lm_head.weight"),
     "Error(s) in loading state_dict for Qwen2VL:: the checkpoint does not fit the model"),
    ("host-memory", "mmrl.build.build_model", lambda run: MemoryError(), "out of host memory"),
    ("gpu-memory", "mmrl.build.build_model",
     lambda run: __import__("torch").cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"),
     "out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB): lower algo.micro_batch_size"),
]


@pytest.mark.parametrize("case, target, make, words", BOUNDARY, ids=[c[0] for c in BOUNDARY])
def test_error_boundary_a_failure_is_one_line_exit_2(tmp_path, monkeypatch, case, target, make, words):
    run = tmp_path / "run"
    monkeypatch.setattr(target, _raises(make(run)))
    before = _state(tmp_path)
    result = _train(f"trainer.output_dir={run}")
    assert result.exit_code == 2, (result.output, result.exception)
    assert words.format(run=run) in _one_clean_line(result.output)
    assert _state(tmp_path) == before and not run.exists()  # the lock and a folder it made are gone


def test_error_boundary_debug_shows_the_traceback_and_a_bug_keeps_it(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr("mmrl.build.build_model", _raises(OSError(28, "No space left on device", str(run / "x"))))
    result = CliRunner().invoke(app, ["--debug", "train", RECIPE, *CHEAP, f"trainer.output_dir={run}"])
    assert isinstance(result.exception, OSError) and result.exception.errno == 28
    monkeypatch.setattr("mmrl.build.build_model", _raises(TypeError("a bug in mmrl")))
    result = CliRunner().invoke(app, ["train", RECIPE, *CHEAP, f"trainer.output_dir={run}"])
    assert isinstance(result.exception, TypeError)  # not hidden behind one line


def test_error_boundary_doctor_on_a_cut_short_config(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2_vl", "hidden_si')
    before = _state(tmp_path)
    result = CliRunner().invoke(app, ["doctor", str(folder), "--workers", "0", "--no-progress"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"{folder / 'config.json'}: not a readable config (" in line, line
    assert _state(tmp_path) == before


@pytest.mark.slow
def test_error_boundary_a_full_disk_at_the_export_keeps_the_weights(tmp_path, monkeypatch):
    """With the default save_every 0, the export is where a finished run was lost: now it is
    one line naming the file, no half-written final/, and a checkpoint to resume from."""
    import errno

    import mmrl.trainer

    run = tmp_path / "run"
    real_export = mmrl.trainer.export_policy

    def disk_fills(actor, processing, path, dist, **options):
        (path / "config.json").write_text("{}")  # the export got this far
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "model.safetensors"))

    monkeypatch.setattr("mmrl.trainer.export_policy", disk_fills)
    result = _train(f"trainer.output_dir={run}", "trainer.export=true", "data.eval=null")
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"{run}/.tmp-final/model.safetensors: no space left on the device" in line, line
    assert f"the trained weights are kept in checkpoint {run / 'checkpoints' / 'step_000001'}" in line, line
    names = sorted(p.name for p in run.iterdir())
    assert names == [".mmrl-run", "checkpoints", "metrics.jsonl", "recipe.yaml", "reward_curve.png"] or \
        names == [".mmrl-run", "checkpoints", "metrics.jsonl", "recipe.yaml", "reward_curve.png", "tensorboard"], names
    assert (run / "checkpoints" / "step_000001" / "manifest.json").is_file()
    # Once fixed, resume evaluates and exports the kept weights.
    monkeypatch.setattr("mmrl.trainer.export_policy", real_export)
    result = _train(f"trainer.output_dir={run}", "trainer.export=true", "data.eval=null", "trainer.resume=true")
    assert result.exit_code == 0, (result.output, result.exception)
    assert (run / "final" / "model.safetensors").is_file() and (run / "final" / "config.json").is_file()


def test_late_checks_an_eval_split_too_small_for_the_shuffled_images_control(tmp_path, monkeypatch):
    """Found at the final evaluation before, after every training step; now before the build."""
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    run = tmp_path / "run"
    result = _train("data.eval=synthetic:count_shapes?n=1&seed=1&image_size=56", f"trainer.output_dir={run}")
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert "data.eval: " in line and "the shuffled-images control needs at least two rows holding as many " \
        "images, but the rows with images are 1 with 1" in line, line
    assert not run.exists()


# -- "late checks": unbounded inputs are refused by a stated limit (docs/training.md#limits) -------
def test_late_checks_a_huge_row_and_a_huge_synthetic_task_are_refused_before_the_build(tmp_path, monkeypatch):
    from mmrl.data.schema import MAX_ROW_CHARS
    from mmrl.data.synthetic import MAX_SYNTHETIC_ROWS

    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    rows = _text_rows(tmp_path)
    with open(rows, "a") as handle:
        handle.write(json.dumps({"q": "x" * (MAX_ROW_CHARS + 1), "answer": "1"}) + "\n")
    run = tmp_path / "run"
    source = json.dumps({"path": str(rows), "columns": {"prompt": "q"}})
    for given, words in ((f"data.train={source}", f"questions.jsonl:5: a row of more than {MAX_ROW_CHARS} bytes"),
                         ("data.train=synthetic:count_shapes?n=100000000",
                          f"n must be a whole number from 1 to {MAX_SYNTHETIC_ROWS}")):
        result = _train(given, f"trainer.output_dir={run}")
        assert result.exit_code == 2, (result.output, result.exception)
        assert words in _one_clean_line(result.output)
        assert not run.exists()


def test_late_checks_a_tool_cannot_take_the_machine():
    from mmrl.envs.builtin import TOOL_REPLY_MAX_CHARS, ToolEnvironment
    from mmrl.envs.tools import Tool, ToolError, calculator

    for expression in ("(9**64)**64", "((2**64)**64)**64", "10**64*" * 80 + "1", "(" * 5000 + "1" + ")" * 5000):
        with pytest.raises(ToolError, match="too large|longer than"):
            calculator({"expression": expression}, {})
    assert calculator({"expression": "2**64"}, {}) == str(2**64)

    env = ToolEnvironment(tools=[Tool("shout", lambda arguments, context: "a" * 10**7)])
    replies, done, _ = env.step([{"role": "assistant", "content": '<tool_call>{"name": "shout", "arguments": {}}'
                                                                  '</tool_call>'}])
    text = replies[0]["content"] if isinstance(replies[0]["content"], str) else replies[0]["content"][0]["text"]
    assert len(text) < TOOL_REPLY_MAX_CHARS + 100 and "cut: " in text


def test_late_checks_a_tool_that_hangs_is_stopped(monkeypatch):
    import time

    from mmrl.envs.builtin import ToolEnvironment
    from mmrl.envs.tools import Tool

    monkeypatch.setattr("mmrl.envs.builtin.TOOL_TIME_LIMIT_S", 0.2)
    calls = []

    def spins(arguments, context):
        calls.append(1)
        while True:
            time.sleep(0.01)

    env = ToolEnvironment(tools=[Tool("spin", spins)])
    replies, done, _ = env.step([{"role": "assistant", "content": '<tool_call>{"name": "spin", "arguments": {}}'
                                                                  '</tool_call>'}])
    assert calls and not done and replies[0]["content"] == "error: took longer than 0.2 s"


def test_late_checks_a_second_signal_says_that_no_checkpoint_was_saved(tmp_path, capsys):
    import signal

    from mmrl.trainer import Trainer

    trainer = object.__new__(Trainer)  # only what the handler reads: no model needed
    trainer.output_dir, trainer.step, trainer._stop_signal = tmp_path, 3, signal.SIGTERM
    trainer.dist = type("Dist", (), {"is_main": True})()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer._on_signal(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    line = _one_clean_line("error: " + capsys.readouterr().err.strip())
    assert "SIGTERM again: stopped at once in step 4, without saving a checkpoint; none was saved before" in line
    saved = tmp_path / "checkpoints" / "step_000002"
    saved.mkdir(parents=True)
    (saved / "manifest.json").write_text("{}")
    assert f"the newest saved is {saved}: continue from it with trainer.resume=true" in \
        trainer._stopped_at_once(signal.SIGTERM)


def test_silent_values_a_16_bit_greyscale_png_keeps_its_shades(tmp_path):
    """Pillow's own conversion clips 16-bit grey at 255: a gradient read as nearly all white."""
    import numpy as np
    from PIL import Image

    from mmrl.data.schema import decode_image

    gradient = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(gradient).save(tmp_path / "grey16.png")
    assert Image.open(tmp_path / "grey16.png").mode == "I;16"
    for source in (tmp_path / "grey16.png", Image.open(tmp_path / "grey16.png")):
        decoded = np.asarray(decode_image(source))
        assert decoded.min() == 0 and decoded.max() == 255 and 120 < decoded.mean() < 135


def test_late_checks_an_extreme_aspect_ratio_names_the_row_before_the_build(tmp_path, monkeypatch):
    from PIL import Image

    Image.new("RGB", (56, 56), "white").save(tmp_path / "fine.png")
    Image.new("RGB", (4000, 10), "white").save(tmp_path / "strip.png")
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
           "answer": "1"}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({**row, "images": [name]}) + "\n"
                                                 for name in ("fine.png", "fine.png", "strip.png")))
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    run = tmp_path / "run"
    before = _state(tmp_path)
    result = _train(f"data.train={tmp_path / 'rows.jsonl'}", f"trainer.output_dir={run}")
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert "row 2: images[0]: " in line and "strip.png: image of 4000x10 pixels, an aspect ratio of 400:1" in line, line
    assert _state(tmp_path) == before


TEXT = ["model.path=qwen2", "model.random_init=true",
        "model.tiny_vocabulary={characters: '0123456789+ ?', words: [What, is, user, assistant]}",
        "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=2", "reward.name=numeric",
        "optim.lr=3e-4", "model.dtype=float32",
        "trainer.progress=false", "trainer.export=false", "trainer.threads=2"]


def test_late_checks_a_dataset_edited_since_the_checkpoint_is_named(tmp_path):
    from mmrl.data.synthetic import from_spec

    rows = tmp_path / "sums.jsonl"
    samples = from_spec("synthetic:arithmetic?n=8&seed=0&max_operand=4")
    rows.write_text("".join(json.dumps({"prompt": s["prompt"], "answer": s["answer"]}) + "\n" for s in samples))
    run = tmp_path / "run"
    recipe = tmp_path / "text.yaml"
    recipe.write_text(f"model: {{path: qwen2}}\ndata: {{train: {rows}}}\n")
    given = ["train", str(recipe), *TEXT, f"trainer.output_dir={run}", "trainer.save_every=1"]
    first = CliRunner().invoke(app, [*given, "trainer.steps=1"])
    assert first.exit_code == 0, (first.output, first.exception)
    rows.write_text("".join(rows.read_text().splitlines(keepends=True)[:5]))  # edited: 3 rows gone
    before = _state(run)
    result = CliRunner().invoke(app, [*given, "trainer.steps=2", "trainer.resume=true"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"trainer.resume: data.train ({rows}) has 5 rows now, 8 when {run / 'checkpoints' / 'step_000001'} was " \
           "saved: the dataset changed" in line, line
    assert _state(run) == before  # metrics.jsonl and the checkpoint untouched


def test_silent_values_a_prompt_longer_than_the_context_is_refused_before_step_1(tmp_path):
    from mmrl.data.synthetic import from_spec

    rows = tmp_path / "sums.jsonl"
    samples = from_spec("synthetic:arithmetic?n=4&seed=0&max_operand=4")
    samples[2] = {**samples[2], "prompt": [{"role": "user", "content": "What is " + "1+" * 100 + "1?"}]}
    rows.write_text("".join(json.dumps({"prompt": s["prompt"], "answer": s["answer"]}) + "\n" for s in samples))
    recipe = tmp_path / "text.yaml"
    recipe.write_text(f"model: {{path: qwen2}}\ndata: {{train: {rows}}}\n")
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(recipe), *TEXT, "model.config_overrides={max_position_embeddings: 128}",
                                      f"trainer.output_dir={run}", "trainer.steps=1"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"data.train: row 2 of {rows}: its prompt's text alone is " in line, line
    assert "above the model's context of 128 tokens" in line, line
    assert not run.exists()  # refused before the run wrote anything


def test_run_folder_resume_counts_a_checkpoint_moved_aside_mid_replace(tmp_path):
    from mmrl.runs import RunFolder

    run = tmp_path / "run"
    aside = run / "checkpoints" / ".old-step_000002"  # a save cut between its two renames
    aside.mkdir(parents=True)
    (aside / "manifest.json").write_text('{"files": {}}')
    for name, text in (("recipe.yaml", "model: {path: qwen2_vl}\n"), ("metrics.jsonl", '{"step": 2}\n'),
                       (".mmrl-run", "")):
        (run / name).write_text(text)
    folder = RunFolder(run)
    folder.claim(resume=True, overwrite=False)  # not refused as "no checkpoint"
    folder.release()
