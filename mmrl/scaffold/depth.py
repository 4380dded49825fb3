"""Stage 6, depth: the probes a zoo family passes beyond the quick checks, run on the
scaffolded family through the probe table (`mmrl.probes.probe`), each claim declared
only where its probe verified it:

- `video`: a 4-frame clip processed and generated from, alone and beside image prompts
  (vision-language types whose processor takes video);
- `sequence_parallel`: Ulysses over 2 gloo processes equals one process (log-probs,
  gradients, the AdamW step);
- `multi_turn`: an image (and a clip, where `video` verified) arriving in turn 3 of the
  agent loop trains as the final conversation processed in one go, under the
  optimizations verified before it (vision-language types).

The probes build the family from the written adapter, and two of them rebuild it in
torchrun subprocesses, so the adapter and its processing are written under importable
module names into a scratch folder on `sys.path`; families that held the type before
(`replace_registered`) are hidden from those subprocesses too. Where a probe fails, a
`Gap` names the column, the cause in one line and what to write by hand.

    depth = Depth(verified)                          # the quick checks' capabilities
    verify_depth(discovery, layout, depth, hidden=[])
    depth.capabilities, depth.gaps
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mmrl import errors
from mmrl.adapter import Capabilities
from mmrl.scaffold.base import DEPTH, Discovery, Gap, Layout
from mmrl.scaffold.render import render_adapter, render_processing

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
}


@dataclass
class Depth:
    """The capabilities so far (the quick checks', then each depth probe's verdict as it
    comes) and the gaps found; a stage that runs out of time keeps what was decided."""

    capabilities: Capabilities
    gaps: list[Gap] = field(default_factory=list)
    decided: list[str] = field(default_factory=list)  # depth columns whose probe gave a verdict
    running: str | None = None  # the column whose probe is running

    def decide(self, column: str, passed: bool, cause: str = "") -> None:
        self.capabilities = dataclasses.replace(self.capabilities, **{column: passed})
        self.decided.append(column)
        self.running = None
        if not passed:
            self.gaps.append(Gap(column, errors.one_line(cause, 240, whole=True), TO_WRITE[column]))


def takes_video(d: Discovery) -> bool:
    """Whether the type's processor takes video (it has a video processor and the
    scaffold found its placeholder)."""
    media = d.tiny.media if d.tiny is not None else None
    return bool(d.resolved.is_vision_language and media is not None and media.video_placeholder)


def applicable(d: Discovery, capabilities: Capabilities) -> list[str]:
    """The depth columns that apply to the type, in the order they run."""
    vlm = d.resolved.is_vision_language
    rules = {"video": takes_video(d), "sequence_parallel": True, "multi_turn": vlm and capabilities.single_image}
    return [column for column in DEPTH if rules[column]]


def verify_depth(d: Discovery, layout: Layout, depth: Depth, hidden: list[str] = ()) -> None:
    """Run the depth probes on the scaffolded family, updating `depth` as each decides:
    `video` and `sequence_parallel` on the adapter claiming both, then `multi_turn` on the
    adapter claiming what verified (its checks follow what the family declares)."""
    columns = applicable(d, depth.capabilities)
    first = [c for c in columns if c != "multi_turn"]
    if first:
        claimed = dataclasses.replace(depth.capabilities, **{c: True for c in first})
        with scratch_family(d, layout, claimed, hidden) as subject:
            for column in first:
                _run(column, subject, depth)
    if "multi_turn" in columns:
        with scratch_family(d, layout, dataclasses.replace(depth.capabilities, multi_turn=True), hidden) as subject:
            _run("multi_turn", subject, depth)


def _run(column: str, subject, depth: Depth) -> None:
    from mmrl.probes import Status, probe

    depth.running = column
    result = probe(column).run(subject)
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


__all__ = ["TO_WRITE", "Depth", "applicable", "scratch_family", "takes_video", "verify_depth"]
