"""bench/recipe_steps.py's `--same-start` and bench/same_learning.py on CPU, with the tiny
recipe for one step: two runs from one saved start agree exactly, a run from another
start does not, and a weights file that does not fit the model fails in one line.

    .venv/bin/python -m pytest -q tests/test_bench_recipe_steps.py
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench_scripts import load_bench

pytestmark = pytest.mark.slow  # its module fixtures run the bench's training runs

BENCH_SCRIPT = "recipe_steps"
REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "tiny_vlm_count.yaml")
# A KL term, so the trainer holds a reference model that the start is loaded into too.
WITH_REFERENCE = "algo.kl_coef=0.01"


@pytest.fixture(scope="module")
def same_learning():
    return load_bench("same_learning")


@pytest.fixture(scope="module")
def runs(bench, tmp_path_factory):
    """Three one-step runs: `saved` writes the start, `loaded` reads it, `other` starts
    from another seed's weights without --same-start."""
    folder = tmp_path_factory.mktemp("recipe_steps")
    common = [TINY, "--device", "cpu", "--steps", "1"]
    start = ["--same-start", str(folder / "start")]
    for name, extra, overrides in (("saved", start, []), ("loaded", start, []), ("other", [], ["trainer.seed=1"])):
        bench.main([*common, *extra, "--out", str(folder / f"{name}.json"), "--variant", "v", WITH_REFERENCE,
                    *overrides])
    reports = {name: json.loads((folder / f"{name}.json").read_text()) for name in ("saved", "loaded", "other")}
    return SimpleNamespace(folder=folder, start=folder / "start" / "actor.safetensors", **reports)


def _learning_keys(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "compile/")) and not k.endswith("_per_s")}


@pytest.mark.slow
def test_two_runs_from_one_start_have_the_same_first_step(runs, same_learning):
    saved, loaded = runs.saved["variants"]["v"], runs.loaded["variants"]["v"]
    assert runs.saved["errors"] == {} and runs.loaded["errors"] == {}
    assert saved["same_start_action"] == "saved" and loaded["same_start_action"] == "loaded"
    assert saved["same_start"] == loaded["same_start"] == str(runs.start) and runs.start.is_file()
    # No temporary left behind: the weights, and the first run's rollout that later runs replay.
    assert sorted(p.name for p in runs.start.parent.iterdir()) == ["actor.safetensors", "first_rollout.json"]
    # Same code, same weights, same seed: every metric but the timings is the same number.
    assert _learning_keys(saved["first_step"]) == _learning_keys(loaded["first_step"])
    assert "entropy" in saved["first_step"] and "reward/mean" in saved["first_step"]
    assert loaded["first_rollout"].pop("replayed") == str(runs.start.parent / "first_rollout.json")
    assert saved["first_rollout"] == loaded["first_rollout"] and saved["first_rollout"]["responses"] == 128
    result = same_learning.main([str(runs.folder / "saved.json"), str(runs.folder / "loaded.json"),
                                 "--out", str(runs.folder / "same.json")])
    assert result["same_learning"] is True and all(result["groups"].values())
    assert result["rollout"]["identical_responses"] == 1.0
    assert json.loads((runs.folder / "same.json").read_text())["same_learning"] is True


def test_a_run_from_another_start_differs(runs, same_learning):
    saved, other = runs.saved["variants"]["v"], runs.other["variants"]["v"]
    assert "same_start" not in other and "first_rollout" not in other
    logprob_keys = [k for k in saved["first_step"] if same_learning.group_of(k) == "logprob"]
    assert any(saved["first_step"][k] != other["first_step"][k] for k in logprob_keys)
    result = same_learning.main([str(runs.folder / "saved.json"), str(runs.folder / "other.json"),
                                 "--out", str(runs.folder / "different.json")])
    assert result["same_learning"] is False and result["rollout"] is None


def test_loading_fills_actor_reference_and_master_weights(runs, bench):
    """A bf16 trainer built from another seed: after loading, the actor, its fp32 masters
    and the reference model all hold the saved start."""
    from safetensors.torch import load_file, save_file

    from mmrl.trainer import Trainer

    start = {k: v.to(torch.bfloat16) for k, v in load_file(str(runs.start)).items()}
    path = runs.folder / "bf16" / "actor.safetensors"
    path.parent.mkdir()
    save_file(start, str(path))
    values = bench.recipe_values(Path(TINY), None, None)
    recipe = bench.variant_recipe(values, [WITH_REFERENCE, "model.dtype=bfloat16", "trainer.seed=1"], 1,
                                  runs.folder / "bf16_run")
    trainer = Trainer(recipe)
    masters = trainer.actor.master_state_dict()
    assert masters and trainer.ref is not None
    key = next(iter(masters))
    assert not torch.equal(trainer.actor.model.state_dict()[key], start[key])  # another seed, other weights
    bench.load_start(trainer, path)
    for engine in (trainer.actor, trainer.ref):
        state = engine.model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in start.items())
    assert all(torch.equal(master, start[k].float()) for k, master in masters.items())


def test_a_file_that_does_not_fit_fails_in_one_line_naming_the_keys(bench, tmp_path):
    from safetensors.torch import load_file, save_file

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    trainer = SimpleNamespace(actor=SimpleNamespace(model=model), ref=None, critic=None)
    path = tmp_path / "actor.safetensors"
    bench.save_start(trainer, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor.safetensors"]
    state = load_file(str(path))
    state["extra.weight"] = state.pop("1.bias")
    save_file(state, str(path))
    with pytest.raises(ValueError) as error:
        bench.load_start(trainer, path)
    message = str(error.value)
    assert "\n" not in message and "missing 1.bias" in message and "unexpected extra.weight" in message


def test_same_learning_says_in_one_line_what_it_cannot_compare(same_learning, runs, tmp_path):
    without = {"variants": {"v": {"first_step": {}}}, "errors": {}}
    (tmp_path / "without.json").write_text(json.dumps(without))
    cases = [(tmp_path / "missing.json", "no such file"), (tmp_path / "without.json", "has no first_step")]
    for path, words in cases:
        with pytest.raises(SystemExit) as exit_:
            same_learning.main([str(path), str(runs.folder / "saved.json"), "--out", str(tmp_path / "x.json")])
        assert words in str(exit_.value) and "\n" not in str(exit_.value)
    with pytest.raises(SystemExit) as exit_:
        same_learning.main([str(runs.folder / "saved.json"), str(runs.folder / "loaded.json"), "--variant-b", "w",
                            "--out", str(tmp_path / "x.json")])
    assert "no variant 'w'" in str(exit_.value)


def test_same_start_saves_then_loads_and_reseeds_either_way(bench, tmp_path):
    """Two trees build (and draw random numbers) differently; after `same_start` both
    stand at the recipe seed's random state."""
    import random

    def trainer(seed_of_weights: int):
        torch.manual_seed(seed_of_weights)
        return SimpleNamespace(actor=SimpleNamespace(model=torch.nn.Linear(3, 2)), ref=None, critic=None,
                               recipe=SimpleNamespace(trainer=SimpleNamespace(seed=7)))

    first, second = trainer(0), trainer(1)
    assert bench.same_start(first, tmp_path)["same_start_action"] == "saved"
    draws = torch.rand(3), random.random()
    torch.rand(5)  # the second tree's build draws more
    assert bench.same_start(second, tmp_path)["same_start_action"] == "loaded"
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
    assert torch.equal(second.actor.model.weight, first.actor.model.weight)


def test_a_stored_first_rollout_replaces_the_runs_own_samples(bench, tmp_path):
    """A run that finds `first_rollout.json` in the start folder gets those responses from
    its first rollout (ids, mask, lengths; no sampler log-probs), and its own later."""
    import torch

    from mmrl.rollout.base import RolloutResult

    (tmp_path / "first_rollout.json").write_text(json.dumps({"ids": [[5, 6, 7], [8]]}))
    own = RolloutResult(response_ids=torch.tensor([[1, 2], [3, 4]]), response_mask=torch.ones(2, 2),
                        finish_reasons=["length", "length"], prompt_index=torch.tensor([0, 0]),
                        logprobs=torch.zeros(2, 2))
    rollout = SimpleNamespace(generate=lambda *a, **k: own)
    trainer = SimpleNamespace(rollout=rollout, processing=SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0)))
    record = bench.record_first_rollout(trainer, tmp_path)
    first = rollout.generate([], None)
    assert first.response_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert first.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]] and first.logprobs is None
    assert first.finish_reasons == ["length", "stop"] and first.prompt_index.tolist() == [0, 0]
    assert record["ids"] == [[5, 6, 7], [8]] and record["replayed"] == str(tmp_path / "first_rollout.json")
    assert rollout.generate([], None) is own  # later rollouts are the run's own
