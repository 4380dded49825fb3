"""An out-of-tree family for the registry tests: a Qwen2-shaped model under a new name.

Importing this module registers it, as `--plugin tests.plugins.toy_family` would.
"""

from mmrl.adapter import DECODER_PARTS, ModelAdapter, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import char_tokenizer, tiny_text_config


@register_model
class ToyFamily(ModelAdapter):
    family = "toy"
    model_types = ("toy_decoder",)
    architectures = ("ToyDecoderForCausalLM",)
    hf_class = "transformers:Qwen2ForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("Qwen2DecoderLayer",)

    def tiny(self) -> TinyModel:
        tokenizer = char_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        return TinyModel(config=tiny_text_config("transformers:Qwen2Config", tokenizer), processor=tokenizer)
