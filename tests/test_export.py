"""Exports decode as trained: plain transformers, given only the exported folder, gives
the trained policy's greedy answers on the README's recipe (blocked tokens never
produced, the rollout's stop ids and length) and makes the training's image tokens."""

from pathlib import Path

import pytest
import torch
from conftest import VLM_FAMILIES

from mmrl import build_model
from mmrl.build import load_processor
from mmrl.checks import sample_images
from mmrl.config import load_recipe
from mmrl.data import to_conversation
from mmrl.export import budget_problem
from mmrl.rollout import SamplingParams
from mmrl.rollout.base import trim_responses
from mmrl.trainer import Trainer

pytestmark = pytest.mark.slow  # its module fixture trains the run it exports

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_vlm_count.yaml"
# The README's recipe, bounded: three steps of 2 prompts x 2 samples, 8 eval images.
CHEAP = ["trainer.steps=3", "trainer.progress=false", "trainer.eval_every=0",
         "data.validation=null", "data.eval=synthetic:count_shapes?n=8&seed=1&image_size=56",
         "data.prompts_per_step=2", "rollout.samples_per_prompt=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run of the README's recipe with export on: (trainer, final folder)."""
    out = tmp_path_factory.mktemp("export") / "run"
    trainer = Trainer(load_recipe(RECIPE, [*CHEAP, f"trainer.output_dir={out}", "trainer.export=false"]))
    trainer.fit()
    _prefer_a_blocked_token(trainer)
    return trainer, trainer.export(out / "final")


@torch.no_grad()
def _prefer_a_blocked_token(trainer) -> None:
    """Make `<|video_pad|>` the policy's unconstrained greedy choice, as it was after the
    README's full run (plain generate answered it for 64 of 64 images): RL never samples
    a blocked token, so nothing keeps its logit down. Three steps leave it unlikely, so
    its output row becomes twice the row of the token greedy picks now."""
    model, processing = trainer.actor.model, trainer.processing
    batch = dict(processing(_eval_conversations(trainer)))
    picked = model(**batch).logits[:, -1].argmax(-1)
    blocked = processing.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    weight = model.get_output_embeddings().weight
    weight[blocked] = 2 * weight[int(picked.mode().values)]
    assert (model(**batch).logits[:, -1].argmax(-1) == blocked).any()


def _eval_conversations(trainer) -> list:
    return [to_conversation(sample) for sample in trainer.eval_set]


def _plain_greedy(final: Path, conversations, **generate_kwargs) -> list[list[int]]:
    """Each prompt alone through plain transformers: AutoProcessor's chat template and
    `generate` with the folder's own generation config (greedy by default)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(final)
    model = AutoModelForImageTextToText.from_pretrained(final).eval()
    answers = []
    for conversation in conversations:
        inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, **generate_kwargs)
        answers.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return answers


def _rollout_greedy(trainer, conversations, max_new_tokens: int) -> list[list[int]]:
    """The trained policy's greedy answers through mmrl's HF rollout, cut after the stop."""
    result = trainer.rollout.generate(conversations, SamplingParams(n=1, max_new_tokens=max_new_tokens,
                                                                    temperature=0.0))
    return [ids[mask.bool()].tolist() for ids, mask in zip(result.response_ids, result.response_mask)]


def _cut(answers: list[list[int]], stops: list[int]) -> list[list[int]]:
    ids, mask, _ = trim_responses(torch.tensor(answers), stops, pad_id=-1)
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def test_plain_generate_gives_the_trained_greedy_answers(trained):
    trainer, final = trained
    conversations = _eval_conversations(trainer)
    processing = trainer.processing
    # The folder's defaults alone: as many tokens as the rollout sampled (the answer).
    assert _plain_greedy(final, conversations) == _rollout_greedy(trainer, conversations, 1)
    # Longer answers: the stop ids end them where the rollout's do, blocked tokens never come.
    longer = _cut(_plain_greedy(final, conversations, max_new_tokens=4), processing.stop_token_ids)
    assert longer == _rollout_greedy(trainer, conversations, 4)
    blocked = set(processing.blocked_token_ids)
    assert blocked and not any(blocked & set(row) for row in longer)


def test_the_exported_processor_makes_the_trained_image_tokens(trained):
    from transformers import AutoProcessor

    trainer, final = trained
    processing = trainer.processing
    assert (processing.min_pixels, processing.max_pixels) == (3136, 3136)
    reloaded = AutoProcessor.from_pretrained(final)
    image_token = reloaded.tokenizer.convert_tokens_to_ids(reloaded.image_token)
    counts = []
    for image in sample_images(((56, 56), (112, 112), (448, 336))):
        conversation = [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "How many shapes?"}]}]
        served = reloaded.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                              return_dict=True, return_tensors="pt")
        trained_ids = processing([conversation])["input_ids"]
        counts.append((int((served["input_ids"] == image_token).sum()), int((trained_ids == image_token).sum())))
    # 4 tokens for a square image whatever its size: the recipe's budget, not the source's.
    assert [served for served, _ in counts] == [trained for _, trained in counts] and counts[1] == (4, 4)


def test_the_generation_config_holds_the_rollout_constraints(trained):
    from transformers import GenerationConfig

    trainer, final = trained
    config = GenerationConfig.from_pretrained(final)
    processing = trainer.processing
    assert config.suppress_tokens == processing.blocked_token_ids
    assert config.eos_token_id == processing.stop_token_ids
    assert config.pad_token_id == processing.tokenizer.pad_token_id
    assert config.max_new_tokens == trainer.recipe.rollout.max_new_tokens
    assert not list(final.parent.glob(".tmp-*"))  # written aside, renamed whole


def test_doctors_generate_probe_runs_plain_generate_on_the_checkpoint(trained, tmp_path):
    import shutil

    from transformers import GenerationConfig

    from mmrl.probes import Status, Subject, probe
    from mmrl.registry import get_adapter

    _, final = trained
    adapter = get_adapter("qwen2_vl")
    result = probe("generation").run(Subject(adapter=adapter, source=str(final), random_init=False))
    assert result.status is Status.VERIFIED, result.reason
    assert "own generation config" in result.reason
    # The same weights with the generation config an export used to write: caught.
    bare = tmp_path / "bare"
    shutil.copytree(final, bare)
    config = GenerationConfig.from_pretrained(bare)
    config.suppress_tokens, config.eos_token_id, config.max_new_tokens = None, 2, None
    config.save_pretrained(bare)
    result = probe("generation").run(Subject(adapter=adapter, source=str(bare), random_init=False))
    assert result.status is Status.FAILED and "<|video_pad|>" in result.reason, result.reason


# Families whose pixel budget lives outside the processor (images rescaled before it):
# a saved processor cannot hold it, and the export says so.
BUDGET_OUTSIDE_THE_PROCESSOR = {"llava_onevision"}


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_every_vlm_familys_pixel_budget_survives_save_and_reload(family, tmp_path):
    built = build_model(family, random_init=True, processing_options={"min_pixels": 3136, "max_pixels": 200704})
    built.processing.processor_with_budget().save_pretrained(tmp_path)
    built.model.config.save_pretrained(tmp_path)
    problem = budget_problem(built.processing, load_processor(tmp_path, built.adapter, trust_remote_code=False))
    assert (problem is not None) == (family in BUDGET_OUTSIDE_THE_PROCESSOR), problem
