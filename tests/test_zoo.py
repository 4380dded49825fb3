"""Every registered family, end to end on its tiny random-init model.

One table-driven test module for the whole zoo (the vLLM model test's pattern): a new
family gets these tests by registering. Run: pytest tests/test_zoo.py -k qwen2_vl
"""

import pytest
import torch

from conftest import FAMILIES, VLM_FAMILIES
from mmrl import build_model, load_model
from mmrl.checks import (
    checkpointing_difference,
    generate,
    logits_of,
    lora_merge_difference,
    loss_and_backward,
    packed_boundary_gap,
    packed_vs_padded,
    padded_vs_single,
    sample_conversations,
    video_conversations,
)
from mmrl.parts import check_parts, freeze, parameters_by_part
from mmrl.rope import RopeSpec

TOLERANCE = 2e-4  # fp32 logits, max absolute difference


@pytest.mark.parametrize("family", FAMILIES)
def test_save_reload_forward_backward_generate(family, tmp_ckpt):
    built = build_model(family, random_init=True)
    conversations = sample_conversations(built.adapter)
    before = logits_of(built.model.eval(), built.inputs(conversations))
    built.save(tmp_ckpt)
    assert (tmp_ckpt / "model.safetensors").is_file()

    reloaded = load_model(tmp_ckpt)
    assert reloaded.adapter is built.adapter
    after = logits_of(reloaded.model.eval(), reloaded.inputs(conversations))
    assert torch.allclose(before, after, atol=1e-5), "reloaded model disagrees with the saved one"

    loss = loss_and_backward(reloaded, conversations)
    assert torch.isfinite(loss)
    grads = {part: [p.grad for _, p in params if p.requires_grad]
             for part, params in parameters_by_part(reloaded.model).items()}
    assert any(g is not None and g.abs().sum() > 0 for g in grads["language"])
    if reloaded.adapter.is_multimodal:
        assert any(g is not None and g.abs().sum() > 0 for g in grads["vision"]), "no gradient reached vision"

    new_tokens = generate(reloaded, conversations, max_new_tokens=8)
    assert new_tokens.shape == (len(conversations), 8)
    assert not torch.isin(new_tokens, torch.tensor(reloaded.processing.blocked_token_ids)).any()
    texts = reloaded.processing.decode(new_tokens)
    assert len(texts) == len(conversations) and all(isinstance(t, str) for t in texts)


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_cover_the_model(family):
    built = build_model(family, random_init=True)
    assert check_parts(built.model) == []
    groups = parameters_by_part(built.model)
    assert None not in groups, f"parameters in no part: {[n for n, _ in groups[None]][:5]}"
    layer_classes = {type(m).__name__ for m in built.model.modules()}
    missing = set(built.adapter.shard_layers) - layer_classes
    assert not missing, f"shard_layers names classes the model lacks: {missing}"


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_each_prompt_alone(family):
    built = build_model(family, random_init=True)
    assert padded_vs_single(built, sample_conversations(built.adapter)) < TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_matches_padded(family):
    built = build_model(family, random_init=True)
    if not built.adapter.capabilities.padding_free:
        pytest.skip(f"{family} does not declare padding_free")
    assert packed_vs_padded(built, sample_conversations(built.adapter)) < TOLERANCE
    # A short sample packed right behind a long neighbour equals itself alone: no state
    # (convolution, linear attention) crosses the boundary.
    assert packed_boundary_gap(built).exact


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_spec_is_consistent(family, tmp_ckpt):
    built = build_model(family, random_init=True)
    spec = built.adapter.rope(built.model.config)
    assert spec.problems() == []
    built.save(tmp_ckpt)
    import json

    raw = json.loads((tmp_ckpt / "config.json").read_text())
    assert RopeSpec.from_config(raw) == spec, "raw config.json and loaded config disagree"


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_matches_plain(family):
    built = build_model(family, random_init=True)
    if not built.adapter.capabilities.gradient_checkpointing:
        pytest.skip(f"{family} does not declare gradient_checkpointing")
    gap = checkpointing_difference(built, sample_conversations(built.adapter))
    assert gap["enabled"] and gap["same_parameters"] and gap["tensors"] > 0
    assert gap["loss_diff"] <= 1e-6
    assert gap["max_grad_diff"] <= 1e-5


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_freeze_vision(family):
    built = build_model(family, random_init=True)
    frozen = freeze(built.model, parts=("vision",))
    assert frozen > 0
    loss_and_backward(built, sample_conversations(built.adapter))
    groups = parameters_by_part(built.model)
    assert all(p.grad is None and not p.requires_grad for _, p in groups["vision"])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for _, p in groups["language"])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for _, p in groups["projector"])


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_merge_matches_unmerged(family):
    built = build_model(family, random_init=True)
    scopes = ["language"] + (["vision", "all"] if built.adapter.capabilities.lora_vision else [])
    for scope in scopes:
        fresh = build_model(family, random_init=True)
        merge_gap, effect = lora_merge_difference(fresh, sample_conversations(fresh.adapter), scope)
        assert effect > 1e-3, f"LoRA ({scope}) did not change the output"
        assert merge_gap < TOLERANCE, f"LoRA ({scope}) merged and unmerged differ by {merge_gap}"


@pytest.mark.parametrize("family", [f for f in VLM_FAMILIES])
def test_multi_image_and_video(family):
    built = build_model(family, random_init=True)
    caps = built.adapter.capabilities
    if caps.multi_image:
        conversations = sample_conversations(built.adapter, images_per_prompt=2)
        assert torch.isfinite(loss_and_backward(built, conversations))
    if caps.video:
        new_tokens = generate(built, video_conversations(), max_new_tokens=4)
        assert new_tokens.shape == (1, 4)
    if not (caps.multi_image or caps.video):
        pytest.skip(f"{family} declares neither multi-image nor video")


def test_random_weights_are_drawn_where_asked():
    """`device=` draws random weights there; without it the caller's default device
    (`with torch.device(...)`) holds, as it did before `device` existed."""
    import torch

    from mmrl import build_model

    assert {p.device.type for p in build_model("qwen2", random_init=True, device="meta").model.parameters()} == {"meta"}
    with torch.device("meta"):
        built = build_model("qwen2", random_init=True)
    assert {p.device.type for p in built.model.parameters()} == {"meta"}
    assert {p.device.type for p in build_model("qwen2", random_init=True).model.parameters()} == {"cpu"}

