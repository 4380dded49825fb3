"""Qwen2 and Qwen2.5 (text): the reference decoder-only family (ChatML template)."""

from mmrl.adapter import Capabilities, DECODER_PARTS, ModelAdapter, Rollout, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import char_tokenizer, tiny_text_config
from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS


@register_model
class Qwen2(ModelAdapter):
    family = "qwen2"
    model_types = ("qwen2",)
    hf_class = "transformers:Qwen2ForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("Qwen2DecoderLayer",)
    rollout = Rollout(vllm_architecture="Qwen2ForCausalLM")
    capabilities = Capabilities(vllm=True, sequence_parallel=True)

    def tiny(self) -> TinyModel:
        tokenizer = char_tokenizer(
            special_tokens=CHATML_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            chat_template=CHATML,
        )
        config = tiny_text_config("transformers:Qwen2Config", tokenizer, tie_word_embeddings=True)
        return TinyModel(config=config, processor=tokenizer)
