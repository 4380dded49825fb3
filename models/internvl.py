"""InternVL 2.5 / 3 in the transformers-native format (model_type "internvl", the
OpenGVLab/InternVL*-hf checkpoints): InternViT tiles + pixel unshuffle + Qwen2."""

from mmrl.adapter import (
    ATTN_AND_MLP,
    Capabilities,
    LoraTargets,
    VISION_TOWER_PARTS,
    Rollout,
    TinyModel,
    VisionLanguageAdapter,
)
from mmrl.processors.internvl import tiny_model
from mmrl.registry import register_model


@register_model
class InternVL(VisionLanguageAdapter):
    family = "internvl"
    model_types = ("internvl",)
    hf_class = "transformers:InternVLForConditionalGeneration"
    modalities = ("text", "image", "video")
    parts = VISION_TOWER_PARTS
    shard_layers = ("Qwen2DecoderLayer", "InternVLVisionLayer")
    lora = LoraTargets(
        language=ATTN_AND_MLP, vision=("q_proj", "k_proj", "v_proj", "projection_layer", "fc1", "fc2")
    )
    # vLLM serves this architecture with its InternS1 model; these are its
    # hf_to_vllm_mapper prefixes.
    rollout = Rollout(
        vllm_architecture="InternVLForConditionalGeneration",
        weight_prefixes=(
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("lm_head.", "language_model.lm_head."),
        ),
    )
    capabilities = Capabilities(
        single_image=True, multi_image=True, video=True, lora_vision=True, vllm=True, sequence_parallel=True,
        multi_turn=True,
    )
    processing = "mmrl.processors.internvl:InternVLProcessing"

    def tiny(self) -> TinyModel:
        config, processor = tiny_model()
        notes = "56px tiles of 4 tokens; <= 4 tiles + a thumbnail an image"
        return TinyModel(config=config, processor=processor, notes=notes)
