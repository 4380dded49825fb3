"""What a run records as it goes: `metrics.jsonl`, `samples.jsonl`, the logger backends
(TensorBoard by default; `mmrl.loggers`), the reward curve.

    log = RunLog(output_dir, main=dist.is_main, loggers=["tensorboard", "wandb"])
    history = log.history_until(step)             # after a resume: later lines cut off
    log.purge_step = step + 1                     # ... and TensorBoard purges its events past it
    log.start(recipe_dict)                        # the backends' run config
    log.open()                                    # their runs started (else at the first write)
    log.write({"step": 1, "reward/mean": 0.5})    # a line of metrics.jsonl, and each backend's scalars
    log.write_samples(1, rows)                    # lines of samples.jsonl (mmrl.samples), and each backend's
    plot_rewards(history, output_dir / "reward_curve.png", "title")
    log.close()

Only the main rank writes; files are replaced whole (mmrl/atomic.py) and never written
through a symbolic link. After a resume the metrics and samples files keep the steps up
to the checkpoint (a line cut short by the interruption and a finished run's final line
and final-evaluation samples are dropped), and TensorBoard purges its events past it, so
every step appears once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmrl.atomic import replacing
from mmrl.loggers import Logger, open_loggers
from mmrl.samples import SAMPLES_FILE

METRICS_FILE = "metrics.jsonl"


class RunLog:
    def __init__(self, output_dir: Path, main: bool, loggers: Sequence[str] = ("tensorboard",)) -> None:
        self.output_dir = output_dir
        self.main = main
        self.logger_names = tuple(loggers)
        self.purge_step: int | None = None  # TensorBoard drops its events from this step on
        self._files: dict[str, Any] = {}
        self._loggers: list[Logger] | None = None  # opened by `open` or the first write
        self._config: dict[str, Any] | None = None

    def start(self, config: dict[str, Any]) -> None:
        """The recipe (as dumped), which the logger backends get as the run's config when
        they open (`open`, else at the first write)."""
        self._config = config

    def open(self) -> None:
        """Start the backends' runs now (the main rank's): the trainer opens them after the
        build, before step 1, so a backend that cannot start (no login) stops the run before
        its first step's work, and a run that fails to build leaves no logger run behind."""
        if self.main:
            self._backends()

    def _backends(self) -> list[Logger]:
        if self._loggers is None:
            self._loggers = open_loggers(self.logger_names, self.output_dir, run_name=self.output_dir.name,
                                         purge_step=self.purge_step, config=self._config)
        return self._loggers

    def _append(self, name: str, records: list[dict[str, Any]]) -> None:
        if name not in self._files:
            # Never through a link planted in the run folder (O_NOFOLLOW): it could point out of it.
            fd = os.open(self.output_dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            self._files[name] = os.fdopen(fd, "a")
        handle = self._files[name]
        handle.write("".join(json.dumps(record) + "\n" for record in records))
        handle.flush()

    def write(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        backends = self._backends()  # first: a backend that cannot start leaves no line behind
        self._append(METRICS_FILE, [record])
        scalars = {key: value for key, value in record.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
        for logger in backends:
            logger.log_metrics(record.get("step", 0), scalars)

    def write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Rows of `mmrl.samples.sample_rows` (one split) as lines of samples.jsonl, and to each backend."""
        if not self.main or not rows:
            return
        backends = self._backends()
        self._append(SAMPLES_FILE, rows)
        for logger in backends:
            logger.log_samples(step, rows[0]["split"], rows)

    def history_until(self, step: int) -> list[dict[str, Any]]:
        """The logged records of steps up to `step`; metrics.jsonl is cut back to them, so
        steps run after the checkpoint (and a finished run's final line) appear once.
        samples.jsonl is cut back the same way (final-evaluation rows dropped too)."""
        _cut(self.output_dir / SAMPLES_FILE,
             lambda row: row.get("split") != "eval" and row.get("step", step + 1) <= step)
        return _cut(self.output_dir / METRICS_FILE, lambda r: not r.get("final") and r.get("step", step + 1) <= step)

    def close(self) -> None:
        for logger in self._loggers or []:
            logger.close()
        self._loggers = None
        for handle in self._files.values():
            handle.close()
        self._files = {}


def _cut(path: Path, keep) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that `keep` accepts; the file is rewritten to them
    (a line cut short by an interruption is dropped)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by the interruption
        if isinstance(record, dict) and keep(record):
            kept.append(record)
    with replacing(path) as temp:
        temp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def plot_rewards(history: list[dict[str, Any]], path: Path, title: str = "reward curve") -> None:
    if not history:
        return
    import matplotlib.pyplot as plt

    fig = reward_figure(history, title)
    with replacing(path) as temp:  # renamed over the name: a link planted there is replaced, not followed
        fig.savefig(temp, dpi=120, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)


def reward_figure(history: list[dict[str, Any]], title: str):
    """The reward curve (and validation accuracy) over the steps of `history`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewarded = [h for h in history if "reward/mean" in h]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in rewarded], [h["reward/mean"] for h in rewarded], label="mean reward per step")
    evals = [(h["step"], h["validation/accuracy"]) for h in history if "validation/accuracy" in h]
    if evals:
        ax.plot(*zip(*evals), marker="o", label="greedy validation accuracy")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("training step")
    ax.set_ylabel("reward / accuracy")
    low = min([0.0, *(h["reward/mean"] for h in rewarded)])
    high = max([1.0, *(h["reward/mean"] for h in rewarded)])
    ax.set_ylim(low - 0.02, high + 0.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig
