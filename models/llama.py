"""Llama 3 / 3.x (text): the Llama 3 header chat format and llama3 rope scaling."""

from mmrl.adapter import Capabilities, DECODER_PARTS, ModelAdapter, Rollout, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import char_tokenizer, tiny_text_config
from mmrl.processors.templates import LLAMA3, LLAMA3_SPECIAL_TOKENS

# Llama 3.1's rope: theta 500000 with llama3 frequency scaling. The original context is
# shrunk to 128 so that, on a 16-wide head, some frequencies are scaled, some kept and
# some interpolated: the tiny model runs every branch of the llama3 rope.
TINY_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
}


@register_model
class Llama(ModelAdapter):
    family = "llama"
    model_types = ("llama",)
    hf_class = "transformers:LlamaForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("LlamaDecoderLayer",)
    rollout = Rollout(vllm_architecture="LlamaForCausalLM")
    capabilities = Capabilities(vllm=True, sequence_parallel=True)

    def tiny(self) -> TinyModel:
        tokenizer = char_tokenizer(
            special_tokens=(*LLAMA3_SPECIAL_TOKENS, "<|end_of_text|>"), bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>", chat_template=LLAMA3,
        )
        config = tiny_text_config(
            "transformers:LlamaConfig", tokenizer, rope_parameters=dict(TINY_ROPE), tie_word_embeddings=True,
        )
        return TinyModel(config=config, processor=tokenizer)
