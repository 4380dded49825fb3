"""mmrl/compile_watch.py: every compile of the process is counted and timed, the trainer
reports it per step, and inductor's cache folder is mmrl's unless the user chose one."""

import json
import os
from pathlib import Path

import torch

from mmrl.compile_watch import cache_root, persistent_cache, watch


def test_each_new_graph_is_counted_once_and_announced(capsys):
    torch._dynamo.reset()  # clears dynamo's callbacks: `watch()` registers again
    w = watch()
    w.take()
    w.announce = False  # a trainer built earlier in this process may have left it on

    def double(x):
        return x * 2 + 1

    compiled = torch.compile(double, backend="eager", dynamic=False)
    compiled(torch.ones(3))
    compiled(torch.ones(3))  # same shape: no new graph
    w.announce = True
    try:
        compiled(torch.ones(5))  # a new shape, compiled again (dynamic=False)
    finally:
        w.announce = False
    seconds, graphs = w.take()
    assert graphs == 2 and seconds > 0
    assert w.take() == (0.0, 0)
    out = capsys.readouterr().out
    # one line, named by dynamo's id and the function compiled (this file's `double`)
    lines = [one for one in out.splitlines() if one.startswith("compiled graph")]
    assert len(lines) == 1, out
    line = lines[0]
    first_line = double.__code__.co_firstlineno
    assert f"test_each_new_graph_is_counted_once_and_announced.<locals>.double (test_compile_watch.py:{first_line})" \
        in line, line


def test_the_cache_folder_is_mmrls_unless_the_user_set_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("MMRL_COMPILE_CACHE", str(tmp_path / "cache"))
    folder = persistent_cache("cpu")
    assert folder == tmp_path / "cache" / f"torch-{torch.__version__}" and folder.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert persistent_cache("cpu") is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    # inductor's own default, which inductor writes into the variable at its first lookup: not the user's
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert persistent_cache("cpu") == folder and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    monkeypatch.delenv("MMRL_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "mmrl" / "compile"


def test_a_trainer_counts_only_its_own_compiles(tmp_path):
    """Compiles earlier in the process (another run, a test) are not the new run's step 1."""
    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # a compile before the run
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml", [
        "trainer.steps=1", "trainer.progress=false", "trainer.export=false", "trainer.summary=false",
        "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "data.eval=null",
        f"trainer.output_dir={tmp_path / 'run'}"])
    Trainer(recipe).fit()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["compile/graphs"] == 0 and first["time/compile"] == 0.0


_EARLY_WORKERS = r"""
import torch
from torch._inductor import config
from torch._inductor.async_compile import AsyncCompile
from mmrl.compile_watch import start_compile_workers

config.compile_threads = 2  # a pool, whatever this machine's cores
assert AsyncCompile._ready_future is None  # nothing started at import
assert start_compile_workers()
assert AsyncCompile._ready_future is not None  # its readiness probe is on its way before any compile
AsyncCompile.wait_pool_ready(timeout=300)
assert AsyncCompile.use_process_pool()  # the first compile's kernels go to the workers


def f(x):
    return torch.nn.functional.gelu(x @ x.T) + 1


x = torch.randn(6, 6)
torch.testing.assert_close(torch.compile(f)(x), f(x))
print("ok")
"""


def test_compile_workers_are_ready_before_the_first_compile(tmp_path):
    """`start_compile_workers` starts inductor's pool and sends its readiness probe at once,
    so that a first compile hands its kernels to the workers instead of compiling them one
    after another in the process (the trainer calls it before the model build on a GPU)."""
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "MMRL_EARLY_COMPILE_WORKERS": "1",
           "TORCH_WARM_POOL": "1"}
    done = subprocess.run([sys.executable, "-c", _EARLY_WORKERS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_compile_workers_stay_lazy_where_asked_or_pointless(monkeypatch):
    from torch._inductor import config

    from mmrl.compile_watch import start_compile_workers

    # (inductor's own patch: monkeypatch's restore of its config breaks later compiles)
    with config.patch(compile_threads=1):  # inductor compiles in the process
        assert not start_compile_workers()
    with config.patch(compile_threads=2):
        monkeypatch.setenv("MMRL_EARLY_COMPILE_WORKERS", "0")  # the bench's A/B side
        assert not start_compile_workers()
        monkeypatch.setenv("MMRL_EARLY_COMPILE_WORKERS", "1")
        monkeypatch.setenv("TORCH_WARM_POOL", "0")  # inductor's own switch
        assert not start_compile_workers()
