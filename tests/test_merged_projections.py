"""Merged projections in the compiled rollout's decode steps (mmrl/rollout/merged.py): the
groups found in each decoder layer, results equal to the separate products (fp32 on CPU,
eagerly and through torch.compile's full graph), a member called with another input
computing its own product, fresh weights after an update, the modules' own forwards back
afterwards, "auto" off on the CPU, and memory that does not fit leaving merging off with
one warning. Speed: bench/decode_bound.py (--rollout-options merge_projections=false for
the unmerged step); on a GPU in bf16: tests/test_gpu.py.
"""

import warnings

import pytest
import torch
from widened_models import prompt_conversations, widened_engine

from mmrl.adapter import MERGED_PROJECTIONS
from mmrl.engine.surgery import decoder_layers
from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout.merged import MergedProjections, merge_sites

PARAMS = SamplingParams(n=2, max_new_tokens=10, temperature=0, logprobs=True)


def _same(merged, plain):
    assert torch.equal(merged.response_ids, plain.response_ids)
    assert torch.equal(merged.response_mask, plain.response_mask)
    torch.testing.assert_close(merged.logprobs, plain.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_each_decoder_layer_merges_q_k_v_and_gate_up(family):
    built, _ = widened_engine(family)
    layers = decoder_layers(built.model, built.adapter)
    sites = merge_sites(layers, MERGED_PROJECTIONS)
    assert len(sites) == 2 * len(layers)
    names = {name: module for name, module in built.model.named_modules()}
    found = sorted({tuple(next(n for n, m in names.items() if m is member).rsplit(".", 1)[-1]
                          for member in site.members) for site in sites})
    assert found == [("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj")]
    # The vision tower's MLPs (gate/up too in Qwen2.5-VL) are not decode-step modules.
    assert all(any(member is m for layer in layers for m in layer.modules()) for s in sites for member in s.members)


def test_a_merged_layer_equals_the_separate_products_and_restores_its_forwards():
    built, _ = widened_engine("qwen2")
    layers = decoder_layers(built.model, built.adapter)
    attention, mlp = layers[0].self_attn, layers[0].mlp
    x = torch.randn(3, 1, attention.q_proj.in_features)
    plain = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x), mlp(x)]
    merging = MergedProjections(MERGED_PROJECTIONS, lambda model: decoder_layers(model, built.adapter))
    with torch.no_grad(), merging.merged(built.model) as groups:
        assert groups == 2 * len(layers)
        merged = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x), mlp(x)]
        # k called on another tensor computes its own product (no slice of x's).
        other = torch.randn_like(x)
        torch.testing.assert_close(attention.k_proj(other), torch.nn.functional.linear(
            other, attention.k_proj.weight, attention.k_proj.bias), atol=0, rtol=0)
    for a, b in zip(merged, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert not any("forward" in vars(m) for layer in layers for m in layer.modules())
    assert merging.merged_bytes(built.model) == sum(
        p.numel() * p.element_size() for layer in layers for name, p in layer.named_parameters()
        if name.rsplit(".", 2)[-2] in {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


def test_a_group_declared_out_of_call_order_gives_the_same_results():
    """A declaration that does not fit the family costs speed only: with v declared first
    and q called first, q finds no slice of its input and computes its own product."""
    built, engine = widened_engine("qwen2")
    conversations = prompt_conversations(built)
    plain = make_rollout("hf_compiled", engine, built.processing, compile=False,
                         merge_projections=False).generate(conversations, PARAMS)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, merge_projections=True)
    rollout.merging = MergedProjections((("v_proj", "q_proj"),), rollout.merging.layers_of)
    _same(rollout.generate(conversations, PARAMS), plain)
    assert rollout.stats["merged_groups"] == engine.model.config.num_hidden_layers


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_merged_decoding_gives_the_tokens_and_logprobs_of_unmerged_decoding(family):
    built, engine = widened_engine(family)
    conversations = prompt_conversations(built)
    unmerged = make_rollout("hf_compiled", engine, built.processing, compile=False, merge_projections=False)
    merged = make_rollout("hf_compiled", engine, built.processing, compile=False, merge_projections=True)
    plain = unmerged.generate(conversations, PARAMS)
    assert len(set(plain.response_ids[0].tolist())) > 3  # not one token repeated
    _same(merged.generate(conversations, PARAMS), plain)
    assert unmerged.stats["merged_groups"] == 0
    assert merged.stats["merged_groups"] == 2 * engine.model.config.get_text_config().num_hidden_layers
    # After an update the merged copies follow the new weights.
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if p.dim() == 2 and ("proj" in name):
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    changed = unmerged.generate(conversations, PARAMS)
    assert not torch.equal(changed.response_ids, plain.response_ids)
    _same(merged.generate(conversations, PARAMS), changed)
    assert not any("forward" in vars(m) for m in engine.model.modules())


def test_merged_decoding_traces_as_one_graph():
    built, engine = widened_engine("qwen2")
    conversations = prompt_conversations(built)
    plain = make_rollout("hf_compiled", engine, built.processing, compile=False,
                         merge_projections=False).generate(conversations, PARAMS)
    rollout = make_rollout("hf_compiled", engine, built.processing, merge_projections=True,
                           compile_options={"backend": "eager", "fullgraph": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        fast = rollout.generate(conversations, PARAMS)
        again = rollout.generate(conversations, PARAMS)
    assert rollout.fallback_reason is None and rollout.stats["merged_groups"] > 0
    _same(fast, plain)
    _same(again, plain)


def test_auto_merges_on_a_gpu_in_half_precision_only():
    built, engine = widened_engine("qwen2")
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    assert rollout.merge_projections == "auto"
    rollout.generate(prompt_conversations(built), PARAMS)
    assert rollout.stats["merged_groups"] == 0  # CPU, fp32
    with pytest.raises(ValueError, match="rollout.merge_projections must be true, false or auto, got 'yes'"):
        make_rollout("hf_compiled", engine, built.processing, merge_projections="yes")


def test_merged_weights_that_do_not_fit_warn_once_and_decode_unmerged(monkeypatch):
    built, engine = widened_engine("qwen2")
    conversations = prompt_conversations(built)
    plain = make_rollout("hf_compiled", engine, built.processing, compile=False,
                         merge_projections=False).generate(conversations, PARAMS)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, merge_projections=True)

    def full(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")

    monkeypatch.setattr(rollout.merging, "merged", full)
    with pytest.warns(UserWarning, match="merged weights do not fit .*decoding unmerged") as caught:
        _same(rollout.generate(conversations, PARAMS), plain)
    assert len(caught) == 1 and rollout.merge_projections is False and rollout.stats["merged_groups"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(rollout.generate(conversations, PARAMS), plain)


def test_the_recipe_setting_reaches_the_compiled_rollout():
    from mmrl.config import RolloutConfig
    from mmrl.rollout import rollout_options

    assert rollout_options(RolloutConfig(), "hf_compiled")["merge_projections"] == "auto"
    assert rollout_options(RolloutConfig(merge_projections=False), "hf_compiled")["merge_projections"] is False
