"""The chunked head's fused functions (`mmrl.engine.fusion.on_cuda`) compile once over chunks
of different rows (`chunk_tokens` rows, the last chunk shorter; issue 28): dim 0 is marked
dynamic before the first compile. The compiled-on-CUDA condition is swapped for "always" and
the backend for one that counts graphs and runs them eagerly (conftest's `fused_graphs`), so
this runs on the CPU."""

import pytest
import torch

from mmrl.engine import logprobs
from mmrl.engine.logprobs import LogitTransform

VOCAB = 64


def _chunk(rows, seed):
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(rows, VOCAB, generator=generator)
    targets = torch.randint(0, VOCAB, (rows,), generator=generator)
    grad_logp = torch.randn(rows, generator=generator)
    grad_entropy = torch.randn(rows, generator=generator)
    return raw, targets, grad_logp, grad_entropy


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=30.0, scale=0.5)])
def test_chunks_of_different_rows_compile_one_graph_per_function_and_equal_eager(fused_graphs, transform):
    for rows, seed in ((1024, 0), (970, 1), (1024, 2)):
        raw, targets, grad_logp, grad_entropy = _chunk(rows, seed)
        stats = logprobs._stats(raw, targets, transform, 0.7)
        eager_stats = logprobs._stats.__wrapped__(raw, targets, transform, 0.7)
        for got, want in zip(stats, eager_stats, strict=True):
            torch.testing.assert_close(got, want)
        _, entropy, lse = eager_stats
        grad = logprobs._raw_grad(raw, targets, lse, entropy, grad_logp, grad_entropy, transform, 0.7)
        eager = logprobs._raw_grad.__wrapped__(raw, targets, lse, entropy, grad_logp, grad_entropy, transform, 0.7)
        torch.testing.assert_close(grad, eager)
    assert "failed" not in logprobs._stats.state and "failed" not in logprobs._raw_grad.state
    assert len(fused_graphs) == 2, [graph.code for graph in fused_graphs]  # one per function: no graph at 970 rows
