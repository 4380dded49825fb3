"""One-step-off with the next rollout beside the update, on one device (`algo.overlap: thread`).

    steps = steps_for(trainer)                       # ConcurrentSteps, or the sequential schedule
    batch, metrics = steps.next(done=trainer.step)   # as BufferedSteps.next

The schedule is `algo.max_staleness`'s (mmrl/buffer/schedule.py): before the update of
step t the buffer gets the batch of step t + max_staleness, sampled by the weights of
step t - 1. Run sequentially, that rollout and the update take turns on the device;
here the rollout runs in a thread of its own while the main thread updates, so the decode
(memory-bound) shares the device with the update (compute-bound). The two must not touch
the same weights: the thread samples from an inference copy (`InferenceCopy`: the
actor's weights, bf16 on a GPU), which only the main thread writes, and only between two
batches: at the start of each step it waits for the thread's batch, puts it in the
buffer, copies the updated weights into the copy, and starts the thread on the next
batch. On a GPU the thread issues its kernels on a CUDA stream of its own; events order
the copy's refresh after the thread's last read and the thread's first read after the
refresh, so no read sees half-written weights.

Sequential and concurrent runs compute the same thing (tests/test_overlap.py):
- the batches are the same, sampled in the same order from the same data: the thread
  only samples and scores; the main thread alone puts batches in the buffer, whose state
  at each step's end (what a checkpoint records) is the sequential schedule's;
- the random draws are the same: with max_staleness >= 1 the compiled rollout samples
  each batch from a generator of its own, seeded by (seed, rank, batch number)
  (`SamplingParams.generator_seed`, `mmrl.buffer.schedule.batch_seed`), so the update's draws (dropout) and the thread's
  cannot interleave differently from one run to the next;
- the behaviour log-probs are the sampler's (`algo.behaviour: sampler`): recomputing them
  would need the actor's forward under the sampling weights, which the update is changing
  at that moment.
The batches of weights version 0 (the first step's) are sampled in the main thread before
the first update: they have nothing to run beside, and the step-0 media check reads the
actor.

An error in the thread (a reward that raises, a decode that fails) is raised again in
the main thread at the next step, with the thread's traceback and a note saying where it
came from; a run that ends or fails never waits on the thread for more than the batch it
is sampling (a daemon thread: the process can exit while it runs).

Metrics (per step): `overlap/waited_for_rollout_s` (the main thread blocked on the
thread's batch), `overlap/waited_for_update_s` (the thread done, waiting for the step to
end), `overlap/rollout_s` (the thread's sampling and scoring), `overlap/refresh_s` (the
copy's refresh), and where the thread's batch spent its time (`PHASE_METRICS`: the
prefill, the decode loop split into the host's launching and its waits for the device,
scoring, host work around them; the decode path the thread took), so one GPU run shows
whether the thread's decode is slower than the main thread's for its own reasons (host
time: the GIL, Python; device time: sharing the GPU). `algo.overlap_switch_interval_ms`
lowers Python's switch interval while the thread samples. `bench/async_overlap.py`
measures the synchronous and concurrent runs and variants that isolate those causes.
"""

from __future__ import annotations

import copy as copying
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from mmrl.buffer.schedule import (BufferedSteps, batch_seed, buffer_for, check_sampler_log_probs, rebuild_for,
                                  sampler_log_probs)
from mmrl.buffer.schedule import steps_for as sequential_steps_for
from mmrl.buffer.store import RolloutBatch, TrajectoryBuffer
from mmrl.buffer.trainer_view import TrainerView
from mmrl.config import Recipe, RecipeError
from mmrl.recipe_checks import overlap_problem
from mmrl.rollout import rollout_options
from mmrl.rollout.compiled import CompiledHFRollout
from mmrl.rollout.inference_copy import InferenceCopy, describe

# Where the thread's batch spent its seconds, per step (0 in steps that collected none).
# Host clock; the decode loop's looks at the running rows (every few steps) wait for the
# device, so `decode_wait_s` is device time the host did not cover with launches and
# `decode_host_s` the host's own: launching steps, and waiting for the GIL.
PHASE_METRICS = {
    "overlap/start_lag_s": "from the thread's start to its first line (the GIL, thread start-up)",
    "overlap/generate_s": "the rollout's generate call (time/rollout)",
    "overlap/generate_host_s": "generate less the compiled loop: tokenizing prompts, trimming responses",
    "overlap/setup_s": "the loop's setup before the prefill (caches, positions)",
    "overlap/prefill_s": "the prompts' forward until the device finished it (after the copy's refresh)",
    "overlap/decode_s": "the decode loop",
    "overlap/decode_wait_s": "the decode loop's host waits for the device",
    "overlap/decode_host_s": "the decode loop less its waits: launching, Python, the GIL",
    "overlap/decode_step_ms": "the decode loop per step",
    "overlap/decode_steps": "decode steps",
    "overlap/trim_s": "the tokens' copy to the host after the loop (the last steps' device time)",
    "overlap/score_s": "the rewards",
    "overlap/host_other_s": "the rest of the thread's batch: choosing prompts, building the batch",
    "overlap/graphs_recorded": "CUDA graphs the decode step recorded during the batch",
    "overlap/decode_graphs": "1 where the decode step replayed CUDA graphs",
    "overlap/decode_compiled_layers": "1 where those graphs run the compiled decoder layers",
    "overlap/switch_interval_ms": "Python's switch interval while the thread sampled",
}


def overlap_mode(recipe: Recipe, device: torch.device, backend: str) -> str:
    """`algo.overlap` as this run takes it, "thread" or "off" ("auto": the thread on a GPU
    where the recipe allows it, off elsewhere; `backend`: rollout.backend as settled).
    An explicit "thread" the recipe or backend cannot take raises RecipeError."""
    asked = recipe.algo.overlap
    if asked == "off":
        return "off"
    problem = overlap_problem(recipe)
    if problem is None and backend != "hf_compiled":
        problem = (f"algo.overlap=thread samples with the compiled rollout; rollout.backend=auto settled on "
                   f"{backend!r} here: set rollout.backend=hf_compiled")
    if asked == "thread":
        if problem:
            raise RecipeError(problem)
        return "thread"
    return "thread" if problem is None and device.type == "cuda" else "off"


def steps_for(trainer: TrainerView) -> BufferedSteps:
    """The trainer's schedule: concurrent (`ConcurrentSteps`) where `algo.overlap` takes the
    thread, else the sequential one (`mmrl.buffer.schedule.steps_for`)."""
    mode = overlap_mode(trainer.recipe, trainer.dist.device, trainer.settled.rollout_backend)
    if mode == "off":
        return sequential_steps_for(trainer)
    return ConcurrentSteps.for_trainer(trainer)


class CopyRollout(CompiledHFRollout):
    """The compiled rollout on an inference copy of the engine's weights that only
    `refresh` writes (kept between rollouts): nothing it does reads or writes the engine's
    own weights or runs a collective, so it can sample while the engine updates. A failure
    of the compiled path raises (plain `generate` would read the engine's weights)."""

    def __init__(self, engine, processing, **options):
        super().__init__(engine, processing, **{**options, "inference_copy": "keep"})
        if self.copy is None:  # one process: the compiled rollout would decode on the engine's model
            self.copy = InferenceCopy(engine, keep="keep")

    def refresh(self) -> None:
        """The engine's current weights into the copy (collective under FSDP2: every rank,
        in step). Never while a rollout runs."""
        self.copy.stale()
        self.copy.refresh(self.engine)

    def sampling_model(self) -> torch.nn.Module:
        return self.copy.model

    def _sample(self, batch, shared, params):
        if not self.copy.fresh:
            raise RuntimeError("the inference copy was not refreshed before this rollout")
        return self._fast_sample(batch, shared, params)

    def sync(self, engine) -> None:
        """Nothing: `ConcurrentSteps` refreshes the copy between batches."""


class RolloutSide:
    """The trainer as the rollout thread sees it: `Trainer.roll_out_batch` runs on this, with
    the thread's own rollout (`CopyRollout`), processing (a fast tokenizer may not be used
    by two threads at once) and clock, and the weights version it samples at as `step`;
    every other attribute is the trainer's. The thread moves only the trainer's data
    position, which the main thread leaves alone while a batch is being sampled."""

    def __init__(self, trainer: TrainerView, rollout: CopyRollout, processing):
        self._trainer = trainer
        self.rollout = rollout
        self.processing = processing
        self.step = 0
        self.timings: dict[str, float] = defaultdict(float)
        self.phases: dict[str, float] = {}  # the last batch's (`batch_phases`)

    def __getattr__(self, name: str):
        return getattr(self._trainer, name)

    # The trainer's own methods, run on this object (its clock, its processing).
    def timed(self, name: str):
        return type(self._trainer).timed(self, name)

    def score(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return type(self._trainer).score(self, *args, **kwargs)
        finally:
            self.phases["score_s"] = time.perf_counter() - began

    def roll_out(self, version: int, seed: int) -> RolloutBatch:
        """The next prompts' scored rollout, sampled by weights version `version` from a
        generator seeded `seed`."""
        self.step = version
        self.phases = {}
        generating = self.timings.get("rollout", 0.0)
        batch = type(self._trainer).roll_out_batch(self, generator_seed=seed)
        self.phases["generate_s"] = self.timings.get("rollout", 0.0) - generating
        return batch

    def batch_phases(self) -> dict[str, float]:
        """Where the last batch's seconds went (`PHASE_METRICS`, without the prefix), and
        the decode path it took."""
        stats, phases = self.rollout.stats, self.phases
        out = {key: float(stats.get(key, 0.0)) for key in
               ("setup_s", "prefill_s", "decode_s", "decode_wait_s", "trim_s", "graphs_recorded",
                "decode_graphs", "decode_compiled_layers")}
        steps = float(stats.get("steps", 0))
        out.update(generate_s=phases.get("generate_s", 0.0), score_s=phases.get("score_s", 0.0), decode_steps=steps,
                   decode_host_s=out["decode_s"] - out["decode_wait_s"],
                   decode_step_ms=1000 * out["decode_s"] / steps if steps else 0.0)
        loop = out["setup_s"] + out["prefill_s"] + out["decode_s"] + out["trim_s"]
        out["generate_host_s"] = max(0.0, out["generate_s"] - loop) if steps else 0.0
        return out


class _InFlight:
    """One batch being sampled in the thread: its result or error, and its times."""

    def __init__(self, number: int, version: int):
        self.number, self.version = number, version
        self.batch: RolloutBatch | None = None
        self.error: BaseException | None = None
        self.busy = 0.0  # seconds the thread sampled and scored
        self.launched_at = time.perf_counter()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.phases: dict[str, float] = {}  # where its seconds went (`RolloutSide.batch_phases`)
        self.switch_interval = sys.getswitchinterval()  # in force while it sampled
        self.switch_before: float | None = None  # Python's own, restored when it is done
        self.thread: threading.Thread | None = None
        self.event = None  # a CUDA event recorded on the thread's stream after its last kernel


class ConcurrentSteps(BufferedSteps):
    """`BufferedSteps` whose last batch per step is sampled in a thread while the step's
    update runs (module docstring). `roll_out(version, number)` samples and scores batch
    `number` (any thread); `refresh()` copies the current weights into the rollout's copy (main
    thread, no rollout running); `timings` is the trainer's clock, which gets the thread's
    rollout seconds when its batch is collected. `phases()`: where the batch just sampled
    spent its time (`RolloutSide.batch_phases`); `switch_interval_ms`: Python's switch
    interval while the thread samples (None: left as it is); `sampler`: the thread's
    rollout, for benches to read (`CompiledHFRollout.decode_path`)."""

    def __init__(self, buffer: TrajectoryBuffer, *, max_staleness: int, total_steps: Callable[[], int],
                 roll_out: Callable[[int, int], RolloutBatch], refresh: Callable[[], None],
                 device: torch.device, side_timings: dict[str, float],
                 timings: dict[str, float], rebuild: Callable | None = None, summary: str = "",
                 phases: Callable[[], dict[str, float]] | None = None, switch_interval_ms: float | None = None,
                 sampler: CopyRollout | None = None):
        super().__init__(buffer, max_staleness=max_staleness, total_steps=total_steps, produce=self._inline,
                         behaviour=sampler_log_probs, rebuild=rebuild)
        self.roll_out = roll_out
        self.refresh = refresh
        self.summary = summary  # the run summary's line on it (`mmrl.summary`)
        self.device = device
        self.side_timings = side_timings
        self.timings = timings
        self.phases = phases
        self.switch_interval = None if switch_interval_ms is None else switch_interval_ms / 1000
        self.sampler = sampler
        # High priority: a decode step is a short kernel chain each token waits for; the
        # update's long kernels fill the device around it.
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.in_flight: _InFlight | None = None
        self.copy_version: int | None = None  # the weights version the copy holds
        self._done = 0
        self._metrics: dict[str, float] = {}

    @classmethod
    def for_trainer(cls, trainer: TrainerView) -> ConcurrentSteps:
        """The concurrent schedule of `trainer`'s recipe: its rollout on a copy of the actor."""
        recipe, settled = trainer.recipe, trainer.settled
        index_of = {source: index for index, source in enumerate(trainer.train_set.source_rows)}
        name = getattr(trainer.train_set, "name", "") or ""
        options = rollout_options(recipe.rollout, "hf_compiled", settled.rollout_decode)
        processing = copying.deepcopy(trainer.processing)
        sampler = CopyRollout(trainer.actor, processing, **options)
        side = RolloutSide(trainer, sampler, processing)
        check_sampler_log_probs(side.rollout, recipe)  # its raw log-probs: rollout.temperature 1 (or 0)
        seed, rank = recipe.trainer.seed, trainer.dist.dp_rank

        def roll_out(version: int, number: int) -> RolloutBatch:
            batch = side.roll_out(version, batch_seed(seed, rank, number))
            batch.indices = [index_of[row] for row in batch.rows]
            batch.dataset = name
            return batch

        return cls(buffer_for(trainer), max_staleness=recipe.algo.max_staleness,
                   total_steps=lambda: trainer.recipe.trainer.steps, roll_out=roll_out, refresh=side.rollout.refresh,
                   device=trainer.dist.device, side_timings=side.timings, timings=trainer.timings,
                   rebuild=rebuild_for(trainer), phases=side.batch_phases,
                   switch_interval_ms=recipe.algo.overlap_switch_interval_ms, sampler=sampler,
                   summary=f"thread (algo.overlap={recipe.algo.overlap}): the next batch sampled beside the update "
                           f"on an {describe(side.rollout.copy)}")

    # -- the schedule ---------------------------------------------------------------------------
    def next(self, done: int) -> tuple[RolloutBatch, dict[str, float]]:
        self._done = done
        self._metrics = {"overlap/waited_for_rollout_s": 0.0, "overlap/waited_for_update_s": 0.0,
                         "overlap/rollout_s": 0.0, "overlap/refresh_s": 0.0, **dict.fromkeys(PHASE_METRICS, 0.0)}
        self._collect()
        self._refresh(done)
        batch, metrics = super().next(done)
        if "buffer/pending" in metrics and self.in_flight is not None:
            metrics["buffer/pending"] += 1.0  # the batch being sampled: the sequential schedule's count
        return batch, {**metrics, **self._metrics}

    def _fill(self, done: int) -> None:
        """The sequential schedule's fill (`BufferedSteps._fill`), its last batch sampled in
        the thread, except at weights version 0 (module docstring)."""
        self._collect()
        pending = self.buffer.pending
        while True:
            wanted = len(pending) < self.max_staleness + 1 and (done + len(pending) < self.total_steps()
                                                                or not pending)
            if not wanted:
                return
            last = len(pending) == self.max_staleness  # the one that runs beside the update
            if done == 0 or not last:
                self.buffer.put(self._behaved(self._inline()))
            else:
                self._start(done)
                return

    def _inline(self) -> RolloutBatch:
        batch = self.roll_out(self._done, self.buffer.produced + 1)
        self._move_timings()
        return batch

    def _move_timings(self) -> None:
        """The rollout's seconds (`time/rollout`, ...) onto the trainer's clock (main thread)."""
        for key in list(self.side_timings):
            self.timings[key] += self.side_timings.pop(key)

    def _behaved(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.behaviour_logp is None:
            batch.behaviour_logp = self.behaviour(batch)
        return batch

    def state(self) -> dict[str, int]:
        self._collect()
        return super().state()

    def drain(self) -> None:
        """At a run's end: the batch being sampled (one an early stop leaves) is waited
        for and kept, as the sequential schedule would have made it."""
        self._collect()

    # -- the thread -----------------------------------------------------------------------------
    def _start(self, version: int) -> None:
        job = _InFlight(self.buffer.produced + 1, version)
        if self.switch_interval is not None:
            # Each time the thread wants the GIL while the main thread runs Python, it waits
            # up to the interval (`sys.getswitchinterval()`) before the main thread is made to let go.
            job.switch_before = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval)
            job.switch_interval = self.switch_interval
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # after the copy's refresh on the main stream
        job.thread = threading.Thread(target=self._work, args=(job, ready), daemon=True,
                                      name=f"mmrl-rollout-batch-{job.number}")
        self.in_flight = job
        job.thread.start()

    def _work(self, job: _InFlight, ready) -> None:
        started = job.started_at = time.perf_counter()
        try:
            if self.stream is None:
                job.batch = self.roll_out(job.version, job.number)
            else:
                self.stream.wait_event(ready)
                with torch.cuda.stream(self.stream):
                    job.batch = self.roll_out(job.version, job.number)
                    job.event = torch.cuda.Event()
                    job.event.record(self.stream)
            if self.phases is not None:
                job.phases = self.phases()
        except BaseException as error:  # noqa: BLE001 - raised again in the main thread
            job.error = error
        finally:
            if job.switch_before is not None:  # nothing competes for the GIL from here on
                sys.setswitchinterval(job.switch_before)
            job.finished_at = time.perf_counter()
            job.busy = job.finished_at - started

    def _collect(self) -> None:
        """Wait for the batch being sampled, if any, and put it in the buffer (main thread);
        its error, if it failed, is raised here."""
        job = self.in_flight
        if job is None:
            return
        waited = time.perf_counter()
        job.thread.join()
        now = time.perf_counter()
        self.in_flight = None
        self._metrics["overlap/waited_for_rollout_s"] = now - waited
        self._metrics["overlap/waited_for_update_s"] = max(0.0, waited - job.finished_at)
        self._metrics["overlap/rollout_s"] = job.busy
        self._metrics.update(_phase_metrics(job))
        self._move_timings()
        if job.error is not None:
            job.error.add_note(f"raised in the rollout thread (algo.overlap=thread), sampling batch {job.number} "
                               f"with the weights of step {job.version}")
            raise job.error
        if job.event is not None:
            torch.cuda.current_stream().wait_event(job.event)  # the copy's next refresh after its last read
        self.buffer.put(self._behaved(job.batch))

    def _refresh(self, done: int) -> None:
        if self.copy_version == done:
            return
        started = time.perf_counter()
        self.refresh()
        self.copy_version = done
        self._metrics["overlap/refresh_s"] = time.perf_counter() - started


def _phase_metrics(job: _InFlight) -> dict[str, float]:
    """`PHASE_METRICS` of a finished batch."""
    out = {f"overlap/{key}": value for key, value in job.phases.items() if f"overlap/{key}" in PHASE_METRICS}
    out["overlap/start_lag_s"] = (job.started_at or job.launched_at) - job.launched_at
    out["overlap/switch_interval_ms"] = 1000 * job.switch_interval
    if job.phases:
        counted = job.phases.get("generate_s", 0.0) + job.phases.get("score_s", 0.0)
        out["overlap/host_other_s"] = max(0.0, job.busy - counted)
    return out


__all__ = ["PHASE_METRICS", "ConcurrentSteps", "CopyRollout", "RolloutSide", "overlap_mode", "steps_for"]
