"""Exported policies that decode as they were trained, and step checkpoints converted.

    export_policy(actor, processing, output_dir / "final", dist, recipe=recipe)
    config = decoding_config(model.generation_config, processing, max_new_tokens=64)
    export_checkpoint(Path("runs/x/checkpoints/step_000200"), Path("out"))    # mmrl export
    export_checkpoint(Path("runs/x"), Path("out"), adapter_only=True)        # newest, LoRA only

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
so a crash never leaves a half-written export where a server would load it. It is a
hub-format folder: a `README.md` model card (library, base model, pipeline tag) and the
run's `recipe.yaml` beside the weights, ready for `huggingface-cli upload`.

`export_checkpoint` (`mmrl export CHECKPOINT OUT`) turns a step checkpoint (or a run
folder's newest one that verifies) into the same folder: the run's `recipe.yaml` rebuilds
the policy as the trainer built it (base weights, LoRA wrapping), the checkpoint's actor
weights are loaded into it (a LoRA run on a base checkpoint saved its adapter only), and
the result is written merged, or for a LoRA run with `adapter_only` as a PEFT adapter
folder (`adapter_config.json`, `adapter_model.safetensors`) that loads onto its base.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import yaml

from mmrl.atomic import atomic_folder
from mmrl.build import build_model
from mmrl.checkpoint import STATE_FILE, record_dtype
from mmrl.checks import sample_images
from mmrl.config import Recipe, dump_recipe, load_recipe
from mmrl.lora import apply_lora, merge_lora, merged_state_dict
from mmrl.parts import freeze
from mmrl.processing import batch_differences
from mmrl.runs import RECIPE_FILE, newest_checkpoint, verify_checkpoint

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


class ExportError(ValueError):
    """A checkpoint cannot be exported; the message says why, naming the path."""


def export_policy(actor, processing, path: Path, dist, *, recipe: Recipe | None = None) -> Path:
    """The trained policy as a HF folder (LoRA merged) that decodes as trained; every
    rank calls it (sharded weights are gathered), the main rank writes."""
    state = actor.full_state_dict()
    with dist.together():  # a failed write (a full disk) reaches every rank: none waits for rank 0
        if dist.is_main:
            model = actor.model
            if hasattr(model, "get_base_model"):
                model = model.get_base_model()
            with atomic_folder(Path(path)) as temp:
                model.save_pretrained(temp, state_dict=merged_state_dict(model, state), safe_serialization=True)
                if actor.half_dtype is not None:
                    record_dtype(temp / "config.json", actor.half_dtype)
                save_decoding(temp, model, processing, recipe.rollout.max_new_tokens if recipe else None)
                if recipe is not None:
                    write_card(temp, recipe, processing, adapter_only=False)
    return path


def export_checkpoint(source: Path, out: Path, *, adapter_only: bool = False) -> Path:
    """A step checkpoint (or a run folder's newest good one) as a HF folder at `out`:
    merged weights, or with `adapter_only` a LoRA run's PEFT adapter. Raises ExportError."""
    step = find_checkpoint(Path(source))
    recipe_file = step.parent.parent / RECIPE_FILE
    if not recipe_file.is_file():
        raise ExportError(f"{source}: no {RECIPE_FILE} in the run folder {step.parent.parent} (it rebuilds the "
                          "policy the checkpoint's weights belong to)")
    recipe = load_recipe(recipe_file)
    lora = recipe.model.lora_scope != "none"
    if adapter_only and not lora:
        raise ExportError(f"{source}: --adapter-only needs a LoRA run, and this one trained no adapter "
                          "(model.lora_scope: none); export it merged")
    if adapter_only and recipe.model.random_init:
        # Its base is drawn from a seed, saved nowhere that PEFT could load it from.
        raise ExportError(f"{source}: --adapter-only needs a base checkpoint to apply the adapter to, and this run's "
                          "base is a random init (model.random_init: true); export it merged")
    out = Path(out)
    check_output(out, step, recipe)
    built = policy_from_recipe(recipe)
    load_actor_weights(built.model, step / "actor" / "model.safetensors")
    with atomic_folder(out) as temp:
        if adapter_only:
            built.model.save_pretrained(temp, safe_serialization=True)
            base = built.model.get_base_model()
        else:
            base = merge_lora(built.model) if lora else built.model
            base.save_pretrained(temp, safe_serialization=True)
        save_decoding(temp, base, built.processing, recipe.rollout.max_new_tokens)
        write_card(temp, recipe, built.processing, adapter_only=adapter_only, step=step.name)
    return out


def check_output(out: Path, step: Path, recipe: Recipe) -> None:
    """Refuse an output folder whose replacement would lose anything but an earlier
    mmrl export (weights beside a `recipe.yaml`): the run, its base model, other files."""
    resolved, run = out.resolve(), step.resolve().parent.parent
    checkpoints = run / "checkpoints"
    if resolved in (run, checkpoints) or resolved in run.parents or checkpoints in resolved.parents:
        raise ExportError(f"{out}: the output would replace the run or its checkpoints; choose another folder")
    if run in resolved.parents and resolved != run / "final":
        # A folder mmrl does not know inside the run would stop the run's resume and overwrite.
        raise ExportError(f"{out}: inside the run folder {run}; choose a folder outside it (or its final/)")
    if not recipe.model.random_init and resolved == Path(recipe.model.path).expanduser().resolve():
        raise ExportError(f"{out}: is the run's base model (model.path); choose another folder")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"{out}: is a file; give a folder")
        weights = (out / "config.json").is_file() or (out / "adapter_config.json").is_file()
        if any(out.iterdir()) and not (weights and (out / RECIPE_FILE).is_file()):
            raise ExportError(f"{out}: holds other files than an mmrl export; choose another folder")


def find_checkpoint(source: Path) -> Path:
    """The step checkpoint `source` names: itself, or a run folder's newest one that verifies."""
    if not source.is_dir():
        raise ExportError(f"{source}: not a folder (give a step checkpoint, checkpoints/step_N, or a run folder)")
    if (source / STATE_FILE).is_file():
        problem = verify_checkpoint(source)
        if problem:
            raise ExportError(f"{source}: the checkpoint does not verify ({problem})")
        return source
    if (source / RECIPE_FILE).is_file():
        found, skipped = newest_checkpoint(source / "checkpoints")
        if found is None:
            why = f"; skipped: {', '.join(f'{p.name} ({w})' for p, w in skipped)}" if skipped else ""
            raise ExportError(f"{source}: the run folder holds no step checkpoint that verifies (runs save them with "
                              f"trainer.save_every; its final/ is already an export){why}")
        for bad, why in skipped:  # as resume says it: an older step is exported, not silently
            print(f"skipped checkpoint {bad}: {why}; exporting {found.name}", file=sys.stderr, flush=True)
        return found
    raise ExportError(f"{source}: neither a step checkpoint (no {STATE_FILE}) nor a run folder (no {RECIPE_FILE})")


def policy_from_recipe(recipe: Recipe):
    """The policy as the trainer builds it (`Trainer._build`), on the CPU: the base
    model (its checkpoint, or the random init the seed draws), frozen parts, LoRA."""
    m = recipe.model
    options = {k: v for k, v in (("min_pixels", m.min_pixels), ("max_pixels", m.max_pixels)) if v is not None}
    built = build_model(m.path, random_init=m.random_init, dtype=m.dtype, attn_implementation=m.attn_implementation,
                        seed=recipe.trainer.seed, processing_options=options, trust_remote_code=m.trust_remote_code,
                        config_overrides=m.config_overrides or None, tiny_vocabulary=m.tiny_vocabulary or None)
    if m.freeze:
        freeze(built.model, parts=m.freeze, adapter=built.adapter)
    if m.lora_scope != "none":
        built.model = apply_lora(built.model, scope=m.lora_scope, rank=m.lora_rank, adapter=built.adapter)
    return built


def load_actor_weights(model, weights: Path) -> None:
    """A checkpoint's actor weights into `model` (built by `policy_from_recipe`): every
    weight it holds must be the model's, and what it lacks must be frozen (a LoRA run's
    base, which `model` already holds)."""
    from safetensors.torch import load_file

    if not weights.is_file():
        raise ExportError(f"{weights}: missing (not a checkpoint written by mmrl train)")
    state = load_file(str(weights))
    known = model.state_dict()
    unknown = sorted(set(state) - set(known))
    if unknown:
        raise ExportError(f"{weights}: {len(unknown)} weights do not belong to the recipe's model, e.g. {unknown[0]}")
    trained = [name for name, p in model.named_parameters(remove_duplicate=False)
               if p.requires_grad and name not in state]
    if trained:
        raise ExportError(f"{weights}: lacks {len(trained)} trained weights, e.g. {trained[0]}")
    model.load_state_dict(state, strict=False)


def write_card(path: Path, recipe: Recipe, processing, *, adapter_only: bool, step: str | None = None) -> None:
    """A hub model card (`README.md`, with its metadata block) and the run's recipe."""
    m = recipe.model
    # The hub takes a hub id as base_model; a local folder or a random init names none.
    base = None if m.random_init or Path(m.path).exists() else m.path
    metadata = {"library_name": "peft" if adapter_only else "transformers",
                **({"base_model": base} if base else {}),
                "pipeline_tag": "image-text-to-text" if processing.is_multimodal else "text-generation",
                "tags": ["mmrl", "reinforcement-learning", recipe.algo.advantage]}
    what = "a LoRA adapter" if adapter_only else ("LoRA merged into the weights" if m.lora_scope != "none"
                                                  else "full weights")
    loader = ("AutoModelForImageTextToText" if processing.is_multimodal else "AutoModelForCausalLM")
    usage = (f"base = {loader}.from_pretrained(\"{base or '<base model>'}\")\n"
             "model = PeftModel.from_pretrained(base, \"<this folder>\")" if adapter_only
             else f"model = {loader}.from_pretrained(\"<this folder>\")")
    card = (f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---\n\n"
            f"# {recipe.model.path} trained with mmrl ({recipe.algo.advantage})\n\n"
            f"Reward `{recipe.reward.name}`, {recipe.trainer.steps} steps planned"
            + (f", exported from checkpoint `{step}`" if step else "") + f"; {what}.\n"
            "`generation_config.json` holds the decoding the policy was trained with (blocked special tokens "
            "as `suppress_tokens`, the stop ids as `eos_token_id`), and the processor its pixel budget.\n\n"
            f"```python\nfrom transformers import AutoProcessor, {loader}\n"
            + ("from peft import PeftModel\n" if adapter_only else "")
            + f"{usage}\nprocessor = AutoProcessor.from_pretrained(\"<this folder>\")\n```\n\n"
            f"The run's recipe is `{RECIPE_FILE}`.\n")
    (path / "README.md").write_text(card)
    (path / RECIPE_FILE).write_text(dump_recipe(recipe))


def save_decoding(path: Path, model, processing, max_new_tokens: int | None = None) -> None:
    """Write the processor (with its pixel budget) and the decoding constraints of
    `processing` into the HF folder `path`; warn when the saved processor cannot make
    the trained image tokens."""
    processor = processing.processor_with_budget()
    problem = budget_problem(processing, processor)
    if problem:
        warnings.warn(f"export: the saved processor does not reproduce the trained pixel budget "
                      f"(min_pixels={processing.min_pixels}, max_pixels={processing.max_pixels}); served with "
                      f"its defaults it makes other inputs ({problem})", stacklevel=2)
    processor.save_pretrained(path)
    if getattr(model, "can_generate", lambda: False)():
        decoding_config(model.generation_config, processing, max_new_tokens).save_pretrained(path)
