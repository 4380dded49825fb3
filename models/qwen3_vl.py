"""Qwen3-VL (dense): Qwen2-VL's layout with a DeepStack vision tower (extra mergers
feeding early decoder layers), patch 16 and interleaved mrope.

Only what differs from `Qwen2VL` is declared here. Videos arrive as one run of
tokens per frame group, each after a timestamp; `mrope_position_ids` handles both.
"""

from mmrl.adapter import LoraTargets, Parts, Rollout, SequenceParallel
from mmrl.models.qwen2_vl import VISION_ATTENTION, Qwen2VL
from mmrl.processors.qwen_vl import QWEN3_VL_TEMPLATE
from mmrl.registry import register_model


@register_model
class Qwen3VL(Qwen2VL):
    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    hf_class = "transformers:Qwen3VLForConditionalGeneration"
    parts = Parts(
        language="model.language_model", embed="model.language_model.embed_tokens", lm_head="lm_head",
        vision="model.visual", projector=("model.visual.merger", "model.visual.deepstack_merger_list"),
    )
    shard_layers = ("Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock")
    lora = LoraTargets(vision=VISION_ATTENTION + ("linear_fc1", "linear_fc2"))
    rollout = Rollout(vllm_architecture="Qwen3VLForConditionalGeneration")
    # DeepStack adds vision features inside early decoder layers, one row per visual
    # position of visual_pos_masks: under Ulysses each rank keeps its positions' rows.
    sequence_parallel = SequenceParallel(masked_inputs=(("visual_pos_masks", ("deepstack_visual_embeds",)),))

    default_mrope_section = (24, 20, 20)
    mrope_interleaved = True

    tiny_processor_classes = ("transformers:Qwen3VLProcessor", "transformers:Qwen3VLVideoProcessor")
    tiny_patch_size = 16
    tiny_chat_template = QWEN3_VL_TEMPLATE
    # A square position table (8x8 patches), DeepStack from the first block.
    tiny_vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    # Interleaved thw over 16 frequency pairs: t takes 8, h and w 4 each.
    tiny_mrope_section = (8, 4, 4)
    vision_output_field = "out_hidden_size"
