"""From a scored rollout to the training batch: the sequences the engines train on.

    batches, minis = training_batches(conversations, result, rows, algo=recipe.algo, dist=dist,
                                      processing=processing, adapter=adapter, actor=actor)
    seqs = rollout_sequences(conversations, ids, mask, processing, adapter, model)        # single-turn rows
    seqs = trajectory_sequences(result.trajectories, processing, adapter, model, pad_id)  # multi-turn rows

`training_batches` is what the update takes (`mmrl.update`): the kept `rows` of a
`RolloutResult` as micro-batches (by rows, or by tokens with `algo.micro_batch_tokens`),
planned into mini-batches, `minis`, each a list of (micro-batch index, loss scale)
(`mmrl.engine.batching`). Every rank runs as many micro-batches and optimizer steps as
the others (FSDP2's collectives): a rank short of rows repeats some with scale 0. Each
micro-batch carries the rollout rows it holds in `extras["rows"]`.

Single-turn rows join their prompts with their responses (`mmrl.engine.join`); the
rollout's own processed prompt batch is reused when the rows are exactly it, and a
sub-batch is processed again (media tensors cannot be sliced). Multi-turn rows
(`mmrl.rollout.agent`) are each trajectory's last context processed in one go with its
last policy turn joined after it; the loss mask covers exactly the tokens the policy
sampled. Where the actor shares media encoding (`mmrl.engine.media`), the samples of one
prompt encode its media once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmrl.adapter import ModelAdapter
from mmrl.config import AlgoConfig
from mmrl.engine import Engine, Sequences, join
from mmrl.engine.batching import even_out, update_plan
from mmrl.engine.media import SharedMedia, placeholder_tokens
from mmrl.parallel import Dist
from mmrl.processing import Processing
from mmrl.rollout.agent import Trajectory
from mmrl.rollout.base import RolloutResult, right_padded

# One mini-batch of the update: (index into the micro-batches, loss scale) per pass.
Mini = list[tuple[int, float]]


def training_batches(conversations: list | None, result: RolloutResult, rows: torch.Tensor, *, algo: AlgoConfig,
                     dist: Dist, processing: Processing, adapter: ModelAdapter,
                     actor: Engine) -> tuple[list[Sequences], list[Mini]]:
    """Training sequences of the kept `rows` of `result` (answering `conversations`; None
    for a multi-turn rollout) in micro-batches on the actor's device, and the mini-batches."""
    lengths = row_lengths(conversations, result, rows, processing) if algo.micro_batch_tokens else [0] * len(rows)
    # Every rank takes as many optimizer steps, and as many passes per step (FSDP2's
    # collectives), as the others: the fewest kept rows bound the mini-batches.
    mini_batches = min(algo.mini_batches, *(int(n) for n in dist.all_gather_objects(len(rows))))
    plan = update_plan(lengths, mini_batches=mini_batches, micro_batch_size=algo.micro_batch_size,
                       micro_batch_tokens=algo.micro_batch_tokens)
    if dist.distributed:
        counts = dist.all_gather_objects([len(mini) for mini in plan])
        plan = even_out(plan, [max(c) for c in zip(*counts)])
    parts = list(dict.fromkeys(micro.rows for mini in plan for micro in mini if micro.scale))
    index = {part: i for i, part in enumerate(parts)}
    minis = [[(index[micro.rows], micro.scale) for micro in mini] for mini in plan]
    chosen_rows = [rows[list(part)] for part in parts]
    share = actor.shares_media
    if result.trajectories is not None:
        pad = processing.tokenizer.pad_token_id
        # Samples of one prompt encode its opening media once (`shared_pieces`).
        batches = [trajectory_sequences([result.trajectories[i] for i in chosen.tolist()], processing, adapter,
                                        actor.model, pad, share=share)
                   for chosen in chosen_rows]
    else:
        owners = result.prompt_index.tolist()
        expanded = [conversations[i] for i in owners]
        # One micro-batch of every row: the rollout's own prompt batch is that batch.
        reuse = result.prompt_inputs if len(parts) == 1 and len(rows) == len(expanded) else None
        batches = [rollout_sequences([expanded[i] for i in chosen], result.response_ids[chosen],
                                     result.response_mask[chosen], processing, adapter, actor.model, share=share,
                                     prompts=reuse, owners=[owners[i] for i in chosen], media=result.shared_media,
                                     device=dist.device)
                   for chosen in chosen_rows]
    batches = [seqs.to(dist.device) for seqs in batches]
    for seqs, chosen in zip(batches, chosen_rows):
        seqs.extras["rows"] = chosen  # so values computed over the batch can be told back by row
    return batches, minis


def row_lengths(conversations: list | None, result: RolloutResult, rows: torch.Tensor,
                processing: Processing) -> list[int]:
    """Tokens (prompt + response) of each kept row, for micro-batches by token budget."""
    if result.trajectories is not None:
        return [len(result.trajectories[i].prompt_ids) + len(result.trajectories[i].last_ids)
                for i in rows.tolist()]
    responses = result.response_mask.sum(-1).long()
    if result.prompt_inputs is not None:
        prompts = result.prompt_inputs["attention_mask"].sum(-1).long().cpu()
    else:  # a backend that kept no processed batch: each prompt processed once
        per_prompt = processing(conversations)["attention_mask"].sum(-1).long()
        prompts = per_prompt[result.prompt_index]
    return (prompts[rows] + responses[rows]).tolist()


def rollout_sequences(conversations: list, ids: torch.Tensor, mask: torch.Tensor, processing: Processing,
                      adapter: ModelAdapter, model: torch.nn.Module, *, share: bool = False,
                      prompts: dict | None = None, owners: list[int] | None = None,
                      media: SharedMedia | None = None, device: torch.device | None = None) -> Sequences:
    """Training sequences of single-turn rows answering `conversations` (one per row).
    `prompts` is their processed batch where the caller has it. With `share` (pass the
    engine's `shares_media`), `owners` (the rows' prompt indices) lets repeated prompts
    share their media encoding, with their processed media taken from `media` (the
    rollout's) where it has them; `device` (where the rows will run): their media
    collated there from the prompts' (`SharedMedia.rows`)."""
    length = max(1, int(mask.sum(-1).max()))
    shared = None
    if owners and share:
        if media is not None:
            shared = (media if device is None else media.on(device)).select(owners)
        else:
            shared = SharedMedia.of(processing, conversations, owners)
    if prompts is None:
        prompts = (shared.rows(processing, conversations, device=device) if shared is not None
                   else dict(processing(conversations)))
    return join(prompts, ids[:, :length], mask[:, :length], adapter, model, processing.tokenizer.pad_token_id,
                shared=shared)


def trajectory_sequences(trajectories: Sequence[Trajectory], processing: Processing, adapter: ModelAdapter,
                         model: torch.nn.Module, pad_token_id: int, share: bool = False) -> Sequences:
    """Training sequences of whole trajectories: each row is its last context processed in
    one go (every image so far, the family's positions) with the last policy turn
    joined after it; the response columns cover everything after the opening prompt,
    and `response_mask` is 1 exactly on the tokens the policy sampled.

    Per-turn credit (`algo.credit_assignment: turn`) reads two extras: `turn` (N, R), the
    1-based policy turn of each sampled token (0 elsewhere), and `turn_rewards` (N, R),
    the environment's reward after each policy turn on that turn's last token.

    With `share` (pass the engine's `shares_media`), samples of one prompt encode its
    opening media once per batch and each its mid-conversation media alone
    (`shared_pieces`); where the pieces do not lay out the batch's media exactly, the
    batch carries no sharing and the engine runs the plain path."""
    prompts = dict(processing([t.context for t in trajectories]))
    shared = shared_pieces(trajectories, processing, prompts, model) if share else None
    width = prompts["input_ids"].shape[1]
    for row, t in enumerate(trajectories):
        got = prompts["input_ids"][row][prompts["attention_mask"][row].bool()].tolist()
        if got != t.prompt_ids:
            raise ValueError(f"trajectory {row}: processing its conversation again gave other tokens than the "
                             "rollout's (processing must be deterministic)")
    last, last_mask = right_padded([t.last_ids for t in trajectories], pad_token_id)
    last_width = last.shape[1]
    seqs = join(prompts, last, last_mask, adapter, model, pad_token_id, shared=shared)
    total = seqs.inputs["input_ids"].shape[1]
    span = last_width + max(len(t.prompt_ids) - t.first for t in trajectories)
    start = total - span
    mask = torch.zeros(len(trajectories), span)
    turn = torch.zeros(len(trajectories), span, dtype=torch.long)
    turn_rewards = torch.zeros(len(trajectories), span)
    for row, t in enumerate(trajectories):
        offset = width - len(t.prompt_ids) - start  # column of the row's token 0, in the response columns
        for index, (a, b) in enumerate(t.spans):
            mask[row, offset + a:offset + b] = 1
            turn[row, offset + a:offset + b] = index + 1
            if b > a and index < len(t.turn_rewards):
                turn_rewards[row, offset + b - 1] = t.turn_rewards[index]
    device = seqs.inputs["input_ids"].device
    seqs.response_ids = seqs.inputs["input_ids"][:, start:].clone()
    seqs.response_mask = mask.to(device)
    seqs.extras["turn"] = turn.to(device)
    seqs.extras["turn_rewards"] = turn_rewards.to(device)
    seqs.prompt_length = start
    return seqs


def _media_parts(message: dict) -> list[dict]:
    content = message.get("content")
    return [p for p in content if isinstance(p, dict) and p.get("type") in ("image", "video")] \
        if isinstance(content, list) else []


def shared_pieces(trajectories: Sequence[Trajectory], processing: Processing, batch: dict,
                  model: torch.nn.Module) -> SharedMedia | None:
    """The media sharing of a trajectory batch (`SharedMedia.of_pieces`): each row's media
    are its opening conversation's, shared by the samples of one prompt whose openings
    are equal, then those that arrived after it, its own; None where nothing repeats or
    the pieces do not lay out `batch` (each trajectory's context processed) exactly."""
    pieces, openings = [], []
    for row, t in enumerate(trajectories):
        opening = t.context[:t.opening]
        # Samples of one prompt share its opening unless their environment changed it.
        key = next((("opening", other) for other, (prompt, seen) in enumerate(openings)
                    if prompt == t.prompt and seen == opening), ("opening", row))
        openings.append((t.prompt, opening))
        later = [part for message in t.context[t.opening:] for part in _media_parts(message)]
        row_pieces = [(key, opening)]
        if later:
            row_pieces.append((("later", row), [{"role": "user", "content": later}]))
        pieces.append(row_pieces)
    # Only openings that hold media and repeat save anything: else process nothing more.
    shared_openings = [row[0][0] for row in pieces if any(_media_parts(m) for m in row[0][1])]
    if len(set(shared_openings)) == len(shared_openings):
        return None
    return SharedMedia.of_pieces(processing, pieces, batch, placeholder_tokens(model))


__all__ = ["Mini", "rollout_sequences", "row_lengths", "shared_pieces", "training_batches", "trajectory_sequences"]
