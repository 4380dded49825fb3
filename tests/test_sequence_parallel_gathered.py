"""Sequence parallelism with gathered mixers (mmrl.parallel.gathered), for decoders Ulysses
cannot split by heads: 2 processes under torchrun (gloo) against one process, on tiny
transformers models built from configs (attention outside transformers' attention
interface with ALiBi or local windows, and a state-space decoder); then which modules
count as mixers, the recipe check that skips the heads rule, and the line a crashed
probe launch is reported by (the rows of the coverage sweep quote it).
"""

import json
from pathlib import Path

import pytest
import torch

from cpu_processes import padded_rows, run, torchrun

MODELS = {
    "alibi": ("BloomConfig", dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)),
    "local": ("GPTNeoConfig", dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                   attention_types=[[["global", "local"], 1]], max_position_embeddings=64)),
    "rotary": ("CodeGenConfig", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    "state_space": ("MambaConfig", dict(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2)),
}


def tiny(kind: str):
    import transformers

    config_name, fields = MODELS[kind]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**fields)).float()


def adapter_of(model):
    """What the engine reads of an adapter: the decoder layers (the first ModuleList's
    class, under its parent) and a gathered SequenceParallel."""
    from types import SimpleNamespace

    from mmrl.adapter import Parts, SequenceParallel

    name, layers = next((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
    return SimpleNamespace(family="x", sequence_parallel=SequenceParallel(gather_mixers=True),
                           shard_layers=(type(layers[0]).__name__,), parts=Parts(language=name.rsplit(".", 1)[0]))


SCRIPT = '''
import sys
sys.path.insert(0, sys.argv[3])
import torch
import torch.distributed as dist
from cpu_processes import (join_gloo_group, leave_gloo_group, one_process_reference, padded_rows,
                           summed_gradient_gaps, token_weights)
from test_sequence_parallel_gathered import adapter_of, tiny
from mmrl.parallel import gathered, ulysses

rank, size = join_gloo_group()
ids, mask = padded_rows()
length = ids.shape[1]
weights = token_weights(mask)
results = {}
for name in sys.argv[2].split(","):
    kind, _, checkpointed = name.partition("+")
    model = tiny(kind)
    if checkpointed:  # layers recomputed in backward, outside the forward's context
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": ulysses.checkpoint_context})
        model.train()
    reference, expected = one_process_reference(model, ids, mask, weights)
    gathered.install(model, adapter_of(model))
    columns, widths = ulysses.local_columns(length, 0, length, rank, size)
    start, _ = ulysses.owned_range(length, rank, size)
    with ulysses.active(dist.group.WORLD):
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=columns)
    local = torch.log_softmax(out.logits, -1).gather(-1, ids[:, start + columns][..., None])[..., 0]
    split = ulysses.gather_columns(local, widths, rank, dist.group.WORLD)
    (split * weights).sum().backward()
    gaps = summed_gradient_gaps(model, expected)
    results[name] = {"logprob_gap": (split - reference).detach()[mask.bool()].abs().max().item(),
                     "grad_gap": max(gaps), "grads": len(gaps), "expected_grads": len(expected),
                     "local_logits": out.logits.shape[1]}
leave_gloo_group(results, sys.argv[1])
'''


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_gathered_mixers_equal_one_process(tmp_path):
    """Log-probs and every gradient of 2 ranks equal one process, each rank's logits
    covering its own positions only: ALiBi, local windows, rotary, a state-space scan; and
    one with activation checkpointing (the gathers run again in the recompute)."""
    script, out = tmp_path / "gathered.py", tmp_path / "gathered.json"
    script.write_text(SCRIPT)
    names = [*MODELS, "alibi+checkpointed"]
    run(torchrun(2, script, out, ",".join(names), Path(__file__).parent), timeout=400)
    results = json.loads(out.read_text())
    assert set(results) == set(names)
    for kind, record in results.items():
        assert record["grads"] == record["expected_grads"] > 0, (kind, record)
        assert record["logprob_gap"] <= 1e-5 and record["grad_gap"] <= 1e-5, (kind, record)
        assert record["local_logits"] == 5, (kind, record)  # 9 positions over 2 ranks: 5 each, rank 0's all real


def test_mixers_are_the_modules_that_take_masks_positions_caches_or_states():
    from mmrl.parallel.gathered import is_mixer, mixers

    for kind in MODELS:
        model = tiny(kind)
        found = mixers(model, adapter_of(model))
        assert len(found) == 2, (kind, [type(m).__name__ for m in found])  # one per layer
        names = {type(m).__name__ for m in found}
        assert not any("MLP" in name or "Norm" in name for name in names), (kind, names)
    assert not is_mixer(torch.nn.Linear(2, 2)) and not is_mixer(torch.nn.LayerNorm(2))


def test_outside_a_sequence_parallel_forward_nothing_changes():
    from mmrl.parallel import gathered

    model = tiny("alibi")
    ids, mask = padded_rows()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        gathered.install(model, adapter_of(model))
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_gathered_mixers_skip_the_heads_rule(tmp_path):
    """A family with gather_mixers splits no heads: no head count refuses a degree."""
    from types import SimpleNamespace

    from mmrl.adapter import SequenceParallel
    from mmrl.recipe_checks import _check_sequence_parallel

    adapter = SimpleNamespace(family="x", sequence_parallel=SequenceParallel(gather_mixers=True))
    recipe = SimpleNamespace(parallel=SimpleNamespace(sequence_parallel=3), model=None)
    import mmrl.recipe_checks as checks

    original = checks._built_config
    checks._built_config = lambda m: (tiny("alibi").config, adapter)
    try:
        _check_sequence_parallel(recipe)  # 3 divides none of 4 heads; no error
    finally:
        checks._built_config = original


def test_a_crashed_launch_is_told_by_the_ranks_exception_not_torchruns_summary():
    from mmrl.probes.launcher import crash_line

    stderr = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: RuntimeError: shape '[-1, 9, 32]' is invalid for input of size 320",
        "[rank0]: RuntimeError: Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    ])
    assert crash_line(stderr) == "[rank1]: RuntimeError: shape '[-1, 9, 32]' is invalid for input of size 320"
    assert crash_line("some error happened\nlast line") == "some error happened"
    assert crash_line("") == ""


def test_position_wise_children_get_their_per_position_inputs_cut():
    """Rank 1 of 2 over 9 positions owns 5..9 (9 is padding): token ids a router reads
    beside the hidden states are cut to those (the last id repeats), floats pad with 0."""
    from mmrl.parallel import gathered, ulysses

    ids = torch.arange(18).reshape(2, 9)
    hidden = torch.randn(2, 5, 4)
    with ulysses.active(None, rank=1, size=2) as ctx:
        ctx.length = 9
        args, kwargs = gathered._cut_position_inputs(None, (hidden,), {"input_ids": ids, "scale": torch.ones(2, 9)})
    assert args[0] is hidden
    assert kwargs["input_ids"].tolist() == [[5, 6, 7, 8, 8], [14, 15, 16, 17, 17]]
    assert kwargs["scale"].tolist() == [[1, 1, 1, 1, 0]] * 2


def test_mixers_held_in_a_module_list_are_found_one_by_one():
    from mmrl.parallel.gathered import is_mixer, layer_children

    class Attention(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
            return hidden_states

    layer = torch.nn.Module()
    layer.self_attn = torch.nn.ModuleList([Attention(), Attention()])
    layer.mlps = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    children = layer_children(layer)
    assert len(children) == 4 and [is_mixer(c) for c in children] == [True, True, False, False]


def test_cut_positions_are_contiguous():
    """A model may .view() what it gets back (a narrow along the sequence is not contiguous)."""
    from mmrl.parallel import gathered, ulysses

    with ulysses.active(None, rank=0, size=2) as ctx:
        ctx.length = 9
        mine = gathered._own_positions(torch.randn(2, 9, 4), ctx)
    assert mine.shape == (2, 5, 4) and mine.is_contiguous()
    mine.view(10, 4)


def test_a_layer_or_mixer_called_without_hidden_states_is_named():
    """Both hooks find the hidden states one way (`_hidden`) and name the module that
    lacks them; a mixer reached before the first layer measured the sequence is refused alike."""
    from mmrl.parallel import gathered, ulysses

    layer = torch.nn.Linear(2, 2)
    with ulysses.active(None, rank=0, size=2) as ctx:
        for hook in (gathered._cut_first_layer, gathered._gather_inputs):
            with pytest.raises(ValueError, match="needs the hidden states of Linear$"):
                hook(layer, (), {"hidden_states": None})
        with pytest.raises(ValueError, match="needs the hidden states of Linear$"):
            gathered._gather_inputs(layer, (torch.randn(2, 5, 4),), {})
        args, kwargs = gathered._cut_first_layer(layer, (torch.randn(2, 9, 4),), {})
        assert ctx.length == 9 and args[0].shape == (2, 5, 4)
