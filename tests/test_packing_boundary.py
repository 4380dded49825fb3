"""Packing across sequence boundaries (issue 31): the padding-free probe's boundary case
(a short sample packed right behind a long neighbour, log-probs against itself alone)
fails for a hybrid family whose state leaks across the boundary, and the trainer refuses
to pack a family that does not declare padding_free.

The hybrid family here is transformers' Lfm2 with one short-convolution layer (the
scaffold's tiny Lfm2 config has attention layers only, so it cannot show the leak).
"""

from types import SimpleNamespace

import pytest
import torch

from mmrl import build_model
from mmrl.adapter import DECODER_PARTS, Capabilities, LoraTargets, ModelAdapter, TinyModel
from mmrl.checks import (
    BOUNDARY_HIDDEN_TOLERANCE, BOUNDARY_TOLERANCE, packed_boundary_gap, packed_vs_padded, sample_conversations,
)
from mmrl.config import ModelConfig, RecipeError
from mmrl.recipe_checks import _check_pack
from mmrl.settle import packs_model
from mmrl.probes import Subject, probe
from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS
from mmrl.registry import register_model, unregister
from mmrl.tiny import char_tokenizer, sized_config

pytest.importorskip("transformers.models.lfm2")


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
def leaky():
    # As the scaffold declared Lfm2 before the boundary case: padding_free claimed.
    register_model(_hybrid("leaky_conv", ["conv", "full_attention"], Capabilities(padding_free=True)))
    yield "leaky_conv"
    unregister("leaky_conv")


@pytest.fixture
def unpacked():
    register_model(_hybrid("unpacked_conv", ["conv", "full_attention"], Capabilities(padding_free=False)))
    yield "unpacked_conv"
    unregister("unpacked_conv")


def test_boundary_case_catches_a_convolution_state_crossing_the_boundary(leaky):
    gap = packed_boundary_gap(build_model(leaky, random_init=True))
    assert not gap.exact
    # Both measures catch it: 1.6e-4 in log-prob, far more in the hidden state.
    assert gap.logprob > 10 * BOUNDARY_TOLERANCE and gap.hidden > 10 * BOUNDARY_HIDDEN_TOLERANCE
    # The same model without its convolution layer packs exactly.
    attention_only = build_model(leaky, random_init=True, config_overrides={
        "layer_types": ["full_attention", "full_attention"], "full_attn_idxs": [0, 1]})
    assert packed_boundary_gap(attention_only).exact


def test_padding_free_probe_fails_on_the_boundary_case(leaky):
    from mmrl.registry import get_adapter

    result = probe("padding_free").run(Subject(adapter=get_adapter(leaky), source=leaky))
    assert result.status == "failed"
    assert "state crosses a packed sequence boundary" in result.reason


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
        "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]})
    assert not packed_boundary_gap(hybrid).exact  # what packing it would do
    assert unverified_layer_kinds(hybrid.adapter, hybrid.model.config) == {"conv"}
    with pytest.raises(ValueError, match=r"^model.pack: true, but this attention_tiny model has conv layers"):
        Engine(hybrid, init_distributed("cpu"), pack=True)
    assert Engine(tiny, init_distributed("cpu"), pack=True).pack  # verified: packs
    gpu = SimpleNamespace(device=torch.device("cuda"), distributed=False, world_size=1)
    assert packs_model("auto", hybrid.adapter, gpu, tiny.model.config)
    assert not packs_model("auto", hybrid.adapter, gpu, hybrid.model.config)  # auto: padded
    checkpoint = hybrid.save(tmp_path / "hybrid")
    with pytest.raises(RecipeError, match=r"^model.pack: true, but this attention_tiny model has conv layers"):
        _check_pack(SimpleNamespace(model=ModelConfig(path=str(checkpoint), pack=True)))
    _check_pack(SimpleNamespace(model=ModelConfig(path=str(checkpoint), pack="auto")))


def test_stateful_layer_kinds_read_legacy_names_as_transformers_does():
    """A config that still lists a state-space layer by its legacy name (set after the
    config was built, or an older writer's) counts it, under transformers' current name;
    attention layers, in old or new names, are no stateful kind."""
    from mmrl.boundaries import stateful_layer_kinds

    legacy = SimpleNamespace(layer_types=["mamba", "attention", "full_attention"])
    assert stateful_layer_kinds(legacy) == {"linear_attention"}
    assert stateful_layer_kinds(SimpleNamespace(layer_types=["conv", "sliding_attention"])) == {"conv"}
    assert stateful_layer_kinds(SimpleNamespace(layer_types=None)) == set()
def test_ulysses_is_refused_for_a_checkpoint_with_stateful_layers_its_tiny_model_lacks(attention_tiny, tmp_path):
    """The same rule for sequence parallelism: Ulysses would run the checkpoint's conv
    layers on each rank's slice of the sequence, which the family's probe never saw (its
    tiny model is all attention); the recipe check and the engine refuse it in one line."""
    from mmrl.engine.surgery import apply_ulysses
    from mmrl.recipe_checks import _check_sequence_parallel

    hybrid = build_model(attention_tiny, random_init=True, config_overrides={
        "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]})
    checkpoint = hybrid.save(tmp_path / "hybrid")
    recipe = SimpleNamespace(model=ModelConfig(path=str(checkpoint)), parallel=SimpleNamespace(sequence_parallel=2))
    refusal = r"^parallel.sequence_parallel: this attention_tiny model has conv layers \(layer_types\)"
    with pytest.raises(RecipeError, match=refusal):
        _check_sequence_parallel(recipe)
    with pytest.raises(ValueError, match=refusal):
        apply_ulysses(hybrid.model, SimpleNamespace(sequence_parallel=2, adapter=hybrid.adapter))
