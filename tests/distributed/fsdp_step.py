"""One GRPO-style update of a tiny model, in one process or sharded with FSDP2 over
several (torchrun), on the same global batch; writes the gradients and updated weights.

    python tests/distributed/fsdp_step.py FAMILY OUT.safetensors
    torchrun --nproc_per_node 2 tests/distributed/fsdp_step.py FAMILY OUT.safetensors
"""

import sys

import torch

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.parallel import init_distributed


def main(family: str, out: str) -> None:
    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    built = build_model(family, random_init=True, seed=0)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-2, grad_clip=1e9), total_steps=1)
    conversations = sample_conversations(built.adapter) * 2  # 4 prompts, split over ranks
    generator = torch.Generator().manual_seed(0)
    vocab = built.model.config.get_text_config().vocab_size
    responses = torch.randint(20, vocab, (len(conversations), 6), generator=generator)
    mask = torch.ones_like(responses)
    mask[1, 4:] = 0
    advantages = torch.randn(len(conversations), generator=generator)
    global_tokens = float(mask.sum())
    rows = list(range(dist.rank, len(conversations), dist.world_size))
    prompts = dict(built.processing([conversations[i] for i in rows]))
    seqs = join(prompts, responses[rows], mask[rows], built.adapter, engine.model, built.tokenizer.pad_token_id)
    logp, _ = engine.log_probs(seqs)
    # Token-mean over the global batch; FSDP averages gradients over ranks.
    loss = -(logp * advantages[rows, None] * seqs.response_mask).sum() / global_tokens * dist.world_size
    loss.backward()
    grads = {}
    for name, param in engine.model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads["grad." + name] = grad.detach().clone().contiguous().float()
    engine.step()
    state = engine.full_state_dict()
    if dist.is_main:
        from safetensors.torch import save_file

        weights = {k: v.detach().clone().contiguous().float() for k, v in state.items()}
        save_file({**weights, **grads}, out)
    if dist.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
