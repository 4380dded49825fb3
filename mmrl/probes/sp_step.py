"""One GRPO-style update with Ulysses sequence parallelism over the torchrun processes,
against the same update in one process, for each subject given; rank 0 appends one JSON
line per subject.

The sequence-parallel probe launches it (2 processes, gloo on CPU, nccl on GPUs):

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m mmrl.probes.sp_step OUT.jsonl '[{"source": "FAMILY", "random_init": true}]'

All processes form one SP group (and FSDP2 shards over them): every rank gets the same
batch, whose length is made odd so that the sequence needs padding to split. Rank 0 first
runs the one-process reference on that batch; then log-probs (atol 1e-5), gradients and
AdamW-updated weights are compared with the FSDP2 probe's bounds (`compare_updates`).
"""

from __future__ import annotations

import torch

from mmrl.probes.fsdp_step import compare_updates, probe_engine, step_and_collect
from mmrl.probes.launcher import run_worker

LOGPROB_ATOL = 1e-5


# The batch's rows repeat its two prompts: row i answers prompt OWNERS[i].
OWNERS = [0, 1, 0, 1]


def conversations_of(adapter) -> list:
    from mmrl.checks import sample_conversations

    prompts = sample_conversations(adapter)
    return [prompts[i] for i in OWNERS]


def batch(built):
    """Four prompts and responses on every rank, prompt + response of odd length."""
    conversations = conversations_of(built.adapter)
    prompts = dict(built.processing(conversations))
    length = 6 if prompts["input_ids"].shape[1] % 2 else 5
    generator = torch.Generator(device="cpu").manual_seed(0)
    vocab = built.model.config.get_text_config().vocab_size
    shape = (len(conversations), length)
    responses = torch.randint(min(20, vocab - 1), vocab, shape, generator=generator, device="cpu")
    mask = torch.ones_like(responses)
    mask[1, length - 2:] = 0
    advantages = torch.randn(len(conversations), generator=generator, device="cpu")
    return prompts, responses, mask, advantages


def update(subject, dist) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Log-probs, gradients and updated weights (full, on CPU) of one update on the
    whole batch, in one process or split along the sequence over dist's SP group."""
    from mmrl.engine import join
    from mmrl.engine.media import SharedMedia

    built, engine = probe_engine(subject, dist)
    prompts, responses, mask, advantages = batch(built)
    # The batch repeats its two prompts: where the family shares media encoding, both
    # sides encode each once (the vision tower runs whole on every rank of the group).
    shared = SharedMedia.of(built.processing, conversations_of(built.adapter), OWNERS) if engine.shares_media else None
    seqs = join(prompts, responses, mask, built.adapter, engine.model, built.tokenizer.pad_token_id,
                shared=shared).to(dist.device)
    logp, _ = engine.log_probs(seqs)
    # Token-mean over the batch: the same loss on every rank of the SP group.
    loss = -(logp * advantages[:, None].to(dist.device) * seqs.response_mask).sum() / float(mask.sum())
    (loss * dist.dp_size).backward()
    grads, state = step_and_collect(engine)
    return logp.detach().float().cpu(), grads, state


def compare(reference, parallel) -> tuple[str | None, dict]:
    """(failure reason or None, evidence)."""
    (ref_logp, *ref_update), (logp, *sp_update) = reference, parallel
    if ref_logp.shape != logp.shape:
        return f"log-probs have shape {tuple(logp.shape)}, one process {tuple(ref_logp.shape)}", {}
    gap = (ref_logp - logp).abs().max().item()
    if gap > LOGPROB_ATOL:
        return f"log-probs differ from one process by {gap:.2e} (atol {LOGPROB_ATOL:.0e})", {"max_logprob_diff": gap}
    reason, evidence = compare_updates(tuple(ref_update), tuple(sp_update))
    if reason is not None:
        reason = reason.replace("FSDP2 update", "sequence-parallel update")  # the bounds are shared
    return reason, {"max_logprob_diff": gap, "tokens": int(ref_logp.numel()), **evidence}


def opted_in(subject) -> None:
    """Refuse a subject whose adapter does not declare sequence parallelism."""
    if subject.adapter.sequence_parallel is None:
        raise ValueError("the adapter sets sequence_parallel = None")


def run_sequence_parallel(update) -> None:
    """The main of a Ulysses probe script (this one and `multi_turn_sp`): `update` run in
    one process and over the SP group, compared by `compare`."""
    run_worker(update, compare, sequence_parallel=True, precheck=opted_in)


if __name__ == "__main__":
    run_sequence_parallel(update)
