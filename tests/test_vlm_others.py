"""Idefics3, SmolVLM, LLaVA-OneVision and InternVL: what the zoo test does not check.

The image placeholder tokens the processor writes must equal the features the model's
vision path produces for that image (a config/processor mismatch of tile size, tokens
per tile or grid pinpoints breaks this first), and the pixel budget options must move
the token count. Run: pytest tests/test_vlm_others.py
"""

import pytest
import torch

from mmrl import build_model
from mmrl.checks import (
    logits_of,
    model_inputs,
    padded_vs_single,
    sample_conversations,
    sample_images,
    video_conversations,
)

TILE = 56 * 56  # every tiny model here uses 56-pixel tiles
# Per family: a budget that must shrink the larger test image's tokens, and (where the
# family has a lower bound) one that must grow the smaller image's tokens.
BUDGETS = {
    "idefics3": {"max_pixels": TILE},
    "smolvlm": {"max_pixels": TILE},
    "llava_onevision": {"max_pixels": TILE, "min_pixels": 4 * TILE},
    "internvl": {"max_pixels": TILE, "min_pixels": 4 * TILE},
}
FAMILIES = sorted(BUDGETS)


def one_image_prompt(image) -> list[list[dict]]:
    return [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi?"}]}]]


def placeholder_count(built, batch) -> int:
    return int((batch["input_ids"] == built.model.config.image_token_id).sum())


@torch.no_grad()
def feature_count(built, batch) -> int:
    """Image feature vectors the model's vision path produces for `batch`."""
    config = built.model.config
    inputs = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    for key in ("vision_feature_layer", "vision_feature_select_strategy"):
        if hasattr(config, key):
            inputs[key] = getattr(config, key)
    features = built.model.eval().get_image_features(**inputs).pooler_output
    features = features if isinstance(features, (list, tuple)) else [features]
    return sum(f.numel() for f in features) // config.get_text_config().hidden_size


@pytest.mark.parametrize("family", FAMILIES)
def test_image_tokens_match_vision_features(family):
    built = build_model(family, random_init=True)
    for image in sample_images():
        batch = dict(built.processing(one_image_prompt(image)))
        tokens = placeholder_count(built, batch)
        assert tokens > 0
        assert tokens == feature_count(built, batch), f"{image.size}: placeholders != vision features"


@pytest.mark.parametrize("family", FAMILIES)
def test_pixel_budget_changes_image_tokens(family):
    small, large = sample_images()
    default = build_model(family, random_init=True)
    for option, image, direction in (("max_pixels", large, -1), ("min_pixels", small, +1)):
        if option not in BUDGETS[family]:
            continue
        budgeted = build_model(family, random_init=True, processing_options={option: BUDGETS[family][option]})
        before = placeholder_count(default, dict(default.processing(one_image_prompt(image))))
        batch = dict(budgeted.processing(one_image_prompt(image)))
        after = placeholder_count(budgeted, batch)
        assert (after - before) * direction > 0, f"{option} left {before} image tokens at {after}"
        assert after == feature_count(budgeted, batch)
        assert torch.isfinite(logits_of(budgeted.model.eval(), batch)).all()


@pytest.mark.parametrize("pil_default", [False, True], ids=["torchvision-default", "pil-default"])
def test_tiny_image_processor_survives_save_reload(tmp_path, monkeypatch, pil_default):
    """With torchvision < 0.27 (the GPU image), transformers loads Idefics3/SmolVLM image
    processors with the PIL backend; a tiny processor must use the backend it reloads
    with, or a saved tiny checkpoint sees different pixels (the GPU cells once failed)."""
    from transformers import AutoProcessor
    from transformers.models.auto import image_processing_auto

    names = ["Idefics3ImageProcessor", "SmolVLMImageProcessor"] if pil_default else []
    monkeypatch.setattr(image_processing_auto, "DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS", names)
    built = build_model("smolvlm", random_init=True)
    built.processor.save_pretrained(tmp_path)
    reloaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(reloaded.image_processor) is type(built.processor.image_processor)
    image = sample_images()[1]
    before = built.processor.image_processor(image, return_tensors="pt")["pixel_values"]
    after = reloaded.image_processor(image, return_tensors="pt")["pixel_values"]
    assert before.shape == after.shape and torch.equal(before, after)


def test_smolvlm_connector_output_matches_the_embeddings_under_autocast():
    """Under bf16 autocast over fp32 weights the connector computes in bf16; SmolVLM's
    inputs_merger index-puts its output into an fp32 tensor, which CUDA refuses (the
    GPU cells once failed). The adapter's hook hands the merger the embeddings' dtype."""
    built = build_model("smolvlm", random_init=True)
    seen = []
    built.model.model.connector.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    batch = built.inputs(sample_conversations(built.adapter), add_generation_prompt=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        built.model(**model_inputs(batch))
    assert seen == [torch.float32]


def test_smolvlm_batch_mixing_image_and_video_prompts_equals_each_alone():
    """SmolVLM's processor writes tiles and frames to one `pixel_values`, so a mixed batch
    is processed a prompt at a time and joined; before, the frames replaced the tiles and
    the forward failed."""
    built = build_model("smolvlm", random_init=True)
    images = sample_conversations(built.adapter)
    mixed = [images[0], *video_conversations(), images[1]]
    batch = dict(built.processing(mixed))
    assert batch["pixel_values"].shape[0] == 3
    assert padded_vs_single(built, mixed) < 2e-4


def test_smolvlm_prompt_with_an_image_and_a_video_gets_both_in_order():
    """SmolVLM's processor expands the text of a prompt holding an image and a video
    right but keeps only the frames in `pixel_values`; the family's processing gives the
    image's tiles then the video's frames (each processed alone), the order of their
    `<image>` placeholders, and such a prompt batches with an image-only one."""
    built = build_model("smolvlm", random_init=True)
    images = sample_conversations(built.adapter)
    image_part = images[0][0]["content"][:1]
    video_content = video_conversations()[0][0]["content"]
    both = [{"role": "user", "content": [*image_part, *video_content]}]
    batch = dict(built.processing([both]))
    tiles = built.processing([[{"role": "user", "content": image_part}]])["pixel_values"][0]
    frames = built.processing([[{"role": "user", "content": video_content[:1]}]])["pixel_values"][0]
    assert torch.equal(batch["pixel_values"][0], torch.cat([tiles, frames]))
    placeholders = int((batch["input_ids"] == built.model.config.image_token_id).sum())
    tokens_per_tile = placeholders // batch["pixel_values"].shape[1]
    assert placeholders == tokens_per_tile * (len(tiles) + len(frames))
    mixed = [both, images[1]]
    assert padded_vs_single(built, mixed) < 2e-4


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_exported_chat_template_renders_what_training_did(family, tmp_path):
    """Training writes an assistant turn right after `Assistant:` (the space is the
    model's to sample); the checkpoints' template adds one. The exported processor,
    reloaded by plain transformers, renders a conversation (assistant turns with and
    without a leading space) to the token ids training made, and the generation prompt
    plus the sampled tokens is the start of the rendered conversation."""
    from transformers import AutoProcessor

    from mmrl.export import save_decoding

    built = build_model(family, random_init=True)
    save_decoding(tmp_path, built.model, built.processing)
    exported = AutoProcessor.from_pretrained(tmp_path)
    image = sample_images()[0]
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": " No."}]},
    ]
    trained = built.processing([conversation], add_generation_prompt=False)["input_ids"][0]
    text = exported.apply_chat_template(conversation, tokenize=False)
    served = exported(text=text, images=[[image]], return_tensors="pt")["input_ids"][0]
    assert served.tolist() == trained.tolist()
    prompt = built.processing([conversation[:-1]])["input_ids"][0]
    sampled = built.tokenizer(" No.<end_of_utterance>", add_special_tokens=False)["input_ids"]
    assert served[:len(prompt) + len(sampled)].tolist() == prompt.tolist() + sampled


# The Idefics3 checkpoints' own template (HuggingFaceM4/Idefics3-8B-Llama3), which the
# tiny processors' imitates: contents as parts only, the ': ' separator after every role.
CHECKPOINT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_the_checkpoints_template_is_rewritten_and_one_that_cannot_be_warns():
    built = build_model("idefics3", random_init=True)
    processing = built.processing
    processing.processor.chat_template = processing.tokenizer.chat_template = CHECKPOINT_TEMPLATE
    rewritten = processing.trained_chat_template()
    assert rewritten is not None and rewritten != CHECKPOINT_TEMPLATE
    assert processing.processor_with_budget().chat_template == rewritten
    assert processing.processor.chat_template == CHECKPOINT_TEMPLATE  # the training processor is left alone
    two_separators = CHECKPOINT_TEMPLATE.replace("<end_of_utterance>", "{{': '}}<end_of_utterance>")
    processing.processor.chat_template = processing.tokenizer.chat_template = two_separators
    with pytest.warns(UserWarning, match="could not rewrite it"):
        assert processing.processor_with_budget().chat_template == two_separators
