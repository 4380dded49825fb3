"""What the trainer hands a reward besides the completions, answers and dataset columns.

    fields = trainer_fields(reward_fn, samples, rows, conversations=conversations,
                            response_ids=result.response_ids, response_mask=result.response_mask)

One list entry per completion (`rows[i]` is the sample completion i answers):

    prompts         the sample's prompt conversation, media parts holding decoded images
                    (the same list object for every completion of one prompt)
    images, videos  the sample's images (PIL) and videos (frame lists or paths), in order
    completion_ids  the token ids the policy sampled for the completion

Only the fields the reward takes are built (`mmrl.rewards.accepts`): a reward that takes
none of the media fields costs no image decoding.
"""

from __future__ import annotations

from typing import Any

from mmrl.data import to_conversation
from mmrl.rewards import accepts

MEDIA_FIELDS = {"images": "image", "videos": "video"}


def _media(conversation: list[dict], kind: str) -> list[Any]:
    return [part[kind] for message in conversation if not isinstance(message["content"], str)
            for part in message["content"] if part.get("type") == kind]


def trainer_fields(fn, samples: list[dict], rows: list[int], *, conversations: list | None = None,
                   response_ids=None, response_mask=None, max_pixels: int | None = None) -> dict[str, list]:
    """The fields `fn` takes among prompts, images, videos and completion_ids.
    `conversations` are the samples' decoded prompts when the caller has them (the
    rollout's input); without them the samples are decoded here."""
    fields: dict[str, list] = {}
    wanted = [name for name in ("prompts", *MEDIA_FIELDS) if accepts(fn, name)]
    if wanted:
        if conversations is None:
            conversations = [to_conversation(sample, max_pixels=max_pixels) for sample in samples]
        if "prompts" in wanted:
            fields["prompts"] = [conversations[i] for i in rows]
        for name, kind in MEDIA_FIELDS.items():
            if name in wanted:
                per_sample = [_media(conversation, kind) for conversation in conversations]
                fields[name] = [per_sample[i] for i in rows]
    if response_ids is not None and accepts(fn, "completion_ids"):
        mask = response_mask.bool() if response_mask is not None else None
        fields["completion_ids"] = [(ids[mask[row]] if mask is not None else ids).tolist()
                                    for row, ids in enumerate(response_ids)]
    return fields


__all__ = ["trainer_fields"]
