"""Shared fixtures: the registered families and fresh tiny builds of each."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from mmrl.registry import families  # noqa: E402

FAMILIES = [a.family for a in families()]
VLM_FAMILIES = [a.family for a in families() if a.is_multimodal]


@pytest.fixture
def tmp_ckpt(tmp_path):
    return tmp_path / "ckpt"
