"""What the buffer's schedules use of the trainer, as a `Protocol`.

`mmrl.trainer.Trainer` builds its schedule with `steps_for(self)` and the schedules call
back into it for each batch (`roll_out_batch`, `next_prompts`, `score`, `timed`); naming
those members here keeps the buffer from importing the trainer, which imports the buffer.
`Trainer` matches it structurally, and so does `mmrl.buffer.overlap.RolloutSide`, the
trainer as the rollout thread sees it (its own rollout and clock, the rest the trainer's).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from mmrl.buffer.store import RolloutBatch
from mmrl.config import Recipe
from mmrl.data import Position, PromptDataset
from mmrl.engine import Engine
from mmrl.parallel import Dist
from mmrl.processing import Processing
from mmrl.rollout.agent import AgentRollout
from mmrl.rollout.base import Rollout, RolloutResult
from mmrl.settle import Settled
from mmrl.update import PolicyUpdate


class TrainerView(Protocol):
    """The trainer members the schedules read (and the two they move: `position`, the data
    position after the last prompts taken, and `step`, on a rollout rank the step a batch is
    for)."""

    recipe: Recipe
    settled: Settled
    dist: Dist
    output_dir: Path
    actor: Engine
    update: PolicyUpdate
    processing: Processing
    rollout: Rollout
    agent: AgentRollout | None
    train_set: PromptDataset
    validation_set: PromptDataset | None
    eval_set: PromptDataset | None
    position: Position
    step: int
    timings: dict[str, float]

    def timed(self, name: str) -> AbstractContextManager: ...

    def next_prompts(self) -> tuple[list[dict], list[int]]: ...

    def score(self, samples: list[dict], result: RolloutResult, rows: list[int], dataset: PromptDataset, where: str,
              conversations: list | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[float]]]: ...

    def roll_out_batch(self, prompts: tuple[list[dict], list[int]] | None = None,
                       generator_seed: int | None = None) -> RolloutBatch: ...
