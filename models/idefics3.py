"""Idefics3 (HuggingFaceM4/Idefics3-8B-Llama3): SigLIP tiles + pixel shuffle + Llama.

SmolVLM (`models/smolvlm.py`) is the same architecture under its own model_type and
subclasses this adapter; input handling for both lives in `mmrl.processors.idefics3`.
"""

from mmrl.adapter import (
    ATTN_AND_MLP,
    Capabilities,
    LoraTargets,
    Parts,
    Rollout,
    TinyModel,
    VisionLanguageAdapter,
)
from mmrl.processors.idefics3 import IDEFICS3, tiny_model
from mmrl.registry import register_model


@register_model
class Idefics3(VisionLanguageAdapter):
    family = "idefics3"
    model_types = ("idefics3",)
    hf_class = "transformers:Idefics3ForConditionalGeneration"
    parts = Parts(
        language="model.text_model",
        embed="model.text_model.embed_tokens",
        lm_head="lm_head",
        vision="model.vision_model",
        projector="model.connector",
    )
    shard_layers = ("LlamaDecoderLayer", "Idefics3EncoderLayer")
    lora = LoraTargets(language=ATTN_AND_MLP, vision=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"))
    # vLLM's module tree matches the HF checkpoint names (model.text_model, ...).
    rollout = Rollout(vllm_architecture="Idefics3ForConditionalGeneration")
    capabilities = Capabilities(
        single_image=True, multi_image=True, lora_vision=True, vllm=True, sequence_parallel=True, multi_turn=True,
    )
    processing = "mmrl.processors.idefics3:Idefics3Processing"
    flavour = IDEFICS3

    def tiny(self) -> TinyModel:
        config, processor = tiny_model(self.flavour)
        notes = "56px tiles of 4 tokens; <= 2x2 tiles + a global tile an image"
        return TinyModel(config=config, processor=processor, notes=notes)
