"""Qwen3 (text): Qwen2's layout plus per-head q/k RMSNorm and an explicit head_dim."""

from mmrl.adapter import Capabilities, DECODER_PARTS, ModelAdapter, Rollout, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import char_tokenizer, tiny_text_config
from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS


@register_model
class Qwen3(ModelAdapter):
    family = "qwen3"
    model_types = ("qwen3",)
    hf_class = "transformers:Qwen3ForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("Qwen3DecoderLayer",)
    rollout = Rollout(vllm_architecture="Qwen3ForCausalLM")
    capabilities = Capabilities(vllm=True, sequence_parallel=True)

    def tiny(self) -> TinyModel:
        tokenizer = char_tokenizer(
            special_tokens=CHATML_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            chat_template=CHATML,
        )
        # head_dim is passed on purpose (TINY_TEXT_SHAPES has it): Qwen3Config defaults it
        # to 128 instead of hidden_size / num_attention_heads.
        config = tiny_text_config(
            "transformers:Qwen3Config", tokenizer, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        return TinyModel(config=config, processor=tokenizer)
