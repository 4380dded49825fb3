"""The `multi_turn` probe: an image that the environment returns in turn 3 trains
exactly as the final conversation processed in one go.

    from mmrl.probes import Subject, probe
    probe("multi_turn").run(Subject(get_adapter("FAMILY"), source="FAMILY"))

The agent loop (`mmrl.rollout.agent`, hf backend, fp32) runs on the family's tiny
model: the user's image and question (turn 1), a sampled policy turn (2), an
environment reply holding an image of another size (3), a sampled policy turn (4).
Its training batch (`trajectory_sequences`) must equal the final conversation processed
in one go (token ids, media tensors, per-token type ids, the adapter's positions, mrope
included); the loss mask must cover exactly the sampled tokens and no media placeholder;
and each policy turn's log-probs must equal those the rollout sampled it with.

Where the prefix rule cannot hold, the check fails with the reason: a processor that
lays the opening turn out anew once a second image is in the conversation, or a chat
template that writes text of its own before the assistant's (a sampled turn then
re-renders to other tokens). The agent loop ends such samples early instead of
training on a context the policy never saw.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.probes.base import TOLERANCE, CheckFailed, Subject, Verified, require

SAMPLES = 4
NEW_TOKENS = 4
SEED = 0


class _ImageReply:
    """Replies to the first policy turn with an image and a word; the second ends it."""

    def __init__(self, row: dict, role: str):
        self.row, self.role, self.steps = row, role, 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image", "image": row["image"]},
                                             {"type": "text", "text": row["text"]}]}]

    def step(self, messages: list[dict]) -> tuple[list[dict], bool, float | None]:
        self.steps += 1
        reply = [{"role": self.role, "content": [{"type": "image", "image": self.row["reply"]},
                                                 {"type": "text", "text": "zoomed"}]}]
        return (reply, False, None) if self.steps == 1 else ([], True, None)


def _row() -> dict[str, Any]:
    from mmrl.checks import sample_images

    images = sample_images()
    return {"image": images[0], "reply": images[1], "text": "What is shown here?"}


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
    inserted = agent._inserted_before_content(opening)
    if inserted:
        return (f"the chat template writes {inserted!r} before the assistant's text: a sampled turn that does not "
                "begin with it re-renders to other tokens and ends the sample, so the prefix rule holds for some "
                "turns only")
    return None


def check_multi_turn(subject: Subject) -> Verified:
    from mmrl.engine import Engine
    from mmrl.probes.training import _single_process
    from mmrl.rollout import SamplingParams, make_rollout
    from mmrl.rollout.agent import AgentRollout, trajectory_sequences

    built = subject.build(seed=0)
    engine = Engine(built, _single_process(subject.device), mixed_precision=False, share_media=False)
    processing, adapter = built.processing, built.adapter
    row = _row()
    opening = _ImageReply(row, "user").reset(row)
    role = _reply_role(processing, opening, row["reply"])
    agent = AgentRollout(make_rollout("hf", engine, processing), processing, lambda: _ImageReply(row, role),
                         max_turns=2, max_tokens=4096)
    reason = _prefix_rule_breaks(agent, processing, opening, _ImageReply(row, role).step(opening)[0])
    if reason is not None:
        raise CheckFailed(reason)
    torch.manual_seed(SEED)
    result = agent.generate([row], SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, logprobs=True))
    kept = [t for t in result.trajectories if t.turns == 2]
    require(kept, "no sampled turn stayed a prefix of the next conversation (finishes: "
            f"{', '.join(t.finish for t in result.trajectories)})")
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
    media_ids = sorted({getattr(config, key, None) for key in ("image_token_id", "image_token_index")} - {None})
    placeholders = torch.isin(response, torch.tensor(media_ids)) if media_ids else torch.zeros_like(mask)
    require(not (placeholders & mask).any(), "the loss mask covers image placeholders")
    require(not media_ids or bool((placeholders & ~mask).any()), "the reply image's placeholders are not in "
            "the trained columns")

    # Each policy turn's log-probs: the trainer's equal the rollout's.
    with torch.no_grad():
        logp, _ = engine.log_probs(seqs, temperature=1.0, with_entropy=False)
    ours = logp.cpu()[mask]
    sampler = torch.tensor([p for t in kept for p in t.logprobs])
    require(ours.shape == sampler.shape, "the rollout's log-probs do not match the sampled tokens")
    worst = float((ours - sampler).abs().max())
    require(worst <= TOLERANCE, f"policy-turn log-probs differ from the rollout's by {worst:.2e} (> {TOLERANCE})")
    return Verified(
        f"an image in turn 3 ({role} role): the training batch equals the final conversation processed in one go "
        f"(ids, {', '.join(media + per_token)}{', positions' if positions is not None else ''}); "
        f"policy-turn log-probs equal the rollout's",
        {"samples": len(result.trajectories), "kept": len(kept), "last_turn_round_trips": len(exact),
         "policy_tokens": int(mask.sum()),
         "max_logprob_diff": worst, "reply_role": role},
    )


__all__ = ["check_multi_turn"]
