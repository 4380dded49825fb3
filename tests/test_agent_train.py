"""The trainer with a multi-turn environment: the demo recipe's agent loop runs through
rollout, scoring, update and evaluation, logging the agent metrics."""

import json
from pathlib import Path

from mmrl.config import RecipeError, load_recipe
from mmrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "agent_zoom_count.yaml"


def _recipe(tmp_path, *extra):
    return load_recipe(RECIPE, [f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2", "trainer.progress=false",
                                "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "trainer.eval_every=0",
                                "data.eval=synthetic:count_shapes?n=8&seed=1&image_size=56",
                                "trainer.export=false", *extra])


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
    # A sample that called zoom saw a reply image: its environment tokens include the image's.
    if step["agent/tool_calls"] > 0:
        assert step["tokens/environment"] > 4 * step["agent/tool_calls"]


def test_agent_recipe_errors_name_the_field(tmp_path):
    import pytest

    with pytest.raises(RecipeError, match="rollout.env: unknown environment 'maze'"):
        Trainer(_recipe(tmp_path, "rollout.env=maze"))
    with pytest.raises(RecipeError, match="rollout.env: thumbnail must be a positive number"):
        Trainer(_recipe(tmp_path, "rollout.env_options.thumbnail=0"))
    with pytest.raises(RecipeError, match="rollout.max_tokens"):
        Trainer(_recipe(tmp_path, "rollout.max_tokens=1", "rollout.max_new_tokens=2", "trainer.overwrite=true"))
