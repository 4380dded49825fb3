"""Shared fixtures: the registered families and fresh tiny builds of each; the torch
threads of each test process.

Under pytest-xdist (`-n auto`: README.md's test command) every worker gets its share of
the cores, one thread on a machine with as many cores as workers, and the processes it
starts (torchrun ranks, `mmrl train`) inherit that share through OMP_NUM_THREADS and
MMRL_MAX_THREADS, which caps a recipe's `trainer.threads` (mmrl/logs.py). Without xdist
the one process takes up to 2 threads, as before.
"""

import os

from mmrl.logs import MAX_THREADS_ENV, share_cpu

share_cpu()  # OpenMP threads sleep while they wait: before torch loads (mmrl/logs.py)

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, len(os.sched_getaffinity(0)) // WORKERS))
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # read when torch loads, here and in subprocesses
    os.environ.setdefault(MAX_THREADS_ENV, str(THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(THREADS)

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


def pytest_itemcollected(item):
    """A test that starts torchrun processes is slow too: out of the quick tier
    (`-m "not slow and not gpu"`, README.md), first in the queue."""
    if item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow"):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after pytest has grouped the tests that share a parametrized fixture
def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort keeps their order otherwise): under xdist the long
    end-to-end runs start while the other workers take the quick tests, instead of one
    of them starting last and running on alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
