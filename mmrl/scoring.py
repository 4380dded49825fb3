"""The reward function's scores of a rollout's responses, as training and evaluation take them.

    outcomes, parts = score_rollout(reward_fn, processing, samples, result, rows=[12, 40], dataset=train_set,
                                    where="step 3")

The reward gets the completions, the answers, the samples' other columns and, where its
signature names them, the prompts, images, videos and completion ids
(`mmrl.rewards.fields`); `parts` are a combined reward's scores by part name
(`mmrl.rewards.score_parts`; empty for a single reward).

A failing reward function or a NaN/inf score is one `RewardError` naming the reward, the
step (`where`), the dataset row and the response, so a run stops before any update with
a line that says what to fix.
"""

from __future__ import annotations

import torch

from mmrl.rewards import RewardError, score_parts
from mmrl.rewards.fields import trainer_fields

# Sample keys that are not extra fields for the reward function.
SAMPLE_KEYS = ("prompt", "answer", "images", "videos")


def score_rollout(reward_fn, processing, samples: list[dict], result, *, rows: list[int] | None = None,
                  dataset=None, where: str = "", conversations: list | None = None,
                  max_pixels: int | None = None) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """The reward function's score of each response of `result` (float32, one per
    response; the environment's rewards of a multi-turn rollout are not added), and a
    combined reward's parts. `rows` are the samples' rows in `dataset` (for the error
    message; None: their indices); `conversations` are the samples' decoded prompts where
    the caller has them (otherwise decoded here, only for a reward that takes them)."""
    # Multi-turn rollouts: the final policy turn is the answer.
    texts = result.texts if result.texts is not None else processing.decode(result.response_ids)
    owners = result.prompt_index.tolist()
    answers = [samples[i]["answer"] for i in owners]
    extra_keys = [k for k in samples[0] if k not in SAMPLE_KEYS]
    fields = {k: [samples[i].get(k) for i in owners] for k in extra_keys}
    fields.update(trainer_fields(reward_fn, samples, owners, conversations=conversations,
                                 response_ids=result.response_ids, response_mask=result.response_mask,
                                 max_pixels=max_pixels))
    try:
        scores, parts = score_parts(reward_fn, texts, answers, **fields)
    except RewardError as exc:
        if exc.index is not None:
            prompt = owners[exc.index]
            row = rows[prompt] if rows is not None else prompt
            name = getattr(dataset, "name", "") if dataset is not None else ""
            where += f", row {row}" + (f" of {name}" if name else "") + f" (response {texts[exc.index]!r})"
        raise RewardError(f"{exc} at {where}", reward=exc.reward, index=exc.index) from None
    return torch.tensor(scores, dtype=torch.float32), parts


__all__ = ["score_rollout"]
