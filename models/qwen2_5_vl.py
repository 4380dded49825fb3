"""Qwen2.5-VL: Qwen2-VL with a windowed-attention vision tower and a gated vision MLP.

Only what differs from `Qwen2VL` is declared here. Video positions are spaced by
`tokens_per_second` x `second_per_grid_ts`, which `mrope_position_ids` reads.
"""

from mmrl.adapter import MLP, LoraTargets, Rollout
from mmrl.models.qwen2_vl import VISION_ATTENTION, Qwen2VL
from mmrl.registry import register_model


@register_model
class Qwen25VL(Qwen2VL):
    family = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    hf_class = "transformers:Qwen2_5_VLForConditionalGeneration"
    shard_layers = ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock")
    lora = LoraTargets(vision=VISION_ATTENTION + MLP)
    rollout = Rollout(vllm_architecture="Qwen2_5_VLForConditionalGeneration")

    tiny_processor_classes = ("transformers:Qwen2_5_VLProcessor", "transformers:Qwen2VLVideoProcessor")
    # Block 0 attends within 2x2-token windows (window_size counts pixels), block 1 fully.
    tiny_vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, window_size=56,
        fullatt_block_indexes=[1], tokens_per_second=2,
    )
    vision_output_field = "out_hidden_size"
