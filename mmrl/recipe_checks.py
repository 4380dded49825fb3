"""What a recipe asks for that the schema cannot see, checked before anything is built.

    check_before_build(recipe)               # model.path, LoRA targets, sequence_parallel,
                                             # loggers, the reward, every dataset, pack, strict_media
    check_prompt_lengths(recipe, {"train": train_set, "validation": None, "eval": eval_set},
                         recipe_config(recipe.model))

`mmrl.config` refuses what the recipe alone tells (a value of the wrong type, an unknown
key); this module refuses what needs the filesystem, the model's config or the data, each
in one line naming the field, before the slow model build:
- `check_before_build`: a model.path that is not there or holds unreadable weights
  (`weights_problem`), config_overrides of the wrong type, LoRA targets the model lacks, a
  sequence_parallel size the family or its attention heads cannot take, loggers not
  installed, the reward and the datasets (`check_reward_and_data`), trainer.strict_media
  without media to check, model.pack: true for a family whose packing is unverified;
- `check_prompt_lengths`: a row whose prompt text alone (images add more) plus
  `rollout.max_new_tokens` is above the model's context (`max_position_embeddings`) would
  be cut, or overflow the position table, at some later step. The tokenizer and the config
  load without the model (`mmrl.build.recipe_config`; the trainer's build then takes that
  processor), so the row is named before any weights are drawn or read;
- `unset_toy_defaults`: the notice naming defaults fit only for tiny CPU recipes.

The settings a recipe leaves to "auto" are settled next, by `mmrl.settle.resolve`.
"""

from __future__ import annotations

import json
import struct
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from mmrl.boundaries import unpackable, unverified_layer_kinds, unverified_packing, unverified_ulysses
from mmrl.build import customized_config
from mmrl.config import IN_MEMORY, ModelConfig, Recipe, RecipeError
from mmrl.data import load_prompts
from mmrl.data.layouts import DataSource
from mmrl.data.synthetic import shuffle_control_problem
from mmrl.errors import one_line
from mmrl.hub import HubError, checkpoint_folder
from mmrl.loggers import check_installed
from mmrl.lora import lora_target_modules
from mmrl.registry import RegistryError, adapter_for_config, get_adapter
from mmrl.rewards import BUILTIN_REWARDS, TRAINER_FIELDS, get_reward, missing_fields, reward_name
from mmrl.tiny import vocabulary


def check_before_build(recipe: Recipe, *, reward=None, loaded: dict | None = None) -> None:
    """Raise RecipeError for what the schema cannot see but a model build or the first
    step would trip on late: a model.path that is not there or holds unreadable weights,
    config_overrides of the wrong type, LoRA targets the model lacks, a sequence_parallel
    size the family or its attention heads cannot take, a reward that is not set or cannot
    be found, a dataset that cannot be loaded. `reward` (a function) and `loaded` (datasets by field,
    e.g. {"train": ...}) are what the Python caller gave instead (`mmrl.api.train`)."""
    _check_model(recipe.model)
    _check_lora_targets(recipe.model)
    _check_sequence_parallel(recipe)
    try:
        check_installed(recipe.trainer.loggers)
    except ValueError as exc:
        raise RecipeError(f"trainer.loggers: {exc}") from None
    check_reward_and_data(recipe, reward=reward, loaded=loaded)
    _check_strict_media(recipe)
    _check_pack(recipe)
    if recipe.algo.overlap == "thread" and (problem := overlap_problem(recipe)):
        raise RecipeError(problem)


def overlap_problem(recipe: Recipe) -> str | None:
    """Why `algo.overlap: thread` cannot run this recipe (a one-line message naming the
    field), or None. `auto` takes the thread exactly where this says nothing and the run
    has a GPU (`mmrl.buffer.overlap.overlap_mode`)."""
    algo, rollout, parallel = recipe.algo, recipe.rollout, recipe.parallel
    if algo.max_staleness < 1:
        return ("algo.overlap=thread samples the next batch while the update runs, which needs "
                "algo.max_staleness >= 1, got 0")
    if algo.behaviour != "sampler":
        return ("algo.overlap=thread needs algo.behaviour=sampler: the update changes the actor's weights while the "
                "next batch is sampled, so its behaviour log-probs cannot be recomputed on them")
    if rollout.backend not in ("auto", "hf_compiled"):
        return (f"algo.overlap=thread samples with the compiled rollout on an inference copy; rollout.backend "
                f"{rollout.backend!r} is not it: set rollout.backend=hf_compiled (or auto on a GPU)")
    if rollout.partial_tokens:
        return f"algo.overlap=thread and rollout.partial_tokens={rollout.partial_tokens} cannot be combined yet"
    if parallel.rollout_ranks:
        return (f"algo.overlap=thread and parallel.rollout_ranks={parallel.rollout_ranks} cannot be combined: "
                "rollout ranks already sample beside the update")
    if parallel.sequence_parallel > 1:
        return (f"algo.overlap=thread and parallel.sequence_parallel={parallel.sequence_parallel} cannot be "
                "combined: a sequence-parallel group shares its rollout through a collective")
    if rollout.env is not None:
        return "algo.overlap=thread samples single-turn rollouts only; a multi-turn rollout (rollout.env) needs off"
    return None


def _check_pack(recipe: Recipe) -> None:
    """model.pack: true needs a family whose packed batches are verified (padding_free)."""
    if recipe.model.pack is not True:
        return
    m = recipe.model
    path = _checkpoint_folder(m) or Path(m.path).expanduser()
    adapter = get_adapter(path if path.is_dir() else m.path, source=m.path)
    if not adapter.capabilities.padding_free:
        raise RecipeError(unpackable(adapter))
    if path.is_dir():  # a checkpoint: its layers may be of kinds the family's probe never packed
        if unverified := unverified_layer_kinds(adapter, _base_config(m)):
            raise RecipeError(unverified_packing(adapter, unverified))


def _check_strict_media(recipe: Recipe) -> None:
    """trainer.strict_media makes the step-0 media check an error: it needs the check on
    (`trainer.media_check`), a model that takes images and a single-turn run, where the
    first batch's conversations are known."""
    if not recipe.trainer.strict_media:
        return
    if not recipe.trainer.media_check:
        raise RecipeError("trainer.strict_media: it makes the step-0 media check an error, and "
                          "trainer.media_check=false skips that check; set one of them")
    if recipe.rollout.env is not None:
        raise RecipeError("trainer.strict_media: the step-0 media check runs on single-turn rollouts, and "
                          "rollout.env makes them multi-turn (the multi_turn probe of `mmrl doctor` checks those)")
    m = recipe.model
    path = _checkpoint_folder(m) or Path(m.path).expanduser()
    adapter = get_adapter(path if path.is_dir() else m.path, source=m.path)
    if not adapter.is_multimodal:
        raise RecipeError(f"trainer.strict_media: the model ({adapter.family}) takes no images or video, so there "
                          "is no media to check; leave it false")


def _check_model(m: ModelConfig) -> None:
    path = _checkpoint_folder(m) or Path(m.path).expanduser()
    looks_like_path = "/" in m.path or m.path.startswith((".", "~"))
    if not m.random_init:
        if path.is_file():
            raise RecipeError(f"model.path: {m.path} is a file; give a checkpoint folder")
        if not path.is_dir():
            raise RecipeError(f"model.path: no checkpoint folder {m.path} (to build a family's tiny model "
                              "instead, name the family and set model.random_init=true)")
        if m.config_overrides or m.tiny_vocabulary:
            key = "config_overrides" if m.config_overrides else "tiny_vocabulary"
            raise RecipeError(f"model.{key}: applies to random_init=true builds only")
        problem = weights_problem(path)
        if problem:
            raise RecipeError(f"model.path: {problem}")
    elif looks_like_path and not path.exists():
        raise RecipeError(f"model.path: no checkpoint folder {m.path} (and it is not a family name)")

    try:
        get_adapter(path if path.is_dir() else m.path, source=m.path)  # a family, or a checkpoint of one
    except RegistryError as exc:
        raise RecipeError(f"model.path: {exc}") from None
    if m.random_init and m.config_overrides:
        problem = _override_problem(_base_config(m), m.config_overrides, "model.config_overrides")
        if problem:
            raise RecipeError(problem)


def _check_lora_targets(m: ModelConfig) -> None:
    """model.lora_targets against the model's module names, on an empty (meta-device)
    model of its config: no weights are drawn or read, so a 7B costs what a tiny one does."""
    if m.lora_scope == "none" or not m.lora_targets:
        return
    import torch

    config, adapter = _built_config(m)
    with torch.device("meta"):
        model = adapter.model_class()._from_config(config)
    try:
        lora_target_modules(model, m.lora_scope, adapter, m.lora_targets)
    except ValueError as exc:
        raise RecipeError(f"model.lora_targets: {exc}") from None


def _check_sequence_parallel(recipe: Recipe) -> None:
    """parallel.sequence_parallel against the family and its config's attention heads, from
    the config alone (the model is not built)."""
    size = recipe.parallel.sequence_parallel
    if size == 1:
        return
    config, adapter = _built_config(recipe.model)
    if adapter.sequence_parallel is None:
        raise RecipeError(f"parallel.sequence_parallel: {size} is set, but the {adapter.family} adapter opts out "
                          "of sequence parallelism")
    if adapter.sequence_parallel.gather_mixers:  # no head split: any number of heads
        return
    if unverified := unverified_layer_kinds(adapter, config):
        raise RecipeError(unverified_ulysses(adapter, unverified))
    from mmrl.parallel.ulysses import heads_problem  # the compute layer, reached only when asked

    problem = heads_problem(config.get_text_config(), adapter.sequence_parallel.heads_attrs, size)
    if problem:
        raise RecipeError(f"parallel.sequence_parallel: {problem}")


def _built_config(m: ModelConfig):
    """The config the model of `m` is built with (config_overrides applied), and its adapter."""
    config = _base_config(m)
    adapter = adapter_for_config(config)
    if m.random_init and m.config_overrides:
        config = customized_config(config, adapter, m.config_overrides)
    return config, adapter


def check_reward_and_data(recipe: Recipe, splits: tuple[str, ...] = ("train", "validation", "eval"), *,
                          reward=None, loaded: dict | None = None) -> None:
    """Raise RecipeError, one line naming the field and the file or row, when the reward
    is not set (and no function is given: `reward`) or cannot be found, or needs an
    argument no column of data.train fills, or a dataset of `splits` cannot be loaded
    (every row validated, every image opened; `loaded`: datasets given in memory). The
    datasets stay cached by `load_prompts`, so the trainer does not load them twice."""
    reward_fn = reward if reward is not None else recipe_reward(recipe)
    data = recipe.data
    for field, source, split in (("train", data.train, "train"), ("validation", data.validation, "validation"),
                                 ("eval", data.eval, "test")):
        given = (loaded or {}).get(field)
        if field not in splits or (given is None and source is None):
            continue
        path = source.path if isinstance(source, DataSource) else source
        if given is None and isinstance(path, str) and path.startswith(IN_MEMORY):
            raise RecipeError(f"data.{field}: {path} was a dataset given to mmrl.train() in Python; "
                              "pass it again there, or name a file, folder or synthetic task here")
        try:
            dataset = given if given is not None else load_prompts(source, split=split)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise RecipeError(f"data.{field}: {exc}") from None
        if field == "eval":
            problem = shuffle_control_problem(list(dataset))
            if problem:
                raise RecipeError(f"data.eval: {dataset.name or 'data.eval'}: {problem}")
        if field == "train" and len(dataset) < data.prompts_per_step:
            raise RecipeError(f"data.prompts_per_step: {data.prompts_per_step} prompts per step, but "
                              f"{dataset.name or 'data.train'} has {len(dataset)} rows")
        if field == "train":
            _check_reward_arguments(reward_fn, dataset, "reward" if reward is not None else "reward.name")


def _check_reward_arguments(reward_fn, dataset, field: str) -> None:
    """A RecipeError when the reward requires an argument that neither a column of the
    training rows nor the trainer gives (it would fail at step 1)."""
    columns = set(dataset[0]) - {"prompt", "answer", "images", "videos"}
    missing = missing_fields(reward_fn, columns | set(TRAINER_FIELDS))
    if missing:
        listed = ", ".join(sorted(columns)) or "none"
        raise RecipeError(f"{field}: {reward_name(reward_fn)} needs {', '.join(map(repr, missing))}, which is no "
                          f"column of data.train (its other columns: {listed}) nor one of {', '.join(TRAINER_FIELDS)}")


def recipe_reward(recipe: Recipe):
    """The reward function `reward:` names, resolved against the recipe's folder; a
    RecipeError naming the field when it is not set or does not resolve."""
    reward = recipe.reward
    if reward.name is None:
        raise RecipeError(f"reward.name: not set; name what scores the completions: a built-in "
                          f"({', '.join(BUILTIN_REWARDS)}), path/to/file.py:function or package.module:function "
                          "(docs/training.md#rewards)")
    try:
        return get_reward(reward.name, recipe.folder, **reward.options)
    except (ValueError, TypeError) as exc:
        options = "has no option" in str(exc) or reward.name == "weighted"
        field = "reward.options" if options else "reward.name"
        raise RecipeError(f"{field}: {exc}") from None


# Defaults fit for the tiny CPU recipes, not for a real model: a run that leaves them
# unset is told which ones it uses.
TOY_DEFAULTS = {("optim", "lr"): "a real model usually wants 1e-6 to 1e-5",
                ("model", "dtype"): "bfloat16 halves the memory of a real model on a GPU"}


def unset_toy_defaults(recipe: Recipe) -> str | None:
    """A one-line notice naming the `TOY_DEFAULTS` that `recipe` leaves unset, or None."""
    unset = []
    for (section, field), advice in TOY_DEFAULTS.items():
        config = getattr(recipe, section)
        if field not in config.model_fields_set:
            unset.append(f"{section}.{field}={getattr(config, field)} ({advice})")
    if not unset:
        return None
    return "note: the recipe leaves these at their defaults: " + "; ".join(unset)


def weights_problem(folder: Path) -> str | None:
    """Why the checkpoint folder's weights cannot be loaded, from the safetensors headers
    alone (no tensor is read), or None."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
            return f"{folder} holds only pickle-format weights (.bin/.pt); mmrl loads safetensors only"
        return f"{folder} holds no *.safetensors weights"
    for file in files:
        size = file.stat().st_size
        try:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(handle.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (struct.error, ValueError, KeyError, TypeError, IndexError):
            return f"{file}: not a readable safetensors file (truncated or corrupt header)"
        if 8 + length + end != size:
            return f"{file}: truncated or padded ({size} bytes; its header describes {8 + length + end})"
    return None


def _checkpoint_folder(m: ModelConfig) -> Path | None:
    """model.path's checkpoint folder (a hub id's snapshot in the HF cache), or None."""
    try:
        return checkpoint_folder(m.path, weights=not m.random_init, trust_remote_code=m.trust_remote_code)
    except HubError as exc:
        raise RecipeError(f"model.path: {exc}") from None


def _base_config(m: ModelConfig):
    """The config a random init of `m` starts from (the family's tiny one, or a checkpoint's)."""
    path = _checkpoint_folder(m) or Path(m.path).expanduser()
    if path.is_dir():
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code)
        except Exception as exc:
            if "StrictDataclassError" not in {cls.__name__ for cls in type(exc).__mro__}:
                raise
            raise RecipeError(f"model.path: {path / 'config.json'} is not a valid config "
                              f"({one_line(exc.__cause__ or exc, 300)})") from None
    try:
        adapter = get_adapter(m.path)
    except RegistryError as exc:
        raise RecipeError(f"model.path: {exc}") from None

    with vocabulary(**m.tiny_vocabulary) if m.tiny_vocabulary else nullcontext():
        return adapter.tiny().config


_KINDS = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (str, "a string"),
          ((list, tuple), "a list"))


def _override_problem(config, overrides: dict[str, Any], where: str) -> str | None:
    """The first override whose key the config lacks or whose value has another type."""
    for key, value in overrides.items():
        field = f"{where}.{key}"
        if not hasattr(config, key):
            return f"{field}: {type(config).__name__} has no such field"
        current = getattr(config, key)
        if hasattr(current, "to_dict"):
            if not isinstance(value, dict):
                return f"{field}: a sub-config; give a mapping of its fields, got {type(value).__name__}"
            problem = _override_problem(current, value, field)
            if problem:
                return problem
            continue
        if current is None or value is None:
            continue
        for kind, words in _KINDS:
            if isinstance(current, kind):
                fits = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
                if kind is float:
                    fits = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not fits:
                    return f"{field}: expected {words} (the config has {current!r}), got {value!r}"
                break
    return None


def check_prompt_lengths(recipe: Recipe, datasets: dict[str, Any], loaded: tuple[Any, Any]) -> None:
    """RecipeError naming the split, row and file of the longest prompt that leaves no
    room for `rollout.max_new_tokens` in the model's context; `datasets` by data field
    (None: the split is not set), `loaded` the model's processor and config as
    `recipe_config` gives them."""
    if not any(dataset is not None for dataset in datasets.values()):
        return
    tokenizer, text_config = getattr(loaded[0], "tokenizer", loaded[0]), loaded[1].get_text_config()
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
