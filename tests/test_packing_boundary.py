"""Packing across sequence boundaries (issue 31): the padding-free probe's boundary case
(a short sample packed right behind a long neighbour, log-probs against itself alone)
fails for a hybrid family whose state leaks across the boundary, passes once its
convolution runs one packed sequence a row (`mmrl.engine.stateful_layers`), and the
trainer refuses to pack a family that does not declare padding_free.

The hybrid family here is transformers' Lfm2 with one short-convolution layer.
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import configuration_utils

from mmrl import build_model
from mmrl.adapter import DECODER_PARTS, Capabilities, LoraTargets, ModelAdapter, TinyModel
from mmrl.boundaries import STATEFUL_LAYER_KINDS
from mmrl.checks import (
    BOUNDARY_HIDDEN_TOLERANCE, BOUNDARY_TOLERANCE, packed_boundary_gap, packed_vs_padded, sample_conversations,
)
from mmrl.config import ModelConfig, RecipeError
from mmrl.engine import stateful_layers
from mmrl.recipe_checks import _check_pack
from mmrl.settle import packs_model
from mmrl.probes import Subject, probe
from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS
from mmrl.registry import register_model, unregister
from mmrl.tiny import char_tokenizer, sized_config

Lfm2Config = pytest.importorskip("transformers.models.lfm2").Lfm2Config

# The kind transformers' Lfm2 gives its short-convolution layers ("conv" in 5.17 and 5.19),
# read from its own config rather than written here.
CONV = Lfm2Config(num_hidden_layers=2, full_attn_idxs=[1]).layer_types[0]


def _hybrid(family: str, layer_types: list[str], capabilities: Capabilities) -> type[ModelAdapter]:
    class Hybrid(ModelAdapter):
        hf_class = "transformers:Lfm2ForCausalLM"
        parts = DECODER_PARTS
        shard_layers = ("Lfm2DecoderLayer",)
        lora = LoraTargets(language=("q_proj", "k_proj", "v_proj", "out_proj"))

        def tiny(self) -> TinyModel:
            tokenizer = char_tokenizer(special_tokens=CHATML_SPECIAL_TOKENS, eos_token="<|im_end|>",
                                       pad_token="<|endoftext|>", chat_template=CHATML)
            config = sized_config(
                "transformers:Lfm2Config", tokenizer, hidden_size=64, intermediate_size=128,
                num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=1024, layer_types=layer_types,
                full_attn_idxs=[i for i, kind in enumerate(layer_types) if kind == "full_attention"])
            return TinyModel(config=config, processor=tokenizer)

    Hybrid.family = family
    Hybrid.model_types = ("lfm2",)
    Hybrid.capabilities = capabilities
    Hybrid.__name__ = Hybrid.__qualname__ = family.title().replace("_", "")
    return Hybrid


@pytest.fixture
def no_per_sequence_mixers(monkeypatch):
    """As mmrl packed hybrid models before `mmrl.engine.stateful_layers`: no mixer hooked."""
    monkeypatch.setattr(stateful_layers, "install", lambda model, adapter: [])


@pytest.fixture
def leaky():
    # As the scaffold declared Lfm2 before the boundary case: padding_free claimed.
    register_model(_hybrid("leaky_conv", [CONV, "full_attention"], Capabilities(padding_free=True)))
    yield "leaky_conv"
    unregister("leaky_conv")


@pytest.fixture
def unpacked():
    register_model(_hybrid("unpacked_conv", [CONV, "full_attention"], Capabilities(padding_free=False)))
    yield "unpacked_conv"
    unregister("unpacked_conv")


def test_boundary_case_catches_a_convolution_state_crossing_the_boundary(leaky, no_per_sequence_mixers):
    gap = packed_boundary_gap(build_model(leaky, random_init=True))
    assert not gap.exact
    # Both measures catch it: 1.6e-4 in log-prob, far more in the hidden state.
    assert gap.logprob > 10 * BOUNDARY_TOLERANCE and gap.hidden > 10 * BOUNDARY_HIDDEN_TOLERANCE
    # The same model without its convolution layer packs exactly.
    attention_only = build_model(leaky, random_init=True, config_overrides={
        "layer_types": ["full_attention", "full_attention"], "full_attn_idxs": [0, 1]})
    assert packed_boundary_gap(attention_only).exact


def test_padding_free_probe_fails_on_the_boundary_case(leaky, no_per_sequence_mixers):
    from mmrl.registry import get_adapter

    result = probe("padding_free").run(Subject(adapter=get_adapter(leaky), source=leaky))
    assert result.status == "failed"
    assert "state crosses a packed sequence boundary" in result.reason


def test_the_convolution_run_per_sequence_passes_the_boundary_case(leaky):
    from mmrl.registry import get_adapter

    built = build_model(leaky, random_init=True)
    assert packed_boundary_gap(built).exact
    assert stateful_layers.installed(built.model)
    result = probe("padding_free").run(Subject(adapter=get_adapter(leaky), source=leaky))
    assert result.status == "verified", result.reason


def test_a_zoo_family_passes_the_boundary_case():
    built = build_model("qwen2", random_init=True)
    assert packed_boundary_gap(built).exact
    assert packed_vs_padded(built, sample_conversations(built.adapter)) < 2e-4


def test_pack_true_is_refused_for_a_family_without_padding_free(unpacked):
    from mmrl.registry import get_adapter

    adapter = get_adapter(unpacked)
    gpu = SimpleNamespace(device=torch.device("cuda"), distributed=False, world_size=1)
    with pytest.raises(ValueError, match="model.pack: true, but unpacked_conv does not declare padding_free"):
        packs_model(True, adapter, gpu)
    assert packs_model("auto", adapter, gpu) is False  # auto: unpacked
    assert packs_model(False, adapter, gpu) is False
    recipe = SimpleNamespace(model=ModelConfig(path=unpacked, random_init=True, pack=True))
    with pytest.raises(RecipeError, match="^model.pack: true, but unpacked_conv does not declare padding_free"):
        _check_pack(recipe)
    _check_pack(SimpleNamespace(model=ModelConfig(path=unpacked, random_init=True, pack="auto")))
    _check_pack(SimpleNamespace(model=ModelConfig(path="qwen2", random_init=True, pack=True)))


@pytest.fixture
def attention_tiny():
    # As `mmrl add-model lfm2` scaffolds it: the type's default config is all attention, so
    # the tiny model passes the boundary case and padding_free is declared; a checkpoint
    # of the type with short-convolution layers was never verified packed.
    register_model(_hybrid("attention_tiny", ["full_attention", "full_attention"], Capabilities(padding_free=True)))
    yield "attention_tiny"
    unregister("attention_tiny")


def test_a_checkpoint_with_stateful_layers_its_tiny_model_lacks_is_not_packed(attention_tiny, tmp_path):
    from mmrl.engine import Engine
    from mmrl.boundaries import unverified_layer_kinds
    from mmrl.parallel import init_distributed

    tiny = build_model(attention_tiny, random_init=True)
    assert packed_boundary_gap(tiny).exact and unverified_layer_kinds(tiny.adapter, tiny.model.config) == set()
    hybrid = build_model(attention_tiny, random_init=True, config_overrides={
        "layer_types": [CONV, "full_attention"], "full_attn_idxs": [1]})
    assert CONV in STATEFUL_LAYER_KINDS and unverified_layer_kinds(hybrid.adapter, hybrid.model.config) == {CONV}
    refusal = rf"^model.pack: true, but this attention_tiny model has {CONV} layers"
    with pytest.raises(ValueError, match=refusal):
        Engine(hybrid, init_distributed("cpu"), pack=True)
    assert Engine(tiny, init_distributed("cpu"), pack=True).pack  # verified: packs
    gpu = SimpleNamespace(device=torch.device("cuda"), distributed=False, world_size=1)
    assert packs_model("auto", hybrid.adapter, gpu, tiny.model.config)
    assert not packs_model("auto", hybrid.adapter, gpu, hybrid.model.config)  # auto: padded
    checkpoint = hybrid.save(tmp_path / "hybrid")
    with pytest.raises(RecipeError, match=refusal):
        _check_pack(SimpleNamespace(model=ModelConfig(path=str(checkpoint), pack=True)))
    _check_pack(SimpleNamespace(model=ModelConfig(path=str(checkpoint), pack="auto")))


def test_stateful_layer_kinds_read_legacy_names_as_transformers_does():
    """A config that still lists a state-space layer by its legacy name (set after the
    config was built, or an older writer's) counts it, under transformers' current name;
    attention layers, in old or new names, are no stateful kind."""
    from mmrl.boundaries import stateful_layer_kinds

    legacy = SimpleNamespace(layer_types=["mamba", "attention", "full_attention"])
    assert stateful_layer_kinds(legacy) == {"linear_attention"}
    assert stateful_layer_kinds(SimpleNamespace(layer_types=[CONV, "sliding_attention"])) == {CONV}
    assert stateful_layer_kinds(SimpleNamespace(layer_types=None)) == set()


def test_stateful_layer_kinds_take_an_allowed_kind_by_its_own_name(leaky, monkeypatch):
    """transformers 5.17's legacy table also maps "conv" to "linear_attention", though conv is
    an allowed kind there that its Lfm2 config writes and keeps; 5.19 dropped the entry. A
    kind transformers allows keeps its name under either table, so the refusals name the
    layers as the checkpoint's `layer_types` do; a legacy name is still remapped."""
    from mmrl.boundaries import stateful_layer_kinds
    from mmrl.engine.stateful_layers import stateful_mixers

    assert set(STATEFUL_LAYER_KINDS) <= set(configuration_utils.ALLOWED_ATTN_LAYER_TYPES)
    built = build_model(leaky, random_init=True)
    monkeypatch.setitem(configuration_utils._LEGACY_LAYER_TYPE_REMAP, CONV, "linear_attention")  # 5.17's entry
    assert stateful_layer_kinds(SimpleNamespace(layer_types=[CONV, "full_attention"])) == {CONV}
    assert stateful_layer_kinds(SimpleNamespace(layer_types=["mamba", "attention"])) == {"linear_attention"}
    assert [layer for layer, _ in stateful_mixers(built.model, built.adapter)] == [built.model.model.layers[0]]


def test_ulysses_is_refused_for_a_checkpoint_with_stateful_layers_its_tiny_model_lacks(attention_tiny, tmp_path):
    """The same rule for sequence parallelism: Ulysses would run the checkpoint's conv
    layers on each rank's slice of the sequence, which the family's probe never saw (its
    tiny model is all attention); the recipe check and the engine refuse it in one line."""
    from mmrl.engine.surgery import apply_ulysses
    from mmrl.recipe_checks import _check_sequence_parallel

    hybrid = build_model(attention_tiny, random_init=True, config_overrides={
        "layer_types": [CONV, "full_attention"], "full_attn_idxs": [1]})
    checkpoint = hybrid.save(tmp_path / "hybrid")
    recipe = SimpleNamespace(model=ModelConfig(path=str(checkpoint)), parallel=SimpleNamespace(sequence_parallel=2))
    refusal = rf"^parallel.sequence_parallel: this attention_tiny model has {CONV} layers \(layer_types\)"
    with pytest.raises(RecipeError, match=refusal):
        _check_sequence_parallel(recipe)
    with pytest.raises(ValueError, match=refusal):
        apply_ulysses(hybrid.model, SimpleNamespace(sequence_parallel=2, adapter=hybrid.adapter))


def _engine_log_probs_and_grads(family: str, pack: bool):
    from mmrl.checks import boundary_conversations
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine, join
    from mmrl.engine.packing import pack_sequences
    from mmrl.parallel import init_distributed

    # Larger weights than the default init, so a leak reaches the response tokens' log-probs.
    built = build_model(family, random_init=True, seed=0, config_overrides={"initializer_range": 0.2})
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), pack=pack, pack_tokens=4096)
    rows = boundary_conversations(built.adapter)  # long, then short: one packed row
    prompts = dict(built.processing(rows))
    vocab = built.model.config.get_text_config().vocab_size
    responses = torch.randint(vocab // 2, vocab, (len(rows), 7), generator=torch.Generator().manual_seed(1))
    seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, engine.model,
                built.tokenizer.pad_token_id)
    assert engine.packs(seqs) == pack
    if pack:
        assert len(pack_sequences(seqs.inputs, seqs.response_mask, engine.pack_tokens).rows) == 1
    logp, _ = engine.log_probs(seqs)
    (logp * torch.linspace(-1, 1, 7)).sum().backward()
    return logp.detach(), {n: p.grad for n, p in engine.model.named_parameters() if p.grad is not None}


def test_the_engine_packs_a_hybrid_family_as_it_pads_it(leaky):
    """Engine(pack=True) on the conv family: the short sequence behind the long one gets the
    padded batch's log-probs and gradients (fp32)."""
    padded, padded_grads = _engine_log_probs_and_grads(leaky, pack=False)
    packed, packed_grads = _engine_log_probs_and_grads(leaky, pack=True)
    assert (packed - padded).abs().max().item() < BOUNDARY_TOLERANCE
    assert packed_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_without_per_sequence_mixers_the_engine_packs_the_leak(leaky, no_per_sequence_mixers):
    padded, _ = _engine_log_probs_and_grads(leaky, pack=False)
    packed, _ = _engine_log_probs_and_grads(leaky, pack=True)
    assert (packed - padded).abs().max().item() > 10 * BOUNDARY_TOLERANCE
