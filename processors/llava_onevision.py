"""LLaVA-OneVision input processing, chat template and tiny offline processor.

Each image is cut into "anyres" tiles on the best of `image_grid_pinpoints` plus a base
tile (also in prompts of several images: `LlavaOnevisionProcessing`); videos are frames
pooled 2x2. The model recomputes the tiling from `image_sizes` and its own
config's pinpoints, so processor and config must carry the same pinpoints.
"""

from __future__ import annotations

import math
from typing import Any

from mmrl.processing import Processing
from mmrl.processors.templates import CHATML_SPECIAL_TOKENS, chatml_with_media
from mmrl.tiny import char_tokenizer, tiny_text_config

IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"

# The template of the llava-hf OneVision (Qwen2) checkpoints: ChatML, each message's
# images first, then videos, then its text.
CHAT_TEMPLATE = chatml_with_media("<image>\n", "<video>\n", media_first=True)

# Tiny shapes: 56-pixel tiles of 14-pixel patches (16 tokens a tile) on a grid of at
# most 2 x 2 tiles, so the two test images take 36 and 72 image tokens.
TINY_TILE = 56
TINY_PATCH = 14
TINY_PINPOINTS = [[h * TINY_TILE, w * TINY_TILE] for h in (1, 2) for w in (1, 2)]


def fit_pixel_budget(image, min_pixels: int | None, max_pixels: int | None):
    """`image` rescaled (aspect kept) so its pixel count lies in [min_pixels, max_pixels]."""
    from PIL import Image

    width, height = image.size
    area = width * height
    scale = 1.0
    if max_pixels is not None and area > max_pixels:
        scale = math.sqrt(max_pixels / area)
    elif min_pixels is not None and area < min_pixels:
        scale = math.sqrt(min_pixels / area)
    if scale == 1.0:
        return image
    size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def tiny_model():
    """(config, processor) of a random-init LLaVA-OneVision with a SigLIP tower and Qwen2."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = char_tokenizer(
        special_tokens=CHATML_SPECIAL_TOKENS,
        named_tokens={"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tile = {"height": TINY_TILE, "width": TINY_TILE}
    tokens_per_tile = (TINY_TILE // TINY_PATCH) ** 2
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=tile, image_grid_pinpoints=TINY_PINPOINTS),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size=tile),
        num_image_tokens=tokens_per_tile,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        chat_template=CHAT_TEMPLATE,
    )
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, image_size=TINY_TILE, patch_size=TINY_PATCH, vision_use_head=False,
    )
    config = LlavaOnevisionConfig(
        text_config=tiny_text_config("transformers:Qwen2Config", tokenizer).to_dict(),
        vision_config=vision,
        image_token_index=tokenizer.image_token_id,
        video_token_index=tokenizer.video_token_id,
        image_grid_pinpoints=TINY_PINPOINTS,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=False,
    )
    return config, processor


class LlavaOnevisionProcessing(Processing):
    """Pixel budget by rescaling each image into [min_pixels, max_pixels] before the
    processor tiles it: the anyres grid (and so the token count) follows the image
    size, and the model re-derives that grid from `image_sizes` and the pinpoints of
    its config, which a per-call pinpoint list would contradict.

    Every image is laid out in anyres tiles, however many the prompt holds. transformers
    gives a prompt of several images one base tile each (`batch_num_images`), so an
    image arriving mid-conversation re-laid out the images before it: the opening turn
    became other tokens and no multi-turn sample could keep the context it was sampled
    in (the prefix rule, `mmrl.rollout.agent`). Handed over as one image per entry, each
    image's tokens depend on that image alone, as vLLM counts them too; the processor
    then records one image per entry in `batch_num_images`, which tells the model to
    tile each one the same way."""

    def arrange_images(self, images: list[list[Any]]) -> list[Any]:
        if self.min_pixels is not None or self.max_pixels is not None:
            images = [[fit_pixel_budget(i, self.min_pixels, self.max_pixels) for i in sample] for sample in images]
        return [image for sample in images for image in sample]
