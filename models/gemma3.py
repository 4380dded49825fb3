"""Gemma 3 vision-language (Gemma3ForConditionalGeneration): SigLIP tower, an average
pool plus projection into the Gemma 3 decoder, images attended bidirectionally."""

import torch

from mmrl.adapter import (
    ATTN_AND_MLP, VISION_TOWER_PARTS, Capabilities, LoraTargets, Rollout, TinyModel, VisionLanguageAdapter,
)
from mmrl.registry import register_model
from mmrl.models.gemma3_text import tiny_gemma3_text_config
from mmrl.processors.gemma3 import tiny_processor, tiny_tokenizer


@register_model
class Gemma3(VisionLanguageAdapter):
    family = "gemma3"
    model_types = ("gemma3",)
    hf_class = "transformers:Gemma3ForConditionalGeneration"
    parts = VISION_TOWER_PARTS
    shard_layers = ("Gemma3DecoderLayer", "SiglipEncoderLayer")
    lora = LoraTargets(language=ATTN_AND_MLP, vision=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"))
    # Images are resized to one square size, so there is no pixel budget; no video.
    # Not `vllm`: vLLM attends causally over image tokens where transformers attends
    # bidirectionally, so their log-probs differ (5e-3 on the tiny model; with the
    # image tokens made causal in transformers they agree to 5e-7).
    capabilities = Capabilities(single_image=True, multi_image=True, lora_vision=True, sequence_parallel=True,
                                multi_turn=True)
    processing = "mmrl.processors.gemma3:Gemma3Processing"
    # vLLM's own hf_to_vllm_mapper for this architecture (gemma3_mm.py); vLLM's SigLIP
    # tower keeps the `vision_model.` level that transformers' tower drops.
    rollout = Rollout(
        vllm_architecture="Gemma3ForConditionalGeneration",
        weight_prefixes=(
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower.vision_model."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("lm_head.", "language_model.lm_head."),
        ),
    )

    def tiny(self) -> TinyModel:
        from transformers import Gemma3Config, SiglipVisionConfig

        tokenizer = tiny_tokenizer()
        # 56 px / 14 px patches = 4x4 patches, pooled 2x2 into 4 soft tokens per image.
        image_size, tokens_per_image = 56, 4
        vision = SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=image_size, patch_size=14, vision_use_head=False,
        )
        config = Gemma3Config(
            text_config=tiny_gemma3_text_config(tokenizer), vision_config=vision,
            mm_tokens_per_image=tokens_per_image,
            boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
            image_token_index=tokenizer.image_token_id,
        )
        return TinyModel(config=config, processor=tiny_processor(tokenizer, image_size, tokens_per_image))

    def prepare_model(self, model):
        # HF initializes the projection to zero (real weights overwrite it), which would
        # cut every gradient to the vision tower of a random-init model.
        projector = model.model.multi_modal_projector
        with torch.no_grad():
            projector.mm_input_projection_weight.normal_(std=model.config.initializer_range)
        return model
