"""Every setting a recipe leaves to mmrl ("auto", or None where the schema says so) settled
once, before anything is built, each with the reason for its choice.

    settled = resolve(recipe, dist)          # the family looked up from model.path
    settled.pack, settled.rollout_backend    # what the trainer builds with
    settled.lines()                          # ["model.pack false (auto: cpu, 1 process; ...)", ...]

The rules live here, one function per setting (`pack_choice`, `pack_tokens_choice`,
`compile_layers_choice`, `checkpointing_choice`, `attention_choice`, `backend_choice`);
the engine (`Engine(pack="auto")`, `mmrl.engine.surgery.resolve`) and the rollout
(`mmrl.rollout.choose_backend`) call the same ones when they are used without a recipe.

The trainer prints the settled values in its start-of-run summary (`mmrl.summary`) and
writes them into the run folder's recipe.yaml as its `settled:` section
(`mmrl.config.dump_recipe`). A recipe that carries a `settled:` section keeps those choices
for every setting it still leaves to auto, so a saved recipe runs again as it ran, on
another machine too; a value set in the recipe's own sections wins, and deleting a line
(or the section) settles that setting afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmrl.build import default_attention
from mmrl.config import SETTLED_FIELDS, Recipe, SettledConfig
from mmrl.boundaries import unpackable, unverified_layer_kinds, unverified_packing
from mmrl.hub import checkpoint_folder
from mmrl.registry import get_adapter

if TYPE_CHECKING:
    from mmrl.parallel import Dist

# Tokens per packed row unless `model.pack_tokens` is set: faster than rows of 8192 or 32768
# (`bench/packing.py --modes padded varlen_8192 varlen_16384 varlen_32768`, docs/performance.md);
# `mmrl.engine.packing` re-exports it.
PACK_TOKENS = 16384

# The reason of a value the recipe's own section sets.
SET_IN_RECIPE = "set in the recipe"


@dataclass(frozen=True)
class Choice:
    """One setting's settled value and why."""

    value: Any
    reason: str


def where(dist: Dist) -> str:
    """`cuda, 1 process` / `cpu, 2 processes`: what most automatic choices depend on."""
    count = dist.world_size
    return f"{dist.device.type}, {count} process{'es' if count != 1 else ''}"


def _one_gpu(dist: Dist) -> bool:
    return dist.device.type == "cuda" and not dist.distributed


def _switch(name: str, value) -> None:
    if value not in (True, False, "auto"):
        raise ValueError(f"{name} must be true, false or auto, got {value!r}")


def pack_rule(pack: bool | str, adapter, dist: Dist) -> Choice:
    """`model.pack` by the device rule alone: "auto" packs text families on a GPU in one
    process (faster at RL lengths: docs/performance.md; the VL-3B recipe's update, rows of
    about one length, ran slower packed: docs/training.md)."""
    _switch("pack", pack)
    if pack != "auto":
        return Choice(pack, SET_IN_RECIPE)
    if not _one_gpu(dist):
        return Choice(False, f"auto: {where(dist)}; packs in one GPU process only")
    if adapter.is_multimodal:
        return Choice(False, f"auto: {where(dist)}; {adapter.family} takes media (its rows stepped slower packed)")
    return Choice(True, f"auto: {where(dist)}, a text family")


def pack_choice(pack: bool | str, adapter, dist: Dist) -> Choice:
    """`pack_rule`, and off for a family whose packed batches are not verified (`padding_free`)."""
    choice = pack_rule(pack, adapter, dist)
    if choice.value and not adapter.capabilities.padding_free:
        return Choice(False, f"the {adapter.family} adapter does not declare padding_free")
    return choice


def packs_model(pack: bool | str, adapter, dist: Dist, config=None) -> bool:
    """`model.pack` resolved for a built model (the engine's; `config` its config, None
    before the build: no layer check): `pack_choice`, where `true`
    for a family without `padding_free` is refused (its packed batches are unverified, and a
    hybrid family's convolution or recurrent state would leak from one packed sample into
    the next), and never a model with stateful layers that the family's verified tiny model
    lacks (`mmrl.boundaries`: `true` is refused, `auto` stays padded)."""
    if pack is True and not adapter.capabilities.padding_free:
        raise ValueError(unpackable(adapter))
    packs = pack_choice(pack, adapter, dist).value
    if packs and config is not None and (unverified := unverified_layer_kinds(adapter, config)):
        if pack is True:
            raise ValueError(unverified_packing(adapter, unverified))
        return False
    return packs


def pack_tokens_choice(pack_tokens: int | None, micro_batch_tokens: int | None) -> Choice:
    """`model.pack_tokens`; None: `PACK_TOKENS`, or algo.micro_batch_tokens where that is
    larger, so a token-budget micro-batch packs into one row (in rows of `PACK_TOKENS` its
    rows would pad to the widest: bench/packing.py)."""
    if pack_tokens is not None:
        return Choice(pack_tokens, SET_IN_RECIPE)
    if micro_batch_tokens is not None and micro_batch_tokens > PACK_TOKENS:
        return Choice(micro_batch_tokens, "auto: algo.micro_batch_tokens, one micro-batch a row")
    return Choice(PACK_TOKENS, "auto: the default")


def compile_layers_choice(compile_layers: bool | str, dist: Dist) -> Choice:
    """`model.compile_layers`; "auto": on a GPU in one process, packed or padded (measured
    both ways; sharded layers are not compiled unless asked)."""
    _switch("compile_layers", compile_layers)
    if compile_layers != "auto":
        return Choice(compile_layers, SET_IN_RECIPE)
    if _one_gpu(dist):
        return Choice(True, f"auto: {where(dist)}")
    return Choice(False, f"auto: {where(dist)}; compiles in one GPU process only")


# The settled `model.gradient_checkpointing` of one process: off until an update runs out of
# memory, then on and that mini-batch redone (`Engine.checkpoint_after_oom`).
AFTER_OOM = "after_oom"


def checkpointing_choice(gradient_checkpointing: bool | str, dist: Dist) -> Choice:
    """`model.gradient_checkpointing`: True, False or `AFTER_OOM`. "auto": checkpointing
    only where memory needs it. One process starts without it and turns it on when an
    update runs out of memory; sharded GPU ranks cannot recover from one rank's OOM, so
    they keep it on; sharded CPU ranks never need it."""
    if gradient_checkpointing == AFTER_OOM:
        return Choice(AFTER_OOM, SET_IN_RECIPE)
    _switch("gradient_checkpointing", gradient_checkpointing)
    if gradient_checkpointing != "auto":
        return Choice(gradient_checkpointing, SET_IN_RECIPE)
    if not dist.distributed:
        return Choice(AFTER_OOM, f"auto: {where(dist)}; off until an update runs out of memory")
    if dist.device.type == "cuda":
        return Choice(True, f"auto: {where(dist)}; sharded ranks cannot redo an out-of-memory update")
    return Choice(False, f"auto: {where(dist)}")


def attention_choice(attn_implementation: str | None, adapter) -> Choice:
    """`model.attn_implementation`; None: SDPA where the model class supports it, else eager."""
    if attn_implementation is not None:
        return Choice(attn_implementation, SET_IN_RECIPE)
    model_class = adapter.model_class()
    value = default_attention(model_class)
    support = "supports" if value == "sdpa" else "does not support"
    return Choice(value, f"auto: {model_class.__name__} {support} SDPA")


def backend_choice(backend: str, adapter, dist: Dist) -> Choice:
    """`rollout.backend`; "auto": the compiled HF rollout on a GPU
    (bench/results/rollout_speed_gpu.json), single-turn or multi-turn (each turn re-prefills
    its conversation; the decode step's batch width and cache length are dynamic sizes, so
    a new prompt length is not a new graph), under FSDP2 too (each rank decodes on an
    inference copy of the full weights, `mmrl.rollout.inference_copy`; `make_rollout` takes
    plain `generate` where the copy does not fit); plain `generate` on the CPU (compiling
    there costs more than it saves) and for a family that cannot take left padding (its
    prompts generate one length at a time)."""
    if backend != "auto":
        return Choice(backend, SET_IN_RECIPE)
    if dist.device.type != "cuda":
        return Choice("hf", f"auto: {where(dist)}; compiled decoding on a GPU only")
    if not adapter.left_padding:
        return Choice("hf", f"auto: {where(dist)}; {adapter.family} cannot take left padding")
    return Choice("hf_compiled", f"auto: {where(dist)}")


# Decode steps in a run (steps x new tokens per turn x turns) up to which recording the decode
# step as CUDA graphs beats compiling it where the recording runs the eager layers (no compiled
# layers in this process): the compile's first-step cost over what it saves per decode step
# after (docs/performance.md, "Recording the decode step instead of compiling it").
GRAPHS_UP_TO = 40_000


def decode_choice(decode: str, backend: str, recipe: Recipe, compiled_layers: bool = False) -> Choice:
    """`rollout.decode`; "auto": the decode step recorded as CUDA graphs. Where the engine
    compiles its decoder layers (`compiled_layers`, as settled), the recording replays their
    kernels, and a step costs what the compiled one does (bench/results/decode_profile_gpu.json)
    for a fraction of its compile: graphs for any run length. Otherwise the recorded step runs
    the eager layers, and the compiled step pays its compile back past GRAPHS_UP_TO decode
    steps."""
    if decode != "auto":
        return Choice(decode, SET_IN_RECIPE)
    if backend != "hf_compiled":
        return Choice("graphs", f"auto: unused by rollout.backend {backend}")
    if compiled_layers:
        return Choice("graphs", "auto: recorded through the engine's compiled layers")
    r = recipe.rollout
    steps = recipe.trainer.steps * r.max_new_tokens * (r.max_turns if r.env else 1)
    if steps <= GRAPHS_UP_TO:
        return Choice("graphs", f"auto: at most {steps:,} decode steps; compiling pays off past {GRAPHS_UP_TO:,}")
    return Choice("compiled", f"auto: up to {steps:,} decode steps; compiling pays off past {GRAPHS_UP_TO:,}")


@dataclass(frozen=True)
class Settled:
    """A recipe's settings as settled for one run (`resolve`), by dotted field in the order
    of `mmrl.config.SETTLED_FIELDS`."""

    choices: dict[str, Choice]
    # `model.compile_layers: true` in the recipe: a model whose decoder layers cannot be
    # found is an error then, and compiled where they are found otherwise.
    compile_layers_required: bool = False

    @property
    def pack(self) -> bool:
        return self.choices["model.pack"].value

    @property
    def pack_tokens(self) -> int:
        return self.choices["model.pack_tokens"].value

    @property
    def compile_layers(self) -> bool:
        return self.choices["model.compile_layers"].value

    @property
    def gradient_checkpointing(self) -> bool | str:
        return self.choices["model.gradient_checkpointing"].value

    @property
    def attn_implementation(self) -> str:
        return self.choices["model.attn_implementation"].value

    @property
    def rollout_backend(self) -> str:
        return self.choices["rollout.backend"].value

    @property
    def rollout_decode(self) -> str:
        return self.choices["rollout.decode"].value

    def values(self) -> dict[str, Any]:
        """{dotted field: value}."""
        return {field: choice.value for field, choice in self.choices.items()}

    def section(self) -> SettledConfig:
        """The values as a recipe's `settled:` section."""
        return SettledConfig.of(self.values())

    def reasons(self) -> dict[str, str]:
        return {field: choice.reason for field, choice in self.choices.items()}

    def engine_options(self) -> dict[str, Any]:
        """The `Engine` keyword arguments these settle (every engine of the run takes them)."""
        return {"pack": self.pack, "pack_tokens": self.pack_tokens, "compile_layers": self.compile_layers,
                "require_compiled_layers": self.compile_layers_required}

    def lines(self) -> list[str]:
        """`model.pack false (auto: cpu, 1 process; ...)`, one line per setting."""
        return [f"{field} {_word(choice.value)} ({choice.reason})" for field, choice in self.choices.items()]


def _word(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_adapter(recipe: Recipe):
    """The adapter of the family `model.path` names (a family, a checkpoint folder or a
    cached hub id), without building the model."""
    m = recipe.model
    folder = checkpoint_folder(m.path, weights=not m.random_init, trust_remote_code=m.trust_remote_code)
    return get_adapter(folder if folder is not None and folder.is_dir() else m.path, source=m.path)


def resolve(recipe: Recipe, dist: Dist, adapter=None) -> Settled:
    """Every setting of `mmrl.config.SETTLED_FIELDS` settled for `recipe` on this process and
    device. `adapter`: the family's (default: `model_adapter(recipe)`). A setting the recipe
    leaves to auto takes the value of its `settled:` section where that names it."""
    adapter = adapter if adapter is not None else model_adapter(recipe)
    m, pinned = recipe.model, recipe.settled.fields()

    def settle(field: str, asked, choose) -> Choice:
        fresh = choose(asked)
        if asked not in ("auto", None) or pinned[field] is None:
            return fresh
        kept = choose(pinned[field])
        if kept.value != pinned[field]:
            return kept  # the family cannot take it (pack without padding_free): the reason says so
        differs = "" if kept.value == fresh.value else f"; auto here: {_word(fresh.value)}"
        return Choice(kept.value, f"kept from the recipe's settled: section{differs}")

    rules = {
        "model.pack": (m.pack, lambda value: pack_choice(value, adapter, dist)),
        "model.pack_tokens": (m.pack_tokens, lambda value: pack_tokens_choice(value, recipe.algo.micro_batch_tokens)),
        "model.compile_layers": (m.compile_layers, lambda value: compile_layers_choice(value, dist)),
        "model.gradient_checkpointing": (m.gradient_checkpointing, lambda value: checkpointing_choice(value, dist)),
        "model.attn_implementation": (m.attn_implementation, lambda value: attention_choice(value, adapter)),
        "rollout.backend": (recipe.rollout.backend, lambda value: backend_choice(value, adapter, dist)),
        "rollout.decode": (recipe.rollout.decode,
                           lambda value: decode_choice(value, choices["rollout.backend"].value, recipe,
                                                      choices["model.compile_layers"].value is True)),
    }
    choices: dict[str, Choice] = {}
    for field in SETTLED_FIELDS:  # in order: the decode rule reads the settled backend and layers
        choices[field] = settle(field, *rules[field])
    return Settled(choices, compile_layers_required=m.compile_layers is True)


__all__ = ["AFTER_OOM", "PACK_TOKENS", "Choice", "Settled", "attention_choice", "backend_choice",
           "checkpointing_choice", "compile_layers_choice", "decode_choice", "model_adapter", "pack_choice", "pack_rule",
           "pack_tokens_choice", "resolve", "where"]
