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

    import mmrl.export

    run = tmp_path / "run"
    real_card = mmrl.export.write_card

    def disk_fills(folder, *args, **options):  # the weights and config are written, the card is not
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "README.md"))

    monkeypatch.setattr("mmrl.export.write_card", disk_fills)
    result = _train(f"trainer.output_dir={run}", "trainer.export=true", "data.eval=null")
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"{run}/.tmp-final/README.md: no space left on the device" in line, line
    assert f"the trained weights are kept in checkpoint {run / 'checkpoints' / 'step_000001'}" in line, line
    names = sorted(p.name for p in run.iterdir())
    assert names == [".mmrl-run", "buffer", "checkpoints", "metrics.jsonl", "recipe.yaml", "reward_curve.png"] or \
        names == [".mmrl-run", "buffer", "checkpoints", "metrics.jsonl", "recipe.yaml", "reward_curve.png",
                  "tensorboard"], names
    assert (run / "checkpoints" / "step_000001" / "manifest.json").is_file()
    # Once fixed, resume evaluates and exports the kept weights.
    monkeypatch.setattr("mmrl.export.write_card", real_card)
    result = _train(f"trainer.output_dir={run}", "trainer.export=true", "data.eval=null", "trainer.resume=true")
    assert result.exit_code == 0, (result.output, result.exception)
    assert (run / "final" / "model.safetensors").is_file() and (run / "final" / "config.json").is_file()


# Under torchrun: the disk fills while rank 0 writes the export and rank 1 waits for it. Each
# rank's stdout and stderr go to files of its own; its exit code too.
DISK_FILLS_AT_EXPORT = """
import errno, os, sys

out, rank = sys.argv[1], os.environ["RANK"]
for fd, stream in ((1, "out"), (2, "err")):
    os.dup2(os.open(f"{out}/rank{rank}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
import mmrl.export


def disk_fills(folder, *args, **options):
    raise OSError(errno.ENOSPC, "No space left on device", str(folder / "README.md"))


mmrl.export.write_card = disk_fills
from mmrl.cli import app

leave = os._exit  # a rank that failed with the others leaves through it (mesh.exit_cleanly)


def left(code):
    open(f"{out}/rank{rank}.code", "w").write(str(code))
    leave(code)


os._exit = left
try:
    app(sys.argv[2:], prog_name="mmrl")
except SystemExit as exc:
    open(f"{out}/rank{rank}.code", "w").write(str(exc.code))
    raise
"""


@pytest.mark.multiprocess  # torchrun: out of the quick tier, queued with the slow tests
def test_error_boundary_a_full_disk_at_a_two_process_export_stops_every_rank_and_keeps_the_weights(tmp_path):
    """Rank 1 waited at a barrier for rank 0, which had given up: now every rank learns the
    failure, both save the checkpoint together, and each says one line and exits 2."""
    import subprocess

    from cpu_processes import environment, torchrun

    script, logs, run = tmp_path / "worker.py", tmp_path / "logs", tmp_path / "run"
    script.write_text(DISK_FILLS_AT_EXPORT)
    logs.mkdir()
    command = torchrun(2, script, logs, "train", RECIPE, *CHEAP, "trainer.export=true", "data.eval=null",
                       "data.prompts_per_step=4", "trainer.threads=1", f"trainer.output_dir={run}")
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=environment())
    assert finished.returncode != 0, finished.stderr[-3000:]
    kept = run / "checkpoints" / "step_000001"
    said = f"{run}/.tmp-final/README.md: no space left on the device"
    for rank, before in ((0, ""), (1, "rank 0 failed: ")):
        assert (logs / f"rank{rank}.code").read_text() == "2", (logs / f"rank{rank}.err").read_text()
        line = _one_clean_line((logs / f"rank{rank}.err").read_text())
        assert line.startswith(f"error: {before}{said}"), line
        assert f"the trained weights are kept in checkpoint {kept}: once fixed, run again with trainer.resume=true" \
            in line, line
    assert (kept / "manifest.json").is_file() and (kept / "actor" / "model.safetensors").is_file()
    assert not (run / "final").exists() and not list(run.glob(".tmp-*"))


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


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_late_checks_a_tool_that_hangs_is_stopped(monkeypatch, where):
    """A timer signal reaches the main thread only: off it (a rollout in a thread of its
    own) the tool ran unbounded; now a worker thread runs it and is stopped."""
    import threading
    import time

    from mmrl.envs.builtin import ToolEnvironment
    from mmrl.envs.tools import Tool

    monkeypatch.setattr("mmrl.envs.builtin.TOOL_TIME_LIMIT_S", 0.2)
    calls, spun = [], []

    def spins(arguments, context):
        calls.append(threading.current_thread())
        try:
            while True:
                spun.append(1)
                time.sleep(0.01)
        except Exception:  # a tool's own handler does not swallow the stop
            return "swallowed"

    env = ToolEnvironment(tools=[Tool("spin", spins)])
    step = [{"role": "assistant", "content": '<tool_call>{"name": "spin", "arguments": {}}</tool_call>'}]
    out = {}
    if where == "main thread":
        out["step"] = env.step(step)
    else:
        caller = threading.Thread(target=lambda: out.update(step=env.step(step)), daemon=True)
        caller.start()
        caller.join(60)
        assert not caller.is_alive(), "the tool call was not stopped"
    replies, done, _ = out["step"]
    assert calls and not done and replies[0]["content"] == "error: took longer than 0.2 s"
    if calls[0] is not threading.current_thread():
        calls[0].join(60)  # the thread that ran the tool ends: it does not spin on
        assert not calls[0].is_alive()
    count = len(spun)
    time.sleep(0.05)
    assert len(spun) == count


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
    lines = rows.read_text().splitlines(keepends=True)
    before = _state(run)
    # Edited in content, as many rows: the position would now point at other rows.
    rows.write_text("".join([*lines[:3], lines[3].replace('"answer": "', '"answer": "1'), *lines[4:]]))
    result = CliRunner().invoke(app, [*given, "trainer.steps=2", "trainer.resume=true"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"trainer.resume: data.train ({rows}) was edited since {run / 'checkpoints' / 'step_000001'} was saved " \
           "(as many rows, 8, but their content differs)" in line, line
    assert _state(run) == before  # metrics.jsonl and the checkpoint untouched
    rows.write_text("".join(lines[:5]))  # edited: 3 rows gone
    result = CliRunner().invoke(app, [*given, "trainer.steps=2", "trainer.resume=true"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"trainer.resume: data.train ({rows}) has 5 rows now, 8 when {run / 'checkpoints' / 'step_000001'} was " \
           "saved: the dataset changed" in line, line
    assert _state(run) == before


def test_late_checks_a_datasets_fingerprint_is_its_rows_content_in_order(tmp_path):
    """What a checkpoint records of data.train: the same for the same rows loaded again
    (images, in files or in memory, included), another for an edited row or another order."""
    from mmrl.data import load_prompts
    from mmrl.data.loaders import PromptDataset
    from mmrl.data.synthetic import from_spec

    def fresh(source, **options):
        from mmrl.data import loaders

        loaders._RECENT.clear()  # the load cache would hand back the same object
        return load_prompts(source, **options)

    spec = "synthetic:count_shapes?n=6&seed=0&image_size=56"
    assert fresh(spec).fingerprint == fresh(spec).fingerprint
    assert fresh(spec).fingerprint != fresh(spec, shuffle_seed=1).fingerprint
    assert fresh(spec).fingerprint != fresh("synthetic:count_shapes?n=6&seed=1&image_size=56").fingerprint
    samples = from_spec(spec)
    for index, sample in enumerate(samples):
        sample["images"][0].save(tmp_path / f"{index}.png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": s["prompt"], "answer": s["answer"], "images": [f"{i}.png"]}) + "\n"
                            for i, s in enumerate(samples)))
    assert fresh(rows).fingerprint == fresh(rows).fingerprint
    assert PromptDataset(samples).fingerprint == PromptDataset(from_spec(spec)).fingerprint
    samples[2] = {**samples[2], "answer": "99"}
    assert PromptDataset(samples).fingerprint != PromptDataset(from_spec(spec)).fingerprint


@pytest.mark.parametrize("model", ["random init", "checkpoint folder"])
def test_silent_values_a_prompt_longer_than_the_context_is_refused_before_the_build(tmp_path, monkeypatch, model):
    """Found after the build before (it read the built model's tokenizer); the tokenizer and
    config load without the model, so now before any weights are drawn or read."""
    from mmrl.build import build_model
    from mmrl.data.synthetic import from_spec

    rows = tmp_path / "sums.jsonl"
    samples = from_spec("synthetic:arithmetic?n=4&seed=0&max_operand=4")
    samples[2] = {**samples[2], "prompt": [{"role": "user", "content": "What is " + "1+" * 100 + "1?"}]}
    rows.write_text("".join(json.dumps({"prompt": s["prompt"], "answer": s["answer"]}) + "\n" for s in samples))
    recipe = tmp_path / "text.yaml"
    recipe.write_text(f"model: {{path: qwen2}}\ndata: {{train: {rows}}}\n")
    if model == "random init":
        given = [*TEXT, "model.config_overrides={max_position_embeddings: 128}"]
    else:
        folder = tmp_path / "tiny-qwen2"
        build_model("qwen2", random_init=True, config_overrides={"max_position_embeddings": 128}).save(folder)
        given = [*(o for o in TEXT if not o.startswith(("model.path", "model.random_init", "model.tiny_vocabulary"))),
                 f"model.path={folder}"]
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(recipe), *given, f"trainer.output_dir={run}", "trainer.steps=1"])
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


# -- a third round of hostile inputs through each command (train, data check, eval, export, doctor) --
BOMB = "".join(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9 if previous else ['x'] * 9)}]\n"
               for previous, name in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh"))


def test_silent_values_a_yaml_alias_bomb_is_refused_as_read(tmp_path, monkeypatch):
    """Nine aliases of nine aliases ...: 9^8 values once expanded, which dumping or comparing
    the recipe would try to build; a value holding itself loops. Refused when read."""
    from mmrl.config import MAX_RECIPE_VALUES

    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    recipe = tmp_path / "bomb.yaml"
    indented = "".join(f"    {line}\n" for line in BOMB.splitlines())
    recipe.write_text(f"model: {{path: qwen2_vl, random_init: true}}\nreward:\n  name: count_match\n  options:\n"
                      f"{indented}")
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(recipe), *CHEAP, f"trainer.output_dir={run}"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert f"{recipe}: more than {MAX_RECIPE_VALUES:,} values once YAML aliases (*name) are expanded" in \
        _one_clean_line(result.output)
    flat = "{" + ", ".join(BOMB.splitlines()) + "}"
    result = CliRunner().invoke(app, ["data", "check", RECIPE, f"reward.options={flat}"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert "override 'reward.options={a: &a" in line and f"more than {MAX_RECIPE_VALUES:,} values" in line, line
    recipe.write_text("model: {path: qwen2_vl}\nreward: {options: {loop: &loop [1, *loop]}}\n")
    result = CliRunner().invoke(app, ["data", "check", str(recipe)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "a value refers to itself" in _one_clean_line(result.output)
    assert not run.exists()


def test_late_checks_data_check_validates_every_row_not_only_those_shown(tmp_path):
    """`mmrl data check` showed the first rows and said nothing of a broken image in row 3."""
    from PIL import Image

    Image.new("RGB", (56, 56), "white").save(tmp_path / "fine.png")
    (tmp_path / "text.png").write_text("not an image")
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
           "answer": "1"}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({**row, "images": [name]}) + "\n"
                                                 for name in ("fine.png", "fine.png", "fine.png", "text.png")))
    result = CliRunner().invoke(app, ["data", "check", RECIPE, f"data.train={tmp_path / 'rows.jsonl'}", "--rows", "1"])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"rows.jsonl: row 3: images[0]: {tmp_path / 'text.png'}: not a readable image" in line, line


def test_late_checks_eval_refuses_an_out_file_it_cannot_write_before_evaluating(tmp_path, monkeypatch):
    def evaluates(*args, **kwargs):
        raise AssertionError("the evaluation ran before --out was checked")

    monkeypatch.setattr("mmrl.eval_checkpoint.evaluate_checkpoint", evaluates)
    (tmp_path / "a_file").write_text("mine\n")
    result = CliRunner().invoke(app, ["eval", RECIPE, "--checkpoint", str(tmp_path), "--out",
                                      str(tmp_path / "a_file" / "metrics.json")])
    assert result.exit_code == 2, (result.output, result.exception)
    assert f"--out: {tmp_path / 'a_file' / 'metrics.json'} is inside {tmp_path / 'a_file'}, which is a file" in \
        _one_clean_line(result.output)
    assert (tmp_path / "a_file").read_text() == "mine\n"


@pytest.mark.parametrize("case, manifest, words", [
    ("files-not-a-mapping", {"files": 5}, "unreadable manifest (its files are not a mapping of name to bytes"),
    ("entry-not-a-mapping", {"files": {"trainer_state.json": 3}}, "unreadable manifest (its files are not a mapping"),
    ("names-outside", {"files": {"../../recipe.yaml": {"bytes": 1, "sha256": "0"}}},
     "the manifest names '../../recipe.yaml', outside the checkpoint"),
])
def test_error_boundary_a_checkpoint_manifest_of_another_shape_is_skipped_with_why(tmp_path, case, manifest, words):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (run / "recipe.yaml").write_text("model: {path: qwen2_vl, random_init: true}\n")
    (step / "trainer_state.json").write_text('{"step": 1}')
    (step / "manifest.json").write_text(json.dumps(manifest))
    before = _state(tmp_path)
    result = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "out")])
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert "holds no step checkpoint that verifies" in line and f"step_000001 ({words}" in line, line
    assert _state(tmp_path) == before


def test_error_boundary_a_config_json_transformers_refuses_is_one_line(tmp_path, monkeypatch):
    """A config.json whose values transformers' config class refuses (a strict-dataclass
    error, not a ValueError) was a traceback; now one line naming the file, before the build."""
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": -3}')
    run = tmp_path / "run"
    result = _train(f"model.path={folder}", "model.random_init=true", f"trainer.output_dir={run}")
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"model.path: {folder / 'config.json'} is not a valid config (`num_hidden_layers` (-3)" in line, line
    assert not run.exists()
    from mmrl.failures import explain  # wherever else a config is read: one line too

    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - the error class transformers raises
        assert explain(exc).startswith("a model config is not valid (`num_hidden_layers` (-3)"), explain(exc)
    else:
        raise AssertionError("transformers took the config")


@pytest.mark.parametrize("case, make, words", [
    ("doctor-config-without-model-type", lambda d: (d / "config.json").write_text('{"hidden_size": 4}'),
     "config.json: no model_type"),
])
def test_error_boundary_doctor_names_what_the_config_lacks(tmp_path, case, make, words):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    make(folder)
    result = CliRunner().invoke(app, ["doctor", str(folder), "--workers", "0", "--no-progress"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert words in _one_clean_line(result.output)


@pytest.mark.parametrize("case, given, words", [
    ("model-path-empty", ["model.path="], "model.path: String should have at least 1 character"),
    ("recipe-is-a-folder", None, "is a folder; give the recipe's YAML file"),
    ("image-is-a-folder", ["data.train={tmp}/rows.jsonl"], "images[0]: image file not found: {tmp}/pictures is a folder"),
])
def test_silent_values_unclear_paths_say_what_they_are(tmp_path, monkeypatch, case, given, words):
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    (tmp_path / "pictures").mkdir()
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
           "answer": "1", "images": ["pictures"]}
    (tmp_path / "rows.jsonl").write_text((json.dumps(row) + "\n") * 4)
    recipe = str(tmp_path) if given is None else RECIPE
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in given or []]
    result = CliRunner().invoke(app, ["train", recipe, *CHEAP, *overrides, f"trainer.output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert words.replace("{tmp}", str(tmp_path)) in _one_clean_line(result.output)
    assert not (tmp_path / "run").exists()


def test_data_check_names_the_eval_split_as_the_recipe_and_mmrl_eval_do():
    """`--split eval` (the recipe's `data.eval`, as `mmrl eval --split eval` names it) and the
    older `--split test` show the same rows; another name is one line naming the choices."""
    shown = {split: CliRunner().invoke(app, ["data", "check", RECIPE, "--rows", "1", "--split", split])
             for split in ("eval", "test", "train")}
    assert all(result.exit_code == 0 for result in shown.values()), {k: r.output[-500:] for k, r in shown.items()}
    assert shown["eval"].output == shown["test"].output != shown["train"].output
    wrong = CliRunner().invoke(app, ["data", "check", RECIPE, "--split", "dev"])
    assert wrong.exit_code != 0 and "expected train, validation or eval, got 'dev'" in wrong.output
