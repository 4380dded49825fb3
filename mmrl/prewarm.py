"""The update's graphs compiled in a helper process while the run starts (issue 28).

On a fresh machine a run's first step compiles every graph it needs. The largest is the
decoder layer's forward and backward with gradients (about 12 s of a 32 s first step at the
Qwen2.5-VL-3B shape on one H200, bench/decode_ab.sh), and the run reaches it only after
the rollout has compiled the decode step's graphs and the media check has run. So at the
start of a run on one GPU, a helper process runs the same recipe for one step with random
weights in a model of one decoder layer per layer type, rolling out through plain
`generate` (nothing compiled there). What it compiles is what the engine's forwards
compile (the layer with and without gradients, the chunked log-prob functions), and
inductor writes it to the run's compile cache (`mmrl.compile_watch.persistent_cache`). The
run compiles the decode step meanwhile. While the helper is still at work, the run does not
wait for it: each step's log-probs and update run through the engines' eager layers
(`CompiledLayers.eager`: nothing compiled, nothing waited for), which at the VL-3B shape costs an
update about 0.25 s against 10-12 s of compiling. The first step after the helper is done
compiles the update's graphs, finding their kernels in the cache (dynamo still traces).

    helper = start(recipe, settled, dist)   # None where no helper is wanted (`reason_not`)
    if helper.pending(): ...                # still compiling: this step's update runs eagerly
    mark_done(recipe, settled)              # after the first compiled update: the next run starts none

Off by default (`model.compile_prewarm: false`). Measured on one H200 at the VL-3B shape
when the run still waited for the helper before its first update
(bench/results/decode_ab_vl3b_prewarm_gpu.json), the run's update found its layer graph in
the cache (1.1 s where it compiled for 10 s), but the run waited 36 s for the helper, whose
own start (imports, data, a model build, its rollout) under the run's compiles took longer
than the run's way to its first update. `true` or `auto` turn it on.

A helper that fails or is not done within `JOIN_TIMEOUT_S` costs the run only its eager
updates until then (one line says so, its log stays in the cache folder): the run then
compiles its own. It runs niced, so the run's own compiles keep the CPU first, and it exits
when the run does. Nothing of it is needed for correctness: the cache holds compiled code
keyed by the graph, and a graph the helper's model does not share with the run's is
compiled by the run as without a helper. bench/decode_ab.sh measures a fresh machine's run
with it; tests/test_prewarm.py checks the helper's recipe, when it starts, and that its step runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmrl.config import Recipe, dump_recipe

if TYPE_CHECKING:
    from mmrl.parallel import Dist
    from mmrl.settle import Settled

# Seconds the helper may take, counted from its start; then it is stopped and the run
# compiles what it still needs itself.
JOIN_TIMEOUT_S = 300.0
# The helper's niceness: below the run's, whose own compiles come first.
NICENESS = 5
# Where the marks and the helper's log live, under the compile cache folder.
FOLDER = "mmrl-prewarm"
# The run's process id, which the helper watches (it exits when the run is gone).
PARENT_ENV = "MMRL_PREWARM_PARENT"
# "1": the helper builds its trainer under cProfile and logs where the time went.
PROFILE_ENV = "MMRL_PREWARM_PROFILE"
# New tokens a helper's rollout samples at most: its responses only feed the update, whose
# compiled graphs take their sequence lengths as dynamic sizes, and plain `generate` of a
# recipe's 1024 tokens with random weights would take the helper most of its time.
HELPER_NEW_TOKENS = 16


def cache_folder() -> Path | None:
    """The compile cache the run's inductor writes to (`TORCHINDUCTOR_CACHE_DIR`, set by
    `persistent_cache` or the user); None without one."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(folder) if folder else None


def recipe_key(recipe: Recipe, settled: Settled) -> str:
    """What makes a run's compiled graphs differ, hashed: the recipe less how it is run
    (trainer, eval) and the settled values."""
    import torch

    what = recipe.model_dump(mode="json", exclude={"trainer", "eval", "settled"})
    what["settled"] = settled.values()
    what["torch"] = torch.__version__
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _mark(recipe: Recipe, settled: Settled) -> Path | None:
    folder = cache_folder()
    return folder / FOLDER / f"{recipe_key(recipe, settled)}.done" if folder is not None else None


def mark_done(recipe: Recipe, settled: Settled) -> None:
    """Note in the cache folder that this recipe's first update has compiled there."""
    mark = _mark(recipe, settled)
    if mark is None or mark.exists():
        return
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    except OSError:
        pass  # a read-only cache: the next run starts a helper again, nothing worse


def marks(settled: Settled, dist: Dist) -> bool:
    """Whether a run's first update compiles the graphs a helper would (`mark_done` after it)."""
    return dist.device.type == "cuda" and not dist.distributed and bool(settled.compile_layers)


def reason_not(recipe: Recipe, settled: Settled, dist: Dist, *, given_objects: bool = False) -> str | None:
    """Why this run starts no helper, or None where it does. `given_objects`: the run was
    handed a reward function or datasets (`mmrl.api.train`), which a helper process
    cannot rebuild."""
    asked = recipe.model.compile_prewarm
    if asked is False:
        return "model.compile_prewarm is false"
    if dist.device.type != "cuda":
        return f"nothing compiled on {dist.device.type}"
    if dist.distributed:
        return "sharded ranks compile graphs of their own"
    if given_objects:
        return "the run was given a reward function or datasets, which a helper process cannot rebuild"
    if not settled.compile_layers or settled.gradient_checkpointing is True:
        return "the engine's layers run eagerly (model.compile_layers off or activation checkpointing on)"
    mark = _mark(recipe, settled)
    if mark is None:
        return "no compile cache (TORCHINDUCTOR_CACHE_DIR) to share"
    if mark.exists() and asked == "auto":
        return f"this recipe's update compiled in this cache before ({mark})"
    return None


def layer_kinds(text_config) -> list[str]:
    """The distinct layer types of a text config (`layer_types`), in order; empty where it
    names none. The helper keeps one decoder layer of each (at least one)."""
    return list(dict.fromkeys(getattr(text_config, "layer_types", None) or []))


def shrunk_layers(config) -> dict[str, Any]:
    """`model.config_overrides` that keep one decoder layer of each layer type of `config`'s
    text model (nested under the text config's name where it is a sub-config); empty where
    the text config has no `num_hidden_layers`."""
    text = config.get_text_config()
    if not isinstance(getattr(text, "num_hidden_layers", None), int):
        return {}
    kinds = layer_kinds(text)
    override: dict[str, Any] = {"num_hidden_layers": max(1, len(kinds))}
    if kinds:
        override["layer_types"] = kinds
    if text is config:
        return override
    for name, value in vars(config).items():
        if value is text:
            return {name: override}
    return {}


def helper_recipe(values: dict[str, Any], folder: str | Path | None) -> Recipe:
    """The recipe the helper runs: `helper_values`' sections validated (paths resolved
    against the run recipe's `folder`), with random weights and one decoder layer of each
    layer type. The model's config is read as the build reads it (`recipe_config`): built
    from the family's tiny config apart from the recipe's own settings, the layer graph got
    another cache key than the run's and the run compiled anew."""
    from mmrl.build import recipe_config
    from mmrl.config import validate_recipe

    recipe = validate_recipe(values, where="compile helper", folder=folder)
    _, config = recipe_config(recipe.model, processor=False)  # as the build makes it, without the weights
    shrink = shrunk_layers(config)
    if not shrink:
        raise SystemExit("compile helper: the text config has no num_hidden_layers to shrink")
    model = recipe.model.model_copy(update={"random_init": True,
                                            "config_overrides": merged(recipe.model.config_overrides, shrink)})
    return recipe.model_copy(update={"model": model})


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` laid over it, nested mappings merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def helper_values(recipe: Recipe, output_dir: str | Path) -> dict[str, Any]:
    """The helper's recipe (unvalidated sections): the run's, settled as the run settled,
    for one step into `output_dir` with nothing saved, logged or evaluated, every group
    updated (random weights may reward all samples alike), plain `generate`, no step-0
    media check (the run checks its own media), no helper of
    its own and at most `HELPER_NEW_TOKENS` new tokens a sample. The model's random weights
    and its shrunk layers are set by `helper_recipe`, which reads the model's config."""
    import yaml

    values = yaml.safe_load(dump_recipe(recipe))
    values["trainer"].update(
        steps=1, output_dir=str(output_dir), overwrite=True, resume=False, export=False, progress=False,
        summary=False, loggers=[], samples_every=0, eval_every=0, val_before_train=False, save_every=0,
        strict_media=False, media_check=False, time_budget_s=None, target_accuracy=None)
    values["rollout"]["backend"] = "hf"
    values["rollout"]["max_new_tokens"] = min(values["rollout"]["max_new_tokens"], HELPER_NEW_TOKENS)
    values["algo"].update(filter_uniform_groups=False, max_staleness=0)
    values["model"]["compile_prewarm"] = False
    return values


# The share of the GPU's memory kept free beside the run's weights, its first update's
# training state and the helper's (activations, the rollout's cache, fragmentation).
RESERVE_SHARE = 0.15


def helper_bytes(model, layers: list, kept: int) -> int:
    """What the helper's model takes on the GPU at most, estimated from the run's `model`:
    its parameters less the decoder `layers` beyond the `kept` ones the helper builds, each
    trainable parameter with its gradient and AdamW's two moments in fp32 (and an fp32
    master beside half-precision weights), each frozen one its weight alone."""

    def cost(parameter) -> int:
        extra = (12 if parameter.dtype.itemsize >= 4 else 16) if parameter.requires_grad else 0
        return parameter.numel() * (parameter.element_size() + extra)

    everything = sum(cost(p) for p in model.parameters())  # a tied weight is yielded once
    in_layers = [sum(cost(p) for p in layer.parameters()) for layer in layers]
    if not in_layers:
        return everything
    return everything - sum(in_layers) + min(kept, len(in_layers)) * max(in_layers)


def room_problem(free: int, total: int, pending: int, helper: int) -> str | None:
    """Why the helper must give the GPU back, or None where it may go on: the run's `free`
    bytes after its build must hold its first update's `pending` training state (gradients
    and moments), the `helper`'s model at its peak and `RESERVE_SHARE` of the `total`."""
    reserve = int(total * RESERVE_SHARE)
    if free - pending - helper >= reserve:
        return None
    gib = 2 ** 30
    return (f"the GPU's {free / gib:.1f} GiB free after the build leave too little for the first update's "
            f"{pending / gib:.1f} GiB of training state, the helper's {helper / gib:.1f} GiB and "
            f"{reserve / gib:.1f} GiB to spare; stopped, so the run has the memory")


class Helper:
    """A started helper: `pending` says whether it is still at work, `join` waits for it (at
    most until `JOIN_TIMEOUT_S` after its start)."""

    def __init__(self, process: subprocess.Popen, log: Path, timeout: float = JOIN_TIMEOUT_S,
                 announce: bool = True, work: Path | None = None) -> None:
        self.process = process
        self.log = log
        self.work = work  # the helper's payload and run folder, removed once it is over
        self.deadline = time.monotonic() + timeout
        self.announce = announce
        self.outcome: str | None = None  # "done", or why not

    def pending(self) -> bool:
        """Whether the helper is still at work (running, within its deadline). Once it has
        ended, or past its deadline, its outcome is recorded as `join` records it."""
        if self.outcome is not None:
            return False
        if self.process.poll() is None and time.monotonic() < self.deadline:
            return True
        self.join()
        return False

    def join(self) -> float:
        """Wait for the helper; seconds waited. Stops it past the deadline. Once."""
        if self.outcome is not None:
            return 0.0
        began = time.monotonic()
        try:
            code = self.process.wait(timeout=max(0.0, self.deadline - began))
        except subprocess.TimeoutExpired:
            self.stop()
            self.outcome = f"not done within {JOIN_TIMEOUT_S:.0f} s, stopped"
        else:
            self.outcome = "done" if code == 0 else f"exited with code {code}"
        if self.outcome != "done" and self.announce:
            print(f"compile helper: {self.outcome} (log: {self.log}); the run compiles its own graphs",
                  file=sys.stderr, flush=True)
        self._remove_work()
        return time.monotonic() - began

    def give_up(self, reason: str) -> None:
        """Stop the helper for `reason` (said in one line), its outcome recorded as such."""
        if self.outcome is not None:
            return
        self.stop()
        self.outcome = reason
        if self.announce:
            print(f"compile helper: {reason}; the run compiles its own graphs", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._remove_work()

    def _remove_work(self) -> None:
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)


def write_payload(recipe: Recipe, work: Path) -> Path:
    """The file `python -m mmrl.compile_helper` reads: the helper's recipe (`helper_values`,
    its run folder under `work`), the folder the run's recipe resolves its paths against and
    when the run started it (wall clock: the helper's log counts its phases from there)."""
    payload = work / "helper.json"
    payload.write_text(json.dumps({"recipe": helper_values(recipe, work / "run"),
                                   "folder": str(recipe.folder) if recipe.folder else None,
                                   "started": time.time()}))
    return payload


def start(recipe: Recipe, settled: Settled, dist: Dist, *, given_objects: bool = False) -> Helper | None:
    """Start the helper (`python -m mmrl.compile_helper`) where it is wanted (`reason_not`);
    None where not."""
    if reason_not(recipe, settled, dist, given_objects=given_objects) is not None:
        return None
    folder = cache_folder() / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mmrl-prewarm-"))
    payload = write_payload(recipe, work)
    log = folder / f"{recipe_key(recipe, settled)}.log"
    # The run's import path: a reward or environment module found beside its script is found.
    path = os.pathsep.join(entry for entry in sys.path if entry and Path(entry).exists())
    # The run reads the CUDA libraries ahead itself (`mmrl.page_cache`): the helper reading
    # the same gigabytes at once would only compete with it for the disk.
    env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONPATH": path, "MMRL_READ_AHEAD": "0"}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "mmrl.compile_helper", str(payload)],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    helper = Helper(process, log, announce=dist.is_main, work=work)
    import atexit

    atexit.register(helper.stop)
    return helper
