"""The recipe schema: frozen, validated sections loaded from YAML plus `key=value` overrides.

    cfg = load_recipe("recipes/tiny_vlm_count.yaml", ["rollout.backend=vllm", "optim.lr=1e-4"])

Every field has a default, so a recipe states only what differs. Unknown keys and bad
values are errors that name the dotted field (`optim.lr: Input should be a valid number`);
a YAML error, or a key given twice, names the line and column. Values are not coerced
(`true` is no number, `1` no switch, `"5"` no integer; non-finite floats are refused), and
what can be told from the recipe alone (group-relative advantages need samples that can
differ) is refused here, before anything is built. What needs the filesystem, the model's
config or the data is checked in `mmrl.recipe_checks` (`check_before_build`), before the slow
model build. `same_run` tells whether a saved recipe is the run being resumed. A recipe's
`settled:` section (`SettledConfig`) holds what a run settled for the settings left to mmrl
(`mmrl.settle`); `dump_recipe` writes it last, with the reason for each value.
"""

from __future__ import annotations

import math
import os
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from mmrl.data.layouts import DataSource, DataSpec
from mmrl.errors import one_line

# What a data field reads when `mmrl.train` was given that dataset in memory (mmrl/api.py).
IN_MEMORY = "memory:"

# The keys of `mmrl.tiny.vocabulary`, and what each holds.
TINY_VOCABULARY_KEYS = {"characters": str, "words": list}


# A seed goes to torch, Python's and NumPy's generators: a non-negative 32-bit integer fits all.
SEED = Field(0, ge=0, le=2**32 - 1)
# Advantages normalized within each prompt's group of samples: a group of one sample, or of
# samples that are all alike (greedy decoding), gives every sample a zero advantage.
GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo")


def _scalar_kinds(annotation) -> tuple[set[type], tuple]:
    """The plain scalar types (int, float, bool, str) and the literal values a field admits."""
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    kinds, literals = set(), ()
    for arg in args:
        if get_origin(arg) is Literal:
            literals += get_args(arg)
        elif arg in (int, float, bool, str):
            kinds.add(arg)
    return kinds, literals


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse values pydantic would quietly convert: `true` for a number (read as 1),
        `1` or "yes" for a switch, a string for an integer, and a float that is not finite.
        A numeric string stays a number for float fields: YAML reads `1e-6` as a string."""
        kinds, literals = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if not kinds or value is None:
            return value
        numbers = kinds & {int, float}
        if isinstance(value, bool):
            if bool not in kinds and numbers:
                raise ValueError(f"expected a number, got a boolean ({str(value).lower()})")
            return value
        if bool in kinds and not numbers and str not in kinds and not (isinstance(value, str) and value in literals):
            raise ValueError(f"expected true or false, got {value!r}")
        if numbers == {int} and str not in kinds and isinstance(value, str) and value not in literals:
            raise ValueError(f"expected an integer, got a string ({value!r})")
        if numbers == {int} and isinstance(value, float) and value.is_integer():
            raise ValueError(f"expected an integer, got {value}")  # a fraction: pydantic says so
        if float in kinds and isinstance(value, (float, str)) and str not in kinds:
            try:
                number = float(value)
            except ValueError:
                return value  # not a number at all: pydantic says so
            if not math.isfinite(number):
                raise ValueError(f"expected a finite number, got {value}")
        return value


class ModelConfig(_Section):
    # A local checkpoint directory, a hub id `org/name[@revision]` (read through the HF
    # cache, mmrl/hub.py), or a family name with `random_init: true`.
    path: str = Field(min_length=1)
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
    # LoRA's scale is lora_alpha / lora_rank; None: 2 x lora_rank (a scale of 2).
    lora_alpha: float | None = Field(None, gt=0)
    # Dropout on the adapters' inputs in the actor's passes (kept where the engine switches
    # every other dropout off: `mmrl.lora.keep_lora_dropout`); 0 is what RL trainers use.
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    # Leaf names of the linear modules LoRA wraps inside the scope's parts (e.g.
    # [q_proj, v_proj]); empty: the family's declared targets (`ModelAdapter.lora`).
    lora_targets: list[str] = Field(default_factory=list)
    # Activation checkpointing. "auto": off in one GPU process until an update runs out
    # of memory (then on, and that mini-batch redone), on for sharded GPU ranks, off on
    # the CPU.
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    # Encode each prompt's images/videos once per micro-batch and reuse the features for
    # all its samples (rollout and update), where the family declares media_sharing.
    share_media: bool = True
    # Padding-free log-probs in the engine (`mmrl.engine.packing`), for families that
    # declare padding_free: sequences packed into rows of at most `pack_tokens` tokens
    # (the speed-up and its row widths: docs/performance.md, "Packing and compiled layers").
    # "auto": on a GPU in one process for text families (the VL-3B recipe, whose rows are
    # about the same length, stepped slower packed: docs/training.md).
    pack: bool | Literal["auto"] = "auto"
    # None: 16384, or algo.micro_batch_tokens where that is larger, so a token-budget
    # micro-batch packs into one row: in narrower rows its rows pad to the widest
    # (bench/packing.py; the figures: docs/performance.md, "Packing and compiled layers").
    pack_tokens: int | None = Field(None, gt=0)
    # The text decoder's layers through torch.compile in the engines' log-prob and value
    # forwards (`mmrl.engine.compiled_layers`). "auto": on a GPU in one process, where it
    # speeds up packed and padded updates alike (bench/packing.py, bench/recipe_steps.py;
    # the figures: docs/performance.md, "Packing and compiled layers").
    compile_layers: bool | Literal["auto"] = "auto"
    # A helper process compiles the update's graphs while the run starts, into the run's
    # compile cache (`mmrl.prewarm`). "auto": on a GPU in one process where the layers compile,
    # unless this recipe's update compiled in that cache before; true: that last case too.
    # While it is at work, the run's updates run eagerly rather than wait for it. Off by
    # default: when the run still waited, at the VL-3B shape on one H200 it waited 24-36 s for
    # the helper, which saved it 10 s of compiling (docs/performance.md, "Compile helper").
    compile_prewarm: bool | Literal["auto"] = False
    # Pixel budget per image; images are also decoded reduced toward max_pixels, so a
    # huge source image does not take memory in proportion to its size.
    min_pixels: int | None = Field(None, gt=0)
    max_pixels: int | None = Field(None, gt=0)
    trust_remote_code: bool = False

    @field_validator("tiny_vocabulary")
    @classmethod
    def _vocabulary_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if key not in TINY_VOCABULARY_KEYS:
                raise ValueError(f"unknown key {key!r} (the keys are {', '.join(TINY_VOCABULARY_KEYS)})")
            expected = TINY_VOCABULARY_KEYS[key]
            if not isinstance(item, expected) or (key == "words" and not all(isinstance(w, str) for w in item)):
                wanted = "a string" if expected is str else "a list of strings"
                raise ValueError(f"{key}: expected {wanted}, got {type(item).__name__}")
        return value

    @field_validator("lora_alpha", "lora_dropout", "lora_targets")
    @classmethod
    def _lora_settings_need_a_scope(cls, value, info):
        if value and info.data.get("lora_scope") == "none":
            raise ValueError("set, but lora_scope is none, so there is no adapter to apply it to")
        if info.field_name == "lora_targets" and any(not name or "." in name for name in value):
            raise ValueError(f"give leaf module names such as q_proj, got {value}")
        return value

    @model_validator(mode="after")
    def _pixel_budget_in_order(self):
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is above max_pixels ({self.max_pixels})")
        return self


class DataConfig(_Section):
    # A .jsonl/.parquet file, a dataset folder, or a synthetic task such as
    # "synthetic:count_shapes?n=2048&seed=0"; or a mapping: a public dataset in its own
    # layout with its columns mapped onto the schema (`mmrl.data.layouts.DataSource`).
    train: DataSpec
    eval: DataSpec | None = None
    # Checked every `trainer.eval_every` steps (early stopping); defaults to `eval`. Keep
    # it apart from `eval` so the final figure is not measured on the stopping set.
    validation: DataSpec | None = None
    prompts_per_step: int = Field(16, gt=0)
    shuffle_seed: int = SEED


class RolloutConfig(_Section):
    # hf_compiled: HF with a static KV cache and a compiled decode step (docs/training.md);
    # auto: hf_compiled on a GPU (under FSDP2 on each rank's inference copy, where it fits),
    # hf on the CPU and for families that cannot take left padding.
    backend: Literal["auto", "hf", "hf_compiled", "vllm"] = "auto"
    samples_per_prompt: int = Field(8, gt=0)
    max_new_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # Fraction of memory vLLM may take; ignored by the hf backend.
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    # hf_compiled with fp32 weights under autocast: bf16 copies of the linear layers, cast
    # once per rollout and kept between rollouts (half the weights' memory); false casts
    # them at every decode step instead.
    half_weights: bool = True
    # hf_compiled: the decode steps run each group of sibling projections that read the same
    # input (q/k/v, gate/up; the family's `Rollout.merged_projections`) as one product over
    # merged copies of their weights (refreshed each rollout; their bytes again in memory).
    # "auto": on a GPU when decoding in bf16/fp16 (docs/performance.md, "Merged projections").
    merge_projections: bool | Literal["auto"] = "auto"
    # hf_compiled under FSDP2: each rank decodes on an inference copy of the full weights,
    # gathered after each update; "keep" holds it between rollouts, "free" releases it after
    # each, "auto" keeps it when it takes at most half the free GPU memory (docs/training.md).
    inference_copy: Literal["auto", "keep", "free"] = "auto"
    # hf_compiled on a GPU: how the decode step runs fast. "graphs" records the eager step as
    # CUDA graphs (a fraction of a second each), "compiled" compiles it with torch.compile
    # (tens of seconds at a run's first steps); "auto": graphs where the engine compiles its
    # decoder layers (the recording replays their kernels: a step as fast as the compiled
    # one), else graphs for a run of at most 40,000 decode steps (steps x max_new_tokens x
    # turns) and compiled past that (`mmrl.settle.decode_choice`; docs/performance.md).
    decode: Literal["auto", "graphs", "compiled"] = "auto"
    # hf_compiled: prefill each distinct prompt once and copy its cache rows out to the
    # samples that repeat it (`mmrl.rollout.prefix`); false prefills every sample's row.
    prefill_once: bool = True
    # hf_compiled, multi-turn: a later turn's prefill into the kept cache runs through the
    # engine's compiled decoder layers, as the decode step does (one more graph to compile
    # at the first later turn); false keeps it eager.
    prefill_layers: bool = True
    # Multi-turn rollouts (docs/agents.md): an environment by built-in name or import path
    # (None: one policy turn per sample), its options, the policy turns per sample and
    # the tokens a sample may add after its prompt.
    env: str | None = None
    env_options: dict[str, Any] = Field(default_factory=dict)
    max_turns: int = Field(4, gt=0)
    max_tokens: int = Field(1024, gt=0)
    # Multi-turn on hf_compiled: keep each sample's cache between turns and prefill only a
    # turn's new tokens and images (`mmrl.rollout.sessions`); false prefills the whole
    # conversation at every turn. Partial rollouts on hf_compiled: keep a carried sample's
    # cache between rounds (docs/async.md); false re-prefills it under the new weights.
    keep_cache: bool = True
    # Partial rollouts (docs/async.md): the tokens a sample may generate per rollout round;
    # one still generating is carried to the next step's round, under the new weights.
    # 0: off, every sample generates to its end in the round it starts.
    partial_tokens: int = Field(0, ge=0)

    @field_validator("max_tokens")
    @classmethod
    def _one_turn_fits(cls, value: int, info: ValidationInfo) -> int:
        new_tokens = info.data.get("max_new_tokens")
        if info.data.get("env") is not None and new_tokens is not None and new_tokens > value:
            raise ValueError(f"{value} is smaller than one turn's rollout.max_new_tokens ({new_tokens})")
        return value


class AlgoConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    # Passes over each rollout batch; with 1 pass of 1 mini-batch the ratio is exactly 1 and
    # no old log-probs are needed.
    epochs_per_rollout: int = Field(1, gt=0)
    # Optimizer steps per pass (PPO-style): the batch's sequences split in this many
    # consecutive parts, each one step, with the ratio against the log-probs taken before
    # the first step (so clipping acts from the second part on).
    mini_batches: int = Field(1, gt=0)
    micro_batch_size: int = Field(64, gt=0)
    # Micro-batches by tokens instead of rows: consecutive sequences up to this many
    # tokens (prompt + response) each, a longer one alone; None: micro_batch_size rows.
    micro_batch_tokens: int | None = Field(None, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    entropy_coef: float = 0.0
    filter_uniform_groups: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    # Multi-turn rollouts: "trajectory" sums the environment's rewards into one reward per
    # sample; "turn" credits each policy turn with the rewards from that turn on, the
    # reward function's score counted at the last turn (docs/agents.md has the formula).
    credit_assignment: Literal["trajectory", "turn"] = "trajectory"
    # Asynchrony (mmrl/buffer, docs/async.md): how many updates old a trajectory may be when
    # it is trained on (0: the synchronous loop; 1: one-step-off), and how its tokens are
    # weighted against the log-probs of the weights that sampled them (mmrl/algos/off_policy.py).
    max_staleness: int = Field(0, ge=0)
    off_policy: Literal["tis", "mask", "none"] = "tis"
    is_cap: float = Field(2.0, gt=1)
    # Where a stale token's behaviour log-prob comes from: the trainer's forward under the
    # sampling weights ("recomputed", one more forward pass) or the sampler's own (docs/async.md).
    behaviour: Literal["recomputed", "sampler"] = "recomputed"
    # One-step-off on one device: "thread" samples the next batch beside the update, on an
    # inference copy (needs max_staleness >= 1 and behaviour sampler); "auto" takes the
    # thread on a GPU where the recipe allows it; "off": one after the other (docs/async.md).
    overlap: Literal["off", "thread", "auto"] = "off"
    # Python's thread switch interval (`sys.setswitchinterval`), in milliseconds, while the
    # overlap thread samples (restored when its batch is done); None: Python's own. A
    # thread that wants the GIL may wait that long each time the other holds it
    # (docs/async.md, "Where the rollout thread's time goes").
    overlap_switch_interval_ms: float | None = Field(None, gt=0)

    @field_validator("overlap", mode="before")
    @classmethod
    def _off_is_a_word(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `off` as false: `overlap: off` means "off"."""
        return "off" if value is False else value


class RewardConfig(_Section):
    # A built-in reward name, "path/to/file.py:function" (relative to the recipe's folder)
    # or "package.module:function" (a module beside the recipe imports too). No default:
    # a run without one stops before the build (`mmrl.recipe_checks`), unless
    # `mmrl.train(recipe, reward=fn)` passes a function.
    name: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


class OptimConfig(_Section):
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # Each in [0, 1): Adam's running averages diverge at 1 and above.
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    critic_lr: float = Field(1e-3, gt=0)
    # Learning-rate multipliers by model part, e.g. {vision: 10, projector: 10}: a
    # random-init vision tower learns much slower than the language model at one rate.
    # A negative one would climb the loss (gradient ascent); 0 leaves a part as it is.
    lr_multipliers: dict[Literal["vision", "projector", "language", "embed", "lm_head"],
                         Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(default_factory=dict)


class EvalConfig(_Section):
    # A response is correct when its reward is at least this; every accuracy (reward/,
    # validation/, eval/ and pass@k) counts by it, and mean rewards are logged beside.
    correct_threshold: float = 1.0
    # Responses sampled per prompt at `temperature` on top of the greedy one: above 1,
    # pass@k (unbiased estimator) for k = 1, 2, 4, ... up to `samples`, and mean@samples.
    samples: int = Field(1, gt=0)
    temperature: float = Field(1.0, gt=0)
    # Draws the sampled responses from their own generator, so an evaluation changes
    # nothing in training and repeats exactly.
    seed: int = 0
    # The final evaluation of an image task scores the questions again with the images
    # shuffled among them (chance if the policy reads the image): twice the work.
    shuffled_images: bool = True
    # Prompts per generate call.
    batch_size: int = Field(128, gt=0)


class SmokeConfig(BaseModel):
    """What `--smoke` swaps in for the recipe's checkpoint and dataset (mmrl/smoke.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A registered family (its tiny random-init model); None: model.path when it already
    # names a family.
    family: str | None = None
    # A local copy of the dataset in its own layout; replaces `path` in each data source
    # mapping (and a plain path source). None: the sources are used as they are.
    data: str | None = None
    # Applied to the tiny config (rarely needed).
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    # The bundled images are tens of pixels wide; real budgets would upscale them a hundredfold.
    min_pixels: int = Field(3136, gt=0)
    max_pixels: int = Field(12544, gt=0)


class TrainerConfig(_Section):
    steps: int = Field(100, gt=0)
    seed: int = SEED
    output_dir: str = "runs/default"
    log_every: int = Field(1, gt=0)
    eval_every: int = Field(0, ge=0)
    # Validate once before the first step too (logged at step 0): where the policy starts.
    val_before_train: bool = False
    save_every: int = Field(0, ge=0)
    # Step checkpoints kept: after a save, older ones beyond the newest N go (None: all).
    keep_checkpoints: int | None = Field(None, gt=0)
    # Stop early once the greedy eval accuracy reaches this (checked every eval_every).
    target_accuracy: float | None = Field(None, ge=0, le=1)
    # Wall-clock budget in seconds for the training loop (None: no limit).
    time_budget_s: float | None = None
    # Continue the run in output_dir from its newest good checkpoint (the same run only).
    resume: bool = False
    # Remove the results of a run already in output_dir before starting this one.
    overwrite: bool = False
    export: bool = True
    # Torch's CPU threads (None: torch's own choice).
    threads: int | None = Field(None, ge=1)
    progress: bool = True
    # A few lines before the first step: model, parameters (trainable share), rows, batch,
    # the settled "auto" values, the output folder (`mmrl.summary`).
    summary: bool = True
    # Sampled completions (prompt, media references, completion, reward, advantage) into
    # <output_dir>/samples.jsonl and every logger, every this many steps and at each
    # validation (0: none); at most samples_per_log rows each time, whole prompt groups first.
    samples_every: int = Field(10, ge=0)
    samples_per_log: int = Field(8, gt=0)
    # Logger backends (mmrl/loggers.py), each optional; metrics.jsonl is written whatever the list.
    loggers: list[Literal["tensorboard", "wandb", "mlflow", "trackio", "swanlab"]] = ["tensorboard"]
    # At step 0 the first batch's images run real, blank and shuffled through the rollout and
    # the training path (`mmrl.media_check`): a model that does not read them gets a one-line
    # warning, or with this set an error that stops the run. `media_check: false` skips the
    # check (seconds of the first step: 4-6 s at the Qwen2.5-VL-3B shape on one H200). A pass
    # is remembered in the compile cache and the same run again skips it (`PassMemo`).
    strict_media: bool = False
    media_check: bool = True
    # After a step that compiled, one full collection, then what the process holds leaves
    # Python's full collections (`gc.freeze()`, `mmrl.gc_watch`): later ones walk only what
    # the run made since; a run whose first step compiles freezes once at its start too.
    gc_freeze: bool = True

    @field_validator("loggers")
    @classmethod
    def _loggers_once(cls, value: list[str]) -> list[str]:
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} named more than once")
        return value


class ParallelConfig(_Section):
    # Ranks that split every sequence (Ulysses sequence parallelism): it must divide the
    # number of processes and the text model's attention heads (`mmrl.parallel.ulysses`;
    # checked before the build by `mmrl.recipe_checks`).
    sequence_parallel: int = Field(1, gt=0)
    # The last N processes only roll out (holding a full copy of the policy), the others
    # train with FSDP2 and send them the weights after each update; 0: every process does
    # both (`mmrl.parallel.disaggregated`, docs/async.md).
    rollout_ranks: int = Field(0, ge=0)


class SettledModel(_Section):
    # The `model` settings a run settled (`mmrl.settle`); None: not settled, auto decides.
    pack: bool | None = None
    pack_tokens: int | None = Field(None, gt=0)
    compile_layers: bool | None = None
    # "after_oom": off until an update runs out of memory, then on (`mmrl.settle.AFTER_OOM`).
    gradient_checkpointing: bool | Literal["after_oom"] | None = None
    attn_implementation: str | None = None


class SettledRollout(_Section):
    backend: Literal["hf", "hf_compiled", "vllm"] | None = None
    decode: Literal["graphs", "compiled"] | None = None


class SettledConfig(_Section):
    """What a run settled for each setting a recipe may leave to mmrl ("auto", or None for
    pack_tokens and attn_implementation), by section and field as in the recipe: the run
    folder's recipe.yaml records it, and a run of a recipe that carries it keeps these
    choices for every setting its own sections still leave to auto (`mmrl.settle`)."""

    model: SettledModel = SettledModel()
    rollout: SettledRollout = SettledRollout()

    def fields(self) -> dict[str, Any]:
        """{"model.pack": value, ...} for every settled field, None where not settled."""
        return {f"{name}.{field}": value for name in type(self).model_fields
                for field, value in getattr(self, name).model_dump(mode="json").items()}

    @classmethod
    def of(cls, values: dict[str, Any]) -> SettledConfig:
        """The section holding {"model.pack": value, ...}."""
        nested: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            section, _, field = key.partition(".")
            nested.setdefault(section, {})[field] = value
        return cls.model_validate(nested)


# Every setting a recipe may leave to mmrl, as "section.field" (`mmrl.settle.resolve` settles them).
SETTLED_FIELDS = tuple(SettledConfig().fields())


class Recipe(_Section):
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    reward: RewardConfig = RewardConfig()
    optim: OptimConfig = OptimConfig()
    trainer: TrainerConfig = TrainerConfig()
    parallel: ParallelConfig = ParallelConfig()
    eval: EvalConfig = EvalConfig()
    # What `mmrl train RECIPE --smoke` swaps in for the checkpoint and dataset (mmrl/smoke.py).
    smoke: SmokeConfig = SmokeConfig()
    # What a run settled for the settings left to auto (`SettledConfig`), as the run
    # folder's recipe.yaml records it.
    settled: SettledConfig = SettledConfig()
    # The recipe file's folder: `reward.name` and `rollout.env` paths resolve there.
    _folder: Path | None = PrivateAttr(None)

    @property
    def folder(self) -> Path | None:
        """The folder of the recipe file (None for a recipe built in memory)."""
        return self._folder

    def with_folder(self, folder: str | Path | None) -> Recipe:
        """This recipe, its `reward.name` and `rollout.env` paths resolved against `folder`."""
        located = self.model_copy()
        located._folder = Path(folder).expanduser().resolve() if folder is not None else None
        return located

    @field_validator("algo")
    @classmethod
    def _mini_batches_fit_the_step(cls, value: AlgoConfig, info) -> AlgoConfig:
        data, rollout = info.data.get("data"), info.data.get("rollout")
        if data is not None and rollout is not None:
            sequences = data.prompts_per_step * rollout.samples_per_prompt
            if value.mini_batches > sequences:
                raise ValueError(f"mini_batches ({value.mini_batches}) is above the sequences of a step "
                                 f"({sequences}: data.prompts_per_step x rollout.samples_per_prompt)")
        return value

    @field_validator("algo")
    @classmethod
    def _turn_credit_needs_turns(cls, value: AlgoConfig, info) -> AlgoConfig:
        rollout = info.data.get("rollout")
        if value.credit_assignment == "turn" and rollout is not None and rollout.env is None:
            raise ValueError("credit_assignment 'turn' needs a multi-turn rollout (set rollout.env)")
        return value

    @field_validator("algo")
    @classmethod
    def _stale_rollouts_are_single_turn(cls, value: AlgoConfig, info) -> AlgoConfig:
        rollout = info.data.get("rollout")
        if value.max_staleness and rollout is not None and rollout.env is not None:
            raise ValueError(f"max_staleness {value.max_staleness} trains single-turn rollouts only for now; a "
                             "multi-turn rollout (rollout.env) needs max_staleness 0")
        return value

    @field_validator("algo")
    @classmethod
    def _partial_rollouts_are_single_turn(cls, value: AlgoConfig, info) -> AlgoConfig:
        rollout = info.data.get("rollout")
        if rollout is not None and rollout.partial_tokens and rollout.env is not None:
            raise ValueError(f"rollout.partial_tokens {rollout.partial_tokens} carries single-turn samples only "
                             "for now; a multi-turn rollout (rollout.env) needs partial_tokens 0")
        return value

    @field_validator("algo")
    @classmethod
    def _groups_can_differ(cls, value: AlgoConfig, info) -> AlgoConfig:
        """A group-relative advantage is zero for every sample of a group of one, or of a
        group decoded greedily (single-turn: all its samples alike): no gradient, ever."""
        rollout = info.data.get("rollout")
        if value.advantage not in GROUP_RELATIVE or rollout is None:
            return value
        if rollout.samples_per_prompt < 2:
            raise ValueError(f"advantage {value.advantage!r} compares the samples of a prompt, but "
                             f"rollout.samples_per_prompt is {rollout.samples_per_prompt}: every advantage would be "
                             "0; set rollout.samples_per_prompt >= 2 or use reinforce_pp or gae")
        if rollout.temperature == 0 and rollout.env is None:
            raise ValueError(f"advantage {value.advantage!r} compares the samples of a prompt, but "
                             "rollout.temperature 0 (greedy) makes them all alike: every advantage would be 0; "
                             "set rollout.temperature > 0 or use reinforce_pp or gae")
        return value

    @field_validator("parallel")
    @classmethod
    def _rollout_ranks_run_ahead(cls, value: ParallelConfig, info) -> ParallelConfig:
        """Rollout ranks sample the next batches while the train ranks update, so the
        batches they send are at least one update old (`mmrl.parallel.disaggregated`)."""
        algo = info.data.get("algo")
        if not value.rollout_ranks or algo is None:
            return value
        if algo.max_staleness < 1:
            raise ValueError(f"rollout_ranks {value.rollout_ranks} needs algo.max_staleness >= 1 (the rollout ranks "
                             "sample ahead of the update), got 0")
        if value.sequence_parallel > 1:
            raise ValueError(f"rollout_ranks {value.rollout_ranks} and sequence_parallel {value.sequence_parallel} "
                             "cannot be combined yet; set one of them")
        return value

    @field_validator("trainer")
    @classmethod
    def _validation_needs_a_set(cls, value: TrainerConfig, info) -> TrainerConfig:
        data = info.data.get("data")
        if value.val_before_train and data is not None and data.validation is None and data.eval is None:
            raise ValueError("val_before_train is true, but there is nothing to validate on (set data.validation "
                             "or data.eval)")
        return value

    @field_validator("trainer")
    @classmethod
    def _output_dir_is_set(cls, value: TrainerConfig) -> TrainerConfig:
        if not value.output_dir:
            raise ValueError("output_dir must not be empty")
        if value.resume and value.overwrite:
            raise ValueError("resume and overwrite are both true; choose one")
        return value


class RecipeError(ValueError):
    """A recipe file or override is malformed; the message names the file or field."""


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (the
    plain loader keeps the last one, so an edit lower in the file silently wins)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *defaults`: keys given beside it override the merged ones, as meant
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the constructor reports it
                if first is not None:
                    raise _DuplicateKey(None, None, f"key {key!r} appears twice (first at line {first.line + 1})",
                                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


# The most values (mappings, lists and scalars) a recipe or an override's value may hold
# once YAML aliases are expanded: `&a [x, x]`, `&b [*a, *a]`, ... doubles at each level, a
# few lines that would take the machine's memory where the recipe is dumped or compared.
MAX_RECIPE_VALUES = 100_000


class _TooLarge(yaml.YAMLError):
    pass


def _load_yaml(text: str) -> Any:
    values = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    _check_expanded_size(values)
    return values


def _check_expanded_size(values: Any) -> None:
    """Raise _TooLarge for values that refer to themselves, or that hold more than
    MAX_RECIPE_VALUES once aliases are expanded (counted per distinct node, so the count
    itself stays cheap)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(value: Any) -> int:
        if not isinstance(value, (dict, list)):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _TooLarge("a value refers to itself (a YAML alias inside its own anchor)")
        open_nodes.add(key)
        children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1 + sum(size(child) for child in children)
        open_nodes.discard(key)
        if total > MAX_RECIPE_VALUES:
            raise _TooLarge(f"more than {MAX_RECIPE_VALUES:,} values once YAML aliases (*name) are expanded; write "
                            "the repeated parts out, or shorten them")
        sizes[key] = total
        return total

    size(values)


def _parse_value(text: str, override: str) -> Any:
    try:
        return _load_yaml(text) if text != "" else ""
    except _DuplicateKey as exc:
        raise RecipeError(f"override {override!r}: {exc.problem}") from None
    except _TooLarge as exc:
        raise RecipeError(f"override {override!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {override!r}: the value is not valid YAML ({_yaml_problem(exc)}); "
                          "quote it to pass a string") from None


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
        value = _parse_value(raw, override)
        replaced = node.get(parts[-1])
        if isinstance(replaced, dict) and "path" in replaced and not isinstance(value, dict):
            _note_mapping_replaced(key, replaced, raw)
        elif isinstance(replaced, dict) and isinstance(value, dict) and _is_section(parts):
            _note_section_replaced(key, replaced, value)
        node[parts[-1]] = value
    return values


def _note(text: str) -> None:
    """One line on stderr that begins "note: ", from rank 0 alone (every rank loads the recipe)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {text}", file=sys.stderr, flush=True)


def _note_mapping_replaced(key: str, mapping: dict, raw: str) -> None:
    """Tell (once, rank 0) that `KEY=PATH` dropped a dataset mapping's columns and template:
    the new source may have its own layout, so it is not an error, but the usual intent is
    `KEY.path=PATH`."""
    defaults = {name: field.get_default(call_default_factory=True) for name, field in DataSource.model_fields.items()
                if not field.is_required()}
    dropped = ", ".join(name for name, given in mapping.items()
                        if name != "path" and given not in (None, {}, []) and given != defaults.get(name))
    _note(f"{key}={raw} replaces the recipe's {key} mapping ({dropped or 'its layout'}) with a plain source, read "
          f"with the default columns; {key}.path={raw} keeps the mapping and changes only its path")


def _is_section(parts: list[str]) -> bool:
    """Whether the recipe key `parts` names one of its sections (settings with defaults),
    not a free mapping such as `reward.options`."""
    model: Any = Recipe
    for part in parts:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return False
        model = field.annotation
    return isinstance(model, type) and issubclass(model, _Section)


def _note_section_replaced(key: str, section: dict, value: dict) -> None:
    """Tell (once, rank 0) that `KEY={...}` replaced the recipe's section: the settings it
    does not name fall back to their defaults, where `KEY.name=value` changes one alone."""
    dropped = [name for name in section if name not in value]
    if not dropped:
        return
    shown = ", ".join(dropped[:4]) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else "")
    first = next(iter(value), "name")
    _note(f"{key}={{...}} replaces the recipe's {key} section, so its {shown} go back to their defaults; "
          f"{key}.{first}=... changes that setting alone")


def _deep_copy(values: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in values.items()}


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or start from defaults), apply overrides, validate."""
    values = read_recipe(path) if path is not None else {}
    values = apply_overrides(values, overrides or [])
    return validate_recipe(values, where=path, folder=Path(path).parent if path is not None else None)


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The sections of a YAML recipe file, unvalidated; a RecipeError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"recipe file not found: {path} is a folder; give the recipe's YAML file")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        values = _load_yaml(path.read_text()) or {}
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except _DuplicateKey as exc:
        raise RecipeError(f"{path}: {_yaml_problem(exc)}") from None
    except _TooLarge as exc:
        raise RecipeError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({_yaml_problem(exc)})") from None
    if not isinstance(values, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(values).__name__}")
    return values


def validate_recipe(values: dict[str, Any], *, where: str | Path | None = None,
                    folder: str | Path | None = None) -> Recipe:
    """`values` as a Recipe whose paths resolve against `folder`; a RecipeError naming
    `where` (the file) and the field."""
    try:
        return Recipe.model_validate(values).with_folder(folder)
    except ValidationError as exc:
        first = exc.errors()[0]
        # A dict key's error ends its path with "[key]" (and rich would read that as markup).
        field = ".".join(str(p) for p in first["loc"] if p != "[key]")
        prefix = f"{where}: " if where is not None else ""
        message = first["msg"].removeprefix("Value error, ")
        raise RecipeError(f"{prefix}{field}: {message}") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """`line L, column C: problem` of a YAML error (1-based, as editors count)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or one_line(exc)
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


# Recipe fields that say how to run, not what is trained: a resumed run may change them.
_HOW_TO_RUN = {
    "trainer": {"steps", "resume", "overwrite", "progress", "summary", "threads", "time_budget_s", "log_every", "eval_every",
                "save_every", "keep_checkpoints", "export", "target_accuracy", "output_dir", "val_before_train",
                "samples_every", "samples_per_log", "loggers"},
    "rollout": {"backend", "gpu_memory_utilization"},
    "model": {"attn_implementation", "gradient_checkpointing", "share_media", "pack", "pack_tokens",
              "compile_layers", "compile_prewarm"},
    "parallel": {"sequence_parallel", "rollout_ranks"},
    "eval": set(EvalConfig.model_fields),
}


def same_run(recipe: Recipe, saved_text: str) -> str | None:
    """None when the recipe saved in a run folder (`saved_text`) describes the same run
    as `recipe`, else the first field that differs, in words."""
    try:
        saved = yaml.safe_load(saved_text)
        if not isinstance(saved, dict):
            raise ValueError
        saved = Recipe.model_validate(saved).model_dump(mode="json")
    except (yaml.YAMLError, ValueError):
        return "its recipe.yaml cannot be read as a recipe"
    current = recipe.model_dump(mode="json", exclude={"settled"})  # how it ran, not what it trains
    for section, fields in current.items():
        for key, value in fields.items():
            if key in _HOW_TO_RUN.get(section, ()):
                continue
            before = saved.get(section, {}).get(key)
            if before != value:
                return f"{section}.{key} was {before!r}, now {value!r}"
    return None


def dump_recipe(recipe: Recipe, reasons: dict[str, str] | None = None) -> str:
    """The recipe as YAML; its `settled:` section (when it has one) last, under a comment
    that says what it does, each value followed by its reason from `reasons` (by field)."""
    text = yaml.safe_dump(recipe.model_dump(mode="json", exclude={"settled"}), sort_keys=False)
    if recipe.settled == SettledConfig():
        return text
    lines = ["# What this run settled for each setting a recipe may leave to mmrl (mmrl/settle.py), and why.",
             "# A run of this file keeps these choices for every setting still auto above; delete a line",
             "# (or the section) to settle it afresh.", "settled:"]
    section = None
    for key, value in recipe.settled.fields().items():
        if value is None:
            continue
        name, _, field = key.partition(".")
        if name != section:
            lines.append(f"  {name}:")
            section = name
        entry = yaml.safe_dump({field: value}, default_flow_style=False).strip()
        reason = (reasons or {}).get(key)
        lines.append(f"    {entry}" + (f"  # {reason}" if reason else ""))
    return text + "\n".join(lines) + "\n"
