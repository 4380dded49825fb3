"""The compile helper (`mmrl.prewarm`): its recipe, when a run starts one, how the run waits
for it, and that its one step runs with the shrunk model. That its compiles are the ones the
run's first update then finds in the cache needs a GPU: tests/test_gpu.py,
`test_compile_helper_fills_the_cache_the_first_update_reads`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmrl import prewarm
from mmrl.config import load_recipe, validate_recipe
from mmrl.registry import get_adapter
from mmrl.settle import Choice, Settled

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny_vlm_count.yaml"
SMALL_DATA = ["data.train=synthetic:count_shapes?n=16&seed=0&image_size=56", "data.validation=null",
              "data.eval=null", "data.prompts_per_step=4", "trainer.threads=1"]


def settled(compile_layers=True, checkpointing=False) -> Settled:
    return Settled({"model.compile_layers": Choice(compile_layers, ""),
                    "model.gradient_checkpointing": Choice(checkpointing, ""),
                    "rollout.backend": Choice("hf_compiled", "")})


def gpu(distributed=False):
    return SimpleNamespace(device=torch.device("cuda"), distributed=distributed, is_main=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("family, expected", [
    ("qwen2", {"num_hidden_layers": 1, "layer_types": ["full_attention"]}),
    ("qwen2_5_vl", {"text_config": {"num_hidden_layers": 1, "layer_types": ["full_attention"]}}),
    # one layer of each kind: a sliding-window layer compiles another graph than a full one
    ("gemma3", {"text_config": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}}),
    ("llama", {"num_hidden_layers": 1}),
])
def test_shrunk_layers_keep_one_decoder_layer_of_each_type(family, expected):
    config = get_adapter(family).tiny().config
    assert prewarm.shrunk_layers(config) == expected


AUTO = ["model.compile_prewarm=auto"]


def test_a_helper_starts_on_one_gpu_where_the_layers_compile_and_not_elsewhere(cache):
    recipe = load_recipe(TINY, AUTO)
    assert prewarm.reason_not(recipe, settled(), gpu()) is None
    cpu = SimpleNamespace(device=torch.device("cpu"), distributed=False, is_main=True)
    assert "nothing compiled on cpu" in prewarm.reason_not(recipe, settled(), cpu)
    assert "sharded" in prewarm.reason_not(recipe, settled(), gpu(distributed=True))
    assert "eagerly" in prewarm.reason_not(recipe, settled(compile_layers=False), gpu())
    assert "eagerly" in prewarm.reason_not(recipe, settled(checkpointing=True), gpu())
    assert "reward function" in prewarm.reason_not(recipe, settled(), gpu(), given_objects=True)
    assert "false" in prewarm.reason_not(load_recipe(TINY), settled(), gpu())  # the default


def test_the_helper_starts_with_the_runs_environment_less_the_read_ahead(cache, monkeypatch):
    started = {}

    class Started:
        def __init__(self, command, env, **kwargs):
            started.update(command=command, env=env)

        def poll(self):
            return 0

    monkeypatch.setattr(prewarm.subprocess, "Popen", Started)
    monkeypatch.setenv("MMRL_SOME_SETTING", "kept")
    helper = prewarm.start(load_recipe(TINY, AUTO), settled(), gpu())
    assert helper is not None and started["command"][1:3] == ["-m", "mmrl.compile_helper"]
    env = started["env"]
    assert env["MMRL_SOME_SETTING"] == "kept" and env[prewarm.PARENT_ENV] == str(os.getpid())
    assert env["MMRL_READ_AHEAD"] == "0"  # the run reads the libraries ahead, not the helper too
    helper.stop()


def test_a_recipe_whose_update_compiled_in_the_cache_starts_no_helper_again(cache):
    recipe = load_recipe(TINY, AUTO)
    prewarm.mark_done(recipe, settled())
    assert "compiled in this cache before" in prewarm.reason_not(recipe, settled(), gpu())
    # another recipe (what it trains) or other settled values: other graphs, a helper again
    other = load_recipe(TINY, [*AUTO, "rollout.max_new_tokens=2"])
    assert prewarm.reason_not(other, settled(), gpu()) is None
    assert prewarm.reason_not(recipe, settled(checkpointing="after_oom"), gpu()) is None
    # how it is run is not in the key; `true` starts one anyway
    assert prewarm.reason_not(load_recipe(TINY, [*AUTO, "trainer.steps=3"]), settled(), gpu()) is not None
    assert prewarm.reason_not(load_recipe(TINY, ["model.compile_prewarm=true"]), settled(), gpu()) is None


def test_no_cache_folder_no_helper(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert "no compile cache" in prewarm.reason_not(load_recipe(TINY, AUTO), settled(), gpu())


def test_the_helpers_recipe_is_one_quiet_step_of_the_run_without_a_helper(tmp_path):
    recipe = load_recipe(TINY, [*AUTO, "algo.filter_uniform_groups=true", "trainer.save_every=5"])
    values = prewarm.helper_values(recipe, tmp_path / "run")
    helper = validate_recipe(values)
    assert helper.trainer.steps == 1 and helper.trainer.output_dir == str(tmp_path / "run")
    assert (helper.trainer.save_every, helper.trainer.eval_every, helper.trainer.samples_every) == (0, 0, 0)
    assert helper.trainer.loggers == [] and not helper.trainer.export and not helper.trainer.progress
    assert helper.rollout.backend == "hf"  # nothing compiled in its rollout
    assert not helper.trainer.media_check  # the run checks its own media before it waits
    assert not helper.algo.filter_uniform_groups  # random weights: every group still updates
    assert helper.model.compile_prewarm is False
    # what shapes the graphs is the run's
    for section in ("data", "reward", "optim"):
        assert getattr(helper, section) == getattr(recipe, section)
    assert helper.model.model_copy(update={"compile_prewarm": "auto"}) == recipe.model
    assert helper.rollout.model_copy(update={"backend": recipe.rollout.backend}) == recipe.rollout


def _helper(code: str, timeout: float = 60.0, work: Path | None = None) -> prewarm.Helper:
    process = subprocess.Popen([sys.executable, "-c", code])
    return prewarm.Helper(process, Path("helper.log"), timeout=timeout, work=work)


def test_the_run_waits_for_a_helper_and_goes_on_whatever_it_did(capsys, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "helper.json").write_text("{}")
    done = _helper("import time; time.sleep(0.3)", work=work)
    assert done.join() >= 0.0 and done.outcome == "done"
    assert not work.exists()  # the payload and the helper's run folder go with it
    assert done.join() == 0.0  # once
    assert capsys.readouterr().err == ""
    failed = _helper("raise SystemExit(4)")
    failed.join()
    assert failed.outcome == "exited with code 4"
    assert "compile helper: exited with code 4 (log: helper.log); the run compiles its own" in capsys.readouterr().err
    slow = _helper("import time; time.sleep(60)", timeout=0.5)
    waited = slow.join()
    assert waited < 30 and slow.outcome.startswith("not done") and slow.process.poll() is not None


def _run_helper(recipe, work: Path) -> subprocess.CompletedProcess:
    """The helper's process on `recipe`, as `prewarm.start` starts it, waited for; it succeeded."""
    work.mkdir()
    payload = prewarm.write_payload(recipe, work)
    out = subprocess.run([sys.executable, "-m", "mmrl.compile_helper", str(payload)], capture_output=True, text=True,
                         cwd=REPO, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


# The run's first step in a process of its own: in a test worker, what earlier tests left in
# torch's global settings (which inductor's cache keys hold) is not what a run starts with.
_RUN_ONE_STEP = """
import json, sys
from mmrl.compile_watch import cache_counts
from mmrl.config import load_recipe
from mmrl.trainer import Trainer
trainer = Trainer(load_recipe(sys.argv[1], json.loads(sys.argv[2])))
before = cache_counts()
metrics = trainer.train_step()
print(json.dumps({"counts": [a - b for a, b in zip(cache_counts(), before)],
                  "compiled_calls": trainer.actor.compiled_layers.compiled_calls,
                  "response_length": metrics["response/length"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("new_tokens", [None, 3 * prewarm.HELPER_NEW_TOKENS])
def test_the_run_finds_the_helpers_compiles_in_the_cache(tmp_path, monkeypatch, new_tokens):
    """The helper runs one step of the recipe with one decoder layer, and on the CPU too
    (inductor's C++ kernels) the run's first step then compiles its decoder layer graph from
    the cache, none anew; also where the run samples longer responses than the helper's
    (at most `HELPER_NEW_TOKENS`). The CUDA twin: tests/test_gpu.py,
    `test_compile_helper_fills_the_cache_the_first_update_reads`."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    overrides = [*SMALL_DATA, "model.compile_layers=true", "model.compile_prewarm=false",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false", "trainer.summary=false",
                 "trainer.steps=2", *([f"rollout.max_new_tokens={new_tokens}"] if new_tokens else [])]
    helper = _run_helper(load_recipe(TINY, overrides), tmp_path / "helper")
    # the recipe's model has 2 decoder layers: the helper's, one of its one layer type
    assert "compile helper: one step done, 1 decoder layer;" in helper.stdout
    run = subprocess.run([sys.executable, "-c", _RUN_ONE_STEP, str(TINY), json.dumps(overrides)],
                         capture_output=True, text=True, cwd=REPO, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    hits, misses = result["counts"]
    if new_tokens:  # the run's responses are longer than any of the helper's
        assert result["response_length"] > prewarm.HELPER_NEW_TOKENS, result
    assert result["compiled_calls"] > 0
    assert hits > 0 and misses == 0, (hits, misses)


def test_pending_says_whether_the_helper_is_at_work_and_records_how_it_ended():
    busy = _helper("import time; time.sleep(60)", timeout=30.0)
    assert busy.pending() and busy.outcome is None
    busy.stop()
    done = _helper("pass")
    done.process.wait()
    assert not done.pending() and done.outcome == "done"
    late = _helper("import time; time.sleep(60)", timeout=0.2)
    time.sleep(0.3)
    assert not late.pending() and late.outcome.startswith("not done") and late.process.poll() is not None


class _Pending:
    """A stand-in helper at work for the first `steps` calls of `pending`."""

    def __init__(self, steps: int):
        self.steps, self.outcome = steps, None

    def pending(self) -> bool:
        self.steps -= 1
        if self.steps < 0:
            self.outcome = "done"
        return self.steps >= 0

    def stop(self) -> None:
        pass


def _trainer(tmp_path, *more):
    from mmrl.trainer import Trainer

    overrides = [*SMALL_DATA, f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false",
                 "trainer.summary=false", "trainer.steps=3", *more]
    return Trainer(load_recipe(TINY, overrides))


def test_a_run_updates_eagerly_while_the_helper_compiles_and_marks_the_first_compiled_update(cache, tmp_path):
    trainer = _trainer(tmp_path)
    trainer.compile_helper, trainer.compile_helper_marks = _Pending(steps=1), True  # as on one GPU
    mark = prewarm._mark(trainer.recipe, trainer.settled)
    first = trainer.train_step()
    assert first["compile/helper_pending"] == 1.0 and not mark.exists()  # nothing compiled by the run yet
    second = trainer.train_step()
    assert "compile/helper_pending" not in second and mark.exists()
    assert trainer.compile_helper.outcome == "done"


def test_checkpointing_an_eager_update_turned_on_goes_off_at_the_first_compiled_step(cache, tmp_path, capsys):
    """The eager layers beside the helper keep more activations than the compiled ones: an eager
    update that runs out of memory is redone with checkpointing (`gradient_checkpointing: auto`),
    which stays on while the steps are eager and goes off, in one line, at the first compiled one."""
    import torch

    trainer = _trainer(tmp_path)
    trainer.compile_helper = _Pending(steps=2)  # steps 1 and 2 eager, step 3 compiled
    assert trainer.recipe.model.gradient_checkpointing == "auto" and not trainer.actor.checkpointing
    passes = []  # (step, checkpointing) of each grad-enabled log-prob pass
    log_probs = trainer.actor.log_probs

    def short_of_memory(*args, **kwargs):
        if torch.is_grad_enabled():
            passes.append((trainer.step, trainer.actor.checkpointing))
            if len(passes) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return log_probs(*args, **kwargs)

    trainer.actor.log_probs = short_of_memory
    for _ in range(3):
        trainer.train_step()
    by_step = {step: {on for s, on in passes if s == step} for step, _ in passes}
    assert passes[0] == (1, False) and by_step[1] == {False, True}  # the OOM, then its redo checkpointed
    assert by_step[2] == {True} and by_step[3] == {False}
    assert not trainer.actor.checkpointing and not trainer.actor.model.is_gradient_checkpointing
    out = capsys.readouterr().out
    assert out.count("turned it on (gradient_checkpointing: auto)") == 1
    assert out.count("activation checkpointing off again") == 1


@pytest.mark.slow
def test_an_update_while_the_helper_compiles_compiles_nothing(cache, tmp_path):
    """The step's log-probs and update while the helper is at work: the engine's compiled
    layers (inductor's C++ kernels on the CPU) run their eager forwards, and the first step
    after it compiles them."""
    trainer = _trainer(tmp_path, "model.compile_layers=true")
    trainer.compile_helper = _Pending(steps=1)
    layers = trainer.actor.compiled_layers
    trainer.compile_watch.take()
    trainer.train_step()
    assert trainer.compile_watch.take()[1] == 0 and layers.compiled_calls == 0
    trainer.train_step()
    assert trainer.compile_watch.take()[1] > 0 and layers.compiled_calls > 0 and layers.failed is None


def test_the_helper_can_log_where_its_build_goes(capsys):
    from mmrl import compile_helper

    assert compile_helper._profiled(lambda x: sorted(x * 2), [3, 1, 2]) == [1, 1, 2, 2, 3, 3]
    out = capsys.readouterr().out
    assert out.startswith("compile helper: the trainer's build under cProfile") and "cumulative" in out
    assert "sorted" in out


def test_the_helpers_memory_is_the_runs_model_less_its_extra_layers_with_training_state():
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    model = torch.nn.ModuleList([embed, *layers, head])
    embed.weight.requires_grad_(False)
    layer = 4 * 4 + 4
    # fp32: a trainable parameter 4 + 12 bytes (gradient, two moments), a frozen one 4
    assert prewarm.helper_bytes(model, layers, kept=1) == 10 * 4 * 4 + (layer + 4 * 10 + 10) * 16
    assert prewarm.helper_bytes(model, layers, kept=2) == 10 * 4 * 4 + (2 * layer + 4 * 10 + 10) * 16
    assert prewarm.helper_bytes(model, [], kept=1) == 10 * 4 * 4 + (3 * layer + 4 * 10 + 10) * 16
    half = model.to(torch.bfloat16)  # 2 bytes a weight, and an fp32 master beside each trainable one
    assert prewarm.helper_bytes(half, layers, kept=1) == 10 * 4 * 2 + (layer + 4 * 10 + 10) * 18


def test_the_helper_gives_the_gpu_back_where_the_first_update_would_not_fit_beside_it():
    gib = 2 ** 30
    # an H200's 140 GiB with 119 free after a VL-3B fp32 build: 45 for the update, 22 for the helper
    assert prewarm.room_problem(free=119 * gib, total=140 * gib, pending=45 * gib, helper=22 * gib) is None
    said = prewarm.room_problem(free=58 * gib, total=80 * gib, pending=45 * gib, helper=22 * gib)
    assert said == ("the GPU's 58.0 GiB free after the build leave too little for the first update's 45.0 GiB of "
                    "training state, the helper's 22.0 GiB and 12.0 GiB to spare; stopped, so the run has the memory")


def test_a_run_stops_its_helper_after_the_build_where_memory_is_short(tmp_path, capsys, monkeypatch):
    from mmrl.rollout import inference_copy

    trainer = _trainer(tmp_path, "model.compile_layers=true")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=100 * 2 ** 30))
    needs = prewarm.helper_bytes(trainer.actor.model, trainer.actor.compiled_layers.layers, kept=1)
    moments, gradients = inference_copy.pending_training_bytes(trainer.actor)
    assert needs > 0 and moments > 0 and gradients > 0
    room = 15 * 2 ** 30 + moments + gradients + needs  # the reserve, the update's state and the helper's model
    for free, stays in ((room, True), (room - 1, False)):
        trainer.compile_helper = _helper("import time; time.sleep(60)", timeout=30.0)
        monkeypatch.setattr(inference_copy, "free_memory", lambda device, free=free: free)
        trainer._check_helper_room()
        helper = trainer.compile_helper
        assert helper.pending() is stays, free
        if stays:
            helper.stop()
        else:
            assert helper.outcome.endswith("stopped, so the run has the memory") and helper.process.poll() is not None
            assert f"compile helper: {helper.outcome}; the run compiles its own graphs" in capsys.readouterr().err
