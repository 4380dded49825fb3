"""The trainer with a multi-turn environment: the demo recipe's agent loop runs through
rollout, scoring, update and evaluation, logging the agent metrics; its policy calls the
tool and the reply images reach the training batch."""

import json
from pathlib import Path

import pytest

from mmrl.config import RecipeError, load_recipe
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "agent_zoom_count.yaml"


def _recipe(tmp_path, *extra):
    return load_recipe(RECIPE, [f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2", "trainer.progress=false",
                                "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "trainer.eval_every=0",
                                "data.eval=synthetic:count_shapes?n=8&seed=1&image_size=56",
                                "trainer.export=false", *extra])


@pytest.mark.slow
def test_agent_recipe_trains_and_logs_agent_metrics(tmp_path):
    trainer = Trainer(_recipe(tmp_path))
    before = {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}
    summary = trainer.fit()
    assert summary["steps"] == 2 and 0 <= summary["eval/accuracy"] <= 1
    assert any(not (v == trainer.actor.model.state_dict()[k]).all() for k, v in before.items())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = records[0]
    for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors", "tokens/policy", "tokens/environment"):
        assert key in step
    assert 1 <= step["agent/turns"] <= 2 and step["agent/tool_calls"] <= 1
    assert 0 <= step["agent/samples_calling_tools"] <= 1


@pytest.mark.slow
def test_agent_recipe_calls_the_tool_and_the_reply_image_reaches_the_batch(tmp_path):
    """The demo's opening prompt holds no image: the only image a sample sees is the
    zoom reply. A random-init policy calls zoom in about 1 of 8 turns, so 64 samples
    call it; each caller's training row holds exactly the reply image's placeholders and
    patches, outside the loss mask."""
    import torch

    from mmrl.rollout import SamplingParams
    from mmrl.rollout_batch import trajectory_sequences

    trainer = Trainer(_recipe(tmp_path))
    rows = [trainer.train_set[i] for i in range(8)]
    torch.manual_seed(0)
    result = trainer.agent.generate(rows, SamplingParams(n=8, max_new_tokens=1))
    called = [t for t in result.trajectories if t.tool_calls > 0]
    assert called and result.stats["agent/samples_calling_tools"] == len(called) / 64
    assert all(not any(p.get("type") == "image" for p in t.messages[0]["content"] if isinstance(p, dict))
               for t in result.trajectories)  # the opening hides the image
    processing = trainer.processing
    seqs = trajectory_sequences(called, processing, trainer.built.adapter, trainer.actor.model,
                                processing.tokenizer.pad_token_id)
    pad = trainer.actor.model.config.image_token_id
    placeholders = seqs.inputs["input_ids"] == pad
    assert placeholders.sum(-1).tolist() == [4] * len(called)  # one 56 px image (2x2 merged tokens) each
    assert seqs.inputs["pixel_values"].shape[0] == 16 * len(called)  # its 4x4 patches
    assert seqs.inputs["image_grid_thw"].tolist() == [[1, 4, 4]] * len(called)
    in_tail = (seqs.response_ids == pad)
    assert in_tail.any(-1).all() and not (in_tail & seqs.response_mask.bool()).any()


def test_agent_recipe_errors_name_the_field(tmp_path):
    import pytest

    with pytest.raises(RecipeError, match="rollout.env: unknown environment 'maze'"):
        Trainer(_recipe(tmp_path, "rollout.env=maze"))
    with pytest.raises(RecipeError, match="rollout.env: thumbnail must be a positive number"):
        Trainer(_recipe(tmp_path, "rollout.env_options.thumbnail=0"))
    with pytest.raises(RecipeError, match="rollout.max_tokens"):
        Trainer(_recipe(tmp_path, "rollout.max_tokens=1", "rollout.max_new_tokens=2", "trainer.overwrite=true"))
