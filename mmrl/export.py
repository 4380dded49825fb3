"""Exported policies that decode as they were trained.

    export_policy(actor, processing, output_dir / "final", dist, max_new_tokens=64)
    config = decoding_config(model.generation_config, processing, max_new_tokens=64)

An export is a HF folder (weights, config, processor, `generation_config.json`) that
plain transformers loads and decodes the way the rollout did:

- `generation_config.json` holds the rollout's constraints: the special tokens it never
  samples as `suppress_tokens` (what the HF rollout passes to `generate`; transformers
  masks them to -inf, as the compiled rollout and the vLLM backend do), its stop ids as
  `eos_token_id` (a list: a chat model ends its turn with its own token), the pad id and
  the rollout's `max_new_tokens`;
- the processor carries the recipe's pixel budget as its own defaults
  (`Processing.processor_with_budget`), so a reloaded processor makes as many image
  tokens per image as training did; `budget_problem` checks that on test images and the
  export warns when a family applies its budget somewhere a saved processor cannot hold.

The folder is written under a temporary name beside its place and renamed at the end,
so a crash never leaves a half-written export where a server would load it.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from pathlib import Path

from mmrl.checkpoint import record_dtype
from mmrl.processing import batch_differences

# Images the pixel-budget check processes: below, at and above the usual budgets, one of
# them not square (a budget changes its grid, not only its size).
BUDGET_CHECK_SIZES = ((28, 28), (56, 56), (84, 112), (448, 448), (640, 480))


def decoding_config(generation_config, processing, max_new_tokens: int | None = None):
    """A copy of `generation_config` that makes plain `generate` decode as the rollout:
    blocked tokens suppressed, the stop ids as `eos_token_id`, the pad id, and (when
    given) the rollout's `max_new_tokens`."""
    config = copy.deepcopy(generation_config)
    config.eos_token_id = list(processing.stop_token_ids)
    config.pad_token_id = processing.tokenizer.pad_token_id
    config.suppress_tokens = list(processing.blocked_token_ids) or None
    if max_new_tokens is not None:
        config.max_new_tokens = max_new_tokens
    # Written by mmrl, not derived from config.json: `generate` must take it as it is.
    config._from_model_config = False
    return config


def budget_problem(processing, processor) -> str | None:
    """None when `processor`, used with its own defaults, makes the same model inputs as
    `processing` (with its pixel budget) for images of several sizes; else what differs."""
    if not processing.is_multimodal or (processing.min_pixels is None and processing.max_pixels is None):
        return None
    from mmrl.checks import sample_images

    plain = copy.copy(processing)
    plain.processor, plain.min_pixels, plain.max_pixels = processor, None, None
    plain.tokenizer = getattr(processor, "tokenizer", processor)
    problems = []
    for image in sample_images(BUDGET_CHECK_SIZES):
        conversation = [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "?"}]}]
        trained, saved = dict(processing([conversation])), dict(plain([conversation]))
        differ = batch_differences(saved, trained)
        if differ:
            problems.append(f"{image.width}x{image.height}: {', '.join(differ)}")
    return "; ".join(problems) or None


def export_policy(actor, processing, path: Path, dist, *, max_new_tokens: int | None = None) -> Path:
    """The trained policy as a HF folder (LoRA merged) that decodes as trained; every
    rank calls it (sharded weights are gathered), the main rank writes."""
    from mmrl.lora import merged_state_dict

    state = actor.full_state_dict()
    if dist.is_main:
        model = actor.model
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        with replacing_folder(Path(path)) as temp:
            model.save_pretrained(temp, state_dict=merged_state_dict(model, state), safe_serialization=True)
            if actor.half_dtype is not None:
                record_dtype(temp / "config.json", actor.half_dtype)
            save_decoding(temp, model, processing, max_new_tokens)
    dist.barrier()
    return path


def save_decoding(path: Path, model, processing, max_new_tokens: int | None = None) -> None:
    """Write the processor (with its pixel budget) and the decoding constraints of
    `processing` into the HF folder `path`; warn when the saved processor cannot make
    the trained image tokens."""
    processor = processing.processor_with_budget()
    problem = budget_problem(processing, processor)
    if problem:
        warnings.warn(f"{path.name}: the exported processor does not reproduce the trained pixel budget "
                      f"(min_pixels={processing.min_pixels}, max_pixels={processing.max_pixels}); served with "
                      f"its defaults it makes other inputs ({problem})", stacklevel=2)
    processor.save_pretrained(path)
    if getattr(model, "can_generate", lambda: False)():
        decoding_config(model.generation_config, processing, max_new_tokens).save_pretrained(path)


class replacing_folder:
    """A temporary folder beside `final` to write into; renamed to `final` when the block
    ends (an existing `final` is moved aside, then removed), removed if the block raises."""

    def __init__(self, final: Path):
        self.final = Path(final)
        self.temp = self.final.parent / f".tmp-{self.final.name}.{os.getpid()}"

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if self.temp.exists():
            shutil.rmtree(self.temp)
        self.temp.mkdir()
        return self.temp

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            return
        old = self.final.parent / f".old-{self.final.name}.{os.getpid()}"
        if self.final.exists():
            os.rename(self.final, old)
        os.rename(self.temp, self.final)
        if old.exists():
            shutil.rmtree(old)
