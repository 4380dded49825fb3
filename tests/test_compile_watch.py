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
    assert "compiled graph" in capsys.readouterr().out


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
