"""One GRPO-style update sharded with FSDP2 over the torchrun processes, against the same
update in one process, for each subject given; rank 0 appends one JSON line per subject.

The FSDP2 probe launches it (2 processes, gloo on CPU, nccl on GPUs):

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m mmrl.probes.fsdp_step OUT.jsonl '[{"source": "FAMILY", "random_init": true}]'

All subjects share one launch, so the start-up cost (two interpreters importing torch and
transformers) is paid once. The one-process reference runs on rank 0 with an unsharded
engine on the same global batch; the sharded step splits the prompts over the ranks and
scales the loss so that FSDP2's gradient averaging gives the one-process gradient.
"""

from __future__ import annotations

import torch

from mmrl.probes.launcher import run_worker

GRAD_RTOL = 1e-5  # per tensor: |diff| <= GRAD_RTOL * max(1, max|grad|) + GRAD_ATOL
GRAD_ATOL = 1e-7
# One AdamW step of lr 1e-2 moves each weight by about 1e-2. Adam divides a gradient by
# its own magnitude (plus eps 1e-8), so for gradients near 1e-8 a last-bit difference
# changes the step by O(lr): the worst-weight bound (5% of a step) applies where the
# reference gradient is at least SETTLED_GRAD, the mean bound applies to every weight.
WEIGHT_WORST = 5e-4
WEIGHT_MEAN = 1e-6
SETTLED_GRAD = 1e-6


def update(subject, dist) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients and updated weights (full, on CPU) of one update on this rank's share."""
    from mmrl.checks import sample_conversations
    from mmrl.engine import join
    from mmrl.engine.media import SharedMedia

    built, engine = probe_engine(subject, dist)
    conversations = sample_conversations(built.adapter) * 2  # 4 prompts, split over ranks
    generator = torch.Generator(device="cpu").manual_seed(0)
    vocab = built.model.config.get_text_config().vocab_size
    shape = (len(conversations), 6)
    responses = torch.randint(min(20, vocab - 1), vocab, shape, generator=generator, device="cpu")
    mask = torch.ones_like(responses)
    mask[1, 4:] = 0
    advantages = torch.randn(len(conversations), generator=generator, device="cpu")
    global_tokens = float(mask.sum())
    rows = list(range(dist.rank, len(conversations), dist.world_size))
    chosen = [conversations[i] for i in rows]
    prompts = dict(built.processing(chosen))
    # Rows 0 and 2 (1 and 3) repeat a prompt: where the family shares media encoding,
    # both sides encode it once, so the sharded update covers that path too.
    shared = SharedMedia.of(built.processing, chosen, [i % 2 for i in rows]) if engine.shares_media else None
    seqs = join(prompts, responses[rows], mask[rows], built.adapter, engine.model, built.tokenizer.pad_token_id,
                shared=shared)
    seqs = seqs.to(dist.device)
    logp, _ = engine.log_probs(seqs)
    weights = advantages[rows, None].to(dist.device)
    # Token-mean over the global batch; FSDP averages gradients over ranks.
    loss = -(logp * weights * seqs.response_mask).sum() / global_tokens * dist.world_size
    loss.backward()
    return step_and_collect(engine)


def probe_engine(subject, dist):
    """(built, engine) for one side of a sharded-vs-plain probe: the subject's model with
    seed 0 and an AdamW engine in fp32 on both sides (no bf16 policy or autocast on
    GPUs): the probes check the sharding, not bf16 numerics."""
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine

    built = subject.build(seed=0) if dist.device.type == "cpu" else _built_on_cpu(subject)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-2, grad_clip=1e9), total_steps=1,
                    mixed_precision=False)
    return built, engine


def step_and_collect(engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The full gradients after a backward, then the full weights after one optimizer
    step, in fp32 on CPU (the weights on rank 0 only when sharded)."""
    grads = {}
    for name, param in engine.model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.detach().float().cpu().clone()
    engine.step()
    state = {k: v.detach().float().cpu().clone() for k, v in engine.full_state_dict().items()}
    return grads, state


def _built_on_cpu(subject):
    """Built on CPU whatever the default device (a probe may run under the GPU's), with
    its processing there too; the Engine moves the model to the rank's device itself."""
    from mmrl.build import build_model

    with torch.device("cpu"):
        return build_model(subject.source, random_init=subject.random_init, seed=0)


def compare_updates(reference: tuple[dict, dict], sharded: tuple[dict, dict]) -> tuple[str | None, dict]:
    """(failure reason or None, evidence): the test_distributed criteria, shared."""
    (ref_grads, ref_weights), (grads, weights) = reference, sharded
    if ref_grads.keys() != grads.keys():
        return f"gradients exist for different parameters ({len(ref_grads)} vs {len(grads)})", {}
    if not ref_grads:
        return "no gradients recorded", {}
    worst_grad = 0.0
    for name, grad in ref_grads.items():
        scale = grad.abs().max().item() + 1e-12
        gap = (grad - grads[name]).abs().max().item()
        worst_grad = max(worst_grad, gap)
        if gap > GRAD_RTOL * max(1.0, scale) + GRAD_ATOL:
            return f"{name}: gradients differ by {gap:.2e} (scale {scale:.2e})", {"max_grad_diff": gap}
    if ref_weights.keys() != weights.keys():
        return "the updated state dicts name different tensors", {}

    def settled_gap(name: str) -> float:
        gap = (ref_weights[name] - weights[name]).abs()
        grad = ref_grads.get(name)
        if grad is not None and grad.shape == gap.shape:
            gap = gap[grad.abs() >= SETTLED_GRAD]
        return gap.max().item() if gap.numel() else 0.0

    worst = max(settled_gap(k) for k in ref_weights)
    mean = sum((ref_weights[k] - weights[k]).abs().sum().item() for k in ref_weights) / max(
        1, sum(t.numel() for t in ref_weights.values()))
    evidence = {"max_grad_diff": worst_grad, "max_weight_diff": worst, "mean_weight_diff": mean,
                "gradient_tensors": len(ref_grads)}
    if worst >= WEIGHT_WORST:
        return (f"the sharded update differs from one process by up to {worst:.2e} where |grad| >= "
                f"{SETTLED_GRAD:.0e} (bound {WEIGHT_WORST:.0e})"), evidence
    if mean >= WEIGHT_MEAN:
        return (f"the sharded update differs from one process by {mean:.2e} on average "
                f"(bound {WEIGHT_MEAN:.0e})"), evidence
    return None, evidence


if __name__ == "__main__":
    run_worker(update, compare_updates)
