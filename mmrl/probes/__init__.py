"""Probes: one per feature, each run on a family's tiny model (or a local checkpoint),
each returning verified / failed / n/a / not run here with its reason, time, device and
versions. The support matrix (`mmrl support-matrix`) and `mmrl doctor` are built on them.

    from mmrl.probes import PROBES, Subject
    subject = Subject(get_adapter("FAMILY"), source="FAMILY")
    results = {p.feature: p.run(subject) for p in PROBES}

`PROBES` is the table: its order is the order of the matrix's columns. A probe's
`capability` names the `Capabilities` field it verifies (None: every adapter must pass).
"""

from __future__ import annotations

from mmrl.probes.base import (
    TOLERANCE,
    CheckFailed,
    NotRunHere,
    Probe,
    ProbeResult,
    Status,
    Subject,
    Verified,
)
from mmrl.probes.model import (
    check_forward_backward,
    check_freeze,
    check_generation,
    check_gradient_checkpointing,
    check_lora_language,
    check_lora_vision,
    check_multi_image,
    check_padded_batch,
    check_padding_free,
    check_random_init,
    check_rope,
    check_save_reload,
    check_single_image,
    check_video,
    needs_images,
    needs_language_lora,
    needs_video,
    needs_vision_lora,
)
from mmrl.probes.multi_turn import check_multi_turn, check_multi_turn_many
from mmrl.probes.reads_media import check_reads_media, reads_media_inapplicable
from mmrl.probes.rollout_agreement import check_rollout_agreement
from mmrl.probes.sequence_parallel import (
    check_sequence_parallel,
    check_sequence_parallel_many,
    sequence_parallel_inapplicable,
)
from mmrl.probes.training import (
    check_critic,
    check_fsdp2,
    check_fsdp2_many,
    check_media_sharing,
    check_vllm,
    media_sharing_inapplicable,
    vllm_inapplicable,
)

PROBES: tuple[Probe, ...] = (
    Probe("random_init", "Random init", "Builds from the tiny config (or loads the checkpoint); every parameter "
          "belongs to a declared part; the declared shard layers exist.", check_random_init),
    Probe("save_reload", "Save / reload", "save_pretrained then from_pretrained (safetensors) gives the same "
          "logits (atol 1e-5).", check_save_reload),
    Probe("rope", "RoPE", "adapter.rope() is consistent, and the raw config.json normalizes to the same "
          "RopeSpec as the loaded config.", check_rope),
    Probe("forward_backward", "Fwd/bwd", "Finite LM loss on a processor-made batch (images of two sizes for "
          "VLMs); gradients reach the language model (and the vision tower).", check_forward_backward),
    Probe("generation", "HF generate", "HF generate: 8 greedy tokens per prompt, no blocked special tokens, "
          "decoded to text.", check_generation, capability="generation"),
    Probe("padded_batch", "Padded batch", "A left-padded batch with the adapter's position ids (where the family "
          "declares left_padding=False: one sequence a row from the first column, as the engine runs it) equals "
          "each prompt run alone (fp32 logits, 2e-4).",
          check_padded_batch),
    Probe("padding_free", "Padding-free", "The batch packed into one row (positions restart per sequence) "
          "equals the padded batch (2e-4), and a short sample right behind a long neighbour equals itself "
          "alone (1e-5 in log-prob, 1e-4 in the last hidden state): no state crosses a boundary.",
          check_padding_free, capability="padding_free"),
    Probe("freeze", "Freeze parts", "Each declared part frozen alone gets no gradient while every other part "
          "still does.", check_freeze, cost=2.0),
    Probe("lora_language", "LoRA lang.", "LoRA on the language model changes the logits; merged equals "
          "unmerged (2e-4).", check_lora_language, capability="lora_language", inapplicable=needs_language_lora),
    Probe("lora_vision", "LoRA vision", "LoRA on the vision tower, then on both: changes the logits; merged "
          "equals unmerged (2e-4).", check_lora_vision, capability="lora_vision", inapplicable=needs_vision_lora,
          cost=2.0),
    Probe("gradient_checkpointing", "Act. ckpt", "Activation checkpointing gives the same loss and gradients "
          "(atol 1e-6 / 1e-5).", check_gradient_checkpointing, capability="gradient_checkpointing", cost=3.0),
    Probe("critic", "Critic head", "A value-head engine gives a value per response token, and a value-loss "
          "step moves the values toward the returns.", check_critic, capability="critic"),
    Probe("fsdp2", "FSDP2 x2", "Two processes under torchrun (gloo on CPU, NCCL on GPUs; fp32): the "
          "FSDP2-sharded update equals the one-process update (gradients and AdamW step); VLMs share media "
          "encoding.", check_fsdp2,
          capability="fsdp2", check_many=check_fsdp2_many, cost=10.0),
    Probe("sequence_parallel", "Ulysses SP", "Two processes under torchrun split each sequence (Ulysses, odd "
          "length): log-probs (1e-5), gradients and the AdamW step equal one process's.", check_sequence_parallel,
          capability="sequence_parallel", inapplicable=sequence_parallel_inapplicable,
          check_many=check_sequence_parallel_many, cost=10.0),
    Probe("vllm", "vLLM rollout", "vLLM greedy rollout log-probs equal the trainer's (1e-4), before and after a "
          "weight sync.", check_vllm, capability="vllm", inapplicable=vllm_inapplicable),
    Probe("single_image", "1 image", "One image per prompt (two sizes in a batch): finite loss, vision "
          "gradients, generation.", check_single_image, capability="single_image", inapplicable=needs_images),
    Probe("multi_image", "Multi-image", "Two images per prompt: finite loss and backward.", check_multi_image,
          capability="multi_image", inapplicable=needs_images),
    Probe("video", "Video", "A 4-frame clip: processed and 4 tokens generated; in a batch with image prompts "
          "each prompt equals itself alone (2e-4).", check_video, capability="video",
          inapplicable=needs_video),
    Probe("media_sharing", "Shared media", "Rows repeating a prompt (GRPO samples) encode its images/video once: "
          "rows collated from each prompt's batch equal processing them; log-probs (1e-5), gradients and the AdamW "
          "step equal the plain forward's, with less vision input.",
          check_media_sharing, capability="media_sharing", inapplicable=media_sharing_inapplicable, cost=2.0),
    Probe("multi_turn", "Multi-turn", "The agent loop (hf backend) with an image (and a video, where declared) "
          "arriving in turn 3, from the environment: the training batch equals the final conversation processed in "
          "one go (ids, media tensors, positions incl. mrope), the loss mask covers only sampled tokens, each policy "
          "turn's log-probs equal the rollout's (2e-4); shared media, packed rows (2e-4) and Ulysses over 2 "
          "processes give the plain batch's log-probs.", check_multi_turn, capability="multi_turn",
          inapplicable=needs_images, check_many=check_multi_turn_many, cost=4.0),
    Probe("reads_media", "Reads media", "Log-probs with the real images differ from those with blank and with "
          "shuffled images (1e-4) on the rollout path (greedy token) and the training path (the engine's log-probs), "
          "and the vision tower is called with the same pixels on both; where vLLM is installed, on its rollout path "
          "too (its log-probs of the same tokens).", check_reads_media,
          inapplicable=reads_media_inapplicable, cost=2.0),
    Probe("rollout_agreement", "Rollout agreement", "Per rollout backend (hf, hf_compiled; vllm where installed): "
          "KL and largest log-prob difference between what it sampled with and the trainer's log-probs of the same "
          "tokens; fp32 on CPU (1e-4, KL 1e-8), bf16 on a GPU (recorded, 1e-1, KL 1e-3).", check_rollout_agreement,
          cost=3.0),
)

FEATURES: tuple[str, ...] = tuple(p.feature for p in PROBES)


def declared_not_applicable(adapter) -> list[str]:
    """The capabilities `adapter` declares whose probe does not apply to it (media sharing
    in a text family): `mmrl models` lists them apart, as the support matrix shows them n/a."""
    declared = adapter.capabilities.declared()
    return [p.capability for p in PROBES if p.capability in declared and p.inapplicable(adapter)]


def probe(feature: str) -> Probe:
    """The probe for `feature` (KeyError names the known features)."""
    for p in PROBES:
        if p.feature == feature:
            return p
    raise KeyError(f"no probe for feature {feature!r}; features are {', '.join(FEATURES)}")


__all__ = [
    "FEATURES", "PROBES", "TOLERANCE", "CheckFailed", "NotRunHere", "Probe", "ProbeResult", "Status", "Subject",
    "Verified", "declared_not_applicable", "probe",
]
