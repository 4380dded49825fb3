"""How a step's sequences are split for the update: mini-batches (one optimizer step each)
made of micro-batches (one forward/backward each, gradients accumulated).

Mini-batches are consecutive parts of the batch, as equal in size as the count allows.
Micro-batches hold `micro_batch_size` rows, or, with a token budget, consecutive rows up
to `micro_batch_tokens` tokens each (`packing.bins_by_tokens`: a longer row alone), so
short responses share a forward and long ones do not run out of memory together. The
split changes no gradient: the trainer weights each micro-batch's loss by its share of
its mini-batch's tokens (or rows), so the accumulated gradient is the mini-batch's.

    plan = update_plan(lengths, mini_batches=2, micro_batch_tokens=8192)
    plan = even_out(plan, [max(c) for c in zip(*counts_of_every_rank)])   # FSDP: same count

A plan is a list of mini-batches, each a list of micro-batches, each a list of row
positions (into `lengths`); a micro-batch may be `(positions, 0.0)`-weighted filler
(`Micro.scale`) where a rank needs more micro-batches than it has rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.engine.packing import bins_by_tokens


@dataclass(frozen=True)
class Micro:
    rows: tuple[int, ...]  # positions of the rows it holds
    # 1.0; 0.0 for a filler that repeats rows only so that every rank runs as many
    # forward/backward passes as the others (FSDP2's collectives), adding nothing.
    scale: float = 1.0


def update_plan(lengths: list[int], *, mini_batches: int = 1, micro_batch_size: int = 64,
                micro_batch_tokens: int | None = None) -> list[list[Micro]]:
    """Mini-batches of micro-batches over rows of the given token `lengths`, in order."""
    count = len(lengths)
    parts = max(1, min(mini_batches, count))
    base, extra = divmod(count, parts)
    plan, start = [], 0
    for index in range(parts):
        end = start + base + (index < extra)
        positions = list(range(start, end))
        if micro_batch_tokens is not None:
            bins = bins_by_tokens([lengths[p] for p in positions], micro_batch_tokens)
            micro = [tuple(positions[i] for i in members) for members in bins]
        else:
            micro = [tuple(positions[i:i + micro_batch_size]) for i in range(0, len(positions), micro_batch_size)]
        plan.append([Micro(rows) for rows in micro])
        start = end
    return plan


def even_out(plan: list[list[Micro]], targets: list[int]) -> list[list[Micro]]:
    """Each mini-batch with exactly `targets[i]` micro-batches (at least its own count):
    the micro-batch of most rows is halved while one has two rows or more, then zero-
    weighted copies of the last one fill the rest."""
    out = []
    for micro, target in zip(plan, targets):
        micro = list(micro)
        while len(micro) < target:
            widest = max(range(len(micro)), key=lambda i: len(micro[i].rows))
            rows = micro[widest].rows
            if len(rows) < 2:
                micro.append(Micro(micro[-1].rows, 0.0))
                continue
            half = len(rows) // 2
            micro[widest:widest + 1] = [Micro(rows[:half]), Micro(rows[half:])]
        out.append(micro)
    return out


__all__ = ["Micro", "even_out", "update_plan"]
