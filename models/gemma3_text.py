"""Gemma 3 text-only (Gemma3ForCausalLM, model_type gemma3_text): interleaved sliding
and full attention layers, each layer type with its own rope."""

from mmrl.adapter import Capabilities, DECODER_PARTS, ModelAdapter, Rollout, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import tiny_text_config
from mmrl.processors.gemma3 import tiny_tokenizer


def tiny_gemma3_text_config(tokenizer):
    """The tiny Gemma 3 decoder, shared by the text and the vision-language family.

    One sliding and one full attention layer with the real per-type rope (linear x8 at
    theta 1e6 globally, plain theta 1e4 locally); the window of 16 is shorter than the
    test prompts, so the sliding mask matters. query_pre_attn_scalar follows head_dim,
    as in the real models."""
    return tiny_text_config(
        "transformers:Gemma3TextConfig", tokenizer,
        query_pre_attn_scalar=32, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )


@register_model
class Gemma3Text(ModelAdapter):
    family = "gemma3_text"
    model_types = ("gemma3_text",)
    hf_class = "transformers:Gemma3ForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("Gemma3DecoderLayer",)
    processing = "mmrl.processors.gemma3:Gemma3Processing"
    rollout = Rollout(vllm_architecture="Gemma3ForCausalLM")
    capabilities = Capabilities(vllm=True, sequence_parallel=True)

    def tiny(self) -> TinyModel:
        tokenizer = tiny_tokenizer()
        return TinyModel(config=tiny_gemma3_text_config(tokenizer), processor=tokenizer)
