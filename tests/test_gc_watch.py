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
start = watch_gc().frozen
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
print(json.dumps({"start": start, "frozen": frozen, "tracked": tracked, "weights": weights, "garbage_tensor_bytes": garbage}))
"""


@pytest.mark.slow
def test_a_run_freezes_after_its_compiling_step_and_learns_the_same(tmp_path):
    """`trainer.gc_freeze`: the run with compiled layers (inductor's C++ kernels on the CPU)
    freezes at its start and after step 1 compiled, and steps 2-3 compile nothing and freeze nothing; its
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
    assert frozen["start"] > 100_000 and frozen["frozen"][0] > frozen["start"] + 10_000
    assert frozen["frozen"][1:] == [frozen["frozen"][0]] * 2
    assert plain["start"] == 0 and plain["frozen"] == [0, 0, 0]
    assert frozen["tracked"] * 4 < plain["tracked"]
    assert frozen["weights"] == plain["weights"]
    assert frozen["garbage_tensor_bytes"] <= plain["garbage_tensor_bytes"]


@pytest.mark.parametrize("compiles", [False, True])
def test_a_run_freezes_at_its_start_only_where_its_first_step_compiles(tmp_path, monkeypatch, compiles):
    """On the CPU the plain run compiles nothing and freezes nothing at its start (a test
    process builds many trainers; what it froze would outlive them in reference cycles); with
    `model.compile_layers` its first step compiles, and it freezes once, after collecting."""
    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    calls = []
    monkeypatch.setattr(GcWatch, "freeze_now", lambda self: calls.append(gc.get_count()) or 0)
    overrides = ["data.train=synthetic:count_shapes?n=16&seed=0&image_size=56", "data.validation=null",
                 "data.eval=null", f"model.compile_layers={str(compiles).lower()}", "model.compile_prewarm=false",
                 f"trainer.output_dir={tmp_path}", "trainer.progress=false", "trainer.summary=false"]
    Trainer(load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", overrides))
    assert len(calls) == int(compiles)
    Trainer(load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml",
                        [*overrides, "trainer.gc_freeze=false", "trainer.overwrite=true"]))
    assert len(calls) == int(compiles)


def test_freezing_now_collects_first_and_counts_what_moved():
    watch = GcWatch()
    try:
        cycle = [_Held()]
        cycle.append(cycle)
        dead = weakref.ref(cycle[0])
        del cycle
        before = gc.get_freeze_count()
        moved = watch.freeze_now()
        assert dead() is None  # collected, not frozen
        assert moved > 0 and watch.frozen == moved == gc.get_freeze_count() - before
    finally:
        gc.unfreeze()
