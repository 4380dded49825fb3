"""LLaVA-OneVision (llava-hf/llava-onevision-qwen2-*-hf): SigLIP anyres tiles + Qwen2."""

from dataclasses import replace

from mmrl.adapter import (
    ATTN_AND_MLP,
    Capabilities,
    LoraTargets,
    VISION_TOWER_PARTS,
    Rollout,
    TinyModel,
    VisionLanguageAdapter,
)
from mmrl.processors.llava_onevision import tiny_model
from mmrl.registry import register_model


@register_model
class LlavaOnevision(VisionLanguageAdapter):
    family = "llava_onevision"
    model_types = ("llava_onevision",)
    hf_class = "transformers:LlavaOnevisionForConditionalGeneration"
    modalities = ("text", "image", "video")
    # The learned newline embedding is spliced between rows of image features.
    parts = replace(VISION_TOWER_PARTS, projector=("model.multi_modal_projector", "model.image_newline"))
    shard_layers = ("Qwen2DecoderLayer", "SiglipEncoderLayer")
    lora = LoraTargets(language=ATTN_AND_MLP, vision=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"))
    # vLLM's own hf_to_vllm_mapper for this architecture (it nests the decoder as
    # language_model.model and hoists the vision tower and projector to the top); vLLM's
    # SigLIP tower keeps the `vision_model.` level that transformers' tower drops.
    rollout = Rollout(
        vllm_architecture="LlavaOnevisionForConditionalGeneration",
        weight_prefixes=(
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower.vision_model."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.image_newline", "image_newline"),
            ("lm_head.", "language_model.lm_head."),
        ),
    )
    capabilities = Capabilities(
        single_image=True, multi_image=True, video=True, lora_vision=True, vllm=True, sequence_parallel=True,
        multi_turn=True,
    )
    processing = "mmrl.processors.llava_onevision:LlavaOnevisionProcessing"

    def tiny(self) -> TinyModel:
        config, processor = tiny_model()
        notes = "56px tiles of 16 tokens; grid pinpoints up to 2x2 tiles"
        return TinyModel(config=config, processor=processor, notes=notes)
