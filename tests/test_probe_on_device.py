"""Probes on a GPU process their inputs on CPU (`mmrl.probes.base.OnDevice`), whatever
method of the processing they reach, and whatever default device they run under.

On the H200 the rollout_agreement probe failed for idefics3, smolvlm and internvl: with
two samples per prompt the HF rollout collates the rows from each prompt's batch
(`SharedMedia.rows` -> `Processing.collate_rows`), a method that went past the wrapper
and processed the rows again under the probe's CUDA default device (GPU rows compared
with a half-CPU batch; numpy handed a CUDA tensor). No GPU here: the probe's non-CPU
default device is emulated with `meta`, under which a processor fails as it did on CUDA.

    .venv/bin/python -m pytest -q tests/test_probe_on_device.py
"""

import pytest
import torch

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.engine.media import SharedMedia
from mmrl.processing import batch_differences
from mmrl.probes.base import OnDevice


class RecordingProcessing:
    """A processing stand-in whose call and `collate` say under which default device they ran."""

    tokenizer = "the tokenizer"

    def __init__(self):
        self.default_devices = []

    def __call__(self, conversations):
        self.default_devices.append(torch.get_default_device())
        return {"input_ids": torch.tensor([[1, 2, 3]])}

    def collate(self, batches):
        self.default_devices.append(torch.get_default_device())
        return {"input_ids": torch.cat([b["input_ids"] for b in batches])}


def test_every_method_runs_on_cpu_and_its_tensors_land_on_the_device():
    inner = RecordingProcessing()
    processing = OnDevice(inner, "meta")
    with torch.device("meta"):  # the probe's default device (cuda on a GPU)
        batch = processing([[{"role": "user", "content": "hi"}]])
        collated = processing.collate([{"input_ids": torch.tensor([[4, 5]], device="cpu")}] * 2)
    assert inner.default_devices == [torch.device("cpu")] * 2
    assert batch["input_ids"].device.type == "meta" and collated["input_ids"].device.type == "meta"
    assert collated["input_ids"].shape == (2, 2)
    assert processing.tokenizer == "the tokenizer"  # attributes that are not methods pass through


@pytest.mark.parametrize("family", ["idefics3", "internvl"])
def test_repeated_prompts_collate_on_cpu_under_another_default_device(family):
    built = build_model(family, random_init=True)
    conversations = sample_conversations(built.adapter)
    expanded = [c for c in conversations for _ in range(2)]
    owners = [0, 0, 1, 1]
    processing = OnDevice(built.processing, "cpu")
    with torch.device("meta"):
        # What HFRollout.generate does with two samples per prompt.
        shared = SharedMedia.of(processing, expanded, owners)
        rows = shared.rows(processing, expanded)
    assert built.processing.collate_matches is True
    plain = dict(built.processing(expanded))
    assert all(value.device.type == "cpu" for value in rows.values())
    assert batch_differences(rows, plain) == []
