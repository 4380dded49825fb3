"""The compiled rollout prefills each distinct prompt once (mmrl/rollout/prefix.py, issue
28): on tiny fp32 models on CPU (the decode loop eager), every zoo family (greedy; the VLMs'
images laid out per image or per row) and a text family, an mrope VLM and VLMs without
mrope (seeded sampling) give the same tokens and log-probs with the shared prefill as with
every row prefilled (`prefill_once=False`), and the prefill's forward sees one row per
prompt. Batches whose repeats cannot be proven equal prefill every row.
"""

import pytest
import torch
from test_rollout_fast import _assert_same
from test_rollout_zoo import ZOO
from widened_models import prompt_conversations, widened_model

from mmrl.engine import Engine
from mmrl.engine.media import SharedMedia, placeholder_tokens
from mmrl.parallel import init_distributed
from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout.prefix import distinct_prompts

def _engine(family: str, device: str = "cpu"):
    """The widened model's fp32 engine with media sharing on (the rollout then records
    which rows repeat which prompt, `SharedMedia`)."""
    built = widened_model(family, device)
    return built, Engine(built, init_distributed(device), mixed_precision=False, share_media=True)


def _both(family: str, params: SamplingParams, prompts: int = 3, device: str = "cpu", **options):
    """The rollout of `prompts` prompts with the shared prefill and without, and the rows
    each one's prefill forwards ran."""
    built, engine = _engine(family, device)
    conversations = prompt_conversations(built, count=prompts)
    results, prefilled = [], []
    options = {"compile": False, **options}
    for once in (True, False):
        rollout = make_rollout("hf_compiled", engine, built.processing, prefill_once=once, **options)
        seen = []
        prefill = rollout.prefill
        rollout.prefill = lambda run, cache, inputs, positions: (
            seen.append(len(inputs["input_ids"])) or prefill(run, cache, inputs, positions))
        results.append(rollout.generate(conversations, params))
        assert rollout.fallback_reason is None, rollout.fallback_reason
        assert rollout.stats["prefill_rows"] == seen[0]
        prefilled.append(seen)
    return results, prefilled


@pytest.mark.parametrize("family", ZOO)
def test_greedy_tokens_and_logprobs_equal_every_row_prefilled(family):
    params = SamplingParams(n=3, max_new_tokens=10, temperature=0, logprobs=True)
    (shared, plain), (once, every) = _both(family, params)
    assert once == [3] and every == [9]  # three prompts of three samples: one prefill row each
    assert len(set(plain.response_ids.flatten().tolist())) > 3  # not one token repeated
    _assert_same(plain, shared)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl", "idefics3"])
def test_seeded_samples_equal_every_row_prefilled(family):
    params = SamplingParams(n=4, max_new_tokens=10, temperature=1.0, logprobs=True, generator_seed=5)
    (shared, plain), (once, every) = _both(family, params, prompts=2)
    assert once == [2] and every == [8]
    # The samples of one prompt part ways although their prefill was one row.
    assert len({tuple(row) for row in plain.response_ids[:4].tolist()}) > 1
    _assert_same(plain, shared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl", "idefics3"])
def test_on_cuda_the_recorded_decode_after_a_shared_prefill_equals_every_row_prefilled(family):
    params = SamplingParams(n=4, max_new_tokens=10, temperature=0, logprobs=True)
    (shared, plain), (once, every) = _both(family, params, device="cuda", compile=True, decode="graphs")
    assert once == [3] and every == [12]
    _assert_same(plain, shared)


def test_a_media_batch_without_its_sharing_record_prefills_every_row():
    """Images whose rows repeat a prompt but without the rollout's `SharedMedia` (an
    engine without media sharing): the images cannot be proven equal, so every row is
    prefilled."""
    built = widened_model("qwen2_5_vl")
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False, share_media=False)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    rollout.generate(prompt_conversations(built, count=2), SamplingParams(n=2, max_new_tokens=4, temperature=0))
    assert rollout.stats["prefill_rows"] == 4


def test_text_rows_are_grouped_by_equal_tokens_in_order_of_first_row():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [1, 2, 3], [0, 0, 7]])
    mask = (ids != 0).long()
    distinct = distinct_prompts({"input_ids": ids, "attention_mask": mask}, None)
    assert distinct.first.tolist() == [0, 1, 4]
    assert distinct.owners.tolist() == [0, 1, 0, 1, 2]
    assert torch.equal(distinct.batch["input_ids"], ids[[0, 1, 4]])
    # mrope positions (axes, rows, S): the rows' dimension is the middle one.
    positions = torch.arange(3 * 3 * 3).view(3, 3, 3)
    assert torch.equal(distinct.expand(positions), positions[:, [0, 1, 0, 1, 2]])
    # Equal ids under another mask are another prompt; no repeat at all: nothing to share.
    assert distinct_prompts({"input_ids": ids[:2], "attention_mask": mask[:2]}, None) is None
    other_mask = mask.clone()
    other_mask[2, 0] = 1
    assert distinct_prompts({"input_ids": ids, "attention_mask": other_mask}, None).first.tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision", "idefics3"])
def test_a_sharing_record_whose_rows_differ_in_tokens_or_layout_is_not_trusted(family):
    """The distinct prompts' batch is what processing them alone gives (images laid out
    per image or per row); a record that does not match the batch is not used."""
    built = widened_model(family)
    conversations = prompt_conversations(built, count=2)
    rows = [conversations[0], conversations[0], conversations[1], conversations[1]]
    shared = SharedMedia.of(built.processing, rows, [0, 0, 1, 1])
    batch = shared.rows(built.processing, rows)
    placeholders = placeholder_tokens(built.model)
    distinct = distinct_prompts(batch, shared, placeholders)
    assert distinct.first.tolist() == [0, 2] and distinct.owners.tolist() == [0, 0, 1, 1]
    assert all(torch.equal(distinct.batch[k], v) for k, v in dict(built.processing(conversations)).items())
    # The rollout computes the prompts' positions and copies them out to their rows.
    adapter = built.adapter
    assert torch.equal(distinct.expand(adapter.position_ids(built.model, distinct.batch)),
                       adapter.position_ids(built.model, batch))
    # A record that calls rows 1 and 2 one prompt: their tokens differ.
    assert distinct_prompts(batch, SharedMedia(shared.owners[:1] + [1, 0, 1], shared.singles), placeholders) is None
    # Media that are not the record's prompts' (another image in the batch).
    changed = dict(batch, pixel_values=batch["pixel_values"] + 1)
    assert distinct_prompts(changed, shared, placeholders) is None



@pytest.mark.parametrize("once", [True, False])
def test_the_recipes_switch_reaches_the_compiled_rollout(once):
    """`rollout.prefill_once` (default true) is the `CompiledHFRollout` option of that name."""
    from mmrl.config import RolloutConfig
    from mmrl.rollout import rollout_options

    assert RolloutConfig().prefill_once is True
    built, engine = _engine("qwen2")
    options = rollout_options(RolloutConfig(prefill_once=once), "hf_compiled")
    assert make_rollout("hf_compiled", engine, built.processing, **options).prefill_once is once
