"""The agent loop (mmrl.rollout.agent) on tiny random-init models, fp32 on CPU: each
policy turn's log-probs in the training sequence equal what the rollout sampled them
with, the loss mask covers exactly the sampled tokens (never environment tokens or
image placeholders), images that arrive mid-conversation give the tensors and positions
of the final conversation processed in one go, and the token budget drops whole turns."""

import pytest
import torch
from conftest import VLM_FAMILIES
from PIL import Image

from mmrl import build_model
from mmrl.engine import Engine
from mmrl.parallel import init_distributed
from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout.agent import AgentRollout
from mmrl.rollout_batch import trajectory_sequences


class ImageReplies:
    """An environment whose every reply is an image (a different one each turn) and a word."""

    def __init__(self, reply_role="tool"):
        self.reply_role = reply_role
        self.tool_calls = 0

    def reset(self, row):
        return [{"role": "user", "content": [{"type": "image", "image": row["image"]},
                                             {"type": "text", "text": row["text"]}]}]

    def step(self, messages):
        self.tool_calls += 1
        shade = 40 * self.tool_calls
        image = Image.new("RGB", (28 * (1 + self.tool_calls % 2), 56), (shade, 255 - shade, 90))
        return [{"role": self.reply_role, "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "ok"}]}], False, 0.25


def _rows():
    return [{"image": Image.new("RGB", (56, 56), (200, 30, 30)), "text": "What is it?"},
            {"image": Image.new("RGB", (84, 56), (20, 30, 230)), "text": "And this?"}]


def _setup(family):
    built = build_model(family, random_init=True, seed=0, processing_options={"min_pixels": 784,
                                                                               "max_pixels": 56 * 56})
    engine = Engine(built, init_distributed(), mixed_precision=False, share_media=False)
    return built, engine


# Every zoo VLM keeps the prefix rule: LLaVA-OneVision lays each image out alone (not in
# transformers' multi-image mode) and Idefics3 / SmolVLM write an assistant's text as
# sampled, with no space of the template's before it (processors/*.py).
PREFIX_STAYS = VLM_FAMILIES


@pytest.mark.parametrize("family", PREFIX_STAYS)
def test_policy_turns_keep_their_log_probs_and_only_they_are_trained(family):
    built, engine = _setup(family)
    torch.manual_seed(0)
    role = "tool" if family.startswith("qwen") else "user"  # the other templates have no tool role
    agent = AgentRollout(make_rollout("hf", engine, built.processing), built.processing,
                         lambda: ImageReplies(role), max_turns=3, max_tokens=4096)
    result = agent.generate(_rows(), SamplingParams(n=2, max_new_tokens=4, logprobs=True))
    trajectories = result.trajectories
    assert len(trajectories) == 4 and result.prompt_index.tolist() == [0, 0, 1, 1]
    assert all(t.finish in ("turns", "drift") for t in trajectories)
    full = [t for t in trajectories if t.finish == "turns"]
    assert full, "no trajectory reached three turns"
    assert all(t.turns == 3 and len(t.spans) == 3 for t in full)
    assert result.env_rewards.tolist() == [0.25 * t.turns for t in trajectories]  # one reward per step
    assert result.stats["agent/turns"] == sum(t.turns for t in trajectories) / 4

    seqs = trajectory_sequences(trajectories, built.processing, built.adapter, engine.model,
                                built.processing.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = engine.log_probs(seqs, temperature=1.0, with_entropy=False)
    mask = seqs.response_mask.bool()
    # The mask covers exactly the sampled tokens, in order; everything else is context.
    assert int(mask.sum()) == sum(t.policy_tokens for t in trajectories)
    for row, t in enumerate(trajectories):
        sampled = [tok for a, b in t.spans for tok in t.ids[a:b]]
        assert seqs.response_ids[row][mask[row]].tolist() == sampled
    config = engine.model.config
    media_ids = {getattr(config, key, None) for key in ("image_token_id", "image_token_index")} - {None}
    assert media_ids and not torch.isin(seqs.response_ids[mask], torch.tensor(sorted(media_ids))).any()
    in_tail = torch.isin(seqs.response_ids, torch.tensor(sorted(media_ids))) & ~mask
    assert in_tail.any(), "no tool-reply image inside the trained columns"
    # Each policy turn's log-probs equal the rollout's (fp32: the same context, media and positions).
    sampler = torch.cat([torch.tensor(t.logprobs) for t in trajectories])
    assert sampler.shape == logp[mask].shape
    torch.testing.assert_close(logp[mask], sampler, atol=2e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_mid_conversation_images_match_the_final_conversation_in_one_go(family):
    built, engine = _setup(family)
    torch.manual_seed(1)
    agent = AgentRollout(make_rollout("hf", engine, built.processing), built.processing, ImageReplies,
                         max_turns=3, max_tokens=4096)
    result = agent.generate(_rows()[:1], SamplingParams(n=2, max_new_tokens=3))
    trajectories = [t for t in result.trajectories if t.finish == "turns"]
    assert trajectories
    seqs = trajectory_sequences(trajectories, built.processing, built.adapter, engine.model,
                                built.processing.tokenizer.pad_token_id)
    # The whole conversation (every image, the final policy turn as text) processed in one go.
    final = dict(built.processing([t.messages for t in trajectories], add_generation_prompt=False))
    for key in ("pixel_values", "image_grid_thw"):
        torch.testing.assert_close(seqs.inputs[key], final[key], rtol=0, atol=0)
    positions = built.adapter.position_ids(engine.model, {k: v for k, v in final.items()})
    for row, t in enumerate(trajectories):
        real = seqs.inputs["attention_mask"][row].bool()
        one_go_real = final["attention_mask"][row].bool()
        n = len(t.ids)
        # The trajectory's tokens open the one-go sequence (which adds the template's end of turn).
        assert final["input_ids"][row][one_go_real][:n].tolist() == t.ids
        assert seqs.inputs["mm_token_type_ids"][row][real].tolist() == \
            final["mm_token_type_ids"][row][one_go_real][:n].tolist()
        if positions is not None:
            torch.testing.assert_close(seqs.inputs["position_ids"][..., row, :][..., real],
                                       positions[..., row, :][..., one_go_real][..., :n], rtol=0, atol=0)


def test_token_budget_drops_whole_turns():
    built, engine = _setup("qwen2_vl")
    torch.manual_seed(2)
    agent = AgentRollout(make_rollout("hf", engine, built.processing), built.processing, ImageReplies,
                         max_turns=5, max_tokens=40)
    result = agent.generate(_rows()[:1], SamplingParams(n=2, max_new_tokens=4))
    image_pad = built.processing.tokenizer.image_token_id
    for t in result.trajectories:
        assert t.finish in ("tokens", "drift")
        assert len(t.ids) - t.first <= 40
        # The sample ends on a policy turn: no reply image was cut off after it.
        assert t.spans[-1][1] == len(t.ids) and t.ids[-1] != image_pad
        assert t.messages[-1]["role"] == "assistant" and len(t.messages) == len(t.context) + 1
        # Every image's placeholders are all there: the count matches its grid.
        seqs = trajectory_sequences([t], built.processing, built.adapter, engine.model,
                                    built.processing.tokenizer.pad_token_id)
        merge = engine.model.config.vision_config.spatial_merge_size ** 2
        assert int((seqs.inputs["input_ids"] == image_pad).sum()) == int(
            seqs.inputs["image_grid_thw"].prod(-1).sum()) // merge
    with pytest.raises(ValueError, match="max_tokens"):
        agent.generate(_rows()[:1], SamplingParams(n=1, max_new_tokens=64))


def test_a_second_image_that_changes_the_first_ends_the_sample(monkeypatch):
    """A processor that lays the first image out anew once a second one is in the
    conversation (transformers' multi-image mode for LLaVA-OneVision, which the family's
    processing no longer uses) changes the context the first turn was sampled in, so the
    sample ends after that turn."""
    from mmrl.processing import Processing
    from mmrl.processors.llava_onevision import LlavaOnevisionProcessing

    monkeypatch.setattr(LlavaOnevisionProcessing, "arrange_images", Processing.arrange_images)
    built, engine = _setup("llava_onevision")
    torch.manual_seed(0)
    agent = AgentRollout(make_rollout("hf", engine, built.processing), built.processing,
                         lambda: ImageReplies("user"), max_turns=3, max_tokens=4096)
    result = agent.generate(_rows()[:1], SamplingParams(n=2, max_new_tokens=4, logprobs=True))
    assert [(t.finish, t.turns) for t in result.trajectories] == [("drift", 1), ("drift", 1)]
    assert result.stats["agent/finish_drift"] == 1.0
    for t in result.trajectories:
        assert t.messages[-1]["role"] == "assistant" and len(t.messages) == 2  # the reply was dropped
    seqs = trajectory_sequences(result.trajectories, built.processing, built.adapter, engine.model,
                                built.processing.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = engine.log_probs(seqs, temperature=1.0, with_entropy=False)
    sampler = torch.cat([torch.tensor(t.logprobs) for t in result.trajectories])
    torch.testing.assert_close(logp[seqs.response_mask.bool()], sampler, atol=2e-4, rtol=0)


def test_an_image_in_a_later_turn_leaves_the_opening_tokens_alone():
    """LLaVA-OneVision: the opening turn processes to the same tokens once a reply image
    is in the conversation (each image in anyres tiles, whatever the count)."""
    built, _ = _setup("llava_onevision")
    processing = built.processing
    opening = ImageReplies().reset(_rows()[0])
    reply, _, _ = ImageReplies("user").step(opening)
    alone = processing([opening])["input_ids"][0].tolist()
    after = processing([[*opening, {"role": "assistant", "content": "ab"}, *reply]])
    real = after["attention_mask"][0].bool()
    assert after["input_ids"][0][real][:len(alone)].tolist() == alone
    assert after["batch_num_images"].tolist() == [1, 1]


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("text", [" ab", "ab"], ids=["opens-with-space", "no-space"])
def test_a_sampled_turn_renders_back_to_its_tokens(family, text):
    """Idefics3's checkpoints render "Assistant: " + content; the family writes the
    content right after "Assistant:" as sampled, so a turn with or without the space the
    model usually samples first renders back to exactly its tokens (before, "ab" gained
    a space and ended the sample)."""
    built, engine = _setup(family)
    processing = built.processing
    agent = AgentRollout(make_rollout("hf", engine, processing), processing, ImageReplies, max_turns=2)
    messages = ImageReplies().reset(_rows()[0])
    assert agent.inserted_before_content(messages) == ""
    prompt = processing([messages])["input_ids"][0].tolist()
    sampled = processing.tokenizer(text, add_special_tokens=False)["input_ids"] + processing.stop_token_ids[:1]
    content = agent._content(messages, sampled)
    assert content == text
    reply, _, _ = ImageReplies("user").step(messages)
    following = processing([[*messages, {"role": "assistant", "content": content}, *reply]])
    real = following["attention_mask"][0].bool()
    assert following["input_ids"][0][real][:len(prompt) + len(sampled)].tolist() == prompt + sampled
    assert processing.render([{"role": "assistant", "content": [{"type": "text", "text": text}]}],
                             add_generation_prompt=False).endswith(f"Assistant:{text}<end_of_utterance>\n")


def test_one_turn_agent_equals_the_single_turn_rollout():
    """With `single_turn`, the agent loop samples the tokens the plain rollout samples, and
    its training sequences give the same log-probs as the plain path's joined batch."""
    from mmrl.data import to_conversation
    from mmrl.engine import join
    from mmrl.envs import get_environment

    built, engine = _setup("qwen2_vl")
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["text"]}]}],
             "images": [r["image"]], "answer": "x"} for r in _rows()]
    params = SamplingParams(n=2, max_new_tokens=5)
    rollout = make_rollout("hf", engine, built.processing)
    torch.manual_seed(3)
    plain = rollout.generate([to_conversation(r) for r in rows], params)
    torch.manual_seed(3)
    agent = AgentRollout(rollout, built.processing, get_environment("single_turn"), max_turns=3, max_tokens=64)
    result = agent.generate(rows, params)
    assert [t.turns for t in result.trajectories] == [1, 1, 1, 1]
    width = plain.response_ids.shape[1]
    assert torch.equal(result.response_ids[:, :width] * plain.response_mask.long(),
                       plain.response_ids * plain.response_mask.long())
    assert torch.equal(result.response_mask[:, :width], plain.response_mask)
    assert result.texts == built.processing.decode(plain.response_ids)
    pad = built.processing.tokenizer.pad_token_id
    ours = trajectory_sequences(result.trajectories, built.processing, built.adapter, engine.model, pad)
    theirs = join(plain.prompt_inputs, plain.response_ids, plain.response_mask, built.adapter, engine.model, pad)
    with torch.no_grad():
        a = engine.log_probs(ours, with_entropy=False)[0][ours.response_mask.bool()]
        b = engine.log_probs(theirs, with_entropy=False)[0][theirs.response_mask.bool()]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.slow
def test_multi_turn_on_the_compiled_rollout_equals_plain_generate(family):
    """Issue 28: the agent loop over the compiled rollout (decode step traced by dynamo, full
    graph) gives plain `generate`'s greedy tokens and log-probs turn by turn, images in the
    replies and mrope positions included, fp32; the turns' growing prompts trace the step
    at most twice (the width is dynamic from the first trace, the cache length after its
    first change)."""
    from mmrl.compile_watch import watch

    built, engine = _setup(family)
    with torch.no_grad():  # widened weights, so greedy continuations vary from token to token
        generator = torch.Generator().manual_seed(1)
        for parameter in engine.model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0, logprobs=True)

    def run(backend, **options):
        agent = AgentRollout(make_rollout(backend, engine, built.processing, **options), built.processing,
                             ImageReplies, max_turns=3, max_tokens=4096)
        return agent, agent.generate(_rows(), params)

    _, plain = run("hf")
    torch._dynamo.reset()  # no shapes remembered from earlier tests' traces of the same step
    w = watch()
    w.take()
    agent, fast = run("hf_compiled", compile_options={"backend": "eager", "fullgraph": True})
    assert agent.backend.fallback_reason is None
    assert [t.turns for t in fast.trajectories] == [t.turns for t in plain.trajectories]
    assert max(t.turns for t in fast.trajectories) >= 2
    for ours, theirs in zip(fast.trajectories, plain.trajectories):
        assert ours.ids == theirs.ids and ours.spans == theirs.spans and ours.finish == theirs.finish
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)
    assert w.take()[1] <= 2
