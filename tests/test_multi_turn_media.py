"""Trajectory batches with images that arrive mid-conversation, under the engine's
optimizations (tiny random-init Qwen2-VL, fp32 on CPU): shared media encoding (each
prompt's opening image encoded once, each sample's reply images alone) gives the plain
path's log-probs with less vision input, and a sharing whose pieces do not lay out the
batch is refused (the plain path runs)."""

import torch
from PIL import Image
from test_agent_rollout import ImageReplies, _rows

from mmrl import build_model
from mmrl.engine import Engine
from mmrl.engine.media import SharedMedia, placeholder_tokens
from mmrl.parallel import init_distributed
from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout.agent import AgentRollout
from mmrl.rollout_batch import shared_pieces, trajectory_sequences


def _trajectories(seed=0, family="qwen2_vl", role="tool"):
    built = build_model(family, random_init=True, seed=0,
                        processing_options={"min_pixels": 784, "max_pixels": 56 * 56})
    plain = Engine(built, init_distributed(), mixed_precision=False, share_media=False)
    torch.manual_seed(seed)
    agent = AgentRollout(make_rollout("hf", plain, built.processing), built.processing,
                         lambda: ImageReplies(role), max_turns=3, max_tokens=4096)
    result = agent.generate(_rows(), SamplingParams(n=3, max_new_tokens=3))
    return built, plain, result.trajectories


def _vision_rows(engine, seqs):
    """Rows of pixel values the vision tower gets in one log-prob pass."""
    seen = []
    hook = engine.model.model.visual.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).shape[0]), with_kwargs=True)
    try:
        with torch.no_grad():
            logp, _ = engine.log_probs(seqs, with_entropy=False)
    finally:
        hook.remove()
    return logp, sum(seen)


def test_trajectory_batch_shares_the_opening_image_exactly():
    built, plain, trajectories = _trajectories()
    assert [t.prompt for t in trajectories] == [0, 0, 0, 1, 1, 1]
    pad = built.processing.tokenizer.pad_token_id
    shared_engine = Engine(built, init_distributed(), mixed_precision=False, share_media=True)
    ours = trajectory_sequences(trajectories, built.processing, built.adapter, plain.model, pad, share=True)
    theirs = trajectory_sequences(trajectories, built.processing, built.adapter, plain.model, pad)
    assert ours.shared is not None and theirs.shared is None
    # Two openings shared by three samples each, then every sample's own replies.
    parts = ours.shared.row_parts()
    assert [p[0] for p in parts] == [0, 0, 0, parts[3][0]] + [parts[3][0]] * 2
    assert len({p for part in parts for p in part[1:]}) == sum(len(p) - 1 for p in parts)
    shared_logp, shared_rows = _vision_rows(shared_engine, ours)
    plain_logp, plain_rows = _vision_rows(plain, theirs)
    mask = theirs.response_mask.bool()
    torch.testing.assert_close(shared_logp[mask], plain_logp[mask], atol=1e-5, rtol=0)
    assert shared_rows < plain_rows
    # The pieces' order matters: a row whose reply comes before its opening differs.
    ours.shared.parts[0] = ours.shared.parts[0][::-1]
    mutated, _ = _vision_rows(shared_engine, ours)
    assert (mutated[mask] - plain_logp[mask]).abs().max() > 1e-4


def test_media_batched_per_row_share_the_opening_exactly(monkeypatch):
    """Idefics3 batches media per row ((rows, tiles, ...)): a row's pieces join along its
    tiles. The sharing is made and gives the plain path's log-probs; without the per-row
    layout the pieces do not lay out the batch and nothing is shared."""
    from mmrl.engine import media

    built, plain, trajectories = _trajectories(family="idefics3", role="user")
    assert built.processing([t.context for t in trajectories])["pixel_values"].dim() == 5
    pad = built.processing.tokenizer.pad_token_id
    ours = trajectory_sequences(trajectories, built.processing, built.adapter, plain.model, pad, share=True)
    theirs = trajectory_sequences(trajectories, built.processing, built.adapter, plain.model, pad)
    assert ours.shared is not None
    shared_engine = Engine(built, init_distributed(), mixed_precision=False, share_media=True)
    with torch.no_grad():
        shared_logp, _ = shared_engine.log_probs(ours, with_entropy=False)
        plain_logp, _ = plain.log_probs(theirs, with_entropy=False)
    mask = theirs.response_mask.bool()
    torch.testing.assert_close(shared_logp[mask], plain_logp[mask], atol=1e-5, rtol=0)
    monkeypatch.setattr(media, "_stack_per_row", lambda per_row, rows: None)
    assert trajectory_sequences(trajectories, built.processing, built.adapter, plain.model, pad,
                                share=True).shared is None


def test_pieces_that_do_not_lay_out_the_batch_give_no_sharing():
    built, plain, trajectories = _trajectories(seed=1)
    batch = dict(built.processing([t.context for t in trajectories]))
    assert shared_pieces(trajectories, built.processing, batch, plain.model) is not None
    # An opening image that differs from the one the batch was processed with.
    other = [t for t in trajectories]
    changed = dict(other[0].context[0])
    changed["content"] = [{"type": "image", "image": Image.new("RGB", (56, 56), (0, 0, 0))},
                          *changed["content"][1:]]
    other[0].context = [changed, *other[0].context[1:]]
    assert shared_pieces(other, built.processing, batch, plain.model) is None
    # No prompt repeats: nothing to share.
    single = dict(built.processing([trajectories[0].context]))
    assert SharedMedia.of_pieces(built.processing, [[("a", trajectories[0].context[:1])]], single,
                                 placeholder_tokens(plain.model)) is None


def test_openings_without_media_process_nothing_more():
    """The demo's layout (the opening hides the image; only tool replies hold one): no
    piece repeats with media, so no piece is processed again."""
    built, plain, trajectories = _trajectories(seed=2)
    for t in trajectories:
        t.context = [{"role": "user", "content": "What is it?"}, *t.context[1:]]
    calls = []

    def processing(*args, **kwargs):
        calls.append(args)
        return built.processing(*args, **kwargs)

    assert shared_pieces(trajectories, processing, {}, plain.model) is None and calls == []
