"""`mmrl eval`: a recipe's evaluation of a saved policy, without training and without
touching the recipe's run folder.

    mmrl eval recipes/tiny_vlm_count.yaml --checkpoint runs/tiny_vlm_count/final
    mmrl eval RECIPE --checkpoint runs/X/checkpoints/step_000200 eval.samples=8 --out eval.json
    metrics = evaluate_checkpoint(load_recipe(RECIPE), "runs/X/final")   # {"eval/accuracy": ..., ...}

The checkpoint is an exported HF folder (`final/`: config.json and safetensors weights,
LoRA merged, with its processor) or a step checkpoint (`checkpoints/step_N/`, verified
against its manifest), whose actor weights load into the model the recipe's `model`
section builds (its LoRA included). The split is the recipe's `data.eval` (or
`data.validation`); metrics are `mmrl.evaluation`'s with the controls, named `eval/...`
(or `validation/...`) as the trainer names them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed

from mmrl.build import build_model, build_recipe_model
from mmrl.config import Recipe, RecipeError
from mmrl.data import load_prompts
from mmrl.engine import Engine
from mmrl.evaluation import Evaluator, reward_scorer, rollout_generator
from mmrl.logs import capped_threads
from mmrl.lora import apply_lora
from mmrl.parallel import init_distributed
from mmrl.recipe_checks import check_reward_and_data, recipe_reward, weights_problem
from mmrl.rollout import make_rollout, rollout_options

from mmrl.runs import verify_checkpoint
from mmrl.settle import resolve
from mmrl.trainer import environment_factory

SPLITS = ("eval", "validation")
# A step checkpoint's actor weights (`mmrl.checkpoint`, `Engine.save_checkpoint`).
ACTOR_WEIGHTS = Path("actor") / "model.safetensors"


def checkpoint_kind(path: Path) -> str:
    """"export" (a HF folder) or "step" (a trainer checkpoint); a RecipeError naming
    `--checkpoint` for anything else."""
    if not path.is_dir():
        raise RecipeError(f"--checkpoint: no folder {path}")
    if (path / ACTOR_WEIGHTS).is_file():
        problem = verify_checkpoint(path)
        if problem:
            raise RecipeError(f"--checkpoint: {path} is a step checkpoint that does not verify: {problem}")
        return "step"
    if (path / "config.json").is_file():
        problem = weights_problem(path)
        if problem:
            raise RecipeError(f"--checkpoint: {problem}")
        return "export"
    if (path / "final").is_dir() or (path / "checkpoints").is_dir():
        raise RecipeError(f"--checkpoint: {path} is a run folder; give its final/ or checkpoints/step_N/ folder")
    raise RecipeError(f"--checkpoint: {path} holds neither an exported model (config.json and *.safetensors) "
                      f"nor a step checkpoint ({ACTOR_WEIGHTS})")


def _policy(recipe: Recipe, path: Path, kind: str, device):
    """The saved policy as a built model."""
    m = recipe.model
    if kind == "export":
        options = {k: v for k, v in (("min_pixels", m.min_pixels), ("max_pixels", m.max_pixels)) if v is not None}
        return build_model(path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                           processing_options=options, trust_remote_code=m.trust_remote_code, device=device)
    from safetensors.torch import load_file

    built = build_recipe_model(m, seed=recipe.trainer.seed, device=device)
    if m.lora_scope != "none":
        built.model = apply_lora(built.model, scope=m.lora_scope, rank=m.lora_rank, alpha=m.lora_alpha,
                                 targets=m.lora_targets, adapter=built.adapter)
    try:
        built.model.load_state_dict(load_file(str(path / ACTOR_WEIGHTS), device=str(device)))
    except RuntimeError as exc:
        first = str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else str(exc)
        raise RecipeError(f"--checkpoint: {path / ACTOR_WEIGHTS} does not fit the model the recipe's model "
                          f"section builds ({first})") from None
    return built


def evaluate_checkpoint(recipe: Recipe, checkpoint: str | Path, *, split: str = "eval") -> dict[str, Any]:
    """The metrics of the policy in `checkpoint` on the recipe's `split`; nothing is written."""
    if split not in SPLITS:
        raise RecipeError(f"--split: {split!r} is not one of {', '.join(SPLITS)}")
    source = recipe.data.eval if split == "eval" else recipe.data.validation
    if source is None:
        other = "validation" if split == "eval" else "eval"
        raise RecipeError(f"data.{split}: not set; give one (data.{split}=...) or pass --split {other}")
    path = Path(checkpoint).expanduser()
    kind = checkpoint_kind(path)
    check_reward_and_data(recipe, splits=(split,))
    environment = environment_factory(recipe)
    if recipe.trainer.threads:
        torch.set_num_threads(capped_threads(recipe.trainer.threads))
    dist = init_distributed(sequence_parallel=recipe.parallel.sequence_parallel)
    r, m = recipe, recipe.model
    built = _policy(recipe, path, kind, dist.device)
    settled = resolve(recipe, dist, adapter=built.adapter)  # as the trainer settles them (`mmrl.settle`)
    engine = Engine(built, dist, share_media=m.share_media, **settled.engine_options())
    backend = settled.rollout_backend
    rollout = make_rollout(backend, engine, built.processing, requested=r.rollout.backend,
                           **rollout_options(r.rollout, backend, settled.rollout_decode))
    agent = None
    if environment is not None:
        from mmrl.rollout.agent import AgentRollout

        agent = AgentRollout(rollout, built.processing, environment, max_turns=r.rollout.max_turns,
                             max_tokens=r.rollout.max_tokens, keep_cache=r.rollout.keep_cache)
    evaluator = Evaluator(r.eval, dist, max_new_tokens=r.rollout.max_new_tokens,
                          generate=rollout_generator(rollout, agent, max_pixels=m.max_pixels),
                          score=reward_scorer(recipe_reward(r), built.processing), progress=r.trainer.progress)
    dataset = load_prompts(source, split="test" if split == "eval" else "validation")
    metrics = evaluator.run(list(dataset), dataset, context=f"evaluation of {path}", controls=True)
    if dist.distributed:
        # No rank may leave while another still talks to it (gloo aborts the process).
        dist.barrier()
        torch.distributed.destroy_process_group()
    return {"checkpoint": str(path), "split": split, "rows": len(dataset),
            **{f"{split}/{name}": value for name, value in metrics.items()}}


__all__ = ["checkpoint_kind", "evaluate_checkpoint"]
