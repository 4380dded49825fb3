"""SmolVLM / SmolVLM2: the Idefics3 architecture under its own model_type, processor and
video processor. Everything but the names is inherited from the Idefics3 adapter."""

from mmrl.adapter import Capabilities, Rollout
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
    modalities = ("text", "image", "video")
    capabilities = Capabilities(
        single_image=True, multi_image=True, video=True, lora_vision=True, vllm=True, sequence_parallel=True,
        multi_turn=True,
    )
    processing = "mmrl.processors.idefics3:SmolVLMProcessing"
    flavour = SMOLVLM

    def on_load(self, model):
        # SmolVLM's inputs_merger index-puts the connector's output into a tensor of the
        # text embeddings' dtype; under bf16 autocast over fp32 weights the connector
        # returns bf16, which CUDA's index_put refuses (transformers 5.17). Cast it.
        embeddings = model.get_input_embeddings()
        model.model.connector.register_forward_hook(
            lambda module, args, output: output.to(embeddings.weight.dtype)
        )
        return model
