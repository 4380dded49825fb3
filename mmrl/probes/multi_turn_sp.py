"""The `multi_turn` probe's Ulysses part: a trajectory batch whose conversations got an
image (and a video, where the family declares video) from the environment in turn 3,
one GRPO-style update split along the sequence over the torchrun processes, against
the same update in one process; rank 0 appends one JSON line per subject.

The multi_turn probe launches it (2 processes, gloo on CPU, nccl on GPUs):

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m mmrl.probes.multi_turn_sp OUT.jsonl '[{"source": "FAMILY", "random_init": true}]'

Rank 0 runs the probe's agent rollout (`mmrl.probes.multi_turn.rollout`, seeded) once per
subject and sends the trajectories to the other ranks, as the trainer sends a rollout
to its sequence-parallel group. The batch shares media encoding where the family
declares it; the comparison is `sp_step`'s (log-probs 1e-5, gradients, AdamW step).
"""

from __future__ import annotations

import torch

from mmrl.probes.fsdp_step import probe_engine, step_and_collect
from mmrl.probes.sp_step import run_sequence_parallel

_TRAJECTORIES: dict[str, list] = {}


def trajectories(subject, dist) -> list:
    """The probe's kept trajectories for `subject`, the same on every rank: rank 0 rolls
    them out the first time (the one-process reference), then sends them to the group."""
    import torch.distributed as torch_dist

    from mmrl.probes.multi_turn import rollout

    if dist.world_size == 1:
        if subject.source not in _TRAJECTORIES:
            _TRAJECTORIES[subject.source] = rollout(subject).kept
        return _TRAJECTORIES[subject.source]
    box = [_TRAJECTORIES.get(subject.source) if dist.rank == 0 else None]
    torch_dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        raise RuntimeError("rank 0 has no trajectories for this subject")
    return box[0]


def update(subject, dist) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Log-probs, gradients and updated weights (full, on CPU) of one update on the whole
    trajectory batch, in one process or split along the sequence over dist's SP group."""
    from mmrl.rollout_batch import trajectory_sequences

    kept = trajectories(subject, dist)
    built, engine = probe_engine(subject, dist)
    seqs = trajectory_sequences(kept, built.processing, built.adapter, engine.model,
                                built.processing.tokenizer.pad_token_id, share=engine.shares_media).to(dist.device)
    logp, _ = engine.log_probs(seqs)
    advantages = torch.linspace(-1.0, 1.0, len(kept), device=dist.device)
    # Token-mean over the batch: the same loss on every rank of the SP group.
    loss = -(logp * advantages[:, None] * seqs.response_mask).sum() / seqs.response_mask.sum()
    (loss * dist.dp_size).backward()
    grads, state = step_and_collect(engine)
    return logp.detach().float().cpu(), grads, state


if __name__ == "__main__":
    run_sequence_parallel(update)
