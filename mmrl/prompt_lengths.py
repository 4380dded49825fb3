"""Prompts against the model's context, checked before the model is built.

    check_prompt_lengths(recipe, {"train": train_set, "validation": None, "eval": eval_set})

A row whose prompt text alone (images add more) plus `rollout.max_new_tokens` is above the
model's context (`max_position_embeddings`) would be cut, or overflow the position table,
at some later step. The tokenizer and the config load without the model
(`mmrl.build.recipe_tokenizer`), so the row is named before any weights are drawn or read.
"""

from __future__ import annotations

from typing import Any

from mmrl.build import recipe_tokenizer
from mmrl.config import Recipe, RecipeError


def check_prompt_lengths(recipe: Recipe, datasets: dict[str, Any]) -> None:
    """RecipeError naming the split, row and file of the longest prompt that leaves no
    room for `rollout.max_new_tokens` in the model's context; `datasets` by data field
    (None: the split is not set)."""
    if not any(dataset is not None for dataset in datasets.values()):
        return
    tokenizer, text_config = recipe_tokenizer(recipe.model)
    context = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(context, int):
        return
    new_tokens = recipe.rollout.max_new_tokens
    for field, dataset in datasets.items():
        if dataset is None:
            continue
        texts = [prompt_text(sample) for sample in dataset]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
        if longest is not None and lengths[longest] + new_tokens > context:
            name = getattr(dataset, "name", "") or f"data.{field}"
            row = dataset.source_rows[longest] if hasattr(dataset, "source_rows") else longest
            raise RecipeError(f"data.{field}: row {row} of {name}: its prompt's text alone is {lengths[longest]} "
                              f"tokens, which with rollout.max_new_tokens {new_tokens} is above the model's context "
                              f"of {context} tokens; shorten or drop the row, or lower rollout.max_new_tokens")


def prompt_text(sample: dict) -> str:
    """The text of a sample's prompt messages (media left out)."""
    parts = []
    for message in sample.get("prompt") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)
