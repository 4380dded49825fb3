"""Mistral (text, v0.3 layout): Llama-shaped decoder with the [INST] chat format."""

from mmrl.adapter import Capabilities, DECODER_PARTS, ModelAdapter, Rollout, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import char_tokenizer, tiny_text_config
from mmrl.processors.templates import MISTRAL, MISTRAL_SPECIAL_TOKENS


@register_model
class Mistral(ModelAdapter):
    family = "mistral"
    model_types = ("mistral",)
    hf_class = "transformers:MistralForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("MistralDecoderLayer",)
    rollout = Rollout(vllm_architecture="MistralForCausalLM")
    capabilities = Capabilities(vllm=True, sequence_parallel=True)

    def tiny(self) -> TinyModel:
        # Mistral ships no pad token; the eos doubles as pad, as trainers usually set it.
        tokenizer = char_tokenizer(
            special_tokens=MISTRAL_SPECIAL_TOKENS, bos_token="<s>", eos_token="</s>", chat_template=MISTRAL,
        )
        # v0.3 has no sliding window and rope theta 1e6.
        config = tiny_text_config(
            "transformers:MistralConfig", tokenizer, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        return TinyModel(config=config, processor=tokenizer)
