"""Logger backends behind one small interface: TensorBoard, wandb, MLflow, trackio, SwanLab.

    check_installed(["tensorboard", "wandb"])    # before the model build: a missing package is one line
    loggers = open_loggers(["tensorboard", "wandb"], output_dir, run_name="tiny", purge_step=None)
    for logger in loggers:
        logger.log_config(recipe_dict)          # the recipe, as dumped, is the run's config
        logger.log_metrics(1, {"reward/mean": 0.5})
        logger.log_samples(1, "train", rows)    # mmrl.samples rows: a table, or Markdown text
        logger.close()

`trainer.loggers` names them; `mmrl.run_log.RunLog` drives them from the main rank
(metrics.jsonl and samples.jsonl are written whatever the list). Each backend imports its
package when it opens, so none is needed unless named, and each is configured the way
its own documentation says, through its environment variables (WANDB_MODE, WANDB_DIR,
WANDB_PROJECT; MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME; TRACKIO_DIR, TRACKIO_SPACE_ID;
SWANLAB_MODE, SWANLAB_PROJ_NAME, ...); the project or experiment is "mmrl" unless one of
those names another. The run is named after the run folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from mmrl.errors import one_line
from mmrl.samples import samples_markdown, table

PROJECT = "mmrl"
# mlflow refuses longer parameter values; the whole recipe is also logged as recipe.json.
MLFLOW_PARAM_CHARS = 6000
MLFLOW_BATCH = 100  # parameters and metrics per log_batch request (the REST API's limit)


class Logger(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_samples(self, step: int, split: str, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """Scalars, the recipe and samples as text (a Markdown table) in `<run>/tensorboard`.
    `purge_step` (a resumed run's first step) drops the events written from it on, so a
    step logged before the interruption appears once (as TensorBoard reads them)."""

    def __init__(self, output_dir: Path, run_name: str, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=purge_step)
        self.resumed = purge_step is not None
        if not self.resumed:
            # TensorBoard takes a run's first session START as its beginning and purges
            # only at a later one (the START that purge_step writes): without this one, a
            # resumed run's repeated steps would show twice.
            self.writer._get_file_writer().add_event(Event(step=0, session_log=SessionLog(status=SessionLog.START)))

    def log_config(self, config: dict[str, Any]) -> None:
        if not self.resumed:  # the first run wrote it at step 0; purging keeps that
            self.writer.add_text("recipe", "```yaml\n" + _yaml(config) + "\n```", 0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, split: str, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text(f"samples/{split}", samples_markdown(rows), step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run (online, or offline with WANDB_MODE=offline): the recipe as its
    config, metrics by step, samples as a wandb.Table per split."""

    def __init__(self, output_dir: Path, run_name: str, purge_step: int | None = None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, split: str, rows: list[dict[str, Any]]) -> None:
        columns, data = table(rows)
        self.run.log({f"samples/{split}": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run under MLFLOW_TRACKING_URI's store: the recipe as dotted parameters
    (and recipe.json), metrics by step, samples as JSON and Markdown artifacts
    (samples/<split>/step_NNNNNN.{json,md})."""

    def __init__(self, output_dir: Path, run_name: str, purge_step: int | None = None):
        from mlflow import MlflowClient

        self.client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in _flatten(config).items()]
        for start in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MLFLOW_BATCH])
        self.client.log_dict(self.run_id, config, "recipe.json")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for start in range(0, len(entries), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=entries[start:start + MLFLOW_BATCH])

    def log_samples(self, step: int, split: str, rows: list[dict[str, Any]]) -> None:
        self.client.log_dict(self.run_id, rows, f"samples/{split}/step_{step:06d}.json")
        self.client.log_text(self.run_id, samples_markdown(rows), f"samples/{split}/step_{step:06d}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _InitLogFinish:
    """A backend whose module runs one run at a time through `init(project, name, config)`,
    `log(values, step=)` and `finish()` (trackio, SwanLab). The run starts at the first
    call, since the config is taken at `init` only; subclasses name the module, the project
    and how samples are logged (`_samples`)."""

    def __init__(self, module, project: str, run_name: str):
        self.module = module
        self.project = project
        self.run_name = run_name
        self.started = False

    def _start(self, config: dict[str, Any] | None = None) -> None:
        if not self.started:
            self.module.init(project=self.project, name=self.run_name, config=config)
            self.started = True

    def log_config(self, config: dict[str, Any]) -> None:
        self._start(config)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._start()
        self.module.log(metrics, step=step)

    def log_samples(self, step: int, split: str, rows: list[dict[str, Any]]) -> None:
        self._start()
        self.module.log({f"samples/{split}": self._samples(rows)}, step=step)

    def _samples(self, rows: list[dict[str, Any]]):
        raise NotImplementedError

    def close(self) -> None:
        if self.started:
            self.module.finish()


class TrackioLogger(_InitLogFinish):
    """A trackio run (local unless TRACKIO_SPACE_ID or a server URL is set): the recipe as
    its config, metrics by step, samples as a trackio.Table per split."""

    def __init__(self, output_dir: Path, run_name: str, purge_step: int | None = None):
        import trackio

        super().__init__(trackio, PROJECT, run_name)

    def _samples(self, rows: list[dict[str, Any]]):
        columns, data = table(rows)
        return self.module.Table(columns=columns, data=data)


class SwanlabLogger(_InitLogFinish):
    """A SwanLab run (mode from SWANLAB_MODE, e.g. local or offline; online needs a
    login): the recipe as its config, metrics by step, samples as Markdown text."""

    def __init__(self, output_dir: Path, run_name: str, purge_step: int | None = None):
        import swanlab

        super().__init__(swanlab, os.environ.get("SWANLAB_PROJ_NAME", PROJECT), run_name)

    def _samples(self, rows: list[dict[str, Any]]):
        return self.module.Text(samples_markdown(rows))


# name -> (class, the module it imports, what to pip install)
LOGGERS: dict[str, tuple[type, str, str]] = {
    "tensorboard": (TensorBoardLogger, "tensorboard", "tensorboard"),
    "wandb": (WandbLogger, "wandb", "wandb"),
    "mlflow": (MlflowLogger, "mlflow", "mlflow"),
    "trackio": (TrackioLogger, "trackio", "trackio"),
    "swanlab": (SwanlabLogger, "swanlab", "swanlab"),
}


class LoggerError(ValueError):
    """A logger backend could not start its run; the message, one line, names it."""


def check_installed(names: Sequence[str]) -> None:
    """Raise ValueError, one line naming the package to install, for the first named
    logger whose package is missing (found without importing it), or for mlflow without
    a store it can write to."""
    for name in names:
        _, module, package = LOGGERS[name]
        if not _importable(module):
            raise ValueError(f"the {name} logger needs the {package} package: pip install {package} "
                             f"(or remove {name} from the list)")
    if "mlflow" in names and not os.environ.get("MLFLOW_TRACKING_URI") and not _importable("sqlalchemy"):
        # mlflow's default store is a sqlite database, which mlflow-skinny cannot open.
        raise ValueError("the mlflow logger needs MLFLOW_TRACKING_URI (a tracking server's http(s):// address, "
                         "or file:///path with MLFLOW_ALLOW_FILE_STORE=true), or the full mlflow package for its "
                         "default sqlite store: pip install mlflow")


def _importable(module: str) -> bool:
    return sys.modules.get(module) is not None or importlib.util.find_spec(module) is not None


def open_loggers(names: Sequence[str], output_dir: Path, run_name: str, purge_step: int | None = None,
                 config: dict[str, Any] | None = None) -> list[Logger]:
    """The named backends, each with its run started and given `config`; one that fails
    is a LoggerError (the ones opened before it are closed)."""
    opened: list[Logger] = []
    for name in names:
        try:
            logger = LOGGERS[name][0](output_dir, run_name, purge_step)
            if config is not None:
                logger.log_config(config)
            opened.append(logger)
        except Exception as exc:
            for logger in opened:
                logger.close()
            raise LoggerError(f"trainer.loggers: {name} could not start its run "
                              f"({one_line(exc, 300, typed=True)})") from exc
    return opened


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: {"optim": {"lr": 1e-4}} -> {"optim.lr": 1e-4}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return flat


def _yaml(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False).rstrip()
