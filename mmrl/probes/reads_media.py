"""The `reads_media` probe: log-probs move when the images do, on the rollout path and on
the training path, and the vision tower gets the same pixels on both (`mmrl.media_check`,
which the trainer also runs on its first batch).

The rollout path is checked with the backend a run takes by default ("auto": the HF
backends, hooked) and, where vLLM is installed and the family names a vLLM architecture,
with vLLM too: its own copy of the model scores the sampled tokens with each variant's
media (its tower's pixels cannot be seen). Where vLLM does not run, the reason says that
its rollout path was not checked, and why. A vLLM failure fails the probe only for a
family that declares `vllm` (as in the rollout_agreement probe).

    mmrl doctor qwen2_vl                      # the "Reads media" line
    mmrl support-matrix --feature reads_media
"""

from __future__ import annotations

import os
from typing import Any

from mmrl.adapter import ModelAdapter
from mmrl.checks import sample_images
from mmrl.media_check import read_media
from mmrl.probes.base import CheckFailed, Subject, Verified, one_line
from mmrl.probes.rollout_agreement import backend_skip_reason

# Three prompts, the first two with images of one size (shuffling swaps them), the third
# with an image of another size (it stays put under shuffling, so the batch mixes sizes).
PROMPTS = ("What is shown here?", "Count the shapes in the picture and answer with a number.",
           "Which colour is the shape?")
SIZES = ((56, 56), (56, 56), (84, 112))


def reads_media_inapplicable(adapter: ModelAdapter) -> str | None:
    return None if "image" in adapter.modalities else "text-only family (no image modality)"


def media_conversations() -> list[list[dict]]:
    """Three one-image prompts whose images differ (two share a size)."""
    return [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": prompt}]}]
            for prompt, image in zip(PROMPTS, sample_images(SIZES))]


def check_reads_media(subject: Subject) -> Verified:
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine
    from mmrl.probes.launcher import single_process
    from mmrl.rollout import make_rollout

    built = subject.build()
    engine = Engine(built, single_process(subject.device), optim=OptimConfig(lr=1e-2), total_steps=1)
    rollout = make_rollout("auto", engine, built.processing)
    reading = read_media(engine, rollout, built.processing, media_conversations())
    if reading.problem is not None:
        raise CheckFailed(reading.problem)
    vllm_line, vllm_evidence = vllm_reading(engine, built)
    return Verified(f"{type(rollout).__name__}: {reading.summary()}; {vllm_line}",
                    {**reading.evidence(), "vllm": vllm_evidence})


def vllm_reading(engine, built) -> tuple[str, dict[str, Any]]:
    """(a clause for the probe's reason, evidence) of the check with the vLLM backend as
    the rollout path; raises CheckFailed where it fails for a family declaring `vllm`."""
    from mmrl.rollout import make_rollout

    skipped = backend_skip_reason("vllm", built.adapter)
    if skipped is not None:
        return f"vLLM's rollout path not checked ({skipped})", {"unchecked": skipped}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep `mmrl doctor --json`'s stdout clean
    gated = built.adapter.capabilities.vllm
    rollout = None
    try:
        rollout = make_rollout("vllm", engine, built.processing)
        reading = read_media(engine, rollout, built.processing, media_conversations())
    except Exception as exc:  # noqa: BLE001 - vLLM's trouble is a finding about vLLM
        from mmrl.rollout.vllm import UnsupportedByVLLM, platform_limit

        if isinstance(exc, UnsupportedByVLLM) or platform_limit(exc):
            why = f"vLLM cannot run this model here: {one_line(exc)}"
        elif gated:
            raise CheckFailed(f"with the vllm backend, the check did not run: {one_line(exc)}") from exc
        else:
            why = f"vLLM failed: {one_line(exc)}"
        return f"vLLM's rollout path not checked ({why})", {"unchecked": why}
    finally:
        close = getattr(rollout, "close", None)
        if close is not None:
            close()
    if reading.problem is not None:
        if gated:
            raise CheckFailed(f"with the vllm backend: {reading.problem}")
        return (f"with vLLM (not declared, not gated): {reading.problem}",
                {"problem": reading.problem, **reading.evidence()})
    shown = ", ".join(f"{k} {v:.1e}" for k, v in reading.figures.items() if k.startswith("rollout/"))
    return (f"VLLMRollout: log-probs move when the images do on its rollout path too (vLLM's log-probs of the "
            f"sampled tokens: {shown}); its tower's pixels not compared (its own copy of the model)",
            reading.evidence())
