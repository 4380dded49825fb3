"""Core processing pieces: media loading, positions and packing, text prompts."""


import pytest
import torch
from PIL import Image

from mmrl import build_model
from mmrl.checks import sample_images
from mmrl.positions import cu_seqlens_from_mask, pack, sequential_positions, unpack
from mmrl.processing import load_image


def test_load_image_from_every_source(tmp_path):
    image = sample_images()[1]
    path = tmp_path / "shape.png"
    image.save(path)
    raw = path.read_bytes()
    for source in (image, path, str(path), raw, {"bytes": raw, "path": None}, {"path": str(path)}):
        loaded = load_image(source)
        assert loaded.mode == "RGB" and loaded.size == image.size
    assert load_image(Image.new("L", (8, 8))).mode == "RGB"


def test_load_image_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(TypeError, match="cannot read an image from int"):
        load_image(3)


def test_positions_and_packing_round_trip():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    positions = sequential_positions(mask)
    assert positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert cu_seqlens_from_mask(mask).tolist() == [0, 3, 8, 9]
    ids = torch.arange(15).view(3, 5)
    packed = pack({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    assert packed["input_ids"].tolist() == [[2, 3, 4, 5, 6, 7, 8, 9, 14]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0]]
    assert "attention_mask" not in packed
    assert torch.equal(unpack(packed["input_ids"], mask, fill=-1), ids.masked_fill(mask == 0, -1))
    # 3-D (mrope-style) positions keep their leading axis and pack along the last one.
    positions3 = torch.stack([positions, positions * 10, positions * 100])
    packed3 = pack({"input_ids": ids, "attention_mask": mask, "position_ids": positions3})
    assert packed3["position_ids"].shape == (3, 1, 9)
    assert packed3["position_ids"][1, 0].tolist() == [0, 10, 20, 0, 10, 20, 30, 40, 0]


def test_text_prompts_are_left_padded_and_decodable():
    built = build_model("qwen2", random_init=True)
    batch = built.processing([[{"role": "user", "content": "hi"}],
                              [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]])
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][:, -1].all()
    text = built.processing.render([{"role": "user", "content": "hi"}])
    assert text.endswith("assistant\n") and "hi" in text
    ids = built.tokenizer("12 + 3", add_special_tokens=False)["input_ids"]
    eos = built.tokenizer.eos_token_id
    assert built.processing.decode([ids + [eos]]) == ["12 + 3"]
    assert eos in built.processing.stop_token_ids
    assert eos not in built.processing.blocked_token_ids
    assert built.tokenizer.convert_tokens_to_ids("<|im_start|>") in built.processing.blocked_token_ids


def test_empty_batch_is_an_error():
    built = build_model("qwen2", random_init=True)
    with pytest.raises(ValueError, match="no conversations"):
        built.processing([])


def test_build_model_errors():
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        build_model("qwen2")
    with pytest.raises(ValueError, match="dtype must be"):
        build_model("qwen2", random_init=True, dtype="int3")


def test_config_overrides_resize_layer_types_and_check_rope():
    built = build_model("qwen2_5_vl", random_init=True, config_overrides={"text_config": {"num_hidden_layers": 3}})
    assert built.model.config.text_config.layer_types == ["full_attention"] * 3
    assert len(built.model.model.language_model.layers) == 3
    with pytest.raises(ValueError, match="layers mix types"):
        build_model("gemma3_text", random_init=True, config_overrides={"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="mrope_section"):
        build_model("qwen2_vl", random_init=True, config_overrides={"text_config": {"head_dim": 64}})
    with pytest.raises(ValueError, match="config.text_config.nonsense"):
        build_model("qwen2_vl", random_init=True, config_overrides={"text_config": {"nonsense": 1}})


def test_a_second_text_encoders_inputs_are_padded_on_the_right():
    # A processor that pads everything on the decoder's (left) side, and emits the
    # inputs of a second text encoder (a Q-Former's) beside the decoder's.
    from mmrl.processing import Processing

    class LeftPaddingProcessor:
        def __init__(self):
            self.tokenizer = object()

        def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True, **kwargs):
            return conversation[0]["content"][-1]["text"]

        def __call__(self, text, padding_side, **kwargs):
            assert padding_side == "left"
            rows = [[7] * len(t) for t in text]
            width = max(map(len, rows))
            ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
            mask = (ids != 0).long()
            return {"input_ids": ids, "attention_mask": mask, "qformer_input_ids": ids.clone(),
                    "qformer_attention_mask": mask.clone(), "pixel_values": torch.zeros(len(text), 3, 2, 2)}

    image = Image.new("RGB", (8, 8))
    conversations = [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": t}]}]
                     for t in ("ab", "abcd")]
    batch = Processing(LeftPaddingProcessor())(conversations)
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]  # the decoder's: left
    assert batch["qformer_attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["qformer_input_ids"].tolist() == [[7, 7, 0, 0], [7, 7, 7, 7]]


def test_a_clip_s_metadata_is_asked_back_for_the_processor_and_kept_out_of_the_batch():
    """Some processors (Cosmos3-Edge's in transformers 5.19) read a clip's metadata back
    from their video processor's output, which holds it only when asked
    (`return_metadata`), and fail without it; others pass it on into their batch. The
    processing asks for it where the video processor takes the argument, and drops it
    from the batch: it is not a model input."""
    from typing import TypedDict

    from mmrl.processing import Processing

    class VideoArguments(TypedDict, total=False):
        return_metadata: bool

    class VideoProcessor:
        valid_kwargs = VideoArguments

    class ReadsMetadataBack:
        video_processor = VideoProcessor()

        def __init__(self):
            self.tokenizer = object()

        def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True, **kwargs):
            return "v"

        def __call__(self, text, padding_side, videos, videos_kwargs, **kwargs):
            if not videos_kwargs.get("return_metadata"):
                raise KeyError("video_metadata")
            assert videos_kwargs["do_sample_frames"] is False and len(videos_kwargs["video_metadata"]) == 1
            ids = torch.ones(1, 3, dtype=torch.long)
            return {"input_ids": ids, "attention_mask": ids.clone(), "pixel_values_videos": torch.zeros(4, 3),
                    "video_metadata": videos_kwargs["video_metadata"]}

    frames = [Image.new("RGB", (8, 8))] * 4
    batch = Processing(ReadsMetadataBack())([[{"role": "user", "content": [{"type": "video", "video": frames}]}]])
    assert "video_metadata" not in batch and tuple(batch["pixel_values_videos"].shape) == (4, 3)


def test_per_token_entries_laid_out_from_the_row_start_follow_left_padding():
    from mmrl.processing import _align_to_tokens

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    batch = {
        "input_ids": torch.tensor([[9, 9, 1, 2, 3], [1, 2, 3, 4, 5]]),
        "attention_mask": mask,
        # Laid out as if unpadded: the short row's values sit in its padding slots.
        "image_embeds_position_mask": torch.tensor([[0, 1, 1, 0, 0], [0, 1, 1, 1, 0]]),
        # Padded correctly already (zeros in the padding): left as it is.
        "token_type_ids": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]),
    }
    _align_to_tokens(batch)
    assert batch["image_embeds_position_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]
