"""The `reads_media` probe: log-probs move when the images do, on the rollout path and on
the training path, and the vision tower gets the same pixels on both (`mmrl.media_check`,
which the trainer also runs on its first batch).

    mmrl doctor qwen2_vl                      # the "Reads media" line
    mmrl support-matrix --feature reads_media
"""

from __future__ import annotations

from mmrl.adapter import ModelAdapter
from mmrl.checks import sample_images
from mmrl.media_check import read_media
from mmrl.probes.base import CheckFailed, Subject, Verified

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
    return Verified(f"{type(rollout).__name__}: " + reading.summary(), reading.evidence())
