"""Shared fixtures: the registered families and fresh tiny builds of each."""

import os

from mmrl.logs import share_cpu

share_cpu()  # OpenMP threads sleep while they wait: before torch loads (mmrl/logs.py)

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)))))

from mmrl.registry import families  # noqa: E402

FAMILIES = [a.family for a in families()]
VLM_FAMILIES = [a.family for a in families() if a.is_multimodal]


@pytest.fixture
def tmp_ckpt(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def plugin_path(tmp_path):
    """`tmp_path` on sys.path for an out-of-tree family (what `mmrl add-model --out`
    writes); afterwards its families are unregistered and its modules forgotten."""
    import importlib
    import sys

    from mmrl.registry import unregister

    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
            for attr in vars(module).values():
                if isinstance(attr, type) and attr.__module__ == name and hasattr(attr, "family"):
                    unregister(attr.family)
    importlib.invalidate_caches()
