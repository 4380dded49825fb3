"""Stage 6, depth: the probes a zoo family passes beyond the quick checks, run on the
scaffolded family through the probe table (`mmrl.probes.probe`), each claim declared
only where its probe verified it:

- `video`: a 4-frame clip processed and generated from, alone and beside image prompts
  (vision-language types whose processor takes video);
- `sequence_parallel`: Ulysses over 2 gloo processes equals one process (log-probs,
  gradients, the AdamW step); where Ulysses fails (a decoder it cannot split by heads:
  recurrent or convolution layers, attention outside transformers' interface), the same
  probe again with gathered mixers (`SequenceParallel(gather_mixers=True)`,
  mmrl.parallel.gathered), declared where that verifies;
- `multi_turn`: an image (and a clip, where `video` verified) arriving in turn 3 of the
  agent loop trains as the final conversation processed in one go, under the
  optimizations verified before it (vision-language types);
- `vllm`: greedy vLLM rollout log-probs equal the trainer's, before and after an
  optimizer step and a weight sync (`mmrl.probes.training.check_vllm`), in a fresh
  process under its own time limit (`VLLM_SECONDS`; vLLM's engine and memory go with
  the process). It runs only where vLLM's registry serves the architecture for
  generation, with a model class of its own or through its Transformers backend
  (`mmrl.scaffold.vllm_registry.vllm_serves`); elsewhere the column is decided without
  running, and its gap says why.

The probes build the family from the written adapter, and two of them rebuild it in
torchrun subprocesses, so the adapter and its processing are written under importable
module names into a scratch folder on `sys.path`; families that held the type before
(`replace_registered`) are hidden from those subprocesses too. Where a probe fails, a
`Gap` names the column, the cause in one line and what to write by hand.

    depth = Depth(verified)                          # the quick checks' capabilities
    verify_depth(discovery, layout, depth, hidden=[])   # columns=("vllm",): only those
    depth.capabilities, depth.gaps
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl import errors
from mmrl.adapter import Capabilities
from mmrl.scaffold.base import DEPTH, Discovery, Gap, Layout
from mmrl.scaffold.render import render_adapter, render_processing
from mmrl.scaffold.vllm_registry import registry_tables, vllm_serves

# The vllm probe's own time limit (seconds), in its fresh process: vLLM's engine start
# and two generations on a tiny model (bench/results/vllm_scaffolded.json has the times).
VLLM_SECONDS = 300

# What to write by hand, per column, where its check or probe failed.
TO_WRITE = {
    "generation": "fix tiny() or the processing until HF generate runs on the tiny model",
    "padding_free": "write packed positions (position_ids for packed rows) or keep padding_free=False",
    "gradient_checkpointing": "name the layers that checkpoint (shard_layers) or keep gradient_checkpointing=False",
    "lora_language": "set the adapter's LoraTargets(language=...)",
    "lora_vision": "set the adapter's LoraTargets(vision=...)",
    "single_image": "fix tiny() or the processing until an image prompt trains (placeholders, image size)",
    "multi_image": "make the processing take two images a prompt, or keep multi_image=False",
    "media_sharing": "keep media_sharing=False, or make the processing's per-prompt batches collate to the batch's",
    "video": "add 'video' to modalities and claim video=True once the processing takes a clip "
             "(load_video / arrange_videos / video_kwargs)",
    "sequence_parallel": "set the adapter's sequence_parallel = SequenceParallel(...) to what Ulysses needs "
                         "(heads, inputs to split), or keep it False",
    "multi_turn": "make the processing keep earlier turns' tokens when media arrive later and write an assistant's "
                  "text as sampled (the prefix rule, docs/agents.md), or keep multi_turn=False",
    "vllm": "make the adapter's rollout match vLLM's model (Rollout(weight_prefixes=...) for HF -> vLLM weight names, "
            "tiny() shapes vLLM takes) until `mmrl support-matrix --family FAMILY` verifies vllm, or keep vllm=False "
            "and roll out with the hf backend",
}


# Failures of a depth probe that no adapter line fixes (a limit of the type, or of mmrl's
# Ulysses), by a pattern of the probe's reason: what the gap line tells the user instead
# of the column's generic advice. Checked in order; {0} is the pattern's first group.
_OUT_OF_TIME = (r"ran past its \d+ s limit",
                "run `mmrl add-model TYPE` again on a less loaded host: the probe did not finish within the depth "
                "stage's time, which says nothing about the type")
_NOT_SERVED = (r"^vLLM's model registry names ",
               "keep vllm=False and roll out with the hf backend: mmrl's vLLM rollout needs vLLM to serve the "
               "architecture for generation (a model class of its own, or its Transformers backend); claiming it "
               "needs one registered (vLLM's ModelRegistry.register_model) and rollout.vllm_architecture naming it")
_VLLM_NOT_RUN = (r"^not run here: ",
                 "run `mmrl add-model TYPE` again where vLLM runs this model (for one, a GPU build of vLLM), or keep "
                 "vllm=False")
LIMITS = {
    "video": (_OUT_OF_TIME,),
    "vllm": (_OUT_OF_TIME, _NOT_SERVED, _VLLM_NOT_RUN),
    "multi_turn": (
        _OUT_OF_TIME,
        (r"opening turn is processed into other tokens",
         "keep multi_turn=False: the processor lays the opening turn out anew once a later image is in the "
         "conversation (e.g. every image's placeholders at the start of the text); claiming it needs a processing "
         "that puts each image's placeholders in the turn the image arrives in"),
        (r"reply image's placeholders are not in the trained columns",
         "keep multi_turn=False: the processor puts the reply image's placeholders outside the turn it arrives in "
         "(e.g. at the start of the text); claiming it needs a processing that puts them in that turn"),
    ),
    "sequence_parallel": (
        _OUT_OF_TIME,
        (r"which no layer of this decoder calls|no attention heads to split",
         "keep sequence_parallel=False: mmrl's Ulysses splits attention heads where a layer calls transformers' "
         "attention interface, and no layer of this decoder does (recurrent, state-space or convolution layers, "
         "or attention written its own way); no adapter line changes that"),
        (r"sdpa(?: or eager)? attention, not '([^']+)'",
         "keep sequence_parallel=False: Ulysses wraps sdpa or eager attention, and this decoder runs {0} "
         "attention only"),
        (r"position biases or attention sinks",
         "keep sequence_parallel=False, or build the family on eager attention (model.attn_implementation: eager): "
         "there Ulysses runs the family's own eager function, which applies them"),
        (r"needs keyword arguments for (\w+)",
         "keep sequence_parallel=False: the model calls its decoder stack {0} with positional arguments, which "
         "mmrl's Ulysses hook (mmrl/parallel/ulysses.py) does not cut"),
        (r"the decoder gets (\w+) \S+ \S+ over the whole sequence",
         "declare it in the adapter: sequence_parallel = SequenceParallel(split_inputs=(..., '{0}')) where {0} "
         "holds one value per position, or masked_inputs=(('{0}', (INPUTS,)),) where it marks the rows of INPUTS"),
        (r"does not divide|heads divisible by",
         "write tiny() with attention heads that 2 divides (the probe's 2 processes), or keep "
         "sequence_parallel=False"),
    ),
}
# What the padding-free check's boundary case reports (mmrl.scaffold.verify) where a packed
# sample behind a long neighbour differs from itself alone.
_CROSSES_BOUNDARY = "state crosses a packed sequence boundary"
# Config fields of layers that carry a state along the sequence (state-space, recurrent,
# linear-attention, short-convolution layers), beside transformers' own `layer_types`.
STATEFUL_FIELDS = re.compile(r"mamba|ssm|rwkv|linear_(num|key|value|conv)|conv_(kernel|L_cache)|short_conv|"
                             r"time_step|state_size|deltanet|lightning|recurrent|xlstm|slstm|mlstm", re.IGNORECASE)


def stateful_layers(config) -> list[str]:
    """What says the tiny model has layers carrying a state along the sequence: the
    stateful kinds of its `layer_types`, else the config fields that name such layers."""
    from mmrl.boundaries import stateful_layer_kinds

    if config is None:
        return []
    kinds = sorted(stateful_layer_kinds(config))
    if kinds:
        return kinds
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return sorted(k for k in text.to_dict() if STATEFUL_FIELDS.search(k))[:3]


def to_write(column: str, cause: str, config=None) -> str:
    """What to write by hand for `column`, whose probe failed with `cause`: the limit
    the cause names (LIMITS), a packed sample that reads its neighbour's state or a
    mismatch of a sequence-parallel step on a decoder with stateful layers, or else the
    column's generic advice (TO_WRITE)."""
    for pattern, advice in LIMITS.get(column, ()):
        found = re.search(pattern, cause)
        if found:
            return advice.format(*found.groups())
    if column == "padding_free" and _CROSSES_BOUNDARY in cause:
        # Without stateful layers the leak is the positions' (absolute or ALiBi ones counted
        # from the row's start), which the generic advice covers.
        layers = stateful_layers(config)
        if layers:
            return (f"keep padding_free=False: the decoder has layers that carry a state along the sequence "
                    f"({', '.join(layers)}), and a packed sample behind a long neighbour still read its neighbour; "
                    "mmrl runs per packed sequence only the cache-taking, non-attention mixers of the layers "
                    "layer_types marks stateful, reached through the layers' seq_idx keyword "
                    "(mmrl/engine/stateful_layers.py), so a state inside attention, a forward that keeps seq_idx from "
                    "its layers or attention without the packed mask stays; the trainer refuses model.pack: true")
    if column == "padding_free" and (layers := stateful_layers(config)):
        # Failed before the boundary case ran: positions first, and the state would still leak.
        return (f"{TO_WRITE[column]}; even with packed positions, the decoder's layers that carry a state along the "
                f"sequence ({', '.join(layers)}) would read a packed neighbour's state, which the check's boundary "
                "case refuses, so keep padding_free=False")
    if column == "sequence_parallel" and re.search(r"differ|exceed|mismatch", cause):
        layers = stateful_layers(config)
        if layers:
            return (f"keep sequence_parallel=False: the decoder has layers that carry a state along the sequence "
                    f"({', '.join(layers)}), which under Ulysses each process runs on its own slice of the sequence, "
                    "so no adapter line makes them equal one process")
    return TO_WRITE[column]


@dataclass
class Depth:
    """The capabilities so far (the quick checks', then each depth probe's verdict as it
    comes) and the gaps found; a stage that runs out of time keeps what was decided."""

    capabilities: Capabilities
    gaps: list[Gap] = field(default_factory=list)
    decided: list[str] = field(default_factory=list)  # depth columns whose probe gave a verdict
    running: str | None = None  # the column whose probe is running
    config: Any = None  # the tiny config (set by verify_depth): what a gap's advice reads

    def decide(self, column: str, passed: bool, cause: str = "") -> None:
        self.capabilities = dataclasses.replace(self.capabilities, **{column: passed})
        self.decided.append(column)
        self.running = None
        if not passed:
            cause = errors.one_line(cause, 240, whole=True)
            self.gaps.append(Gap(column, cause, to_write(column, cause, self.config)))


def takes_video(d: Discovery) -> bool:
    """Whether the type's processor takes video (it has a video processor and the
    scaffold found its placeholder)."""
    media = d.tiny.media if d.tiny is not None else None
    return bool(d.resolved.is_vision_language and media is not None and media.video_placeholder)


def applicable(d: Discovery, capabilities: Capabilities) -> list[str]:
    """The depth columns that apply to the type, in the order they run."""
    vlm = d.resolved.is_vision_language
    # vllm applies to every type: where vLLM does not serve it, the column is a "no" whose gap says so.
    rules = {"video": takes_video(d), "sequence_parallel": True, "multi_turn": vlm and capabilities.single_image,
             "vllm": True}
    return [column for column in DEPTH if rules[column]]


def verify_depth(d: Discovery, layout: Layout, depth: Depth, hidden: list[str] = (),
                 columns: tuple[str, ...] | None = None) -> None:
    """Run the depth probes on the scaffolded family, updating `depth` as each decides:
    `video` and `sequence_parallel` on the adapter claiming both, then `multi_turn` on the
    adapter claiming what verified (its checks follow what the family declares), then
    `vllm` in a process of its own. `columns`: only these depth columns (None: all)."""
    depth.config = d.tiny.config if d.tiny is not None else None
    columns = [c for c in applicable(d, depth.capabilities) if columns is None or c in columns]
    first = [c for c in columns if c not in ("multi_turn", "vllm")]
    if "sequence_parallel" in first and d.sequence_parallel is None:
        with scratch_family(d, layout, depth.capabilities, hidden) as subject:
            try:
                d.sequence_parallel = sequence_inputs(subject)
            except Exception:  # noqa: BLE001 - the default stands; the probe says what fails
                d.sequence_parallel = None
    if first:
        claimed = dataclasses.replace(depth.capabilities, **{c: True for c in first})
        with scratch_family(d, layout, claimed, hidden) as subject:
            for column in first:
                _run(column, subject, depth)
        if "sequence_parallel" in depth.decided and not depth.capabilities.sequence_parallel:
            gather_mixers(d, layout, depth, hidden)
    if "multi_turn" in columns:
        with scratch_family(d, layout, dataclasses.replace(depth.capabilities, multi_turn=True), hidden) as subject:
            _run("multi_turn", subject, depth)
    if "vllm" in columns:
        verify_vllm(d, layout, depth, hidden)


def vllm_unserved(architecture: str) -> str | None:
    """Why the vllm column is decided without running its probe (the cause its gap
    gives: vLLM does not serve `architecture` for generation, with a class of its own or
    through its Transformers backend, or is not installed here), or None where the probe runs."""
    tables = registry_tables()
    if isinstance(tables, str):
        return f"not run here: {tables}"
    served, why = vllm_serves(architecture, tables)
    return None if served else why


def verify_vllm(d: Discovery, layout: Layout, depth: Depth, hidden=()) -> None:
    """The vllm column: the probe in a fresh process on the adapter claiming vllm (the
    capabilities verified so far, its rollout naming the architecture), where vLLM serves
    the architecture; else decided "no" with the reason, without running vLLM."""
    from mmrl.probes.isolated import run_isolated

    unserved = vllm_unserved(d.resolved.model_class)
    if unserved is not None or d.vllm_architecture is None:
        depth.decide("vllm", False, unserved or d.vllm_note)
        return
    depth.running = "vllm"
    with scratch_family(d, layout, dataclasses.replace(depth.capabilities, vllm=True), hidden) as subject:
        _record("vllm", run_isolated("vllm", subject, VLLM_SECONDS), depth)


def gather_mixers(d: Discovery, layout: Layout, depth: Depth, hidden=()) -> None:
    """Where the sequence-parallel probe failed on Ulysses: the probe again on the adapter
    declaring `SequenceParallel(gather_mixers=True)`. Declared where it verifies (the gap
    goes); else the adapter keeps its Ulysses spec and the gap gives both causes."""
    from mmrl.adapter import SequenceParallel
    from mmrl.probes import Status, probe

    gap = next((g for g in reversed(depth.gaps) if g.column == "sequence_parallel"), None)
    if gap is None or re.search(_OUT_OF_TIME[0], gap.cause):
        return
    ulysses_spec, d.sequence_parallel = d.sequence_parallel, SequenceParallel(gather_mixers=True)
    depth.running = "sequence_parallel"
    claimed = dataclasses.replace(depth.capabilities, sequence_parallel=True)
    with scratch_family(d, layout, claimed, hidden) as subject:
        result = probe("sequence_parallel").run(subject)
    depth.running = None
    if result.status is Status.VERIFIED:
        depth.capabilities = claimed
        depth.gaps.remove(gap)
        return
    d.sequence_parallel = ulysses_spec
    cause = errors.one_line(f"{gap.cause}; gathered mixers: {result.reason}", 400, whole=True)
    depth.gaps[depth.gaps.index(gap)] = dataclasses.replace(gap, cause=cause)


# What the Ulysses hook cuts or leaves whole without being told (mmrl.parallel.ulysses).
_KNOWN_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "labels", "past_key_values",
                 "use_cache", "return_dict", "output_hidden_states", "output_attentions")


def sequence_inputs(subject):
    """The adapter's `SequenceParallel` for what the tiny model's decoder stack gets along
    the sequence beyond ids, embeddings and positions (one forward on a sample image
    batch, its keyword arguments read by a pre-hook), or None where it gets nothing more.
    A (B, S) boolean mask whose True count is the row count of other inputs (a tensor,
    or a list of tensors: e.g. visual features added at the image positions) pairs with
    them as `masked_inputs`; any other per-position input is cut as a `split_inputs`."""
    import torch

    from mmrl import build_model
    from mmrl.adapter import SequenceParallel
    from mmrl.checks import logits_of, sample_conversations
    from mmrl.parts import decoder_stack

    built = build_model(subject.source, random_init=True)
    batch = dict(built.processing(sample_conversations(built.adapter)))
    seen: dict = {}
    stack = decoder_stack(built.model, built.adapter)
    handle = stack.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        with torch.no_grad():
            logits_of(built.model, batch)
    finally:
        handle.remove()
    source = seen.get("inputs_embeds", seen.get("input_ids"))
    if not isinstance(source, torch.Tensor):
        return None
    default = SequenceParallel()
    along = [name for name, value in seen.items() if name not in _KNOWN_INPUTS and name not in default.split_inputs
             and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == source.shape[:2]]
    split, masked = list(default.split_inputs), []
    for name in along:
        value = seen[name]
        count = int(value.sum()) if value.dtype == torch.bool and value.dim() == 2 else -1
        rows = tuple(other for other, held in seen.items()
                     if other != name and other not in along and count > 0 and _rows(held) == count)
        if rows:
            masked.append((name, rows))
        else:
            split.append(name)
    if not along:
        return None
    return SequenceParallel(heads_attrs=default.heads_attrs, split_inputs=tuple(split), masked_inputs=tuple(masked))


def _rows(value) -> int | None:
    """The row count of a tensor, or of every tensor of a list (None where they differ)."""
    import torch

    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return value.shape[0]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in value):
        counts = {v.shape[0] for v in value}
        return counts.pop() if len(counts) == 1 else None
    return None


def _run(column: str, subject, depth: Depth) -> None:
    from mmrl.probes import probe

    depth.running = column
    _record(column, probe(column).run(subject), depth)


def _record(column: str, result, depth: Depth) -> None:
    """The column's verdict from its probe's result (a ProbeResult)."""
    from mmrl.probes import Status

    if result.status is Status.VERIFIED:
        depth.decide(column, True)
    elif result.status is Status.NOT_RUN:
        depth.decide(column, False, f"not run here: {result.reason}")
    else:
        depth.decide(column, False, result.reason)


@contextlib.contextmanager
def scratch_family(d: Discovery, layout: Layout, capabilities: Capabilities, hidden=()) -> Iterator:
    """The family as rendered with `capabilities`, registered in this process under
    importable module names (a scratch folder on `sys.path`, which torchrun's processes
    inherit), as a probe `Subject`; unregistered and removed afterwards."""
    from mmrl.probes import Subject
    from mmrl.registry import get_adapter, unregister

    scratch = Path(tempfile.mkdtemp(prefix="mmrl-add-model-depth-"))
    token = uuid.uuid4().hex[:8]  # a fresh module name each time: no stale import
    names = []
    previous_hidden = os.environ.get("MMRL_HIDE_FAMILIES")
    sys.path.insert(0, str(scratch))
    try:
        if hidden:
            os.environ["MMRL_HIDE_FAMILIES"] = ",".join(filter(None, [previous_hidden, *hidden]))
        processing_ref = None
        if layout.processing is not None:
            name = f"_mmrl_depth_processing_{d.family}_{token}"
            (scratch / f"{name}.py").write_text(render_processing(d))
            names.append(name)
            processing_ref = f"{name}:{d.class_name}Processing"
        name = f"_mmrl_depth_adapter_{d.family}_{token}"
        (scratch / f"{name}.py").write_text(render_adapter(d, layout, capabilities, processing_ref))
        names.append(name)
        importlib.invalidate_caches()
        importlib.import_module(name)
        try:
            yield Subject(get_adapter(d.family), source=d.family)
        finally:
            unregister(d.family)
    finally:
        sys.path.remove(str(scratch))
        for name in names:
            sys.modules.pop(name, None)
        if hidden:
            if previous_hidden is None:
                os.environ.pop("MMRL_HIDE_FAMILIES", None)
            else:
                os.environ["MMRL_HIDE_FAMILIES"] = previous_hidden
        shutil.rmtree(scratch, ignore_errors=True)


__all__ = ["LIMITS", "TO_WRITE", "VLLM_SECONDS", "Depth", "verify_vllm", "vllm_unserved", "gather_mixers", "sequence_inputs", "stateful_layers", "to_write", "applicable", "scratch_family", "takes_video", "verify_depth"]
