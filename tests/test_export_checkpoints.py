"""Step checkpoints as HF folders (`mmrl export`), LoRA checkpoints that hold the adapter
only (and resume exactly), and `trainer.keep_checkpoints`. Tiny text model, a few steps."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner, Result

from mmrl import build_model
from mmrl.cli import app
from mmrl.config import load_recipe
from mmrl.export import ExportError, export_checkpoint
from mmrl.runs import prune_checkpoints
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
VOCABULARY = {"characters": "0123456789+ ?", "words": ["What", "is", "user", "assistant"]}
TEXT = [
    "model.path=qwen2", "model.random_init=true",
    "model.tiny_vocabulary={characters: '0123456789+ ?', words: [What, is, user, assistant]}",
    "data.train=synthetic:arithmetic?n=64&seed=0&max_operand=4", "data.eval=null",
    "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3",
    "reward.name=numeric", "algo.micro_batch_size=16", "trainer.progress=false", "trainer.threads=2",
    "optim.lr=1e-2",
]
PROMPT = [[{"role": "user", "content": "What is 1+2?"}]]


def _run(out: Path, *extra: str) -> Trainer:
    trainer = Trainer(load_recipe(None, [*TEXT, f"trainer.output_dir={out}", *extra]))
    trainer.fit()
    return trainer


def _mmrl(*args: str) -> Result:
    """`mmrl ARGS` in this process through the CLI's own `app` (the `mmrl` script's entry
    point): the tests check what the command writes and prints, not its process, and a
    process each paid ~5-10 s of interpreter start and imports."""
    return CliRunner().invoke(app, list(args))


@torch.no_grad()
def _logits(model, trainer) -> torch.Tensor:
    batch = dict(trainer.processing(PROMPT))
    return model.eval()(**batch).logits


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A base checkpoint on disk for LoRA runs (a hub model stands here)."""
    path = tmp_path_factory.mktemp("base") / "qwen2"
    build_model("qwen2", random_init=True, tiny_vocabulary=VOCABULARY).save(path)
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base):
    """A LoRA run on `base`: 3 steps, a checkpoint every step, the newest 2 kept."""
    out = tmp_path_factory.mktemp("lora") / "run"
    trainer = _run(out, f"model.path={base}", "model.random_init=false", "model.tiny_vocabulary={}", "model.lora_scope=language",
                   "trainer.steps=3", "trainer.save_every=1", "trainer.keep_checkpoints=2")
    return trainer, out


@pytest.mark.slow
def test_a_full_runs_step_checkpoint_exports_as_its_final_folder(tmp_path):
    run = tmp_path / "run"
    trainer = _run(run, "trainer.steps=2", "trainer.save_every=2")
    result = _mmrl("export", str(run / "checkpoints" / "step_000002"), str(tmp_path / "out"))
    assert result.exit_code == 0, (result.output, result.exception)
    final, converted = load_file(run / "final" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert final.keys() == converted.keys() and all(torch.equal(final[k], converted[k]) for k in final)
    for name in ("generation_config.json", "tokenizer.json", "README.md", "recipe.yaml"):
        assert (tmp_path / "out" / name).is_file(), name
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["suppress_tokens"]
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.allclose(_logits(loaded, trainer), _logits(trainer.actor.model, trainer), atol=1e-5)
    # A run folder names its newest checkpoint; the output is replaced whole.
    export_checkpoint(run, tmp_path / "out")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    # No LoRA to take alone: one line, exit 2.
    refused = _mmrl("export", str(run), str(tmp_path / "adapter"), "--adapter-only")
    assert refused.exit_code == 2 and "needs a LoRA run" in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert not (tmp_path / "adapter").exists()


def test_lora_checkpoints_hold_the_adapter_and_keep_the_newest(lora_run):
    trainer, run = lora_run
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    saved = load_file(run / "checkpoints" / "step_000003" / "actor" / "model.safetensors")
    assert saved and all("lora_" in name for name in saved)
    trainable = {n for n, p in trainer.actor.model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable


def test_a_lora_checkpoint_resumes_exactly(tmp_path, base, lora_run):
    trainer, _ = lora_run
    lora = [f"model.path={base}", "model.random_init=false", "model.tiny_vocabulary={}", "model.lora_scope=language"]
    _run(tmp_path / "b", *lora, "trainer.steps=2", "trainer.save_every=2", "trainer.export=false")
    resumed = _run(tmp_path / "b", *lora, "trainer.steps=3", "trainer.resume=true", "trainer.export=false")
    ours, theirs = trainer.actor.model.state_dict(), resumed.actor.model.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_a_lora_checkpoint_exports_as_an_adapter_and_merged(lora_run, base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer, run = lora_run
    expected = _logits(trainer.actor.model, trainer)
    result = _mmrl("export", str(run), str(tmp_path / "adapter"), "--adapter-only")
    assert result.exit_code == 0, (result.output, result.exception)
    adapter = tmp_path / "adapter"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    assert "library_name: peft" in (adapter / "README.md").read_text()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    assert torch.allclose(_logits(with_adapter, trainer), expected, atol=1e-5)
    export_checkpoint(run / "checkpoints" / "step_000003", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    assert torch.allclose(_logits(merged, trainer), expected, atol=1e-5)


def test_export_refuses_what_it_cannot_convert_and_leaves_nothing_half_written(lora_run, base, tmp_path,
                                                                              monkeypatch):
    from mmrl import export

    _, run = lora_run
    (tmp_path / "recipe.yaml").write_text((run / "recipe.yaml").read_text())  # a run that saved none
    with pytest.raises(ExportError, match="no step checkpoint that verifies"):
        export_checkpoint(tmp_path, tmp_path / "x")
    with pytest.raises(ExportError, match="neither a step checkpoint"):
        export_checkpoint(run / "checkpoints", tmp_path / "x")
    with pytest.raises(ExportError, match="would replace the run"):
        export_checkpoint(run, run)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ExportError, match="holds other files"):
        export_checkpoint(run, tmp_path / "notes")
    with pytest.raises(ExportError, match="the run's base model"):
        export_checkpoint(run, base)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export, "write_card", broken)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(run, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_prune_keeps_the_newest_up_to_the_saved_one(tmp_path):
    for step in (1, 2, 3, 4, 9, 999999, 1000000):
        (tmp_path / f"step_{step:06d}").mkdir()
    (tmp_path / "step_notes").mkdir()
    removed = prune_checkpoints(tmp_path, tmp_path / "step_000004", keep=2)
    assert [p.name for p in removed] == ["step_000001", "step_000002"]
    # Steps 9 and on are from before a resume to an earlier step: left alone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004", "step_000009",
                                                          "step_1000000", "step_999999", "step_notes"]
    removed = prune_checkpoints(tmp_path, tmp_path / "step_1000000", keep=1)
    assert [p.name for p in removed] == ["step_000003", "step_000004", "step_000009", "step_999999"]


@pytest.mark.multiprocess
def test_a_sharded_lora_run_saves_its_adapter_and_resumes_exactly(tmp_path, base):
    """Two FSDP2 processes: the checkpoint holds the adapter only (gathered without the
    frozen base), resuming from it gives the weights of an uninterrupted run. The run cut
    after step 1 is a copy of the uninterrupted run's folder without its step-2
    checkpoint (what a run killed during step 2 leaves), which saves a third launch."""
    import shutil

    from cpu_processes import run, torchrun

    common = [*TEXT, f"model.path={base}", "model.random_init=false", "model.tiny_vocabulary={}",
              "model.lora_scope=language", "trainer.threads=1", "trainer.export=false"]

    recipe = tmp_path / "text.yaml"
    recipe.write_text("{}\n")  # everything comes from the overrides

    def train(out, *extra):
        run(torchrun(2, "-m", "mmrl.cli", "train", recipe, *common, f"trainer.output_dir={out}", *extra),
            timeout=600)

    train(tmp_path / "straight", "trainer.steps=2", "trainer.save_every=1")
    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000002")
    train(tmp_path / "cut", "trainer.steps=2", "trainer.save_every=2", "trainer.resume=true")
    straight = load_file(tmp_path / "straight" / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    resumed = load_file(tmp_path / "cut" / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    assert straight and all("lora_" in name for name in straight)
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_export_of_a_run_names_the_newer_checkpoints_it_skipped(tmp_path, capsys):
    from mmrl.export import find_checkpoint
    from mmrl.runs import begin_checkpoint, commit_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("model: {path: qwen2}\n")
    for step in (1, 2):
        final = run / "checkpoints" / f"step_00000{step}"
        temp = begin_checkpoint(final)
        (temp / "trainer_state.json").write_text(json.dumps({"step": step}))
        commit_checkpoint(temp, final)
    (run / "checkpoints" / "step_000002" / "trainer_state.json").write_text("{}")  # corrupted after its manifest
    assert find_checkpoint(run).name == "step_000001"
    err = capsys.readouterr().err
    assert "skipped checkpoint" in err and "step_000002" in err and "exporting step_000001" in err


def test_adapter_only_refuses_a_random_init_base_that_nothing_could_load(tmp_path):
    run = tmp_path / "run"
    _run(run, "model.lora_scope=language", "trainer.steps=1", "trainer.save_every=1")
    refused = _mmrl("export", str(run), str(tmp_path / "adapter"), "--adapter-only")
    assert refused.exit_code == 2 and len(refused.stderr.splitlines()) == 1
    assert "base is a random init (model.random_init: true); export it merged" in refused.stderr
    assert not (tmp_path / "adapter").exists()
    assert _mmrl("export", str(run), str(tmp_path / "merged")).exit_code == 0  # merged, it loads alone
