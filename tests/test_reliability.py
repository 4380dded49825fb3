"""Reliability (issue 9): run folders hold one run, checkpoints are whole, resume does not
repeat metrics, and every bad input (data, media, rewards, config) is one clear line.

    .venv/bin/python -m pytest -q tests/test_reliability.py
"""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

import mmrl.trainer as trainer_module
from mmrl.config import RecipeError, load_recipe
from mmrl.recipe_checks import check_before_build
from mmrl.data import load_prompts, schema, to_conversation
from mmrl.evaluation import conversations_of
from mmrl.rewards import RewardError, combine
from mmrl.runs import (LOCK_FILE, MANIFEST_FILE, OWNER_FILE, RunFolder, RunFolderError, begin_checkpoint,
                       commit_checkpoint, newest_checkpoint, verify_checkpoint)
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
# Subprocesses are bounded by their work; this only stops a hung one (a busy shared machine
# made a 1-step run take minutes).
HANG_GUARD_S = 1800

TEXT = [
    "model.path=qwen2", "model.random_init=true",
    "model.tiny_vocabulary={characters: '0123456789+ ?', words: [What, is, user, assistant]}",
    "data.train=synthetic:arithmetic?n=64&seed=0&max_operand=4",
    "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3",
    "reward.name=numeric", "algo.micro_batch_size=16", "trainer.progress=false", "trainer.threads=2",
    "trainer.export=false",
]


def _recipe(run, *extra):
    return load_recipe(None, [*TEXT, f"trainer.output_dir={run}", *extra])


def _steps(run):
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if not r.get("final")], sum(bool(r.get("final")) for r in rows)


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}


def _one_line(message: str) -> bool:
    return "\n" not in message.strip()


# -- run folders ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_folder_holding_a_run_is_refused_then_overwritten_or_resumed(tmp_path):
    run = tmp_path / "run"
    Trainer(_recipe(run, "trainer.steps=3", "trainer.save_every=3")).fit()
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(RunFolderError, match=r"already holds a run \(recipe\.yaml, metrics\.jsonl, checkpoints") as err:
        Trainer(_recipe(run, "trainer.steps=2"))
    assert _one_line(str(err.value)) and "trainer.overwrite=true" in str(err.value)
    assert (run / "metrics.jsonl").read_text() == before  # nothing touched
    assert not (run / LOCK_FILE).exists()  # the refused run let go of the lock

    # A resume that is another run (other seed) is refused too.
    with pytest.raises(RunFolderError, match=r"holds another run \(trainer\.seed was 0, now 1\)"):
        Trainer(_recipe(run, "trainer.steps=4", "trainer.resume=true", "trainer.seed=1"))

    # Overwrite clears the old results first: no old checkpoint, no old metrics.
    Trainer(_recipe(run, "trainer.steps=2", "trainer.overwrite=true", "trainer.seed=1")).fit()
    assert _steps(run) == ([1, 2], 1)
    assert not (run / "checkpoints" / "step_000003").exists()
    assert not (run / LOCK_FILE).exists()


def test_resume_and_overwrite_together_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="trainer: resume and overwrite are both true; choose one"):
        _recipe(tmp_path, "trainer.resume=true", "trainer.overwrite=true")


def test_the_lock_is_shared_within_a_process_and_goes_with_its_last_holder(tmp_path):
    first, second = RunFolder(tmp_path / "run"), RunFolder(tmp_path / "run")
    first.claim(resume=False, overwrite=False)
    second.claim(resume=False, overwrite=False)
    first.release()
    assert (tmp_path / "run" / LOCK_FILE).is_file()
    second.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_the_lock_names_a_live_holder_and_takes_over_a_stale_one(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / "run"
        folder.mkdir()
        (folder / LOCK_FILE).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "started": 0}))
        with pytest.raises(RunFolderError, match=rf"in use by another run \(pid {holder.pid} on "):
            RunFolder(folder).claim(resume=False, overwrite=False)
    finally:
        holder.kill()
        holder.wait()
    # Its process is gone: the lock is stale and taken over.
    claimed = RunFolder(folder)
    claimed.claim(resume=False, overwrite=False)
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    claimed.release()
    assert not (folder / LOCK_FILE).exists()


def test_a_folder_left_with_only_a_recipe_is_taken_and_an_unused_new_folder_goes(tmp_path):
    """A run that stopped before its first step (a reward that raised) left only its
    recipe: the next run starts there. A folder that a refused run created is removed."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("model: {path: qwen2}\n")
    (run / OWNER_FILE).write_text("")  # the run that stopped had claimed the folder
    folder = RunFolder(run)
    folder.claim(resume=False, overwrite=False)
    assert not (run / "recipe.yaml").exists()
    folder.release()
    assert run.is_dir()  # not created by this claim: kept
    fresh = RunFolder(tmp_path / "new" / "run")
    fresh.claim(resume=False, overwrite=False)
    assert (tmp_path / "new" / "run" / LOCK_FILE).is_file()
    fresh.release()
    assert not (tmp_path / "new" / "run").exists()
    kept = RunFolder(tmp_path / "kept")
    kept.claim(resume=False, overwrite=False)
    (tmp_path / "kept" / "metrics.jsonl").write_text("{}\n")
    kept.release()
    assert (tmp_path / "kept" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_two_processes_into_one_folder_the_second_refuses(tmp_path):
    """A real second process: one holds the folder (through RunFolder), the CLI refuses."""
    run = tmp_path / "run"
    script = (f"from mmrl.runs import RunFolder; import time, sys; f = RunFolder({str(run)!r}); "
              "f.claim(resume=False, overwrite=False); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = _cli(f"trainer.output_dir={run}", "trainer.steps=1", "trainer.progress=false")
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2
    assert f"in use by another run (pid {holder.pid}" in result.stderr
    _assert_one_clean_line(result)
    assert not (run / "metrics.jsonl").exists()


def test_output_dir_that_is_a_file_is_one_line_before_the_build(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    for target, words in ((blocker, "is a file"), (blocker / "run", f"is inside {blocker}, which is a file")):
        with pytest.raises(RunFolderError, match=f"trainer.output_dir: {target} {words}"):
            Trainer(_recipe(target))


def _no_build(*args, **kwargs):
    raise AssertionError("the model was built before the recipe was checked")


# -- checkpoints --------------------------------------------------------------------------------
def test_an_interrupted_save_over_a_checkpoint_keeps_the_old_one(tmp_path):
    run = tmp_path / "run"
    first = Trainer(_recipe(run, "trainer.steps=2", "trainer.save_every=2"))
    first.fit()
    saved = _weights(first)
    checkpoint = run / "checkpoints" / "step_000002"
    assert verify_checkpoint(checkpoint) is None

    # A resumed run saving the same step again dies half-way through its write.
    second = Trainer(_recipe(run, "trainer.steps=2", "trainer.resume=true"))
    assert second.resume() and second.step == 2
    with torch.no_grad():
        for p in second.actor.model.parameters():
            p.add_(1.0)

    def dies_midway(path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    second.actor.save_checkpoint = dies_midway
    with pytest.raises(KeyboardInterrupt):
        second.save()
    second.folder.release()
    assert verify_checkpoint(checkpoint) is None  # the old checkpoint is whole and in place
    third = Trainer(_recipe(run, "trainer.steps=2", "trainer.resume=true"))
    assert third.resume() and third.step == 2
    for name, value in _weights(third).items():
        assert torch.equal(value, saved[name]), name


def test_resume_skips_broken_checkpoints_and_says_why(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(_recipe(run, "trainer.steps=4", "trainer.save_every=2")).fit()
    root = run / "checkpoints"
    # step 4's optimizer cut to 0 bytes (as a kill mid-write left it before), and a
    # step 6 whose write never finished (no manifest).
    (root / "step_000004" / "actor" / "optimizer.pt").write_bytes(b"")
    (root / "step_000006" / "actor").mkdir(parents=True)
    (root / "step_000006" / "trainer_state.json").write_text('{"step": 6, "data_position": [0, 0]}')
    resumed = Trainer(_recipe(run, "trainer.steps=4", "trainer.resume=true"))
    assert resumed.resume() and resumed.step == 2
    out = capsys.readouterr().out
    assert "skipped checkpoint" in out and "step_000006: no manifest" in out
    assert "step_000004: actor/optimizer.pt has 0 bytes, the manifest says" in out
    resumed.folder.release()


def test_checkpoint_commit_replaces_atomically_and_recovers_a_cut_rename(tmp_path):
    root = tmp_path / "checkpoints"
    final = root / "step_000001"
    for content in (b"old", b"new"):
        temp = begin_checkpoint(final)
        (temp / "weights.bin").write_bytes(content)
        commit_checkpoint(temp, final)
    assert (final / "weights.bin").read_bytes() == b"new" and (final / MANIFEST_FILE).is_file()
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]
    # Killed between moving the old one aside and renaming the new one in: the old one returns.
    os.rename(final, root / ".old-step_000001")
    found, skipped = newest_checkpoint(root)
    assert found == final and not skipped
    (final / "weights.bin").write_bytes(b"nex")  # same size, other bytes
    assert verify_checkpoint(final) == "weights.bin does not match its checksum"


# -- metrics after resume -------------------------------------------------------------------------------
def test_resume_cuts_metrics_back_and_plots_the_whole_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    # Steps 1-3 ran, the checkpoint is at 2, then the run died (it finished here: a
    # final line to drop as well).
    Trainer(_recipe(run, "trainer.steps=3", "trainer.save_every=2")).fit()
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "reward/me')  # a line cut short by the kill
    plotted = {}
    monkeypatch.setattr(trainer_module, "plot_rewards", lambda history, path, title="": plotted.update(
        steps=[h["step"] for h in history]))
    resumed = Trainer(_recipe(run, "trainer.steps=5", "trainer.resume=true"))
    resumed.fit()
    assert _steps(run) == ([1, 2, 3, 4, 5], 1)
    assert plotted["steps"] == [1, 2, 3, 4, 5]


def test_reward_curve_has_a_title_and_axis_labels():
    from mmrl.run_log import reward_figure

    figure = reward_figure([{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.7,
                                                             "validation/accuracy": 0.4}], "run: grpo")
    ax = figure.axes[0]
    assert ax.get_title() == "run: grpo" and ax.get_xlabel() == "training step" and ax.get_ylabel()


# -- SIGINT / SIGTERM, SIGKILL -----------------------------------------------------------------------
_TRAIN_SCRIPT = ("import sys; from mmrl.config import load_recipe; from mmrl.trainer import train; "
                 "train(load_recipe(None, sys.argv[1:]))")


def _start(run, *extra):
    return subprocess.Popen([sys.executable, "-c", _TRAIN_SCRIPT, *TEXT, f"trainer.output_dir={run}", *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(run, process, count):
    metrics = Path(run) / "metrics.jsonl"
    for _ in range(HANG_GUARD_S * 10):  # polls of 0.1 s: a hang guard, not a speed bound
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.1)
    raise AssertionError("the run did not log its steps")


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.slow
def test_a_signal_finishes_the_step_saves_and_exits(tmp_path, signum, code):
    run = tmp_path / "run"
    process = _start(run, "trainer.steps=10000")
    _wait_for_steps(run, process, 1)
    process.send_signal(signum)
    out, err = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == code, err
    assert "Traceback" not in err
    found, _ = newest_checkpoint(run / "checkpoints")
    steps, finals = _steps(run)
    assert found is not None and found.name == f"step_{steps[-1]:06d}" and finals == 0
    assert "continue with trainer.resume=true" in out
    resumed = Trainer(_recipe(run, f"trainer.steps={steps[-1] + 1}", "trainer.resume=true"))
    resumed.fit()
    assert _steps(run) == (list(range(1, steps[-1] + 2)), 1)


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_equals_an_uninterrupted_run(tmp_path):
    """Five SIGKILLs, each at a random moment after a random step (with a checkpoint
    written every step, many land mid-write), each followed by a resume; the finished run's
    weights and metrics equal those of a run that was never interrupted."""
    import random

    run = tmp_path / "run"
    rng = random.Random(9)
    done = 0
    for trial in range(5):
        process = _start(run, "trainer.steps=10000", "trainer.save_every=1", *(["trainer.resume=true"] * bool(trial)))
        _wait_for_steps(run, process, done + rng.randint(1, 2))
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the step, the save or the next step
        process.kill()
        process.wait()
        found, _ = newest_checkpoint(run / "checkpoints")
        assert found is not None and verify_checkpoint(found) is None
        done = int(found.name.removeprefix("step_"))
    total = done + 3
    reference = Trainer(_recipe(tmp_path / "reference", f"trainer.steps={total}"))
    reference.fit()
    expected = _weights(reference)
    resumed = Trainer(_recipe(run, f"trainer.steps={total}", "trainer.save_every=1", "trainer.resume=true"))
    resumed.fit()
    steps, finals = _steps(run)
    assert steps == list(range(1, total + 1)) and finals == 1
    for name, value in _weights(resumed).items():
        assert torch.equal(value, expected[name]), name
    rewards = [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()[:total]]
    reference_rewards = [json.loads(line)["reward/mean"]
                         for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()[:total]]
    assert rewards == reference_rewards


# -- data and media ----------------------------------------------------------------------------------
def _rows_with_image(folder, image_name="a.png", n=2):
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}],
             "answer": "1", "images": ["ok.png" if i == 0 else image_name]} for i in range(n)]
    Image.new("RGB", (8, 8), (200, 0, 0)).save(folder / "ok.png")
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "rows.jsonl"


def _png_bytes(size=(64, 64)):
    buffer = io.BytesIO()
    Image.new("RGB", size, (0, 120, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("content, words", [
    (b"", "empty image file (0 bytes)"),
    (b"this is not an image at all", "not a readable image (not an image format Pillow knows"),
    (_png_bytes()[:60], "not a readable image"),  # a truncated PNG
])
def test_bad_images_fail_at_load_with_file_and_row(tmp_path, content, words):
    (tmp_path / "a.png").write_bytes(content)
    source = _rows_with_image(tmp_path)
    with pytest.raises(ValueError) as err:
        load_prompts(source)
    message = str(err.value)
    assert message.startswith(f"{source}: row 1: images[0]: {tmp_path / 'a.png'}: {words}"), message
    assert _one_line(message)


def test_an_image_broken_after_load_names_row_and_file_at_its_step(tmp_path):
    """Media that break after the load-time check give the same clear line, with the step."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    dataset = load_prompts(_rows_with_image(tmp_path))
    (tmp_path / "a.png").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=rf"^row 1 of .*rows\.jsonl \(step 3\): {tmp_path / 'a.png'}: not a readable"):
        conversations_of([dataset[1]], [dataset.source_rows[1]], dataset, "step 3")


@pytest.mark.parametrize("content, words", [
    (b"", r"rows\.jsonl: empty file \(0 bytes\)"),
    (b"\n\n   \n", r"rows\.jsonl: no rows \(the file holds only blank lines\)"),
    (b'{"prompt": "a", "answer": "1"}\n{"prompt": \n', r"rows\.jsonl:2: not valid JSON \(Expecting value, column 12\)"),
    (b'{"answer": "1"}\n{"answer": "\xff\xfe"}\n', r"rows\.jsonl:2: not UTF-8 text \(byte 28"),
    (b'{"answer": "1"}\n[1, 2]\n', r"rows\.jsonl:2: a row is a JSON object, got list"),
])
def test_bad_jsonl_files_are_one_line(tmp_path, content, words):
    (tmp_path / "rows.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=words) as err:
        load_prompts(tmp_path / "rows.jsonl")
    assert _one_line(str(err.value))


def test_bad_json_and_parquet_files_are_one_line(tmp_path):
    (tmp_path / "rows.json").write_text('[{"answer": "1"},\n {"answer": }]')
    with pytest.raises(ValueError, match=r"rows\.json:2: not valid JSON \(Expecting value, column 13\)"):
        load_prompts(tmp_path / "rows.json")
    (tmp_path / "rows.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"rows\.parquet: empty file \(0 bytes\)"):
        load_prompts(tmp_path / "rows.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: cannot be read as parquet \(") as err:
        load_prompts(tmp_path / "bad.parquet")
    assert _one_line(str(err.value))


def test_large_images_are_decoded_reduced(tmp_path):
    Image.new("RGB", (4000, 3000), (10, 20, 30)).save(tmp_path / "big.jpg", quality=90)
    Image.new("RGB", (1600, 1200), (10, 20, 30)).save(tmp_path / "big.png")
    for name in ("big.jpg", "big.png"):
        image = schema.decode_image(tmp_path / name, max_pixels=50_000)
        width, height = image.size
        assert 4 * 50_000 <= width * height <= 4 * 4 * 50_000, (name, image.size)
        assert abs(width / height - 4 / 3) < 0.02
    assert schema.decode_image(tmp_path / "big.png", max_pixels=10_000_000).size == (1600, 1200)
    sample = {"prompt": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "big.jpg")}]}]}
    image = to_conversation(sample, max_pixels=50_000)[0]["content"][0]["image"]
    assert image.width * image.height <= 16 * 50_000


@pytest.mark.slow
def test_peak_memory_does_not_follow_the_source_resolution(tmp_path):
    """Four 8000x8000 JPEGs decoded for a 256k-pixel budget: the peak resident memory
    grows by far less than one full-size decode (192 MB)."""
    script = f"""
import resource, sys
from PIL import Image
sys.path.insert(0, {str(REPO)!r})
from mmrl.data.schema import decode_image
paths = []
for i in range(4):
    Image.new("RGB", (1000, 1000), (i * 40, 0, 0)).resize((8000, 8000)).save(f"{tmp_path}/big{{i}}.jpg")
    paths.append(f"{tmp_path}/big{{i}}.jpg")
import gc; gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
images = [decode_image(p, max_pixels=256 * 256 * 4) for p in paths]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) // 1024, max(i.width * i.height for i in images))
"""
    # Writing the sources needs one full-size image; that peak is passed before `before`.
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr
    grown_mb, largest = map(int, result.stdout.split())
    assert largest <= 16 * 256 * 256 * 4
    assert grown_mb < 64, grown_mb


def test_an_image_above_the_decode_limit_is_refused_at_load(tmp_path, monkeypatch):
    monkeypatch.setattr(schema, "MAX_DECODE_PIXELS", 1000)
    Image.new("RGB", (40, 40)).save(tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"row 1: images\[0\]: .*a\.png: 40x40 pixels \(PNG\) is above the 1,000"):
        load_prompts(_rows_with_image(tmp_path))


# -- rewards -----------------------------------------------------------------------------------------
def boom_reward(completions, answers, **fields):
    if "3" in answers:
        raise ZeroDivisionError("no answer may be 3")
    return [0.0] * len(completions)


def nan_reward(completions, answers, **fields):
    return [float("nan")] + [0.0] * (len(completions) - 1)


def test_a_reward_that_raises_names_reward_step_and_row(tmp_path):
    trainer = Trainer(_recipe(tmp_path / "run", "reward.name=test_reliability:boom_reward", "trainer.steps=20"))
    with pytest.raises(RewardError) as err:
        trainer.fit()
    message = str(err.value)
    assert message.startswith("reward 'boom_reward' raised ZeroDivisionError: no answer may be 3 at step "), message
    row = int(message.split(", row ")[1].split()[0])
    assert trainer.train_set[row]["answer"] == "3" and "of synthetic:arithmetic" in message
    assert _one_line(message)
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_nan_reward_stops_before_the_update(tmp_path):
    trainer = Trainer(_recipe(tmp_path / "run", "reward.name=test_reliability:nan_reward", "trainer.steps=2"))
    before = _weights(trainer)
    with pytest.raises(RewardError, match=r"reward 'nan_reward' returned nan \(a reward must be a finite number\) "
                                          r"at step 1, row \d+ of synthetic:arithmetic"):
        trainer.fit()
    assert all(torch.equal(before[k], v) for k, v in _weights(trainer).items())


def test_combined_rewards_name_the_part_that_failed():
    reward = combine([("exact_match", 1.0), (nan_reward, 0.5)])
    with pytest.raises(RewardError, match="reward 'nan_reward' returned nan"):
        reward(["1", "2"], ["1", "2"])
    with pytest.raises(RewardError, match=r"reward 'boom_reward' raised ZeroDivisionError") as err:
        combine([(boom_reward, 1.0)])(["a", "b"], ["1", "3"])
    assert err.value.index == 1


# -- config ---------------------------------------------------------------------------------------------
BASE = ["model.path=qwen2", "data.train=x.jsonl"]


@pytest.mark.parametrize("overrides, message", [
    (["model.min_pixels=5000", "model.max_pixels=1000"],
     "model: min_pixels (5000) is above max_pixels (1000)"),
    (["model.max_pixels=-1"], "model.max_pixels: Input should be greater than 0"),
    (["model.min_pixels=0"], "model.min_pixels: Input should be greater than 0"),
    (["model.tiny_vocabulary={charcters: abc}"],
     "model.tiny_vocabulary: unknown key 'charcters' (the keys are characters, words)"),
    (["model.tiny_vocabulary={words: 3}"], "model.tiny_vocabulary: words: expected a list of strings, got int"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, [*BASE, *overrides])
    assert str(err.value) == message


def test_yaml_errors_give_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: qwen2\n  dtype: [unclosed\ndata: {}\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml: not valid YAML \(line 4, column 5: ") as err:
        load_recipe(bad)
    assert _one_line(str(err.value))
    (tmp_path / "latin.yaml").write_bytes(b"model:\n  path: caf\xe9\n")
    with pytest.raises(RecipeError, match=r"latin\.yaml: not UTF-8 text"):
        load_recipe(tmp_path / "latin.yaml")


@pytest.mark.parametrize("overrides, message", [
    (["model.config_overrides={hidden_size: abc}"],
     "model.config_overrides.hidden_size: expected an integer (the config has 64), got 'abc'"),
    (["model.config_overrides={hidden_sise: 32}"], "model.config_overrides.hidden_sise: Qwen2Config has no such field"),
    (["model.config_overrides={rms_norm_eps: true}"], "model.config_overrides.rms_norm_eps: expected a number"),
])
def test_config_override_types_fail_before_the_build(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr("mmrl.build.build_model", _no_build)
    recipe = _recipe(tmp_path / "run", *overrides)
    with pytest.raises(RecipeError) as err:
        Trainer(recipe)
    assert str(err.value).startswith(message), str(err.value)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_path_that_does_not_exist_is_named(tmp_path):
    recipe = load_recipe(None, ["model.path=" + str(tmp_path / "nope"), "data.train=x.jsonl"])
    with pytest.raises(RecipeError, match=rf"model.path: no checkpoint folder {tmp_path}/nope \(to build"):
        check_before_build(recipe)
    recipe = load_recipe(None, ["model.path=./nope/ckpt", "model.random_init=true", "data.train=x.jsonl"])
    with pytest.raises(RecipeError, match=r"model.path: no checkpoint folder ./nope/ckpt \(and it is not a family"):
        check_before_build(recipe)


# -- the command line: exit 2, one line, no traceback ----------------------------------------------
def _cli(*overrides):
    return subprocess.run([sys.executable, "-m", "mmrl.cli", "train", str(REPO / "recipes" / "tiny_vlm_count.yaml"),
                           *overrides], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)


def _assert_one_clean_line(result):
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr


# The real process for the checks of a checkpoint folder and of config overrides; the
# same table's other stages (recipe values, data files) run in a real process in
# tests/test_bad_inputs.py::test_the_real_process_prints_one_line_on_stderr (a bad YAML
# value, an unreadable image), and these four inputs, min_pixels above max_pixels and an
# empty data file among them, through the CLI in process in its table.
@pytest.mark.parametrize("overrides, words", [
    (["model.path=/no/such/checkpoint", "model.random_init=false", "model.tiny_vocabulary={}",
      "model.config_overrides={}"], "model.path: no checkpoint folder /no/such/checkpoint"),
    (["model.config_overrides={text_config: {hidden_size: big}}"],
     "model.config_overrides.text_config.hidden_size: expected an integer"),
])
@pytest.mark.slow
def test_cli_bad_inputs_exit_2_with_one_line(tmp_path, overrides, words):
    result = _cli(f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false", *overrides)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr
    _assert_one_clean_line(result)
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- issue 13: why a run stopped, labels, the logged lr ----------------------------------------------------
def test_early_stop_says_why_and_progress_labels_both_accuracies(tmp_path, capsys):
    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=5", "trainer.eval_every=1",
                              "trainer.target_accuracy=0.0", "trainer.progress=true",
                              "data.validation=synthetic:arithmetic?n=4&seed=2&max_operand=4"))
    summary = trainer.fit()
    captured = capsys.readouterr()
    assert trainer.step == 1
    assert "stopped early: validation accuracy" in captured.out and "trainer.target_accuracy 0.0 at step 1" in \
        captured.out
    assert summary["stopped_early"].startswith("validation accuracy")
    assert "train_acc=" in captured.err and "val_acc=" in captured.err


def test_logged_lr_is_the_recipes_not_the_first_groups(tmp_path):
    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=1", "optim.lr=1e-3",
                              "optim.lr_multipliers={embed: 10}"))
    assert trainer.actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # the embeddings come first
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["lr"] == pytest.approx(1e-3)


def test_checkpoint_weights_are_checked_before_the_build(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')  # a family: the weights are checked
    recipe = load_recipe(None, [f"model.path={folder}", "data.train=synthetic:arithmetic?n=16",
                                "reward.name=numeric"])
    with pytest.raises(RecipeError, match=r"holds no \*\.safetensors weights"):
        check_before_build(recipe)
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    with pytest.raises(RecipeError, match=r"holds only pickle-format weights \(\.bin/\.pt\); mmrl loads safetensors"):
        check_before_build(recipe)
    save_file({"w": torch.zeros(64)}, str(folder / "model.safetensors"))
    check_before_build(recipe)
    whole = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(whole[:-10])
    with pytest.raises(RecipeError, match=r"model\.safetensors: truncated or padded \(\d+ bytes; its header"):
        check_before_build(recipe)
    (folder / "model.safetensors").write_bytes(whole[:20])
    with pytest.raises(RecipeError, match=r"model\.safetensors: not a readable safetensors file"):
        check_before_build(recipe)


# -- CPU contention: OpenMP threads sleep while they wait (bench/cpu_contention.py) ----------
@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
@pytest.mark.slow
def test_the_cli_sets_the_openmp_wait_policy_before_torch_loads(given, expected):
    script = ("import sys; from typer.testing import CliRunner; from mmrl.cli import app; "
              "assert 'torch' not in sys.modules; result = CliRunner().invoke(app, ['models', '--json']); "
              "import os; print(result.exit_code, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given  # a value the user set is kept
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=HANG_GUARD_S)
    assert result.stdout.split() == ["0", expected], result.stderr[-2000:]


def test_max_threads_caps_the_threads_a_recipe_asks_for(tmp_path, monkeypatch):
    """MMRL_MAX_THREADS (one per pytest-xdist worker in this suite) wins over `trainer.threads`."""
    from mmrl.logs import MAX_THREADS_ENV, capped_threads

    monkeypatch.delenv(MAX_THREADS_ENV, raising=False)
    assert capped_threads(2) == 2
    monkeypatch.setenv(MAX_THREADS_ENV, "x")
    with pytest.raises(ValueError, match="MMRL_MAX_THREADS='x': give a whole number of threads"):
        capped_threads(2)
    monkeypatch.setenv(MAX_THREADS_ENV, "1")
    before = torch.get_num_threads()
    try:
        Trainer(_recipe(tmp_path / "run", "trainer.threads=2"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# -- worker logs: removed when doctor succeeds, kept and named when it fails ------------------
@pytest.mark.parametrize("fails", [False, True])
def test_doctor_removes_its_worker_log_on_success_and_names_it_on_failure(tmp_path, monkeypatch, fails):
    import tempfile

    from typer.testing import CliRunner

    import mmrl.probes.matrix as matrix
    from mmrl.cli import app
    from mmrl.probes.base import ProbeResult, Status

    def fake_run_probes(subjects, probes, *, workers, on_result=None):
        assert workers == 1
        with open(os.environ["MMRL_WORKER_LOG"], "a") as log:  # what a worker would write
            log.write("third-party noise\n")
        failed = Status.FAILED if fails else Status.VERIFIED
        return {(subjects[0].label, p.feature): ProbeResult(status=failed if i == 0 else Status.VERIFIED,
                                                            reason="broken" if fails and i == 0 else "ok",
                                                            declared=None)
                for i, p in enumerate(probes)}

    monkeypatch.setattr(matrix, "run_probes", fake_run_probes)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("MMRL_VERBOSE", raising=False)
    monkeypatch.delenv("MMRL_WORKER_LOG", raising=False)
    result = CliRunner().invoke(app, ["doctor", "qwen2", "--workers", "1", "--no-progress"])
    logs = list(tmp_path.glob("mmrl-doctor-*.log"))
    assert result.exit_code == (1 if fails else 0), (result.output, result.exception)
    if fails:
        assert len(logs) == 1 and logs[0].read_text() == "third-party noise\n"
        squeezed = "".join(result.output.split())  # the console may wrap the line
        assert "".join(f"third-party logs of the probe workers: {logs[0]}".split()) in squeezed
    else:
        assert logs == [] and "mmrl-doctor-" not in result.output


# -- memory over a long run ---------------------------------------------------------------------
@pytest.mark.slow
def test_resident_memory_stays_flat_over_500_steps(tmp_path):
    """500 training steps of the tiny text recipe: resident memory at the end is within
    1.1x of that at step 50 (after warm-up), so nothing grows with the step count."""

    def resident_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    trainer = Trainer(_recipe(tmp_path / "run", "trainer.steps=500"))
    at_50 = None
    for step in range(1, 501):
        trainer.train_step()
        if step == 50:
            at_50 = resident_bytes()
    at_500 = resident_bytes()
    trainer.folder.release()
    print(f"resident memory: {at_50 / 2**20:.0f} MiB at step 50, {at_500 / 2**20:.0f} MiB at step 500")
    assert at_500 <= 1.1 * at_50


def test_replacing_leaves_the_old_file_whole_when_the_writer_fails(tmp_path):
    from mmrl.runs import replacing

    path = tmp_path / "sub" / "metrics.jsonl"
    with replacing(path) as temp:
        temp.write_text("first\n")
    assert path.read_text() == "first\n"
    with pytest.raises(RuntimeError):
        with replacing(path) as temp:
            temp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "first\n"
    assert [p.name for p in path.parent.iterdir()] == ["metrics.jsonl"]  # no temporary left behind


# -- what a run writes: readable weights, no half-written checkpoint, one line for a full disk --
def test_weights_written_into_an_atomic_folder_get_the_umask_s_mode(tmp_path):
    from safetensors.torch import save_file

    from mmrl.atomic import atomic_folder, process_umask

    with atomic_folder(tmp_path / "final") as temp:
        save_file({"w": torch.zeros(2)}, str(temp / "model.safetensors"))  # safetensors 0.8 writes 0o600
    mode = (tmp_path / "final" / "model.safetensors").stat().st_mode & 0o777
    assert mode == 0o666 & ~process_umask()


def test_a_checkpoint_that_fails_to_write_leaves_no_temporary_folder(tmp_path):
    import errno

    from mmrl.checkpoint import save_checkpoint
    from mmrl.parallel.mesh import Dist
    from mmrl.runs import temporary_for

    class FullDisk:
        def save_checkpoint(self, path):
            path.mkdir(parents=True)
            (path / "model.safetensors").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    final = tmp_path / "checkpoints" / "step_000001"
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(final, dist, {"actor": FullDisk()}, {"step": 1})
    assert not temporary_for(final).exists() and not final.exists()


def test_a_full_disk_in_torch_save_or_safetensors_is_one_line_about_space():
    from safetensors import SafetensorError

    from mmrl.failures import explain

    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1280 vs 1174")
    assert explain(torch_save).startswith("[enforce fail") and "is the disk full?" in explain(torch_save)
    written = SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                              "message: \"No space left on device\" })")
    assert explain(written).startswith("a safetensors file cannot be written: no space left on the device")
    assert "cannot be read" in explain(SafetensorError("Error while deserializing header: HeaderTooLarge"))


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_trainer_threads_below_one_is_refused_naming_the_field(tmp_path, threads):
    with pytest.raises(RecipeError, match=r"trainer\.threads"):
        _recipe(tmp_path / "run", f"trainer.threads={threads}")


def test_ctrl_c_in_the_final_export_keeps_the_weights_for_a_resume(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    real_export = Trainer.export

    def interrupted(self, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "export", interrupted)
    with pytest.raises(SystemExit) as stopped:
        Trainer(_recipe(run, "trainer.steps=2", "trainer.export=true")).fit()
    assert stopped.value.code == 130 and not (run / "final").exists()
    err = capsys.readouterr().err
    assert "stopped in the final evaluation or export after step 2" in err and "trainer.resume=true" in err
    found, _ = newest_checkpoint(run / "checkpoints")
    assert found is not None and found.name == "step_000002"
    monkeypatch.setattr(Trainer, "export", real_export)
    Trainer(_recipe(run, "trainer.steps=2", "trainer.export=true", "trainer.resume=true")).fit()
    assert (run / "final" / "config.json").is_file() and _steps(run) == ([1, 2], 1)


# -- one line for bad input to the probe commands and export ---------------------------------
@pytest.mark.parametrize("args, line", [
    (["doctor", "qwen2", "--device", "tpu"], "--device 'tpu': give cpu, cuda or cuda:N"),
    (["doctor", "qwen2", "--workers", "-1"], "--workers -1: give 0 (probes in this process) or more"),
    (["support-matrix", "--check", "--output", "{tmp}/none"], "none/results.json not found: --check compares"),
])
def test_probe_commands_refuse_bad_options_before_any_probe_runs(tmp_path, args, line):
    from typer.testing import CliRunner

    from mmrl.cli import app

    result = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 2 and line in " ".join(result.output.split()), result.output


def test_target_accuracy_above_one_is_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"trainer\.target_accuracy"):
        _recipe(tmp_path / "run", "trainer.target_accuracy=1.5")


def test_export_refuses_a_folder_inside_the_run_but_its_final(tmp_path):
    from mmrl.export import ExportError, check_output

    step = tmp_path / "run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    recipe = _recipe(tmp_path / "run")
    with pytest.raises(ExportError, match="inside the run folder"):
        check_output(tmp_path / "run" / "mine", step, recipe)
    check_output(tmp_path / "elsewhere", step, recipe)  # outside the run: no objection
    check_output(tmp_path / "run" / "final", step, recipe)  # the run's own export


def test_train_seconds_count_a_resumed_run_s_earlier_steps(tmp_path):
    run = tmp_path / "run"
    Trainer(_recipe(run, "trainer.steps=2", "trainer.save_every=2")).fit()
    saved = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["train_seconds"]
    assert saved > 0
    resumed = Trainer(_recipe(run, "trainer.steps=3", "trainer.save_every=2", "trainer.resume=true"))
    summary = resumed.fit()
    assert resumed._seconds_before == saved  # read back from the checkpoint it resumed
    assert summary["train_seconds"] >= round(saved, 1) and _steps(run) == ([1, 2, 3], 1)
