"""Checkpoints by hub id through the HF cache (mmrl/hub.py), and hub datasets out of reach.

A tiny random-init Qwen2 is saved into a fake HF cache laid out as huggingface_hub lays
one out (`models--org--name/refs/main` naming a `snapshots/<commit>/` folder); with
`HF_HUB_OFFLINE=1` it must load from there through every entry point, and anything not
cached must be one line that says what to download. The network is cut at the socket, so
a test that passes made no request (and so no retries).

    .venv/bin/python -m pytest -q tests/test_hub.py
"""

import json
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import mmrl
from mmrl.cli import app
from mmrl.config import RecipeError, load_recipe
from mmrl.recipe_checks import _check_model, check_before_build
from mmrl.hub import HubError, checkpoint_folder, split_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_ID = "tiny-org/tiny-qwen2"


def _one_clean_line(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


class NetworkCut:
    """Every name lookup fails as it does on a machine with no route to the hub; counts them."""

    def __init__(self):
        self.lookups = []

    def __call__(self, host, *args, **kwargs):
        self.lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (network cut by the test)")


@pytest.fixture
def network(monkeypatch):
    cut = NetworkCut()
    monkeypatch.setattr(socket, "getaddrinfo", cut)
    # huggingface_hub (2.x) looks up a registry of agent harnesses once per process, for its
    # user-agent header, on the first request it builds: the test that comes first in a worker
    # would count that look too. It is not one of the requests counted here.
    try:
        from huggingface_hub.utils import _detect_agent
    except ImportError:
        pass
    else:
        if hasattr(_detect_agent, "_registry") and hasattr(_detect_agent, "_EMPTY_REGISTRY"):
            monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    return cut


@pytest.fixture(scope="module")
def tiny_qwen2():
    return mmrl.build_model("qwen2", random_init=True, seed=3)


def _cache_snapshot(cache: Path, repo: str, commit: str = COMMIT) -> Path:
    """The snapshot folder of `repo` at `commit` in an HF cache, `refs/main` pointing at it."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_qwen2, network):
    """An HF cache holding the tiny Qwen2 as HUB_ID; offline; the network cut."""
    cache = tmp_path / "hf-cache"
    tiny_qwen2.save(_cache_snapshot(cache, HUB_ID))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no folder named like the hub id
    return cache


def _recipe(tmp_path: Path, model_path: str, train=None) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                                        "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({
        "model": {"path": model_path},
        "data": {"train": train if train is not None else str(rows), "prompts_per_step": 2},
        "rollout": {"backend": "hf", "samples_per_prompt": 2, "max_new_tokens": 2},
        "reward": {"name": "exact_match"},
        "trainer": {"steps": 1, "progress": False, "export": False, "output_dir": str(tmp_path / "run")},
    }))
    return recipe


# -- how a name is read --------------------------------------------------------------------------

def test_a_name_is_a_local_path_a_family_or_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert split_hub_id("Qwen/Qwen2.5-VL-7B-Instruct") == ("Qwen/Qwen2.5-VL-7B-Instruct", None)
    assert split_hub_id("Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3") == ("Qwen/Qwen2.5-VL-7B-Instruct", "a1b2c3")
    for not_an_id in ("qwen2_vl", "./org/name", "/org/name", "~/org/name", "org/name/more", "org/..", "org/"):
        assert split_hub_id(not_an_id) is None, not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert split_hub_id("org/name") is None  # an existing folder stays local
    assert checkpoint_folder("org/name") == Path("org/name")
    assert checkpoint_folder("qwen2_vl") is None  # a family: no checkpoint


# -- a cached checkpoint, offline ----------------------------------------------------------------

def test_build_model_loads_a_hub_id_from_the_cache_offline(hub_cache, tiny_qwen2, network):
    for name in (HUB_ID, f"{HUB_ID}@main", f"{HUB_ID}@{COMMIT}"):
        built = mmrl.build_model(name)
        assert built.adapter.family == "qwen2"
        for (key, loaded), saved in zip(built.model.state_dict().items(), tiny_qwen2.model.state_dict().values()):
            assert torch.equal(loaded, saved), key
    assert mmrl.get_adapter(HUB_ID).family == "qwen2"
    assert network.lookups == []


def test_a_hub_id_loads_from_the_cache_when_the_hub_cannot_be_reached(hub_cache, monkeypatch, network):
    """Not offline, but no route: huggingface_hub asks once, fails, and reads the cache."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert checkpoint_folder(HUB_ID) == hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert 1 <= len(network.lookups) <= 2, network.lookups  # a look, no retries


def test_models_for_names_the_family_of_a_hub_id(hub_cache, network):
    result = CliRunner().invoke(app, ["models", "--for", HUB_ID])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{HUB_ID}: family qwen2 (by model_type 'qwen2'); modalities: text")
    assert "support matrix, cpu (the family's tiny model): verified: random_init" in result.output
    described = json.loads(CliRunner().invoke(app, ["models", "--for", HUB_ID, "--json"]).output)
    assert described["family"] == "qwen2" and described["folder"].endswith(COMMIT)
    assert network.lookups == []


def test_a_recipe_with_a_hub_id_passes_its_checks_and_data_check(hub_cache, tmp_path, network):
    recipe = _recipe(tmp_path, HUB_ID)
    check_before_build(load_recipe(recipe))
    result = CliRunner().invoke(app, ["data", "check", str(recipe), "--rows", "1"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("--- row 0:") and "What is 0+1?" in result.output
    # A random init from the hub checkpoint's config and tokenizer.
    check_before_build(load_recipe(recipe, ["model.random_init=true", "model.config_overrides.num_hidden_layers=1"]))
    assert network.lookups == []


def test_train_runs_a_step_from_a_hub_id(hub_cache, tmp_path, network):
    result = CliRunner().invoke(app, ["train", str(_recipe(tmp_path, HUB_ID))])
    assert result.exit_code == 0, (result.output, result.exception)
    assert (tmp_path / "run" / "recipe.yaml").is_file()
    assert network.lookups == []


def test_doctor_probes_the_cached_snapshot(hub_cache, monkeypatch, network):
    seen = {}

    def run_probes(subjects, probes, **kwargs):
        seen["source"] = subjects[0].source
        raise SystemExit(0)  # the probes themselves are the support matrix's tests

    monkeypatch.setattr("mmrl.probes.matrix.run_probes", run_probes)
    CliRunner().invoke(app, ["doctor", HUB_ID, "--workers", "0"])
    assert seen["source"].endswith(f"snapshots/{COMMIT}")


# -- what is not cached, or not a family -----------------------------------------------------------

@pytest.mark.parametrize("command", [["models", "--for"], ["doctor"], ["data", "check"], ["train"]])
def test_a_hub_id_not_in_the_cache_is_one_line_saying_what_to_download(hub_cache, tmp_path, monkeypatch,
                                                                       network, command):
    monkeypatch.setattr("mmrl.build.build_model", lambda *a, **k: pytest.fail("built a model"))
    missing = "tiny-org/not-downloaded"
    args = [*command, str(_recipe(tmp_path, missing))] if command[0] in ("data", "train") else [*command, missing]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    line = _one_clean_line(result.output)
    assert f"{missing} is not in the HF cache {hub_cache} (HF_HUB_OFFLINE=1) nor a local folder; download it " \
           f"first: hf download {missing}" in line, line
    if command[0] in ("data", "train"):
        assert line.startswith("error: model.path: "), line
    assert network.lookups == []


def test_build_model_of_a_hub_id_not_in_the_cache_raises_one_line(hub_cache, network):
    with pytest.raises(HubError, match=r"^tiny-org/other@v2 is not in the HF cache .* hf download tiny-org/other "
                                       r"--revision v2$"):
        mmrl.build_model("tiny-org/other@v2")
    assert network.lookups == []


def test_a_cached_config_without_weights_is_one_line(hub_cache, tiny_qwen2, tmp_path, network):
    snapshot = _cache_snapshot(hub_cache, "tiny-org/config-only")
    tiny_qwen2.model.config.save_pretrained(snapshot)
    tiny_qwen2.processor.save_pretrained(snapshot)
    assert mmrl.get_adapter("tiny-org/config-only").family == "qwen2"  # the config is enough to look up
    with pytest.raises(RecipeError, match=r"model.path: tiny-org/config-only: no \*.safetensors weights in its "
                                          r"snapshot .*hf download tiny-org/config-only"):
        check_before_build(load_recipe(_recipe(tmp_path, "tiny-org/config-only")))


def test_a_hub_id_of_an_unregistered_model_type_points_to_add_model(hub_cache, tmp_path, network):
    snapshot = _cache_snapshot(hub_cache, "tiny-org/exotic")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "exotic_lm", "architectures": ["ExoticLM"]}))
    save_file({"w": torch.zeros(2)}, str(snapshot / "model.safetensors"))
    result = CliRunner().invoke(app, ["models", "--for", "tiny-org/exotic"])
    assert result.exit_code == 2
    line = _one_clean_line(result.output)
    assert "tiny-org/exotic: model_type 'exotic_lm' is not registered with mmrl; add it with " \
           "`mmrl add-model exotic_lm`" in line, line
    recipe = _recipe(tmp_path, "tiny-org/exotic")
    result = CliRunner().invoke(app, ["data", "check", str(recipe)])
    assert result.exit_code == 2 and "model_type 'exotic_lm'" in _one_clean_line(result.output)
    for overrides in ([], ["model.random_init=true"]):  # checked before the build, random init or not
        with pytest.raises(RecipeError, match=r"^model.path: tiny-org/exotic: model_type 'exotic_lm' is not "
                                              r"registered with mmrl; add it with `mmrl add-model exotic_lm`"):
            _check_model(load_recipe(recipe, overrides).model)


# -- a hub dataset out of reach ------------------------------------------------------------------

@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_a_hub_dataset_out_of_reach_is_one_line_without_retries(hub_cache, tmp_path, monkeypatch, network,
                                                                offline):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    if not offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    train = {"path": "tiny-org/some-dataset", "columns": {"prompt": "question"}}
    recipe = _recipe(tmp_path, "qwen2", train=train)
    for command in (["data", "check", str(recipe), "model.random_init=true"],
                    ["train", str(recipe), "model.random_init=true"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, (result.output, result.exception)
        line = _one_clean_line(result.output)
        why = "HF_HUB_OFFLINE=1" if offline else "the hub cannot be reached: "
        assert line.startswith(f"error: data.train: tiny-org/some-dataset: a hub dataset that is not in the "
                               f"datasets cache ({why}"), line
        assert "hf download tiny-org/some-dataset --repo-type dataset --local-dir DIR" in line, line
    # Unreachable: one look per command (datasets would retry each request five times).
    assert len(network.lookups) == (0 if offline else 2), network.lookups
    assert datasets.config.HF_HUB_OFFLINE is (True if offline else False)  # restored after the load


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith(f"mmrl {mmrl.__version__} (torch {torch.__version__.split('+')[0]}")
    assert "transformers " in result.output
