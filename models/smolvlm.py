"""SmolVLM / SmolVLM2: the Idefics3 architecture under its own model_type, processor and
video processor. Everything but the names is inherited from the Idefics3 adapter."""

from mmrl.adapter import Rollout
from mmrl.models.idefics3 import Idefics3
from mmrl.processors.idefics3 import SMOLVLM
from mmrl.registry import register_model


@register_model
class SmolVLM(Idefics3):
    family = "smolvlm"
    model_types = ("smolvlm",)
    hf_class = "transformers:SmolVLMForConditionalGeneration"
    shard_layers = ("LlamaDecoderLayer", "SmolVLMEncoderLayer")
    rollout = Rollout(vllm_architecture="SmolVLMForConditionalGeneration")
    # Video stays undeclared although SmolVLM2 reads videos: SmolVLMProcessor wants them
    # nested per sample, and `Processing` hands every processor one flat list of videos.
    flavour = SMOLVLM
