"""The start-of-run summary: what a run is about to train, in a few lines, printed once by
rank 0 after the build and before the first step (`Trainer.fit`), so a wrong checkpoint,
a frozen model, an empty split or an unexpected batch shows before any time is spent.

    model     qwen2_5 (Qwen/Qwen2.5-3B-Instruct)
    weights   3.09B parameters, 3.09B trainable (100.0%); frozen: none; LoRA: none
    rows      train 7473, validation 1319, eval 1319
    step      8 prompts x 8 samples = 64 sequences; 4 mini-batches, micro-batch 4
    settled   model.pack true (auto: cuda, 1 process, a text family)
    settled   model.pack_tokens 16384 (auto: the default)
    settled   model.compile_layers true (auto: cuda, 1 process)
    settled   model.gradient_checkpointing after_oom (auto: cuda, 1 process; off until an update runs out of memory)
    settled   model.attn_implementation sdpa (auto: Qwen2ForCausalLM supports SDPA)
    settled   rollout.backend hf_compiled (auto: cuda, 1 process)
    output    runs/gsm8k

It reads only what the trainer built and settled: one `settled` line per setting a recipe
may leave to auto, as `mmrl.settle.resolve` settled it before the build (the same values
the run folder's recipe.yaml records in its `settled:` section).
"""

from __future__ import annotations

from typing import Any

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
    # The rollout as built, where it says more than its settled line: an inference copy of
    # sharded weights, or an "auto" compiled rollout that took plain generate.
    built = getattr(trainer.rollout, "backend", None)
    copy = getattr(trainer.rollout, "copy", None)
    rollout = []
    if copy is not None or (built and built != trainer.settled.rollout_backend):
        rollout = [f"rollout   {built}" + (f" ({describe(copy)})" if copy is not None else "")]
    return [
        f"model     {actor.adapter.family} ({m.path}{', random init' if m.random_init else ''})",
        f"weights   {_count(total)} parameters, {_count(trainable)} trainable ({share:.1f}%); "
        f"frozen: {frozen}; LoRA: {lora}",
        f"rows      {', '.join(rows)}",
        f"step      {r.data.prompts_per_step} prompts x {r.rollout.samples_per_prompt} samples = {sequences} "
        f"sequences; {r.algo.mini_batches} mini-batch{'es' if r.algo.mini_batches != 1 else ''}, {micro}",
        *(f"settled   {line}" for line in trainer.settled.lines()),
        *rollout,
        # The one-step-off rollout beside the update (mmrl/buffer/overlap.py).
        *([f"overlap   {trainer.trajectories.summary}"] if getattr(trainer.trajectories, "summary", "") else []),
        f"output    {trainer.output_dir}",
    ]


def _count(n: int) -> str:
    """A parameter count people read at a glance: 3.09B, 494.0M, 12.3K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}" if unit == "B" else f"{n / size:.1f}{unit}"
    return str(n)
