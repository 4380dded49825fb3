"""Ulysses on eager attention (mmrl.parallel.ulysses, EAGER_NAME): each rank runs the
family's own `eager_attention_forward` on its heads, so what that function adds to the
scores (attention sinks, soft-capping) holds under sequence parallelism; 2 processes
under torchrun (gloo) against one process, on tiny transformers models built from configs.
"""

import json

import pytest
import torch

from mmrl.parallel import ulysses
from cpu_processes import padded_rows, run, torchrun

# Tiny decoders whose eager attention does more than sdpa's: per-head sinks (a parameter
# of the attention module, cut to each rank's heads), logit soft-capping, and a plain
# grouped-query one; each with a sliding window on some layers and one left-padded row.
MODELS = {
    "sinks": ("GptOssConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                   num_experts_per_tok=1, sliding_window=4,
                                   layer_types=["sliding_attention", "full_attention"])),
    "softcap": ("Gemma2Config", dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=4,
                                     attn_logit_softcapping=2.0)),
    "grouped": ("Qwen2Config", dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)),
}


def tiny(kind: str):
    import transformers

    config_name, fields = MODELS[kind]
    config = getattr(transformers, config_name)(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def adapter_of(model):
    from types import SimpleNamespace

    from mmrl.adapter import Parts, SequenceParallel

    layer = type(model.model.layers[0]).__name__
    return SimpleNamespace(family="x", sequence_parallel=SequenceParallel(), shard_layers=(layer,),
                           parts=Parts(language="model"))


SCRIPT = '''
import sys
sys.path.insert(0, sys.argv[3])
import torch
import torch.distributed as dist
from cpu_processes import (join_gloo_group, leave_gloo_group, one_process_reference, padded_rows,
                           summed_gradient_gaps, token_weights)
from test_ulysses_eager import adapter_of, tiny
from mmrl.parallel import ulysses

rank, size = join_gloo_group()
ids, mask = padded_rows()
length = ids.shape[1]
weights = token_weights(mask)
results = {}
for kind in sys.argv[2].split(","):
    model = tiny(kind)
    reference, expected = one_process_reference(model, ids, mask, weights)
    ulysses.install(model, adapter_of(model))
    columns, widths = ulysses.local_columns(length, 0, length, rank, size)
    start, _ = ulysses.owned_range(length, rank, size)
    local_ids = ids[:, start + columns]
    with ulysses.active(dist.group.WORLD):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, columns]
    local = torch.log_softmax(logits, -1).gather(-1, local_ids[..., None])[..., 0]
    split = ulysses.gather_columns(local, widths, rank, dist.group.WORLD)
    (split * weights).sum().backward()
    gaps = summed_gradient_gaps(model, expected)
    results[kind] = {"logprob_gap": (split - reference).detach()[mask.bool()].abs().max().item(),
                     "grad_gap": max(gaps), "grads": len(gaps), "implementation":
                     model.config._attn_implementation}
leave_gloo_group(results, sys.argv[1])
'''


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_ulysses_on_eager_attention_equals_one_process(tmp_path):
    """Log-probs and every gradient of 2 ranks (each its heads, through the family's eager
    function) equal one process on eager attention: sinks, soft-capping, GQA."""
    from pathlib import Path

    script, out = tmp_path / "eager.py", tmp_path / "eager.json"
    script.write_text(SCRIPT)
    run(torchrun(2, script, out, ",".join(MODELS), Path(__file__).parent), timeout=400)
    results = json.loads(out.read_text())
    assert set(results) == set(MODELS)
    for kind, record in results.items():
        assert record["implementation"] == ulysses.EAGER_NAME, (kind, record)
        assert record["grads"] > 0 and record["logprob_gap"] <= 1e-5, (kind, record)
        assert record["grad_gap"] <= 1e-5, (kind, record)


def test_eager_attention_outside_a_sequence_parallel_forward_is_unchanged():
    """Installed on an eager model, Ulysses changes nothing outside `active`: the family's
    eager function and eager mask run as before (sinks and soft-capping kept)."""
    for kind in ("sinks", "softcap"):
        model = tiny(kind)
        ids, mask = padded_rows()
        with torch.no_grad():
            before = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            ulysses.install(model, adapter_of(model))
            assert model.config._attn_implementation == ulysses.EAGER_NAME
            after = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert torch.equal(before, after), kind


def test_eager_attention_in_one_rank_group_equals_eager(tmp_path):
    """P = 1: the all-to-alls are identities, so the rank-local eager path (boolean mask
    made additive, heads regrouped, per-head sinks cut to the whole group) equals eager."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for kind in MODELS:
            model = tiny(kind)
            ids, mask = padded_rows()
            with torch.no_grad():
                before = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                ulysses.install(model, adapter_of(model))
                with ulysses.active(dist.group.WORLD):
                    split = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            real = mask.bool()
            torch.testing.assert_close(split[:, :ids.shape[1]][real], before[real], atol=1e-5, rtol=0, msg=kind)
    finally:
        dist.destroy_process_group()


def test_rank_heads_cut_per_head_parameters_only():
    sinks = torch.nn.Parameter(torch.arange(4.0))
    assert torch.equal(ulysses._rank_heads(sinks, 4, 2, 4), torch.tensor([2.0, 3.0]))
    assert ulysses._rank_heads(torch.arange(4), 4, 2, 4).shape == (4,), "integer tensors are not per-head values"
    assert ulysses._rank_heads(torch.ones(3), 4, 2, 4).shape == (3,)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, True
    seen = ulysses._RankHeads(module, {"sinks": sinks[2:]})
    assert seen.num_key_value_groups == 1 and seen.training and torch.equal(seen.sinks, sinks[2:])
