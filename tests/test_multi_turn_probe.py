"""The multi_turn probe's checks of the engine's optimizations on a trajectory batch
(an image and a video arriving in turn 3; tiny random-init Qwen2-VL, fp32 on CPU):
shared media encoding and padding-free packing give the plain path's log-probs, and
each check fails when the optimization is broken. Ulysses over 2 processes (gloo) on
the same batch is checked where the whole probe runs on qwen2_vl, with its one torchrun
launch (tests/test_probes.py::test_multi_turn_probe_verifies_and_names_where_the_prefix_rule_cannot_hold)."""

import copy

import pytest
import torch

from mmrl.probes.base import CheckFailed, Subject
from mmrl.registry import get_adapter


@pytest.fixture(scope="module")
def trajectory_batch():
    from mmrl.probes.multi_turn import rollout
    from mmrl.rollout_batch import trajectory_sequences

    run = rollout(Subject(get_adapter("qwen2_vl"), source="qwen2_vl"))
    processing = run.built.processing
    seqs = trajectory_sequences(run.kept, processing, run.built.adapter, run.engine.model,
                                processing.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = run.engine.log_probs(seqs, with_entropy=False)
    return run, seqs, logp


def test_the_reply_holds_a_video_and_every_variant_equals_the_plain_path(trajectory_batch):
    from mmrl.probes.multi_turn import _engine_variants

    run, seqs, logp = trajectory_batch
    assert run.video and len(run.kept) >= 2
    assert "pixel_values_videos" in seqs.inputs and "video_grid_thw" in seqs.inputs
    evidence = {}
    said = _engine_variants(run, seqs, logp, evidence)
    assert said == "shared media, packed, packed with shared media give the plain path's log-probs"
    assert evidence["max_logprob_diff_shared_media"] <= 1e-5
    assert evidence["max_logprob_diff_packed"] <= 2e-4
    assert evidence["shared_pieces"] == f"{len(run.kept) + 1} media pieces encoded for {len(run.kept)} rows"


def test_shared_media_in_the_wrong_order_fails(trajectory_batch, monkeypatch):
    import mmrl.engine.media as media
    from mmrl.probes.multi_turn import _engine_variants

    plain = media.sharing

    def reversed_pieces(model, batch, shared):
        if shared is not None and shared.parts is not None:
            shared = copy.copy(shared)
            shared.parts = [part[::-1] for part in shared.parts]
        return plain(model, batch, shared)

    monkeypatch.setattr(media, "sharing", reversed_pieces)
    run, seqs, logp = trajectory_batch
    with pytest.raises(CheckFailed, match="shared media: the trajectory batch's log-probs differ"):
        _engine_variants(run, seqs, logp, {})


@pytest.mark.parametrize("broken, message", [("positions", "its packed position ids are not its own"),
                                              ("logits", "packed: the trajectory batch's log-probs differ")])
def test_broken_packing_fails(trajectory_batch, monkeypatch, broken, message):
    import mmrl.engine.packing as packing
    from mmrl.probes.multi_turn import _engine_variants

    plain = packing.pack_sequences

    def broken_pack(*args, **kwargs):
        packed = plain(*args, **kwargs)
        if broken == "positions":
            packed.inputs["position_ids"] = packed.inputs["position_ids"] + 1
        else:
            packed.logit_index = packed.logit_index - 1
        return packed

    monkeypatch.setattr(packing, "pack_sequences", broken_pack)
    monkeypatch.setattr("mmrl.engine.layouts.pack_sequences", broken_pack)  # the engine's packed layout
    run, seqs, logp = trajectory_batch
    with pytest.raises(CheckFailed, match=message):
        _engine_variants(run, seqs, logp, {})
