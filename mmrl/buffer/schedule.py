"""Which rollout batch each training step takes from the buffer: the trainer's hook.

    steps = steps_for(trainer)                       # in Trainer._build
    batch, metrics = steps.next(done=trainer.step)   # in Trainer.train_step
    attach_behaviour(micro_batches, batch)           # stale batches carry behaviour log-probs

Before each update the buffer is filled to `max_staleness + 1` batches, produced with the
current weights, and the step takes the oldest. With `algo.max_staleness: 0` that is the
batch just produced: the synchronous loop, and the run's metrics are those of a run
without the buffer bit for bit (tests/test_buffer.py). With 1 the first step samples two
batches and trains on the first; from then on each step samples the batch of the step
after it before updating, so every later batch is trained on by weights one update newer
than the ones that sampled it: the one-step-off schedule, run one after the other on one
device (`algo.overlap: thread` runs that rollout beside the update: mmrl/buffer/overlap.py).
No batch is produced for a step past `trainer.steps`. A compiled rollout samples each such
batch from a generator of its own, seeded by the batch's number (`batch_seed`), so the
sequential and concurrent forms draw alike.

A batch that may be trained on stale records its behaviour log-probs when it is made:
with `algo.behaviour: recomputed` (the default) the trainer's own forward of the sampled
tokens under the sampling weights, at the rollout temperature (the quantity the update's
log-probs are, so the two compare exactly); with `sampler` the log-probs the rollout
backend gave each token as it sampled it, at the rollout temperature, with no extra
forward. A batch trained on by the weights that sampled every one of its tokens (staleness
0) needs no correction and gets none.

With `rollout.partial_tokens: N` the batches come from `mmrl.buffer.partial`: rounds of at
most N new tokens per sample, unfinished samples carried to the next step's rounds; each
token keeps the version and behaviour log-prob of the weights that sampled it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmrl.buffer.partial import PartialRollouts, partial_metrics
from mmrl.buffer.store import RolloutBatch, TrajectoryBuffer, rebuild_batch
from mmrl.buffer.trainer_view import TrainerView
from mmrl.config import RecipeError
from mmrl.evaluation import conversations_of
from mmrl.rollout.base import RolloutResult, can_continue
from mmrl.rollout_batch import training_batches
from mmrl.update import PolicyUpdate

BUFFER_FOLDER = "buffer"


class BufferedSteps:
    """The batch each step trains on (module docstring)."""

    def __init__(self, buffer: TrajectoryBuffer, *, max_staleness: int, total_steps: Callable[[], int],
                 produce: Callable[[], RolloutBatch],
                 behaviour: Callable[[RolloutBatch], torch.Tensor] | None = None,
                 rebuild: Callable[..., RolloutBatch] | None = None):
        """`produce()` makes the next scored batch with the current weights; `behaviour(batch)`
        gives its behaviour log-probs; `rebuild(table, metadata)` reads a batch back
        (`TrajectoryBuffer.restore`)."""
        self.buffer = buffer
        self.max_staleness = max_staleness
        self.total_steps = total_steps  # read at each step: a resumed run may run longer
        self.produce = produce
        self.behaviour = behaviour
        self.rebuild = rebuild

    def next(self, done: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch step `done + 1` trains on, and the buffer's metrics for it (none with
        max_staleness 0, whose metrics would say nothing and change metrics.jsonl)."""
        dropped = 0
        while True:
            self._fill(done)
            batch, skipped = self.buffer.take(done, self.max_staleness)
            dropped += skipped
            if batch is not None:
                break
        staleness = done - batch.version
        if staleness == 0 and not batch.older_tokens(done):
            batch.behaviour_logp = None  # sampled by the weights that train on it: nothing to correct
        # Partial rollouts: the rounds' figures and the trained tokens by staleness.
        metrics = partial_metrics(batch, done) if self.buffer.partial else {}
        if not self.max_staleness:
            return batch, metrics
        return batch, {"off_policy/staleness_mean": float(staleness), "off_policy/staleness_max": float(staleness),
                       "buffer/dropped": float(dropped), "buffer/pending": float(len(self.buffer.pending)), **metrics}

    def _fill(self, done: int) -> None:
        """Produce batches with the current weights until `max_staleness + 1` wait, none
        meant for a step past the last (but always one, so a step has something)."""
        pending = self.buffer.pending
        while len(pending) < self.max_staleness + 1 and (done + len(pending) < self.total_steps() or not pending):
            batch = self.produce()
            # (A partial rollout's batch records its tokens' behaviour log-probs round by round.)
            if self.max_staleness and self.behaviour is not None and batch.behaviour_logp is None:
                batch.behaviour_logp = self.behaviour(batch)
            self.buffer.put(batch)

    def drain(self) -> None:
        """At a run's end: nothing is left running here (the concurrent schedule waits for its thread)."""

    def state(self) -> dict[str, int]:
        """What a checkpoint records (`TrajectoryBuffer.state`)."""
        return self.buffer.state()

    def restore(self, state: dict[str, int] | None) -> None:
        """Back to a checkpoint's `state()` (`TrajectoryBuffer.restore`)."""
        self.buffer.restore(state, self.rebuild)


def behaviour_log_probs(update: PolicyUpdate, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """The current weights' log-probs (N * n, R) of the batch's sampled tokens, 0 off the
    mask, computed as the update computes its own (same micro-batches, same forward)."""
    return forward_log_probs(update, batch.conversations, batch.result, temperature)


def sampler_log_probs(batch: RolloutBatch) -> torch.Tensor:
    """The log-probs (N * n, R) the rollout backend gave the batch's sampled tokens (asked
    for at the rollout temperature: `algo.behaviour: sampler`), 0 off the mask."""
    result = batch.result
    if result.logprobs is None:
        raise RecipeError("algo.behaviour=sampler: the rollout backend returned no log-probs for the sampled tokens; "
                          "use algo.behaviour=recomputed")
    return result.logprobs.float().cpu() * result.response_mask.cpu()


@torch.no_grad()
def forward_log_probs(update: PolicyUpdate, conversations: list | None, result: RolloutResult,
                      temperature: float) -> torch.Tensor:
    """The current weights' log-probs (N * n, R) of `result`'s tokens after their prompts
    (`conversations`, by `result.prompt_index`), 0 off the mask (`behaviour_log_probs`)."""
    rows = torch.arange(len(result.response_ids))
    micro, plan = training_batches(conversations, result, rows, algo=update.recipe.algo, dist=update.dist,
                                   processing=update.processing, adapter=update.adapter, actor=update.actor)
    out = torch.zeros(result.response_mask.shape, dtype=torch.float32)
    # Every pass the plan lists, zero-weighted repeats included: ranks run as many
    # forwards as each other (FSDP2's collectives); a repeat writes the same values.
    for index, _ in (entry for mini in plan for entry in mini):
        seqs = micro[index]
        logp = update.actor.log_probs(seqs, temperature, with_entropy=False)[0]
        chosen = seqs.extras["rows"].cpu()
        out[chosen, :logp.shape[1]] = (logp * seqs.response_mask).float().cpu()
    return out


def attach_behaviour(micro_batches: list, batch: RolloutBatch) -> None:
    """Give each micro-batch its rows' behaviour log-probs (`extras["behaviour_logp"]`),
    which the update weighs its tokens against (`algo.off_policy`); nothing for a batch
    without them."""
    if batch.behaviour_logp is None:
        return
    for seqs in micro_batches:
        rows = seqs.extras["rows"].cpu()
        width = seqs.response_ids.shape[1]
        seqs.extras["behaviour_logp"] = batch.behaviour_logp[rows, :width].to(seqs.response_ids.device)


def buffer_for(trainer: TrainerView) -> TrajectoryBuffer:
    """The trainer's trajectory buffer, in its run folder."""
    dist = trainer.dist
    return TrajectoryBuffer(trainer.output_dir / BUFFER_FOLDER, rank=dist.dp_rank, ranks=dist.dp_size,
                            main=dist.is_main, writer=dist.sp_rank == 0,
                            partial=trainer.recipe.rollout.partial_tokens > 0)


def batch_seed(seed: int, rank: int, number: int) -> int:
    """The seed of the generator that samples batch `number` (1, 2, ... in the order the
    buffer receives them) on data-parallel rank `rank` of a run seeded `seed`: a one-step-off
    batch is sampled alike whether it is made before the update or beside it
    (mmrl/buffer/overlap.py)."""
    return ((seed * 1_000_003 + number) * 65_537 + rank) % (1 << 62)


def steps_for(trainer: TrainerView) -> BufferedSteps:
    """The trainer's schedule, run sequentially: its rollouts (`Trainer.roll_out_batch`) through
    a buffer in its run folder, under its recipe's `algo.max_staleness`. (The concurrent
    form: `mmrl.buffer.overlap.steps_for`.)"""
    dist, recipe = trainer.dist, trainer.recipe
    partial = recipe.rollout.partial_tokens > 0
    buffer = buffer_for(trainer)
    index_of = {source: index for index, source in enumerate(trainer.train_set.source_rows)}
    name = getattr(trainer.train_set, "name", "") or ""
    # One-step-off batches from a rollout that samples from a generator of its own: each
    # batch's draws are fixed by its number, as the concurrent form draws them.
    seeded = recipe.algo.max_staleness > 0 and getattr(trainer.rollout, "takes_generator_seed", False)
    temperature = recipe.rollout.temperature or 1.0
    sampler = recipe.algo.behaviour == "sampler"
    if recipe.algo.max_staleness or partial:  # the only runs that take behaviour log-probs
        check_sampler_log_probs(trainer.rollout, recipe)

    def recompute(conversations: list | None, result: RolloutResult) -> torch.Tensor:
        with trainer.timed("logprob"):
            return forward_log_probs(trainer.update, conversations, result, temperature)

    def behaviour(batch: RolloutBatch) -> torch.Tensor:
        return sampler_log_probs(batch) if sampler else recompute(batch.conversations, batch.result)

    if partial:
        _check_partial(trainer.rollout, dist, recipe)
        rounds = PartialRollouts(trainer, buffer, recompute=None if sampler else recompute)

        def produce() -> RolloutBatch:
            batch = rounds.produce()
            batch.dataset = name
            return batch
    else:
        def produce() -> RolloutBatch:
            seed = batch_seed(recipe.trainer.seed, dist.dp_rank, buffer.produced + 1) if seeded else None
            batch = trainer.roll_out_batch(generator_seed=seed)
            batch.indices = [index_of[row] for row in batch.rows]
            batch.dataset = name
            return batch

    return BufferedSteps(buffer, max_staleness=recipe.algo.max_staleness,
                         total_steps=lambda: trainer.recipe.trainer.steps, produce=produce, behaviour=behaviour,
                         rebuild=rebuild_for(trainer))


def check_sampler_log_probs(rollout, recipe) -> None:
    """`algo.behaviour: sampler` needs the sampler's log-probs at the rollout temperature:
    every backend gives them at temperature 1, only those that say so at another."""
    temperature = recipe.rollout.temperature
    if recipe.algo.behaviour == "sampler" and temperature not in (0, 1) and \
            not getattr(rollout, "tempered_logprobs", False):
        backend = getattr(rollout, "backend", type(rollout).__name__)
        raise RecipeError(f"algo.behaviour=sampler: rollout backend {backend!r} "
                          f"gives log-probs at temperature 1 only, not at rollout.temperature {temperature}; use "
                          "rollout.backend=hf, rollout.temperature=1 or algo.behaviour=recomputed")


def _check_partial(rollout, dist, recipe) -> None:
    """What partial rollouts need today, each refused in one line."""
    tokens = recipe.rollout.partial_tokens
    if not can_continue(rollout):
        raise RecipeError(f"rollout.partial_tokens={tokens}: rollout backend "
                          f"{getattr(rollout, 'backend', type(rollout).__name__)!r} cannot continue a sample from its "
                          "tokens so far; use rollout.backend=hf or hf_compiled, or rollout.partial_tokens=0")
    if dist.dp_size > 1 or dist.sequence_parallel > 1:
        raise RecipeError(f"rollout.partial_tokens={tokens} runs in one process for now (its batches vary in size "
                          "from rank to rank); use rollout.partial_tokens=0 under torchrun")


def rebuild_for(trainer: TrainerView) -> Callable:
    """`TrajectoryBuffer.restore`'s `rebuild` for the trainer's dataset and processor."""

    def conversations(samples: list[dict], rows: list[int]) -> list | None:
        if trainer.agent is not None:
            return None
        return conversations_of(samples, rows, trainer.train_set, f"resuming at step {trainer.step + 1}",
                                max_pixels=trainer.recipe.model.max_pixels)

    def rebuild(table, metadata: dict) -> RolloutBatch:
        return rebuild_batch(table, metadata, dataset=trainer.train_set,
                             pad_id=trainer.processing.tokenizer.pad_token_id, conversations=conversations)

    return rebuild
