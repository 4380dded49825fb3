"""The `multi_turn` probe: an image (and a video) that the environment returns in turn 3
trains exactly as the final conversation processed in one go, under every engine
optimization the family declares.

    from mmrl.probes import Subject, probe
    probe("multi_turn").run(Subject(get_adapter("FAMILY"), source="FAMILY"))
    check_multi_turn_many(subjects)      # [(outcome, seconds)], one torchrun launch

The agent loop (`mmrl.rollout.agent`, hf backend, fp32) runs on the family's tiny
model: the user's image and question (turn 1), a sampled policy turn (2), an
environment reply holding an image of another size, and a 4-frame video where the
family declares video (3), a sampled policy turn (4). Its training batch
(`trajectory_sequences`) must equal the final conversation processed in one go (token
ids, media tensors, per-token type ids, the adapter's positions, mrope included); the
loss mask must cover exactly the sampled tokens and no media placeholder; and each
policy turn's log-probs must equal those the rollout sampled them with. Then the same
batch's log-probs must equal the plain path's with shared media encoding (the prompt's
opening image encoded once for its samples, `SharedMedia.of_pieces`; 1e-5), packed
without padding (each sequence's packed positions its own; 2e-4) and both, as far as
the family declares `media_sharing` / `padding_free`; and where it declares
`sequence_parallel`, one update on it under Ulysses over 2 processes must equal one
process (`mmrl.probes.multi_turn_sp`: log-probs 1e-5, gradients, AdamW step).

Where the prefix rule cannot hold, the check fails with the reason: a processor that
lays the opening turn out anew once a second image is in the conversation, or a chat
template that writes text of its own before the assistant's (a sampled turn then
re-renders to other tokens). The agent loop ends such samples early instead of
training on a context the policy never saw.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mmrl.probes.base import TOLERANCE, CheckFailed, Subject, Verified, require

SAMPLES = 4
NEW_TOKENS = 4
SEED = 0


class _ImageReply:
    """Replies to the first policy turn with an image (and a short video, where `video`)
    and a word; the second ends it."""

    def __init__(self, row: dict, role: str, video: bool = False):
        self.row, self.role, self.video, self.steps = row, role, video, 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image", "image": row["image"]},
                                             {"type": "text", "text": row["text"]}]}]

    def step(self, messages: list[dict]) -> tuple[list[dict], bool, float | None]:
        self.steps += 1
        clip = [{"type": "video", "video": self.row["reply_video"]}] if self.video else []
        reply = [{"role": self.role, "content": [{"type": "image", "image": self.row["reply"]}, *clip,
                                                 {"type": "text", "text": "zoomed"}]}]
        return (reply, False, None) if self.steps == 1 else ([], True, None)


def _row() -> dict[str, Any]:
    from mmrl.checks import sample_images, sample_video

    images = sample_images()
    return {"image": images[0], "reply": images[1], "reply_video": sample_video(), "text": "What is shown here?"}


def _with_video(adapter) -> bool:
    """Whether the reply carries a video too: the family declares video."""
    return adapter.capabilities.video and "video" in adapter.modalities


def _reply_role(processing, opening: list[dict], reply_image) -> str:
    """"tool" where the chat template renders a tool message with an image, else "user"."""
    conversation = [*opening, {"role": "assistant", "content": "a"},
                    {"role": "tool", "content": [{"type": "image", "image": reply_image}]}]
    try:
        processing([conversation])
    except Exception:  # noqa: BLE001 - a template without a tool role raises its own errors
        return "user"
    return "tool"


def _ids(batch: dict, row: int) -> list[int]:
    return batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()


def _prefix_rule_breaks(agent, processing, opening: list[dict], reply: list[dict]) -> str | None:
    """Why the prefix rule cannot hold for this family (None: it can): the opening turn
    must keep its tokens once the reply is in the conversation, and the template must
    write the assistant's text as it is."""
    alone = _ids(processing([opening]), 0)
    after = _ids(processing([[*opening, {"role": "assistant", "content": "a"}, *reply]]), 0)
    if after[:len(alone)] != alone:
        changed = sum(a != b for a, b in zip(alone, after)) + max(0, len(alone) - len(after))
        return ("the opening turn is processed into other tokens once the reply image is in the conversation "
                f"({changed} of {len(alone)} differ): the prefix rule cannot hold, so samples end before the reply")
    inserted = agent.inserted_before_content(opening)
    if inserted:
        return (f"the chat template writes {inserted!r} before the assistant's text: a sampled turn that does not "
                "begin with it re-renders to other tokens and ends the sample, so the prefix rule holds for some "
                "turns only")
    return None


@dataclass
class Rollout:
    """The probe's agent rollout on a subject's tiny model: the samples that reached the
    reply (two policy turns), and what made them."""

    built: Any
    engine: Any
    kept: list
    samples: int
    role: str
    video: bool


def rollout(subject: Subject) -> Rollout:
    """The agent loop (hf backend, fp32, plain engine) on the subject's model, seeded:
    one row, `SAMPLES` samples; raises `CheckFailed` where the prefix rule cannot hold."""
    from mmrl.engine import Engine
    from mmrl.probes.launcher import single_process
    from mmrl.rollout import SamplingParams, make_rollout
    from mmrl.rollout.agent import AgentRollout

    built = subject.build(seed=0)
    engine = Engine(built, single_process(subject.device), mixed_precision=False, share_media=False)
    processing = built.processing
    row, video = _row(), _with_video(built.adapter)
    opening = _ImageReply(row, "user").reset(row)
    role = _reply_role(processing, opening, row["reply"])
    agent = AgentRollout(make_rollout("hf", engine, processing), processing,
                         lambda: _ImageReply(row, role, video), max_turns=2, max_tokens=4096)
    try:
        reason = _prefix_rule_breaks(agent, processing, opening, _ImageReply(row, role, video).step(opening)[0])
    except Exception as exc:
        if not video:
            raise
        raise CheckFailed(f"the family declares video, but a video in the environment's reply, in a conversation "
                          f"holding images, does not process: {exc}") from exc
    if reason is not None:
        raise CheckFailed(reason)
    torch.manual_seed(SEED)
    result = agent.generate([row], SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, logprobs=True))
    kept = [t for t in result.trajectories if t.turns == 2]
    require(kept, "no sampled turn stayed a prefix of the next conversation (finishes: "
            f"{', '.join(t.finish for t in result.trajectories)})")
    return Rollout(built, engine, kept, len(result.trajectories), role, video)


def check_multi_turn(subject: Subject) -> Verified:
    outcome, _ = check_multi_turn_many([subject])[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def check_one_process(subject: Subject) -> Verified:
    """Every check of the probe but Ulysses (which needs several processes)."""
    from mmrl.rollout_batch import trajectory_sequences

    run = rollout(subject)
    built, engine, kept, role = run.built, run.engine, run.kept, run.role
    processing, adapter = built.processing, built.adapter
    pad = processing.tokenizer.pad_token_id
    seqs = trajectory_sequences(kept, processing, adapter, engine.model, pad)
    final = {k: v.cpu() if isinstance(v, torch.Tensor) else v
             for k, v in processing([t.messages for t in kept], add_generation_prompt=False).items()}
    inputs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in seqs.inputs.items()}

    # Token ids and per-token inputs: the trajectory opens the one-go sequence (which adds
    # the template's end of turn after the last policy turn). The loop has checked every
    # turn but the last against the conversation re-processed; the last one's text may
    # re-render to other tokens (a template that trims it): training keeps the sampled
    # tokens, and the one-go comparison takes the samples whose last turn round-trips.
    shape = tuple(final["input_ids"].shape)
    per_token = [k for k, v in final.items() if isinstance(v, torch.Tensor) and tuple(v.shape[:2]) == shape
                 and k not in ("input_ids", "attention_mask")]
    exact = [i for i, t in enumerate(kept) if _ids(final, i)[:len(t.ids)] == t.ids]
    for i, t in enumerate(kept):
        require(_ids(final, i)[:len(t.prompt_ids)] == t.prompt_ids, f"sample {i}: its tokens before the last "
                "policy turn differ from the final conversation processed in one go")
        require(_ids(inputs, i) == t.ids, f"sample {i}: the training row is not its tokens")
    require(exact, "no sample's last policy turn re-renders to its sampled tokens")
    for i in exact:
        real, one_go = inputs["attention_mask"][i].bool(), final["attention_mask"][i].bool()
        for key in per_token:
            require(key in inputs and inputs[key][i][real].tolist() == final[key][i][one_go][:len(kept[i].ids)].tolist(),
                    f"sample {i}: {key} differs from the final conversation processed in one go")

    # Media tensors (every image of every turn, in order) as processing in one go gives them.
    media = [k for k, v in final.items() if isinstance(v, torch.Tensor) and k not in per_token
             and k not in ("input_ids", "attention_mask")]
    require(media, "the processed conversation holds no media tensors")
    for key in media:
        require(key in inputs and inputs[key].shape == final[key].shape
                and torch.equal(inputs[key].to(final[key].dtype), final[key]),
                f"{key} differs from the final conversation processed in one go")

    # Positions (mrope included), where the adapter writes them; otherwise the model
    # derives them from the inputs compared above.
    positions = adapter.position_ids(engine.model, final)
    if positions is not None:
        positions = positions.cpu()
        require("position_ids" in inputs, "the training batch has no position ids")
        for i in exact:
            real, one_go = inputs["attention_mask"][i].bool(), final["attention_mask"][i].bool()
            ours = inputs["position_ids"][..., i, :][..., real]
            theirs = positions[..., i, :][..., one_go][..., :len(kept[i].ids)]
            require(ours.shape == theirs.shape and torch.equal(ours, theirs),
                    f"sample {i}: position ids differ from the final conversation processed in one go")

    # The loss mask: exactly the sampled tokens, never a media placeholder.
    mask = seqs.response_mask.bool().cpu()
    response = seqs.response_ids.cpu()
    require(int(mask.sum()) == sum(t.policy_tokens for t in kept), "the loss mask covers other tokens than "
            "the sampled ones")
    for i, t in enumerate(kept):
        sampled = [tok for a, b in t.spans for tok in t.ids[a:b]]
        require(response[i][mask[i]].tolist() == sampled, f"sample {i}: the masked tokens are not its turns")
    config = engine.model.config
    for kind in ("image", "video") if run.video else ("image",):
        ids = sorted({getattr(config, f"{kind}_token_{s}", None) for s in ("id", "index")} - {None})
        placeholders = torch.isin(response, torch.tensor(ids)) if ids else torch.zeros_like(mask)
        require(not (placeholders & mask).any(), f"the loss mask covers {kind} placeholders")
        require(not ids or bool((placeholders & ~mask).any()), f"the reply {kind}'s placeholders are not in "
                "the trained columns")

    # Each policy turn's log-probs: the trainer's equal the rollout's.
    with torch.no_grad():
        logp, _ = engine.log_probs(seqs, temperature=1.0, with_entropy=False)
    ours = logp.cpu()[mask]
    sampler = torch.tensor([p for t in kept for p in t.logprobs])
    require(ours.shape == sampler.shape, "the rollout's log-probs do not match the sampled tokens")
    worst = float((ours - sampler).abs().max())
    require(worst <= TOLERANCE, f"policy-turn log-probs differ from the rollout's by {worst:.2e} (> {TOLERANCE})")
    evidence = {"samples": run.samples, "kept": len(kept), "last_turn_round_trips": len(exact),
                "policy_tokens": int(mask.sum()), "max_logprob_diff": worst, "reply_role": role,
                "reply_video": run.video}
    engines = _engine_variants(run, seqs, logp, evidence)
    return Verified(
        f"an image{' and a video' if run.video else ''} in turn 3 ({role} role): the training batch equals the final "
        f"conversation processed in one go (ids, {', '.join(media + per_token)}"
        f"{', positions' if positions is not None else ''}); policy-turn log-probs equal the rollout's"
        + (f"; {engines}" if engines else ""), evidence)


# Shared media encoding changes only which rows the vision tower sees: the media
# sharing probe's bound. Packing changes attention's layout: the padding-free probe's.
SHARED_TOLERANCE = 1e-5


def _engine_variants(run: Rollout, plain, plain_logp: torch.Tensor, evidence: dict) -> str:
    """The trajectory batch's log-probs under the optimizations the family declares
    (shared media encoding, padding-free packing, both) against the plain path's."""
    from mmrl.engine import Engine
    from mmrl.engine.packing import pack_sequences
    from mmrl.probes.launcher import single_process
    from mmrl.rollout_batch import trajectory_sequences

    built, kept = run.built, run.kept
    capabilities = built.adapter.capabilities
    pad = built.processing.tokenizer.pad_token_id
    lengths = plain.inputs["attention_mask"].sum(-1).tolist()
    # Packed rows: all sequences but the last in one row, the last in a row of its own.
    row_tokens = int(sum(lengths) - 1)
    mask = plain.response_mask.bool()
    said = []
    variants = [(name, share, pack) for name, share, pack in (
        ("shared media", True, False), ("packed", False, True), ("packed with shared media", True, True))
        if (not share or capabilities.media_sharing) and (not pack or capabilities.padding_free)]
    for name, share, pack in variants:
        engine = Engine(built, single_process(run.engine.dist.device.type), mixed_precision=False,
                        share_media=share, pack=pack, pack_tokens=row_tokens)
        seqs = trajectory_sequences(kept, built.processing, built.adapter, engine.model, pad, share=share)
        if share:
            require(seqs.shared is not None, "the trajectory batch shares no media encoding (its pieces do not lay "
                    "out the batch's media tensors)")
            pieces = {p for part in seqs.shared.row_parts() for p in part}
            evidence["shared_pieces"] = f"{len(pieces)} media pieces encoded for {len(kept)} rows"
        if pack:
            require(engine.packs(seqs), "the packed engine runs the trajectory batch padded")
            packed = pack_sequences(seqs.inputs, seqs.response_mask, row_tokens, pad)
            require(len(packed.rows) == 2 and len(packed.rows[0]) == len(kept) - 1,
                    f"the batch packed into rows {packed.rows}, not all-but-one and one")
            _packed_positions_per_sequence(seqs.inputs, packed)
        with torch.no_grad():
            logp, _ = engine.log_probs(seqs, temperature=1.0, with_entropy=False)
        gap = float((logp[mask] - plain_logp[mask]).abs().max())
        bound = SHARED_TOLERANCE if not pack else TOLERANCE
        evidence[f"max_logprob_diff_{name.replace(' ', '_')}"] = gap
        require(gap <= bound, f"{name}: the trajectory batch's log-probs differ from the plain path's by {gap:.2e} "
                f"(> {bound:.0e})")
        said.append(name)
    return f"{', '.join(said)} give the plain path's log-probs" if said else ""


def _packed_positions_per_sequence(inputs: dict, packed) -> None:
    """Each sequence's positions in the packed rows (mrope included) are its own."""
    positions, real = inputs["position_ids"], inputs["attention_mask"].bool()
    ours = packed.inputs["position_ids"]
    for k, members in enumerate(packed.rows):
        offset = 0
        for i in members:
            own = positions[..., i, :][..., real[i]]
            got = ours[..., k, :][..., offset:offset + own.shape[-1]]
            require(torch.equal(got, own), f"sequence {i}: its packed position ids are not its own")
            offset += own.shape[-1]


def _sequence_parallel_applies(adapter) -> bool:
    return adapter.capabilities.sequence_parallel and adapter.sequence_parallel is not None


def check_multi_turn_many(subjects: list[Subject]) -> list[tuple[Verified | BaseException, float]]:
    """The probe for several subjects: the one-process checks subject by subject, then
    Ulysses over 2 processes for those that passed and declare sequence parallelism, in
    one torchrun launch (`mmrl.probes.multi_turn_sp`)."""
    from mmrl.probes.base import NotRunHere
    from mmrl.probes.sequence_parallel import SP_PROCESSES
    from mmrl.probes.launcher import require_processes, torchrun_many

    outcomes: list[list] = []
    for subject in subjects:
        start = time.perf_counter()
        try:
            outcome: Verified | BaseException = check_one_process(subject)
        except Exception as exc:  # noqa: BLE001 - recorded per subject
            outcome = exc
        outcomes.append([outcome, time.perf_counter() - start])
    todo = [i for i, (outcome, _) in enumerate(outcomes)
            if isinstance(outcome, Verified) and _sequence_parallel_applies(subjects[i].adapter)]
    if todo:
        start = time.perf_counter()
        try:
            require_processes(subjects[0].device)
            parallel = torchrun_many("mmrl.probes.multi_turn_sp", [subjects[i] for i in todo], "", processes=SP_PROCESSES)
        except NotRunHere as exc:
            parallel = [(exc, 0.0)] * len(todo)
        share = (time.perf_counter() - start) / len(todo)
        for i, (result, _) in zip(todo, parallel):
            verified = outcomes[i][0]
            outcomes[i][1] += share
            if isinstance(result, Verified):
                verified.reason += (f"; Ulysses over {SP_PROCESSES} processes equals one process on the trajectory "
                                    "batch (log-probs 1e-5, gradients, AdamW step)")
                verified.evidence["sequence_parallel"] = result.evidence
            elif isinstance(result, NotRunHere):
                verified.reason += f"; Ulysses not run here ({result})"
            else:
                outcomes[i][0] = CheckFailed(f"Ulysses over {SP_PROCESSES} processes on the trajectory batch: {result}")
    return [(outcome, seconds) for outcome, seconds in outcomes]


__all__ = ["check_multi_turn", "check_multi_turn_many", "rollout"]
