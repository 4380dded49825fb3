"""The trajectory buffer between rollout and training, and the schedules over it.

Every step's rollout goes into the buffer and the step trains on what it takes out
(`mmrl.buffer.schedule`): with `algo.max_staleness: 0` that is the rollout just made, the
synchronous loop bit for bit; with N > 0 the buffer is kept N batches ahead, so the batch
a step trains on was sampled by weights N updates older (one-step-off for N = 1, run
sequentially, or with `algo.overlap: thread` the next rollout beside the update:
`mmrl.buffer.overlap`), its tokens reweighted against the log-probs those weights gave them
(`algo.off_policy`, mmrl/algos/off_policy.py).

    store = TrajectoryBuffer(run / "buffer")
    store.put(batch)                               # a scored rollout batch, persisted
    batch, dropped = store.take(version=7, max_staleness=1)

Each trajectory carries its tokens (prompt and completion ids, the completion's mask), its
media by reference (dataset row and file paths, never pixels), per-token behaviour
log-probs, its rewards and their parts, its group (prompt) and the weights version that
sampled it; each batch is one Parquet file in the run folder's `buffer/`, written whole
(mmrl/atomic.py), and a checkpoint records how far the buffer was produced and taken, so a
resumed run trains every batch once (`mmrl.buffer.store`). `mmrl buffer show RUN` prints
what a run's buffer holds (`mmrl.buffer.show`). Under torchrun, `parallel.rollout_ranks`
gives the sampling to ranks of its own that write the batches the train ranks take
(`mmrl.buffer.disaggregated`). With `rollout.partial_tokens` the batches
come from partial rollouts (`mmrl.buffer.partial`): rounds of a few tokens per sample,
the unfinished ones kept in the buffer (and its files) for the next step's round.
docs/async.md explains the settings.
"""

from mmrl.buffer.overlap import ConcurrentSteps, steps_for
from mmrl.buffer.partial import PartialRollouts
from mmrl.buffer.schedule import BufferedSteps, attach_behaviour, behaviour_log_probs
from mmrl.buffer.store import BufferError, RolloutBatch, TrajectoryBuffer

__all__ = ["BufferError", "BufferedSteps", "ConcurrentSteps", "PartialRollouts", "RolloutBatch", "TrajectoryBuffer",
           "attach_behaviour", "behaviour_log_probs", "steps_for"]
