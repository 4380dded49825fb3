"""Qwen2-VL, and the base that the Qwen2.5-VL and Qwen3-VL adapters extend.

The three families share the processing (`mmrl.processors.qwen_vl`), the mrope
position ids and the way a tiny model is assembled; a subclass declares only what
differs: class names, vision MLP names, the tiny vision tower and the rope layout.
"""

from typing import Any, ClassVar

from mmrl.adapter import Capabilities, LoraTargets, Parts, Rollout, TinyModel, VisionLanguageAdapter
from mmrl.processors.qwen_vl import QWEN2_VL_TEMPLATE, mrope_position_ids, tiny_processor
from mmrl.registry import register_model
from mmrl.tiny import TINY_TEXT_SHAPES, token_ids

VISION_ATTENTION = ("qkv", "proj")


@register_model
class Qwen2VL(VisionLanguageAdapter):
    family = "qwen2_vl"
    model_types = ("qwen2_vl",)
    hf_class = "transformers:Qwen2VLForConditionalGeneration"
    modalities = ("text", "image", "video")
    parts = Parts(
        language="model.language_model", embed="model.language_model.embed_tokens", lm_head="lm_head",
        vision="model.visual", projector="model.visual.merger",
    )
    shard_layers = ("Qwen2VLDecoderLayer", "Qwen2VLVisionBlock")
    lora = LoraTargets(vision=VISION_ATTENTION + ("fc1", "fc2"))
    capabilities = Capabilities(
        single_image=True, multi_image=True, video=True, lora_vision=True, vllm=True, sequence_parallel=True,
        multi_turn=True,
    )
    # vLLM's hf_to_vllm_mapper maps transformers' own names, so no prefixes to rewrite.
    rollout = Rollout(vllm_architecture="Qwen2VLForConditionalGeneration")
    processing = "mmrl.processors.qwen_vl:QwenVLProcessing"

    # What the model code assumes when a config names no mrope layout.
    default_mrope_section: ClassVar[tuple[int, ...]] = (16, 24, 24)
    mrope_interleaved: ClassVar[bool] = False

    # The tiny model: processor classes, patch size, template, vision tower and mrope
    # sections (halves of the 32-wide tiny heads, in the real model's proportions).
    tiny_processor_classes: ClassVar[tuple[str, str]] = (
        "transformers:Qwen2VLProcessor", "transformers:Qwen2VLVideoProcessor",
    )
    tiny_patch_size: ClassVar[int] = 14
    tiny_chat_template: ClassVar[str] = QWEN2_VL_TEMPLATE
    tiny_vision: ClassVar[dict[str, Any]] = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2)
    tiny_mrope_section: ClassVar[tuple[int, ...]] = (4, 6, 6)
    # The vision config field holding the merger's output width (the text hidden size).
    vision_output_field: ClassVar[str] = "hidden_size"

    def position_ids(self, model, batch):
        return mrope_position_ids(batch, model.config)

    def rope(self, config):
        spec = super().rope(config)
        if spec.mrope_section is None:
            spec = spec.with_(mrope_section=self.default_mrope_section)
        # The model code fixes the layout whatever the config says.
        return spec.with_(mrope_interleaved=self.mrope_interleaved)

    def tiny(self) -> TinyModel:
        processor = tiny_processor(
            *self.tiny_processor_classes, patch_size=self.tiny_patch_size, chat_template=self.tiny_chat_template,
        )
        tokenizer = processor.tokenizer
        config_class = self.model_class().config_class
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(self.tiny_mrope_section)}
        if self.mrope_interleaved:
            rope["mrope_interleaved"] = True
        text = config_class.sub_configs["text_config"](
            **TINY_TEXT_SHAPES, vocab_size=len(tokenizer), rope_parameters=rope, **token_ids(tokenizer),
        )
        vision = dict(
            self.tiny_vision, patch_size=self.tiny_patch_size, spatial_merge_size=2, temporal_patch_size=2,
            **{self.vision_output_field: TINY_TEXT_SHAPES["hidden_size"]},
        )
        config = config_class(
            text_config=text, vision_config=vision, tie_word_embeddings=True,
            **{f"{name}_id": tokenizer.convert_tokens_to_ids(getattr(tokenizer, name))
               for name in ("image_token", "video_token", "vision_start_token", "vision_end_token")},
        )
        return TinyModel(config=config, processor=processor)
