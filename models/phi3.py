"""Phi-3 / Phi-4-mini (text): fused qkv_proj and gate_up_proj, partial rotary embedding."""

from mmrl.adapter import Capabilities, DECODER_PARTS, LoraTargets, ModelAdapter, Rollout, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import char_tokenizer, tiny_text_config
from mmrl.processors.templates import PHI3, PHI3_SPECIAL_TOKENS


@register_model
class Phi3(ModelAdapter):
    family = "phi3"
    model_types = ("phi3",)
    hf_class = "transformers:Phi3ForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("Phi3DecoderLayer",)
    lora = LoraTargets(language=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    rollout = Rollout(vllm_architecture="Phi3ForCausalLM")
    capabilities = Capabilities(vllm=True, sequence_parallel=True)

    def tiny(self) -> TinyModel:
        # `<|end|>` closes every turn, so it is the eos a chat policy must learn to stop on.
        tokenizer = char_tokenizer(
            special_tokens=PHI3_SPECIAL_TOKENS, bos_token="<s>", eos_token="<|end|>", pad_token="<|endoftext|>",
            chat_template=PHI3,
        )
        # Phi-4-mini rotates 3/4 of each head.
        config = tiny_text_config(
            "transformers:Phi3Config", tokenizer,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        )
        return TinyModel(config=config, processor=tokenizer)
