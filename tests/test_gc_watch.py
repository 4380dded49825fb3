"""The garbage collector's share of a step (`mmrl.gc_watch`, `time/gc`)."""

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from mmrl.gc_watch import GcWatch, watch_gc

REPO = Path(__file__).resolve().parents[1]


def test_the_watch_counts_full_collections_and_their_seconds():
    watch = GcWatch()
    watch.install()
    try:
        assert watch.take() == (0.0, 0)
        gc.collect(0)
        seconds, full = watch.take()
        assert seconds > 0 and full == 0  # a young collection counts its time, not as full
        gc.collect()
        gc.collect()
        seconds, full = watch.take()
        assert seconds > 0 and full == 2
        assert watch.take() == (0.0, 0)  # taken: nothing since
    finally:
        gc.callbacks.remove(watch._callback)


def test_the_process_has_one_watch_installed_once():
    first = watch_gc()
    watch_gc()
    assert watch_gc() is first
    assert gc.callbacks.count(first._callback) == 1


def test_freezing_waits_for_new_compiles_and_keeps_objects_freeable():
    watch = GcWatch()
    before = gc.get_freeze_count()
    try:
        assert not watch.freeze_after(0)  # nothing compiled: nothing frozen
        held = _Held()
        assert watch.freeze_after(2)
        assert watch.frozen > 0 and gc.get_freeze_count() > before
        assert not any(o is held for o in gc.get_objects())  # out of the full collections' walk
        assert not watch.freeze_after(2)  # no compile since
        alone = weakref.ref(held)
        del held
        assert alone() is None  # frozen, and still freed when nothing refers to it
        assert watch.freeze_after(3)
    finally:
        gc.unfreeze()


class _Held:
    pass


_ONE_RUN = """
import gc, json, sys
import torch
from mmrl.config import load_recipe
from mmrl.gc_watch import watch_gc
from mmrl.trainer import Trainer
trainer = Trainer(load_recipe(sys.argv[1], json.loads(sys.argv[2])))
frozen = []
for _ in range(3):
    trainer.train_step()
    frozen.append(watch_gc().frozen)
tracked = len(gc.get_objects())
weights = [p.detach().double().sum().item() for p in trainer.actor.model.parameters()]
gc.unfreeze()
gc.set_debug(gc.DEBUG_SAVEALL)
gc.collect()
garbage = sum(o.untyped_storage().nbytes() for o in gc.garbage  # type(): a dead weak proxy is garbage too
              if issubclass(type(o), torch.Tensor) and not type(o).__name__.startswith("Fake"))
print(json.dumps({"frozen": frozen, "tracked": tracked, "weights": weights, "garbage_tensor_bytes": garbage}))
"""


@pytest.mark.slow
def test_a_run_freezes_after_its_compiling_step_and_learns_the_same(tmp_path):
    """`trainer.gc_freeze`: the run with compiled layers (inductor's C++ kernels on the CPU)
    freezes once, after step 1 compiled, and steps 2-3 compile nothing and freeze nothing; its
    full collections then walk a small share of the objects, its weights after 3 steps are
    those of the run without freezing, and no tensor of a step is kept in frozen garbage."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    results = {}
    for freeze in (True, False):
        overrides = ["data.train=synthetic:count_shapes?n=16&seed=0&image_size=56", "data.validation=null",
                     "data.eval=null", "data.prompts_per_step=4", "trainer.threads=1", "model.compile_layers=true",
                     "model.compile_prewarm=false", f"trainer.output_dir={tmp_path / str(freeze)}",
                     "trainer.progress=false", "trainer.summary=false", f"trainer.gc_freeze={str(freeze).lower()}"]
        run = subprocess.run([sys.executable, "-c", _ONE_RUN, str(REPO / "recipes" / "tiny_vlm_count.yaml"),
                              json.dumps(overrides)], capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
        assert run.returncode == 0, run.stderr[-2000:]
        results[freeze] = json.loads(run.stdout.strip().splitlines()[-1])
    frozen, plain = results[True], results[False]
    assert frozen["frozen"][0] > 100_000 and frozen["frozen"][1:] == [frozen["frozen"][0]] * 2
    assert plain["frozen"] == [0, 0, 0]
    assert frozen["tracked"] * 4 < plain["tracked"]
    assert frozen["weights"] == plain["weights"]
    assert frozen["garbage_tensor_bytes"] <= plain["garbage_tensor_bytes"]
