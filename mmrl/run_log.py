"""What a run records as it goes: `metrics.jsonl`, TensorBoard events, the reward curve.

    log = RunLog(output_dir, main=dist.is_main)
    log.write({"step": 1, "reward/mean": 0.5})    # a line of metrics.jsonl, and scalars
    history = log.history_until(step)             # after a resume: later lines cut off
    plot_rewards(history, output_dir / "reward_curve.png", "title")
    log.close()

Only the main rank writes; files are replaced whole (mmrl/atomic.py) and never written
through a symbolic link. After a resume the metrics file keeps the steps up to the
checkpoint (a line cut short by the interruption and a finished run's final line are
dropped), and TensorBoard purges its events past it, so every step appears once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mmrl.atomic import replacing

METRICS_FILE = "metrics.jsonl"


class RunLog:
    def __init__(self, output_dir: Path, main: bool) -> None:
        self.output_dir = output_dir
        self.main = main
        self.purge_step: int | None = None  # TensorBoard drops its events from this step on
        self._file = None
        self._tensorboard = None  # None: not opened yet; False: TensorBoard not installed

    def write(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        if self._file is None:
            # Never through a link planted in the run folder (O_NOFOLLOW): it could point out of it.
            fd = os.open(self.output_dir / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            self._file = os.fdopen(fd, "a")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=self.purge_step)
            except ImportError:
                self._tensorboard = False
        if self._tensorboard:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tensorboard.add_scalar(key, value, record.get("step", 0))

    def history_until(self, step: int) -> list[dict[str, Any]]:
        """The logged records of steps up to `step`; metrics.jsonl is cut back to them, so
        steps run after the checkpoint (and a finished run's final line) appear once."""
        path = self.output_dir / METRICS_FILE
        if not path.is_file():
            return []
        kept = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by the interruption
            if isinstance(record, dict) and not record.get("final") and record.get("step", step + 1) <= step:
                kept.append(record)
        with replacing(path) as temp:
            temp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def close(self) -> None:
        if self._tensorboard:
            self._tensorboard.close()
        if self._file is not None:
            self._file.close()
            self._file = None


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
