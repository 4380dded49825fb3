"""Training from Python: a recipe (file, dict or `Recipe`), a reward function and
in-memory datasets, without writing files first.

    import mmrl
    from datasets import Dataset

    def short(completions, answers, **fields):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answers)]

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4"}] * 8)
    summary = mmrl.train("recipes/tiny_vlm_count.yaml", reward=short, train_dataset=rows,
                         overrides=["trainer.steps=2"])

`reward` replaces the recipe's `reward:` section (bind options with `functools.partial`);
`train_dataset` and `eval_dataset` replace `data.train` and `data.eval`: a
`datasets.Dataset` or a list of rows in the row schema (`mmrl.data.schema`), or in
their own layout when the recipe's `data.train` / `data.eval` is a mapping (its
`columns`, `template`, `system` and `answer_pattern` apply; its `path` may be left out).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmrl.config import IN_MEMORY, Recipe, RecipeError, apply_overrides, read_recipe, validate_recipe
from mmrl.data import PromptDataset
from mmrl.data.layouts import DataSource, MappedRows
from mmrl.rewards import reward_name


def train(recipe: str | Path | Mapping[str, Any] | Recipe, *, reward=None, train_dataset=None, eval_dataset=None,
          overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train as `mmrl train` does and return the final summary (`mmrl.trainer.train`)."""
    if reward is not None and not callable(reward):
        raise RecipeError(f"reward: expected a function, got {type(reward).__name__} (a name goes in reward.name)")
    given = {"train": train_dataset, "eval": eval_dataset}
    config = _recipe(recipe, list(overrides), {field for field, rows in given.items() if rows is not None})
    datasets = {field: in_memory_dataset(rows, getattr(config.data, field), f"{field}_dataset")
                for field, rows in given.items() if rows is not None}
    if reward is not None and config.reward.name is not None:
        print(f"note: training with reward={reward_name(reward)} given to train(); the recipe's reward.name "
              f"{config.reward.name!r} and its options are not used", file=sys.stderr, flush=True)
    from mmrl.trainer import train as run  # torch and the engine load when training starts

    return run(config, reward=reward, datasets=datasets)


def _recipe(recipe, overrides: list[str], in_memory: set[str]) -> Recipe:
    """The validated recipe; data fields given in memory read a placeholder (a mapping
    keeps its columns and gets a placeholder path)."""
    if isinstance(recipe, Recipe):
        values, where, folder = recipe.model_dump(mode="json", exclude_unset=True), None, recipe.folder
    elif isinstance(recipe, (str, Path)):
        values, where, folder = read_recipe(recipe), recipe, Path(recipe).parent
    elif isinstance(recipe, Mapping):
        values, where, folder = _plain(recipe), None, None
    else:
        raise RecipeError(f"recipe: expected a path, a mapping or a Recipe, got {type(recipe).__name__}")
    values = apply_overrides(values, overrides)
    data = dict(values.get("data") or {})
    for field in in_memory:
        current = data.get(field)
        placeholder = f"{IN_MEMORY}{field}_dataset"
        data[field] = {"path": placeholder, **current} if isinstance(current, Mapping) else placeholder
    values["data"] = data
    return validate_recipe(values, where=where, folder=folder)


def _plain(values: Mapping) -> dict:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in values.items()}


def in_memory_dataset(rows, spec, name: str) -> PromptDataset:
    """`rows` (a `datasets.Dataset` or a list of dicts) as a validated `PromptDataset`:
    schema rows as they are, or mapped by `spec` when the recipe's field is a mapping."""
    if isinstance(rows, PromptDataset):
        return rows
    if not hasattr(rows, "__len__") or not hasattr(rows, "__getitem__") or isinstance(rows, (str, bytes, Mapping)):
        raise RecipeError(f"{name}: expected a datasets.Dataset or a list of rows, got {type(rows).__name__}")
    try:
        if isinstance(spec, DataSource):
            if not hasattr(rows, "column_names"):
                import datasets

                rows = datasets.Dataset.from_list(list(rows))
            return PromptDataset(MappedRows(rows, spec, name), name=name, limit=spec.limit)
        return PromptDataset(rows if hasattr(rows, "column_names") else list(rows), name=name)
    except ValueError as exc:  # PromptDataset's and MappedRows' messages start with the name
        message = str(exc)
        raise RecipeError(message if message.startswith(f"{name}:") else f"{name}: {message}") from None


__all__ = ["IN_MEMORY", "in_memory_dataset", "train"]
