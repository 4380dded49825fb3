"""InternVL (transformers-native `internvl` format) input processing and tiny processor.

An image is cut into up to `max_patches` square tiles on the grid closest to its aspect
ratio, plus a thumbnail tile when it is split; each tile becomes `image_seq_length`
`<IMG_CONTEXT>` tokens between `<img>` and `</img>`. Video frames are one tile each,
and the HF processor merges them into `pixel_values`, so the model only sees tiles.
"""

from __future__ import annotations

import math
from typing import Any

from mmrl.processing import Processing
from mmrl.processors.templates import CHATML_SPECIAL_TOKENS, chatml_with_media
from mmrl.tiny import char_tokenizer, tiny_text_config

NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# The template of the OpenGVLab InternVL*-hf checkpoints: ChatML with `<IMG_CONTEXT>`
# and `<video>` placeholders on their own line.
CHAT_TEMPLATE = chatml_with_media("<IMG_CONTEXT>\n", "<video>\n")

# Tiny shapes: 56-pixel tiles of 14-pixel patches, pixel-unshuffled by 0.5 into 4 tokens
# a tile; at most 4 tiles (+ thumbnail) an image.
TINY_TILE = 56
TINY_PATCH = 14
TINY_DOWNSAMPLE = 0.5
TINY_MAX_PATCHES = 4


def image_seq_length(tile: int, patch: int, downsample_ratio: float) -> int:
    """Tokens per tile, as both the processor and the model's projector count them."""
    return int((tile // patch) ** 2 * downsample_ratio**2)


def tiny_model():
    """(config, processor) of a random-init InternVL with an InternViT tower and Qwen2."""
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor

    tokenizer = char_tokenizer(
        special_tokens=CHATML_SPECIAL_TOKENS,
        named_tokens=NAMED_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tile = {"height": TINY_TILE, "width": TINY_TILE}
    seq_length = image_seq_length(TINY_TILE, TINY_PATCH, TINY_DOWNSAMPLE)
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(
            size=tile, crop_to_patches=True, min_patches=1, max_patches=TINY_MAX_PATCHES
        ),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size=tile),
        image_seq_length=seq_length,
        chat_template=CHAT_TEMPLATE,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=TINY_TILE, patch_size=TINY_PATCH,
    )
    config = InternVLConfig(
        text_config=tiny_text_config("transformers:Qwen2Config", tokenizer).to_dict(),
        vision_config=vision,
        image_token_id=tokenizer.context_image_token_id,
        image_seq_length=seq_length,
        downsample_ratio=TINY_DOWNSAMPLE,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    return config, processor


class InternVLProcessing(Processing):
    """Pixel budget as a tile count: `max_pixels` caps the tiles an image is cut into
    (`max_patches`, at least 1) and `min_pixels` sets the fewest (`min_patches`). A split
    image also gets a thumbnail tile, so it costs up to `max_patches + 1` tiles."""

    def image_kwargs(self) -> dict[str, Any]:
        if self.min_pixels is None and self.max_pixels is None:
            return {}
        size = self.processor.image_processor.size
        tile_area = size["height"] * size["width"]
        options: dict[str, Any] = {}
        if self.max_pixels is not None:
            options["max_patches"] = max(1, self.max_pixels // tile_area)
        if self.min_pixels is not None:
            most = options.get("max_patches", self.processor.image_processor.max_patches)
            options["min_patches"] = min(most, max(1, math.ceil(self.min_pixels / tile_area)))
        return options
