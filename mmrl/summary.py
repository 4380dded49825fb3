"""The start-of-run summary: what a run is about to train, in a few lines, printed once by
rank 0 after the build and before the first step (`Trainer.fit`), so a wrong checkpoint,
a frozen model, an empty split or an unexpected batch shows before any time is spent.

    model     qwen2_5 (Qwen/Qwen2.5-3B-Instruct)
    weights   3.09B parameters, 3.09B trainable (100.0%); frozen: none; LoRA: none
    rows      train 7473, validation 1319, eval 1319
    step      8 prompts x 8 samples = 64 sequences; 4 mini-batches, micro-batch 4
    settled   rollout hf_compiled; pack on; compile_layers on; gradient_checkpointing off (auto)
    output    runs/gsm8k

It reads only what the trainer built: the settled "auto" values are the engine's
(`mmrl.engine.surgery.resolve`) and the rollout's (`mmrl.rollout.choose_backend`).
"""

from __future__ import annotations

from typing import Any

from mmrl.rollout import choose_backend
from mmrl.rollout.inference_copy import describe


def run_summary(trainer) -> list[str]:
    """The summary lines of a built `mmrl.trainer.Trainer`."""
    r = trainer.recipe
    m = r.model
    actor = trainer.actor
    total = trainable = 0
    for parameter in actor.model.parameters():
        count = parameter.numel()  # a sharded (DTensor) parameter counts its whole shape
        total += count
        trainable += count if parameter.requires_grad else 0
    share = 100.0 * trainable / total if total else 0.0
    lora = "none" if m.lora_scope == "none" else f"{m.lora_scope}, rank {m.lora_rank}"
    frozen = ", ".join(m.freeze) or "none"
    rows = [f"{name} {len(dataset)}" for name, dataset in (("train", trainer.train_set),
                                                           ("validation", trainer.validation_set),
                                                           ("eval", trainer.eval_set))
            if dataset is not None and (name != "validation" or dataset is not trainer.eval_set)]
    sequences = r.data.prompts_per_step * r.rollout.samples_per_prompt
    micro = (f"micro-batch {r.algo.micro_batch_tokens} tokens" if r.algo.micro_batch_tokens
             else f"micro-batch {r.algo.micro_batch_size}")
    settings = actor.settings
    checkpointing = _on(settings.checkpointing) + (" (auto)" if settings.checkpointing_auto else "")
    # The rollout built (an "auto" compiled rollout may have taken plain generate).
    backend = getattr(trainer.rollout, "backend", None) or choose_backend(r.rollout.backend, actor)
    copy = getattr(trainer.rollout, "copy", None)
    if copy is not None:
        backend += f" ({describe(copy)})"
    return [
        f"model     {actor.adapter.family} ({m.path}{', random init' if m.random_init else ''})",
        f"weights   {_count(total)} parameters, {_count(trainable)} trainable ({share:.1f}%); "
        f"frozen: {frozen}; LoRA: {lora}",
        f"rows      {', '.join(rows)}",
        f"step      {r.data.prompts_per_step} prompts x {r.rollout.samples_per_prompt} samples = {sequences} "
        f"sequences; {r.algo.mini_batches} mini-batch{'es' if r.algo.mini_batches != 1 else ''}, {micro}",
        f"settled   rollout {backend}; pack {_on(actor.pack)}; compile_layers {_on(settings.compile_layers)}; "
        f"gradient_checkpointing {checkpointing}",
        f"output    {trainer.output_dir}",
    ]


def _on(value: Any) -> str:
    return "on" if value else "off"


def _count(n: int) -> str:
    """A parameter count people read at a glance: 3.09B, 494.0M, 12.3K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}" if unit == "B" else f"{n / size:.1f}{unit}"
    return str(n)
