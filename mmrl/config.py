"""The recipe schema: frozen, validated sections loaded from YAML plus `key=value` overrides.

    cfg = load_recipe("recipes/tiny_vlm_count.yaml", ["rollout.backend=vllm", "optim.lr=1e-4"])

Every field has a default, so a recipe states only what differs. Unknown keys and bad
values are errors that name the dotted field (`optim.lr: Input should be a valid number`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Section):
    # A local checkpoint directory, or a family name with `random_init: true`.
    path: str
    random_init: bool = False
    # Overrides applied to the (tiny or loaded) config before a random init; nested
    # sections by name: {"text_config": {"hidden_size": 64}}.
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    # The tiny tokenizer of a random init: {"characters": "0123...", "words": [...]}
    # (see mmrl.tiny.vocabulary); empty keeps the family's default.
    tiny_vocabulary: dict[str, Any] = Field(default_factory=dict)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # None: SDPA where the model class supports it, else eager.
    attn_implementation: str | None = None
    freeze: list[Literal["vision", "projector", "language", "embed", "lm_head"]] = Field(default_factory=list)
    lora_scope: Literal["none", "language", "vision", "all"] = "none"
    lora_rank: int = Field(8, gt=0)
    gradient_checkpointing: bool = False
    # Encode each prompt's images/videos once per micro-batch and reuse the features for
    # all its samples (rollout and update), where the family declares media_sharing.
    share_media: bool = True
    min_pixels: int | None = None
    max_pixels: int | None = None
    trust_remote_code: bool = False


class DataConfig(_Section):
    # A .jsonl/.parquet file, a dataset folder, or a synthetic task such as
    # "synthetic:count_shapes?n=2048&seed=0".
    train: str
    eval: str | None = None
    # Checked every `trainer.eval_every` steps (early stopping); defaults to `eval`. Keep
    # it apart from `eval` so the final figure is not measured on the stopping set.
    validation: str | None = None
    prompts_per_step: int = Field(16, gt=0)
    shuffle_seed: int = 0


class RolloutConfig(_Section):
    backend: Literal["hf", "vllm"] = "hf"
    samples_per_prompt: int = Field(8, gt=0)
    max_new_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # Fraction of memory vLLM may take; ignored by the hf backend.
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)


class AlgoConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    # Updates per rollout batch; with 1 the ratio is exactly 1 and no old log-probs are needed.
    epochs_per_rollout: int = Field(1, gt=0)
    micro_batch_size: int = Field(64, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    entropy_coef: float = 0.0
    filter_uniform_groups: bool = False
    gamma: float = 1.0
    lam: float = 0.95


class RewardConfig(_Section):
    # A built-in reward name or a dotted path "package.module:function".
    name: str = "counting"
    options: dict[str, Any] = Field(default_factory=dict)


class OptimConfig(_Section):
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    critic_lr: float = Field(1e-3, gt=0)
    # Learning-rate multipliers by model part, e.g. {vision: 10, projector: 10}: a
    # random-init vision tower learns much slower than the language model at one rate.
    lr_multipliers: dict[Literal["vision", "projector", "language", "embed", "lm_head"], float] = Field(
        default_factory=dict
    )


class TrainerConfig(_Section):
    steps: int = Field(100, gt=0)
    seed: int = 0
    output_dir: str = "runs/default"
    log_every: int = Field(1, gt=0)
    eval_every: int = Field(0, ge=0)
    save_every: int = Field(0, ge=0)
    # Stop early once the greedy eval accuracy reaches this (checked every eval_every).
    target_accuracy: float | None = None
    # Wall-clock budget in seconds for the training loop (None: no limit).
    time_budget_s: float | None = None
    resume: bool = False
    export: bool = True
    threads: int | None = None
    progress: bool = True


class ParallelConfig(_Section):
    # Ranks that split every sequence (Ulysses sequence parallelism): it must divide the
    # number of processes and the text model's attention heads (`mmrl.parallel.ulysses`).
    sequence_parallel: int = Field(1, gt=0)

    def check_model(self, adapter, text_config) -> None:
        """Raise RecipeError naming the field when the model cannot be split this way."""
        size = self.sequence_parallel
        if size == 1:
            return
        if adapter.sequence_parallel is None:
            raise RecipeError(f"parallel.sequence_parallel: {size} is set, but the {adapter.family} adapter opts out "
                              "of sequence parallelism")
        from mmrl.parallel.ulysses import heads_problem

        problem = heads_problem(text_config, adapter.sequence_parallel.heads_attrs, size)
        if problem:
            raise RecipeError(f"parallel.sequence_parallel: {problem}")


class Recipe(_Section):
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    reward: RewardConfig = RewardConfig()
    optim: OptimConfig = OptimConfig()
    trainer: TrainerConfig = TrainerConfig()
    parallel: ParallelConfig = ParallelConfig()

    @field_validator("trainer")
    @classmethod
    def _output_dir_is_set(cls, value: TrainerConfig) -> TrainerConfig:
        if not value.output_dir:
            raise ValueError("output_dir must not be empty")
        return value


class RecipeError(ValueError):
    """A recipe file or override is malformed; the message names the file or field."""


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` entries (values parsed as YAML scalars) into a nested dict."""
    values = _deep_copy(values)
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise RecipeError(f"override {override!r} must read key=value (e.g. optim.lr=1e-4)")
        node = values
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {override!r}: {part!r} is not a section")
        node[parts[-1]] = _parse_value(raw)
    return values


def _deep_copy(values: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in values.items()}


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or start from defaults), apply overrides, validate."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file not found: {path}")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
        if not isinstance(values, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(values).__name__}")
    values = apply_overrides(values, overrides or [])
    try:
        return Recipe.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        where = f"{path}: " if path is not None else ""
        raise RecipeError(f"{where}{field}: {first['msg']}") from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
