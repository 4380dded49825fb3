"""Smoke runs of real recipes: two steps on the family's tiny random-init model and the
few rows bundled under recipes/data/ in the dataset's own layout, so a recipe that
names a 7B checkpoint and a hub dataset is checked end to end on a CPU with no download.

    mmrl train RECIPE --smoke                 # 2 steps, tiny model, bundled rows
    mmrl data check RECIPE --smoke --rows 2   # how the first rows render, with token counts

A recipe says what stands in for its checkpoint and its dataset:

    smoke:
      family: FAMILY                   # the registered family whose tiny model is built
      data: recipes/data/DATASET       # replaces `path` in every data source mapping

Everything that shapes the run stays the recipe's: data column mapping and template,
reward, algorithm, optimizer, freezing and LoRA. What only makes it big is replaced:
the model (its config_overrides too), the pixel budget, sampling and batch sizes, the
number of steps, vLLM (the HF backend samples), checkpoints and export. The run goes to
runs/smoke/RECIPE_NAME, a scratch folder whose previous smoke results each run replaces
(unless trainer.output_dir, resume or overwrite is given as an override).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mmrl.config import Recipe, RecipeError, apply_overrides, load_recipe

SMOKE_STEPS = 2


def _checkpoint_family(path: str, source: str | Path) -> str:
    """The family of the checkpoint a recipe trains (a folder or a hub id whose config is
    in reach), whose tiny model stands in for it; a RecipeError naming smoke.family when
    its config cannot be read or its model_type has no family."""
    from mmrl.registry import RegistryError, get_adapter

    try:
        return get_adapter(path).family
    except (RegistryError, OSError, ValueError) as exc:
        raise RecipeError(f"{source}: smoke.family: the family of {path} cannot be told ({exc}); name the family "
                          "whose tiny model stands in for it (smoke: {family: NAME}; `mmrl models` lists them)") from None


def smoke_values(recipe, source: str | Path = "recipe") -> dict[str, Any]:
    """The recipe's values with the smoke replacements made (a dict for `Recipe`)."""
    smoke = recipe.smoke
    values = recipe.model_dump(mode="json")
    family = smoke.family
    if family is None:
        family = recipe.model.path if recipe.model.random_init else _checkpoint_family(recipe.model.path, source)
    model = values["model"]
    model.update(path=family, random_init=True, config_overrides=dict(smoke.config_overrides), dtype="float32",
                 attn_implementation=None, min_pixels=smoke.min_pixels, max_pixels=smoke.max_pixels)
    if recipe.model.path != family or not recipe.model.random_init:
        model["tiny_vocabulary"] = {}  # a vocabulary made for another tokenizer's task
    data = values["data"]
    for key in ("train", "eval", "validation"):
        data[key] = _smoke_source(data[key], smoke.data)
    data["prompts_per_step"] = min(data["prompts_per_step"], 2)
    rollout = values["rollout"]
    rollout.update(backend="hf", samples_per_prompt=min(rollout["samples_per_prompt"], 2),
                   max_new_tokens=min(rollout["max_new_tokens"], 8))
    values["algo"]["micro_batch_size"] = min(values["algo"]["micro_batch_size"], 4)
    # A smoke step holds a handful of sequences: at most one mini-batch each.
    sequences = data["prompts_per_step"] * rollout["samples_per_prompt"]
    values["algo"]["mini_batches"] = min(values["algo"].get("mini_batches", 1), sequences)
    values["trainer"].update(steps=SMOKE_STEPS, eval_every=0, save_every=0, target_accuracy=None,
                             time_budget_s=None, resume=False, export=False, output_dir=smoke_folder(source),
                             overwrite=True)
    values["parallel"]["sequence_parallel"] = 1
    values.pop("settled", None)  # the choices of another model and machine: the tiny run settles its own
    return values


def smoke_folder(source: str | Path) -> str:
    """The scratch folder of a recipe's smoke runs: each run replaces the previous one's
    results there (`trainer.overwrite`), so `--smoke` may run again and again."""
    return f"runs/smoke/{Path(str(source)).stem}"


def _smoke_source(value: Any, data: str | None) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        if data is None:
            return value
        return {**value, "path": data, "name": None, "data_files": None, "limit": None}
    if value.startswith("synthetic:"):
        # A synthetic task draws every image up front: a handful is enough.
        spec = re.sub(r"([?&])n=\d+", r"\1n=8", value)
        return spec if spec != value else value + ("&" if "?" in value else "?") + "n=8"
    return data if data is not None else value


def load_smoke_recipe(path: str | Path, overrides: list[str] | None = None):
    """The recipe at `path` as a smoke run; `overrides` apply after the smoke changes."""
    from pydantic import ValidationError

    recipe = load_recipe(path)
    values = apply_overrides(smoke_values(recipe, path), overrides or [])
    given = {o.partition("=")[0] for o in overrides or []}
    if given & {"trainer.output_dir", "trainer.resume", "trainer.overwrite"}:
        # A folder the user chose (or a resumed smoke run) is not the scratch folder:
        # its results are replaced only when the user says so.
        values["trainer"]["overwrite"] = "trainer.overwrite" in given and values["trainer"]["overwrite"]
    try:
        return Recipe.model_validate(values).with_folder(recipe.folder)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RecipeError(f"{path} (smoke): {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


# -- `mmrl data check` ----------------------------------------------------------------------

def processing_for(recipe):
    """The recipe's input processing without building its model: a checkpoint folder's
    processor, or the family's tiny one for a random init."""
    from mmrl.hub import HubError, checkpoint_folder
    from mmrl.registry import RegistryError, get_adapter

    m = recipe.model
    try:
        path = checkpoint_folder(m.path, weights=False, trust_remote_code=m.trust_remote_code)  # a hub id's snapshot
        adapter = get_adapter(path if path is not None else m.path, source=m.path)
    except (HubError, RegistryError) as exc:
        raise RecipeError(f"model.path: {exc}") from None
    if path is not None and path.is_dir():
        from mmrl.build import load_processor

        processor = load_processor(path, adapter, m.trust_remote_code)
    else:
        from contextlib import nullcontext

        from mmrl.tiny import vocabulary

        with vocabulary(**m.tiny_vocabulary) if m.tiny_vocabulary else nullcontext():
            processor = adapter.tiny().processor
    from mmrl.build import make_processing, pixel_options

    return make_processing(adapter, processor, pixel_options(m))


def describe_rows(recipe, rows: int = 2, split: str = "train") -> list[dict[str, Any]]:
    """How the first `rows` rows of the recipe's `split` source render: the chat-template
    text, the answer, the other columns, the images' sizes and the token counts. Every
    row is validated first (a ValueError naming the first bad one), not only those shown."""
    from mmrl.data import load_prompts, to_conversation

    source = {"train": recipe.data.train, "test": recipe.data.eval, "validation": recipe.data.validation}[split]
    field = f"data.{ {'test': 'eval'}.get(split, split)}"
    if source is None:
        raise ValueError(f"{field}: not set in the recipe")
    try:
        # Every row validated (each image opened), not only those shown: a bad row anywhere
        # stops the check, as it would stop training.
        dataset = load_prompts(source, split)
    except (ValueError, TypeError, FileNotFoundError) as exc:  # as check_before_build names the field
        raise RecipeError(f"{field}: {exc}") from None
    processing = processing_for(recipe)
    processor, tokenizer = processing.processor, processing.tokenizer
    media_ids = {getattr(processor, name, None) or getattr(tokenizer, name, None)
                 for name in ("image_token_id", "video_token_id")} - {None}
    described = []
    for index in range(min(rows, len(dataset))):
        sample = dataset[index]
        conversation = to_conversation(sample)
        batch = processing([conversation])
        ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
        images = [p["image"] for m in conversation if not isinstance(m["content"], str)
                  for p in m["content"] if p["type"] == "image"]
        described.append({
            "row": dataset.source_rows[index],
            "text": processing.render(conversation),
            "answer": sample["answer"],
            "columns": {k: v for k, v in sample.items() if k not in ("prompt", "answer", "images", "videos")},
            "images": [f"{im.width}x{im.height}" for im in images],
            "videos": len(sample.get("videos") or []),
            "tokens": len(ids),
            "media_tokens": sum(1 for i in ids if i in media_ids),
        })
    return described


def format_rows(described: list[dict[str, Any]]) -> str:
    """`describe_rows` as text for the terminal."""
    blocks = []
    for d in described:
        media = ", ".join(d["images"]) or "none"
        lines = [f"--- row {d['row']}: {d['tokens']} prompt tokens ({d['media_tokens']} for media); "
                 f"images: {media}" + (f"; videos: {d['videos']}" if d["videos"] else ""),
                 d["text"].rstrip("\n"),
                 f"answer: {d['answer']!r}"]
        if d["columns"]:
            lines.append("columns for the reward: " + ", ".join(f"{k}={v!r}"[:80] for k, v in d["columns"].items()))
        blocks.append("\n".join(lines))
    return "\n".join(blocks)
