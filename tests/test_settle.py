"""`mmrl.settle`: every setting a recipe leaves to auto is settled once, before the build,
with its reason; the run folder's recipe.yaml and the start-of-run summary record what was
settled, and a run of the saved recipe keeps those choices (on another device too).
Devices other than the CPU are stand-in `Dist`s: settling reads the device, nothing runs there."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from mmrl.config import SETTLED_FIELDS, RecipeError, dump_recipe, load_recipe, same_run
from mmrl.parallel import Dist
from mmrl.registry import get_adapter
from mmrl.settle import GRAPHS_UP_TO, backend_choice, pack_choice, resolve

REPO = Path(__file__).resolve().parents[1]
TEXT, VLM = get_adapter("qwen2"), get_adapter("qwen2_5_vl")


def _dist(device: str, world: int = 1) -> Dist:
    return Dist(rank=0, world_size=world, local_rank=0, device=torch.device(device), mesh=None)


def _recipe(*overrides):
    return load_recipe(None, ["model.path=qwen2", "model.random_init=true", "data.train=synthetic:count_shapes?n=16",
                              "reward.name=counting", *overrides])


def test_a_recipe_of_autos_settles_by_device_processes_and_family():
    recipe = _recipe()
    cpu = resolve(recipe, _dist("cpu"), TEXT)
    assert tuple(cpu.values()) == SETTLED_FIELDS  # every setting, in the schema's order
    assert cpu.values() == {"model.pack": False, "model.pack_tokens": 16384, "model.compile_layers": False,
                            "model.gradient_checkpointing": "after_oom", "model.attn_implementation": "sdpa",
                            "rollout.backend": "hf", "rollout.decode": "graphs"}
    assert cpu.lines()[-2] == "rollout.backend hf (auto: cpu, 1 process; compiled decoding on a GPU only)"
    gpu = resolve(recipe, _dist("cuda"), TEXT)
    assert gpu.values() == {**cpu.values(), "model.pack": True, "model.compile_layers": True,
                            "rollout.backend": "hf_compiled"}
    assert "rollout.backend hf_compiled (auto: cuda, 1 process)" in gpu.lines()
    assert "model.pack true (auto: cuda, 1 process, a text family)" in gpu.lines()
    sharded = resolve(recipe, _dist("cuda", world=2), TEXT)
    # FSDP2 ranks decode compiled too, each on an inference copy (mmrl.rollout.inference_copy)
    assert sharded.values() == {**cpu.values(), "model.gradient_checkpointing": True, "rollout.backend": "hf_compiled"}
    assert resolve(recipe, _dist("cpu", world=2), TEXT).gradient_checkpointing is False
    vlm = resolve(recipe, _dist("cuda"), VLM)  # media: padded on one GPU too, but compiled
    assert not vlm.pack and vlm.compile_layers and vlm.rollout_backend == "hf_compiled"
    assert "qwen2_5_vl takes media" in vlm.reasons()["model.pack"]
    assert "Qwen2_5_VLForConditionalGeneration supports SDPA" in vlm.reasons()["model.attn_implementation"]
    # What every engine of the run is built with.
    assert gpu.engine_options() == {"pack": True, "pack_tokens": 16384, "compile_layers": True,
                                    "require_compiled_layers": False}


def test_values_the_recipe_sets_are_kept_and_the_rest_follow_them():
    recipe = _recipe("model.pack=true", "algo.micro_batch_tokens=32768", "model.attn_implementation=eager",
                     "rollout.backend=vllm", "model.gradient_checkpointing=true", "model.compile_layers=true",
                     "rollout.decode=compiled")
    settled = resolve(recipe, _dist("cpu"), TEXT)
    assert settled.values() == {"model.pack": True, "model.pack_tokens": 32768, "model.compile_layers": True,
                                "model.gradient_checkpointing": True, "model.attn_implementation": "eager",
                                "rollout.backend": "vllm", "rollout.decode": "compiled"}
    reasons = settled.reasons()
    assert reasons.pop("model.pack_tokens") == "auto: algo.micro_batch_tokens, one micro-batch a row"
    assert set(reasons.values()) == {"set in the recipe"}
    assert settled.compile_layers_required  # asked for: a model without findable layers is an error
    # A family whose packed batches are not verified stays padded, and one that cannot take
    # left padding generates with plain `generate`, whatever the device.
    fake = SimpleNamespace(family="fake", is_multimodal=False, left_padding=False,
                           capabilities=SimpleNamespace(padding_free=False))
    assert pack_choice(True, fake, _dist("cuda")).reason == "the fake adapter does not declare padding_free"
    assert backend_choice("auto", fake, _dist("cuda")).value == "hf"
    with pytest.raises(ValueError, match="pack must be true, false or auto, got 'yes'"):
        pack_choice("yes", TEXT, _dist("cpu"))


def test_a_settled_section_keeps_its_choices_for_what_the_recipe_leaves_to_auto():
    """A recipe saved by a run on one GPU, run again on the CPU: the same choices."""
    pinned = ["settled.model.pack=true", "settled.model.compile_layers=true", "settled.rollout.backend=hf_compiled"]
    settled = resolve(_recipe(*pinned), _dist("cpu"), TEXT)
    assert (settled.pack, settled.compile_layers, settled.rollout_backend) == (True, True, "hf_compiled")
    assert settled.reasons()["model.pack"] == "kept from the recipe's settled: section; auto here: false"
    assert not settled.compile_layers_required  # settled from auto: compiled where the layers are found
    assert settled.reasons()["model.pack_tokens"] == "auto: the default"  # not in the section: settled afresh
    # A value set in the recipe's own section wins over the settled one.
    assert resolve(_recipe(*pinned, "model.pack=false"), _dist("cpu"), TEXT).reasons()["model.pack"] == \
        "set in the recipe"
    # A kept value the family cannot take is not kept: the reason says why.
    unpacked = SimpleNamespace(family="fake", is_multimodal=False, left_padding=True, model_class=TEXT.model_class,
                               capabilities=SimpleNamespace(padding_free=False))
    assert resolve(_recipe(*pinned), _dist("cpu"), unpacked).choices["model.pack"].reason == \
        "the fake adapter does not declare padding_free"
    # Where the kept value is what auto chooses here, the reason says only where it comes from.
    again = resolve(_recipe("settled.model.pack=false"), _dist("cpu"), TEXT)
    assert again.reasons()["model.pack"] == "kept from the recipe's settled: section"


@pytest.mark.parametrize("override, message", [
    ("settled.model.dtype=float32", "settled.model.dtype: Extra inputs are not permitted"),
    ("settled.model.pack=1", "settled.model.pack: expected true or false, got 1"),
    ("settled.model.gradient_checkpointing=auto", "settled.model.gradient_checkpointing: expected true or false"),
    ("settled.model.pack_tokens=0", "settled.model.pack_tokens: Input should be greater than 0"),
    ("settled.rollout.backend=auto", "settled.rollout.backend: Input should be 'hf', 'hf_compiled' or 'vllm'"),
])
def test_a_bad_settled_section_is_a_one_line_error(override, message):
    with pytest.raises(RecipeError) as info:
        _recipe(override)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_saved_recipe_writes_its_settled_section_and_reads_it_back(tmp_path):
    recipe = _recipe()
    settled = resolve(recipe, _dist("cuda"), TEXT)
    text = dump_recipe(recipe.model_copy(update={"settled": settled.section()}), settled.reasons())
    assert "\nsettled:\n  model:\n    pack: true  # auto: cuda, 1 process, a text family\n" in text
    assert "    gradient_checkpointing: after_oom  # auto: cuda, 1 process; off until" in text
    assert "  rollout:\n    backend: hf_compiled  # auto: cuda, 1 process\n" in text
    (tmp_path / "recipe.yaml").write_text(text)
    saved = load_recipe(tmp_path / "recipe.yaml")
    assert saved.settled.fields() == settled.values()
    assert yaml.safe_load(text)["settled"] == saved.settled.model_dump(mode="json")
    assert resolve(saved, _dist("cpu"), TEXT).values() == settled.values()  # on the CPU, as on the GPU
    assert same_run(recipe, text) is None  # how a run settled is not what it trains: it may resume
    assert "settled" not in dump_recipe(recipe)


def _tiny_vlm(folder: Path, *overrides):
    return load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [
        "trainer.steps=1", "trainer.progress=false", "trainer.export=false", "data.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "data.validation=null", "data.eval=null", "trainer.eval_every=0",
        "trainer.target_accuracy=null", f"trainer.output_dir={folder}", *overrides])


def test_a_run_records_what_it_settled_and_a_run_of_its_recipe_keeps_it(tmp_path, capsys):
    """The first run keeps a GPU run's packing (as its recipe's settled: section says) on the
    CPU; its run folder's recipe.yaml and its summary name every settled value; a run of that
    recipe.yaml settles the same and packs too."""
    from mmrl.trainer import Trainer

    first = Trainer(_tiny_vlm(tmp_path / "first", "settled.model.pack=true"))
    first.fit()
    assert first.actor.pack  # the engine packs as settled, though auto on the CPU would not
    summary = [line for line in capsys.readouterr().err.splitlines() if line.startswith("settled   ")]
    assert summary == [f"settled   {line}" for line in first.settled.lines()]
    assert summary[0] == "settled   model.pack true (kept from the recipe's settled: section; auto here: false)"
    saved = (tmp_path / "first" / "recipe.yaml").read_text()
    assert load_recipe(tmp_path / "first" / "recipe.yaml").settled.fields() == first.settled.values()
    assert "\n  rollout:\n    backend: hf  # set in the recipe\n" in saved
    again = Trainer(load_recipe(tmp_path / "first" / "recipe.yaml", [f"trainer.output_dir={tmp_path / 'again'}"]))
    try:
        assert again.settled.values() == first.settled.values() and again.actor.pack
    finally:
        again.folder.release()


def test_the_decode_step_is_recorded_always_through_compiled_layers_and_else_for_short_runs():
    """`rollout.decode: auto` on a GPU: CUDA graphs recorded without compiling the decode
    step. Where the engine compiles its layers (one GPU process), the recording replays them,
    so graphs for any run length; where it does not (several ranks, or compile_layers off),
    graphs while the run's decode steps stay within GRAPHS_UP_TO and the compiled step past
    it (where its compile pays off); turns of a multi-turn run count; the recipe's own value
    is kept."""
    def settled(*overrides, world=1):
        return resolve(_recipe(*overrides), _dist("cuda", world), TEXT)

    long = settled("trainer.steps=500", "rollout.max_new_tokens=256")
    assert long.compile_layers and long.rollout_decode == "graphs"
    assert "compiled layers" in long.reasons()["rollout.decode"]
    short = settled("trainer.steps=50", "rollout.max_new_tokens=256", "model.compile_layers=false")
    assert short.rollout_decode == "graphs"
    assert "at most 12,800 decode steps" in short.reasons()["rollout.decode"]
    eager_long = settled("trainer.steps=500", "rollout.max_new_tokens=256", "model.compile_layers=false")
    assert eager_long.rollout_decode == "compiled" and f"{GRAPHS_UP_TO:,}" in eager_long.reasons()["rollout.decode"]
    sharded = settled("trainer.steps=500", "rollout.max_new_tokens=256", world=2)
    assert not sharded.compile_layers and sharded.rollout_decode == "compiled"
    turns = settled("trainer.steps=50", "rollout.max_new_tokens=256", "rollout.env=tools", "rollout.max_turns=4",
                    "model.compile_layers=false")
    assert turns.rollout_decode == "compiled"  # 51,200 decode steps
    assert settled("trainer.steps=500", "rollout.decode=graphs", "model.compile_layers=false").rollout_decode == "graphs"
    assert "unused" in resolve(_recipe("rollout.backend=vllm"), _dist("cuda"), TEXT).reasons()["rollout.decode"]
