"""Readable rollouts and logger backends (issue 32): samples.jsonl rows at the right steps
with the right fields (also as TensorBoard text), cut back on resume; wandb (offline) and
MLflow (a local file store) receive the metrics, the recipe as config and the samples,
read back from their own stores; trackio and SwanLab through fake modules that record
the calls (their packages are not installed here); a logger whose package is missing is
one line before the model build."""

import json
import struct
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmrl.config import RecipeError, load_recipe
from mmrl.run_log import RunLog
from mmrl.samples import SAMPLES_FILE, media_references, prompt_text, samples_markdown
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
VLM_RECIPE = str(REPO / "recipes" / "tiny_vlm_count.yaml")
# The tiny VLM recipe cut to two steps of 2 prompts x 2 samples (tests/test_bad_inputs.py's CHEAP).
VLM_CHEAP = ["trainer.steps=2", "trainer.progress=false", "trainer.export=false",
             "data.validation=synthetic:count_shapes?n=4&seed=2&image_size=56",
             "data.eval=synthetic:count_shapes?n=4&seed=1&image_size=56", "data.prompts_per_step=2",
             "rollout.samples_per_prompt=2"]
TEXT = [
    "model.path=qwen2", "model.random_init=true",
    "model.tiny_vocabulary={characters: '0123456789+ ?', words: [What, is, user, assistant]}",
    "data.train=synthetic:arithmetic?n=64&seed=0&max_operand=4",
    "data.eval=synthetic:arithmetic?n=4&seed=1&max_operand=4",
    "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=3",
    "reward.name=numeric", "algo.micro_batch_size=16", "trainer.progress=false", "trainer.threads=2",
    "trainer.export=false",
]
FIELDS = ["step", "split", "row", "dataset", "prompt", "media", "answer", "completion", "reward", "advantage",
          "length", "finish_reason"]


def _samples(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / SAMPLES_FILE).read_text().splitlines()]


def _tensorboard_texts(run: Path) -> dict[str, list[tuple[int, str]]]:
    # The accumulator TensorBoard's own server reads with: it applies purge_step to text too.
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode())
                                                for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"] if tag.endswith("/text_summary")}


# -- samples.jsonl -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_vlm_run_writes_readable_samples_every_n_steps_and_at_validation(tmp_path):
    run = tmp_path / "run"
    Trainer(load_recipe(VLM_RECIPE, [*VLM_CHEAP, f"trainer.output_dir={run}", "trainer.samples_every=2",
                                     "trainer.eval_every=1", "trainer.samples_per_log=3"])).fit()
    rows = _samples(run)
    by_split = {}
    for row in rows:
        by_split.setdefault(row["split"], []).append(row["step"])
    # Train samples at step 2 only (samples_every=2), validation at every validation, the
    # final evaluation once; at most samples_per_log rows each time.
    assert by_split == {"train": [2, 2, 2], "validation": [1, 1, 1, 2, 2, 2], "eval": [2, 2, 2]}
    for row in rows:
        assert list(row) == FIELDS, list(row)
        assert row["prompt"] == "user: <image>How many shapes are in the image?"
        assert row["media"] == [{"type": "image", "size": [56, 56]}]  # a reference, never pixels
        assert row["answer"] in "1234" and isinstance(row["completion"], str)
        assert isinstance(row["reward"], float) and row["length"] == 1
        assert row["finish_reason"] in ("stop", "length")
    train = [r for r in rows if r["split"] == "train"]
    assert all(isinstance(r["advantage"], float) for r in train)
    assert all(r["advantage"] is None for r in rows if r["split"] != "train")
    assert all(r["dataset"].startswith("synthetic:count_shapes?n=8192") for r in train)
    # Whole prompt groups first: the first two rows answer the same prompt.
    assert train[0]["row"] == train[1]["row"] != train[2]["row"]
    # GRPO: a group's advantages sum to zero.
    assert abs(train[0]["advantage"] + train[1]["advantage"]) < 1e-5
    texts = _tensorboard_texts(run)
    assert [step for step, _ in texts["samples/train"]] == [2]
    assert [step for step, _ in texts["samples/validation"]] == [1, 2]
    table = texts["samples/train"][0][1]
    assert table.splitlines()[0].startswith("| row | prompt | media |") and "56x56" in table
    assert "random_init: true" in texts["recipe"][0][1]


def test_samples_every_0_writes_none(tmp_path):
    run = tmp_path / "run"
    Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={run}", "trainer.steps=1",
                               "trainer.samples_every=0"])).fit()
    assert not (run / SAMPLES_FILE).exists()


@pytest.mark.slow
def test_resume_cuts_samples_back_like_metrics(tmp_path):
    run = tmp_path / "run"
    # Steps 1-3 ran (the final evaluation too), the checkpoint is at 2, then the run died
    # in the middle of a line.
    Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={run}", "trainer.steps=3", "trainer.save_every=2",
                               "trainer.samples_every=1", "trainer.samples_per_log=2"])).fit()
    assert [(r["split"], r["step"]) for r in _samples(run)] == [
        ("train", 1), ("train", 1), ("train", 2), ("train", 2), ("train", 3), ("train", 3), ("eval", 3), ("eval", 3)]
    with open(run / SAMPLES_FILE, "a") as handle:
        handle.write('{"step": 4, "split": "tra')
    Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={run}", "trainer.steps=4", "trainer.resume=true",
                               "trainer.samples_every=1", "trainer.samples_per_log=2"])).fit()
    assert [(r["split"], r["step"]) for r in _samples(run)] == [
        ("train", 1), ("train", 1), ("train", 2), ("train", 2), ("train", 3), ("train", 3), ("train", 4),
        ("train", 4), ("eval", 4), ("eval", 4)]
    texts = _tensorboard_texts(run)
    assert [step for step, _ in texts["samples/train"]] == [1, 2, 3, 4]
    assert [step for step, _ in texts["samples/eval"]] == [4]


def test_sample_rows_take_whole_groups_first_with_reward_parts_and_advantages():
    import torch

    from mmrl.samples import sample_rows

    # Two prompts x two responses, the rollout's rows not in prompt order.
    result = types.SimpleNamespace(prompt_index=torch.tensor([1, 0, 1, 0]),
                                   lengths=torch.tensor([3.0, 1.0, 2.0, 4.0]),
                                   finish_reasons=["stop", "length", "stop", "stop"])
    samples = [{"prompt": "first?", "answer": "1"}, {"prompt": [{"role": "user", "content": "second?"}], "answer": "2"}]
    rows = sample_rows(step=7, split="train", samples=samples, source_rows=[40, 41], result=result,
                       texts=["a", "b", "c", "d"], rewards=[1.0, 0.0, 0.5, 0.25],
                       advantages={0: 0.5, 1: -0.5, 2: -0.5}, reward_parts={"format": [1, 0, 1, 0]},
                       dataset="set", limit=3)
    assert [(r["row"], r["completion"]) for r in rows] == [(40, "b"), (40, "d"), (41, "a")]
    assert rows[0] == {"step": 7, "split": "train", "row": 40, "dataset": "set", "prompt": "first?", "media": [],
                       "answer": "1", "completion": "b", "reward": 0.0, "reward_parts": {"format": 0.0},
                       "advantage": -0.5, "length": 1, "finish_reason": "length"}
    assert rows[1]["advantage"] is None  # row 3 was not in the update (no advantage given)
    assert rows[2]["prompt"] == "user: second?" and rows[2]["reward_parts"] == {"format": 1.0}


def test_media_references_name_files_and_sizes_never_pixels():
    import io

    from PIL import Image

    encoded = io.BytesIO()
    Image.new("RGB", (30, 20)).save(encoded, format="PNG")
    sample = {"prompt": [{"role": "system", "content": "Count."},
                         {"role": "user", "content": [{"type": "image"}, {"type": "image", "path": "own.png"},
                                                      {"type": "image"}, {"type": "video"},
                                                      {"type": "text", "text": "How many?"}]}],
              "images": ["img/1.png", {"bytes": encoded.getvalue(), "path": None}],
              "videos": [[Image.new("RGB", (8, 8))] * 3]}
    assert media_references(sample) == [
        {"type": "image", "path": "img/1.png"}, {"type": "image", "path": "own.png"},
        {"type": "image", "bytes": len(encoded.getvalue()), "size": [30, 20]}, {"type": "video", "frames": 3}]
    assert prompt_text(sample["prompt"]) == "system: Count.\nuser: <image><image><image><video>How many?"
    table = samples_markdown([{"row": 3, "prompt": "a | b\nc", "completion": "x" * 1000, "reward": 0.5,
                               "reward_parts": {"format": 1.0, "math": 0.0}, "media": media_references(sample)}])
    header, _, line = table.splitlines()
    assert "reward_parts" in header and "format 1, math 0" in line
    assert "a \\| b<br>c" in line and "x" * 400 + "..." in line and "x" * 401 not in line
    assert "img/1.png, own.png, 30x20" in line


# -- backends ---------------------------------------------------------------------------------------------
def _wandb_records(wandb_dir: Path) -> list:
    """The records of the offline run's .wandb file (a LevelDB-style log of protobuf
    records: 7-byte file header, then 32 KiB blocks of [crc32, length, type] chunks)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_wandb_offline_and_mlflow_file_store_receive_metrics_config_and_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Every folder wandb writes in is this test's own (by default its service logs, table
    # staging and settings are shared by every run on the machine: other xdist workers,
    # other checkouts running this test at the same moment).
    for variable, folder in (("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                             ("WANDB_ARTIFACT_DIR", "artifacts"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home" / folder))
    store = f"file://{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this
    run = tmp_path / "run"
    import wandb

    try:
        Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={run}", "trainer.steps=2", "trainer.samples_every=1",
                                   "trainer.loggers=[wandb, mlflow]"])).fit()
    finally:
        # The run's .wandb file is read below only once wandb's service process has
        # exited: otherwise it lives on in this xdist worker (with the file open) until
        # the worker ends, and nothing says it is done writing when `finish` returns.
        wandb.teardown()
    assert not (run / "tensorboard").exists()  # not in the list
    local = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    # wandb: history by step, the recipe as config, the samples as tables.
    records = _wandb_records(tmp_path)
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
    assert history[1]["reward/mean"] == pytest.approx(local[0]["reward/mean"])
    assert history[2]["reward/mean"] == pytest.approx(local[1]["reward/mean"])
    assert history[2]["samples/train/_type"] == "table-file"
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
        config.update({u.key: json.loads(u.value_json) for u in updates})
    assert config["trainer"]["loggers"] == ["wandb", "mlflow"] and config["model"]["path"] == "qwen2"
    (files,) = tmp_path.glob("wandb/offline-run-*/files")
    table = json.loads((files / history[2]["samples/train/path"]).read_text())
    assert "completion" in table["columns"] and len(table["data"]) == 4

    # mlflow: metric history, the recipe as dotted parameters and recipe.json, samples artifacts.
    from mlflow import MlflowClient

    client = MlflowClient(store)
    (found,) = client.search_runs([client.get_experiment_by_name("mmrl").experiment_id])
    assert found.info.run_name == "run" and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward/mean"])) for r in local[:2]]
    assert found.data.params["trainer.samples_every"] == "1" and found.data.params["model.path"] == "qwen2"
    artifacts = Path(client.download_artifacts(found.info.run_id, "", str(tmp_path / "artifacts")))
    assert json.loads((artifacts / "recipe.json").read_text())["reward"]["name"] == "numeric"
    rows = json.loads((artifacts / "samples" / "train" / "step_000002.json").read_text())
    assert rows == [r for r in _samples(run) if r["split"] == "train" and r["step"] == 2]
    assert (artifacts / "samples" / "train" / "step_000002.md").read_text().startswith("| row |")


class _Recorder:
    """A stand-in for a logger's package: each call, with its arguments, in `calls`."""

    def __init__(self, name: str, table_type: str):
        self.module = types.ModuleType(name)
        self.calls = []
        for function in ("init", "log", "finish"):
            setattr(self.module, function, self._recording(function))
        recorder = self

        class Rich:  # trackio.Table / swanlab.Text: keeps what it was given
            def __init__(self, *args, **kwargs):
                self.args, self.kwargs = args, kwargs
                recorder.calls.append((table_type, args, kwargs))

        setattr(self.module, table_type, Rich)

    def _recording(self, function: str):
        return lambda *args, **kwargs: self.calls.append((function, args, kwargs))


ROWS = [{"step": 1, "split": "train", "row": 5, "prompt": "user: hi", "media": [], "answer": "2",
         "completion": "2", "reward": 1.0, "advantage": 0.5, "length": 1, "finish_reason": "stop"}]


@pytest.mark.parametrize("name, table_type", [("trackio", "Table"), ("swanlab", "Text")])
def test_trackio_and_swanlab_get_config_metrics_and_samples(tmp_path, monkeypatch, name, table_type):
    """Against their documented calls: init(project, name, config), log(dict, step=),
    finish(); samples as trackio.Table(columns, data) or swanlab.Text(markdown)."""
    fake = _Recorder(name, table_type)
    monkeypatch.setitem(sys.modules, name, fake.module)
    log = RunLog(tmp_path / "my_run", main=True, loggers=[name])
    (tmp_path / "my_run").mkdir()
    log.start({"trainer": {"steps": 3}})
    log.write({"step": 1, "reward/mean": 0.5, "final": True, "note": "text"})
    log.write_samples(1, ROWS)
    log.close()
    calls = [(c[0], c[1], c[2]) for c in fake.calls]
    assert calls[0] == ("init", (), {"project": "mmrl", "name": "my_run", "config": {"trainer": {"steps": 3}}})
    assert calls[1] == ("log", ({"reward/mean": 0.5},), {"step": 1})  # numbers only
    kind, args, kwargs = calls[2]
    assert kind == table_type
    if name == "trackio":
        assert kwargs["columns"][:3] == ["step", "split", "row"] and kwargs["data"][0][4] == "[]"
    else:
        assert args[0].startswith("| row | prompt |") and "user: hi" in args[0]
    assert calls[3][0] == "log" and list(calls[3][1][0]) == ["samples/train"] and calls[3][2] == {"step": 1}
    assert calls[4] == ("finish", (), {}) and len(calls) == 5
    assert (tmp_path / "my_run" / SAMPLES_FILE).read_text().strip() == json.dumps(ROWS[0])


def test_a_logger_without_its_package_is_one_line_before_the_build(tmp_path, monkeypatch):
    from mmrl.cli import app

    monkeypatch.setitem(sys.modules, "swanlab", None)  # not importable, whatever is installed
    run = tmp_path / "run"
    words = ("trainer.loggers: the swanlab logger needs the swanlab package: pip install swanlab "
             "(or remove swanlab from the list)")
    with pytest.raises(RecipeError) as err:
        Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={run}", "trainer.loggers=[tensorboard, swanlab]"]))
    assert str(err.value) == words
    result = CliRunner().invoke(app, ["train", VLM_RECIPE, *VLM_CHEAP, f"trainer.output_dir={run}",
                                      "trainer.loggers=[swanlab]"])
    assert result.exit_code == 2 and result.output.strip() == f"error: {words}", result.output
    assert not run.exists()


def test_mlflow_without_a_store_it_can_open_is_one_line_before_the_build(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny: no sqlite store
    with pytest.raises(RecipeError, match=r"^trainer.loggers: the mlflow logger needs MLFLOW_TRACKING_URI \(a "):
        Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={tmp_path / 'run'}", "trainer.loggers=[mlflow]"]))
    assert not (tmp_path / "run").exists()


def test_a_backend_that_cannot_start_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    from mmrl.loggers import LoggerError

    fake = _Recorder("trackio", "Table")

    def refuse(**kwargs):
        raise RuntimeError("no write access to the Space\nsecond line")

    fake.module.init = refuse
    monkeypatch.setitem(sys.modules, "trackio", fake.module)
    log = RunLog(tmp_path, main=True, loggers=["tensorboard", "trackio"])
    log.start({"trainer": {}})
    with pytest.raises(LoggerError) as err:
        log.write({"step": 1, "reward/mean": 0.5})
    assert str(err.value) == ("trainer.loggers: trackio could not start its run "
                              "(RuntimeError: no write access to the Space)")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_backend_that_cannot_start_stops_the_run_before_step_1_and_the_same_command_runs_again(
        tmp_path, monkeypatch):
    """The backends open after the build, before step 1: no step's work is spent, and the
    folder is left as a run that stopped before its first step (its recipe alone), so the
    command runs again once the backend can start, without trainer.overwrite."""
    from mmrl.loggers import LoggerError

    fake = _Recorder("trackio", "Table")
    began = []

    def refuse(**kwargs):
        raise RuntimeError("no write access to the Space")

    fake.module.init = refuse
    monkeypatch.setitem(sys.modules, "trackio", fake.module)
    run = tmp_path / "run"
    trainer = Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={run}", "trainer.steps=1",
                                         "trainer.loggers=[tensorboard,trackio]"]))
    monkeypatch.setattr(trainer, "train_step", lambda: began.append(1))
    with pytest.raises(LoggerError, match="^trainer.loggers: trackio could not start its run"):
        trainer.fit()
    assert began == []
    assert sorted(p.name for p in run.iterdir()) == [".mmrl-run", "recipe.yaml"]  # tensorboard's events gone
    summary = Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={run}", "trainer.steps=1"])).fit()
    assert summary["steps"] == 1 and (run / "metrics.jsonl").is_file()


def test_loggers_are_checked_by_the_schema():
    with pytest.raises(RecipeError, match="trainer.loggers.0: Input should be 'tensorboard', 'wandb'"):
        load_recipe(None, [*TEXT, "trainer.loggers=[neptune]"])
    with pytest.raises(RecipeError, match="trainer.loggers: wandb named more than once"):
        load_recipe(None, [*TEXT, "trainer.loggers=[wandb, wandb]"])
