"""Numerical checks shared by the tests and the probes: each compares an optimized or
transformed path against the plain one on the same inputs and returns the difference.

    conversations = sample_conversations(adapter)           # two prompts, two image sizes
    padded_vs_single(built, conversations)                  # max |logit diff|
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.adapter import ModelAdapter
from mmrl.positions import pack


def sample_images(sizes=((56, 56), (84, 112))) -> list:
    """Deterministic RGB test images (a coloured shape on a plain ground), one per size."""
    from PIL import Image, ImageDraw

    images = []
    for i, (width, height) in enumerate(sizes):
        image = Image.new("RGB", (width, height), (240, 240 - 40 * i, 200))
        draw = ImageDraw.Draw(image)
        draw.ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=(200, 30 * i, 40))
        images.append(image)
    return images


def sample_video(frames: int = 4, size=(56, 56)) -> list:
    """A short synthetic clip: a square moving left to right."""
    from PIL import Image, ImageDraw

    clip = []
    for t in range(frames):
        frame = Image.new("RGB", size, (20, 20, 20))
        x = 4 + t * (size[0] - 24) // max(frames - 1, 1)
        ImageDraw.Draw(frame).rectangle((x, 16, x + 20, 36), fill=(250, 250, 0))
        clip.append(frame)
    return clip


def sample_conversations(adapter: ModelAdapter, images_per_prompt: int = 1) -> list[list[dict]]:
    """Two prompts of different lengths; for image models each carries images of a
    different size, so one batch mixes image sizes and needs padding."""
    prompts = ["What is shown here?", "Count the shapes in the picture and answer with a number."]
    if "image" not in adapter.modalities:
        return [[{"role": "user", "content": p}] for p in prompts]
    images = sample_images()
    conversations = []
    for i, prompt in enumerate(prompts):
        content = [{"type": "image", "image": images[(i + k) % len(images)]} for k in range(images_per_prompt)]
        conversations.append([{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}])
    return conversations


def video_conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": [
        {"type": "video", "video": sample_video()}, {"type": "text", "text": "What moves?"}]}]]


def model_inputs(batch: dict) -> dict:
    """Forward arguments: keys the model does not take dropped, and no KV cache (with a
    cache, transformers skips the packed-sequence mask)."""
    return {**{k: v for k, v in batch.items() if k not in ("cu_seqlens",)}, "use_cache": False}


@torch.no_grad()
def logits_of(model, batch: dict) -> torch.Tensor:
    return model(**model_inputs(batch)).logits.float()


@torch.no_grad()
def padded_vs_single(built, conversations) -> float:
    """Max |logit difference| between each prompt run alone (the model computing its
    own positions) and the same prompt inside a batch in the layout the engine gives the
    family: left-padded with the adapter's position ids or, where the family cannot take
    left padding (`ModelAdapter.left_padding`), one sequence a row from the first column
    (`mmrl.engine.packing.pack_sequences`, as the engine runs it)."""
    from mmrl.engine.packing import pack_sequences

    model = built.model.eval()
    batch = built.inputs(conversations)
    mask = batch["attention_mask"].bool()
    if built.adapter.left_padding:
        batched = logits_of(model, batch)
        rows = [batched[i][mask[i]] for i in range(len(conversations))]
    else:
        packed = pack_sequences(batch, mask[:, :0], row_tokens=1, pad_token_id=built.tokenizer.pad_token_id or 0)
        batched = logits_of(model, packed.inputs)
        rows = [batched[i][:n] for i, n in enumerate(mask.sum(-1).tolist())]
    worst = 0.0
    for row, conversation in zip(rows, conversations):
        alone = logits_of(model, dict(built.processing([conversation])))[0]
        worst = max(worst, (row - alone).abs().max().item())
    return worst


@torch.no_grad()
def packed_vs_padded(built, conversations) -> float:
    """Max |logit difference| between the padded batch and the same batch packed into
    one row without padding (positions restart per sequence)."""
    from mmrl.engine import stateful_layers  # a higher layer (docs/architecture.md)

    model = built.model.eval()
    stateful_layers.install(model, built.adapter)
    batch = built.inputs(conversations)
    padded = logits_of(model, batch)
    mask = batch["attention_mask"].bool()
    packed_batch = pack(batch)
    if stateful_layers.installed(model):
        packed_batch[stateful_layers.SEQUENCE_INDEX] = stateful_layers.sequence_index(
            packed_batch["cu_seqlens"], packed_batch["input_ids"].shape[1])
    packed = logits_of(model, packed_batch)
    return (padded[mask] - packed[0]).abs().max().item()


# A packed sample against itself alone, in fp32 (`packed_boundary_gap`). Every zoo family
# is within 1e-6 in log-prob and 1.3e-6 in the last hidden state on CPU. A leak is far
# larger in the hidden state than in the log-probs, which a tiny random-init head shrinks:
# a scaffolded hybrid family with short convolutions (window 4) differs by 1.4e-5 in
# log-prob but 9.4e-3 in the hidden state, under the 2e-4 of the padded comparisons.
BOUNDARY_TOLERANCE = 1e-5
BOUNDARY_HIDDEN_TOLERANCE = 1e-4

# The long neighbour's prompt: long enough to fill a state (several 64-token chunks of a
# chunked linear-attention kernel, far past any short convolution's window).
_LONG_NEIGHBOUR = " ".join(["The river bends past the old mill, where the water runs slow and green."] * 12)


def boundary_conversations(adapter: ModelAdapter) -> list[list[dict]]:
    """A long conversation, then a short one: packed, the short sample starts right where
    its long neighbour ends, so any state a layer carries over reaches it at once."""
    long, short = sample_conversations(adapter)
    if "image" in adapter.modalities:
        long = [{"role": "user", "content": [*long[0]["content"][:-1], {"type": "text", "text": _LONG_NEIGHBOUR}]}]
    else:
        long = [{"role": "user", "content": _LONG_NEIGHBOUR}]
    return [long, short]


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(n, V) logits and the n tokens they ran on: the log-prob of each next token (n - 1,)."""
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, tokens[1:, None])[:, 0]


@dataclass(frozen=True)
class BoundaryGap:
    """How far packed samples are from themselves alone: the largest |log-prob| and
    |last hidden state| differences."""

    logprob: float
    hidden: float

    @property
    def exact(self) -> bool:
        return self.logprob < BOUNDARY_TOLERANCE and self.hidden < BOUNDARY_HIDDEN_TOLERANCE

    def __str__(self) -> str:
        return (f"log-prob {self.logprob:.1e} (tolerance {BOUNDARY_TOLERANCE:.0e}), last hidden state "
                f"{self.hidden:.1e} (tolerance {BOUNDARY_HIDDEN_TOLERANCE:.0e})")


def _forward(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model(**model_inputs(inputs), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float() if out.hidden_states else None
    return out.logits[0].float(), hidden


@torch.no_grad()
def packed_boundary_gap(built, conversations=None) -> BoundaryGap:
    """Each sample packed in one row behind its neighbour (`boundary_conversations`: a
    short sample right after a long one), as the engine packs
    (`mmrl.engine.packing.pack_sequences`), against the same sample run alone: per sample,
    the log-prob of every token and the last hidden state. A layer whose state (a
    convolution's window, a linear-attention or recurrent state) crosses the boundary
    fails it, unless the engine runs it per sequence (`mmrl.engine.stateful_layers`)."""
    from mmrl.engine import stateful_layers
    from mmrl.engine.packing import pack_sequences

    model = built.model.eval()
    stateful_layers.install(model, built.adapter)  # as the engine does where it packs
    conversations = conversations or boundary_conversations(built.adapter)
    batch = built.inputs(conversations)
    mask = batch["attention_mask"].bool()
    packed = pack_sequences(batch, mask[:, :0], row_tokens=int(mask.sum()),
                            pad_token_id=built.tokenizer.pad_token_id or 0)
    row_logits, row_hidden = _forward(model, stateful_layers.packed_inputs(model, packed))
    tokens = packed.inputs["input_ids"][0]
    logprob = hidden = 0.0
    start = 0
    for conversation, length in zip(conversations, mask.sum(-1).tolist()):
        alone = dict(built.processing([conversation]))
        alone_logits, alone_hidden = _forward(model, alone)
        here = slice(start, start + length)
        gap = _token_logprobs(row_logits[here], tokens[here]) - _token_logprobs(alone_logits, alone["input_ids"][0])
        logprob = max(logprob, gap.abs().max().item())
        if row_hidden is not None and alone_hidden is not None:
            hidden = max(hidden, (row_hidden[here] - alone_hidden).abs().max().item())
        start += length
    return BoundaryGap(logprob, hidden)


def loss_and_backward(built, conversations) -> torch.Tensor:
    """Language-model loss on a processor-made batch (prompt tokens as labels), backward."""
    model = built.model.train()
    batch = built.inputs(conversations, add_generation_prompt=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    special = torch.tensor(built.processing.blocked_token_ids, dtype=labels.dtype)
    labels = labels.masked_fill(torch.isin(labels, special), -100)
    loss = model(**model_inputs(batch), labels=labels).loss
    loss.backward()
    return loss.detach()


def tower_learns(built) -> bool:
    """After a backward pass: whether a parameter of the vision part got a gradient (True
    where the adapter names no vision part: nothing to check)."""
    from mmrl.parts import parameters_by_part

    tower = parameters_by_part(built.model, built.adapter).get("vision", [])
    return not tower or any(p.grad is not None and bool(p.grad.abs().sum() > 0) for _, p in tower)


def checkpointing_difference(built, conversations) -> dict:
    """Loss and gradients with activation checkpointing against without, on the same
    batch. Turns checkpointing on for `built.model`. Returns the loss gap, the worst
    gradient gap, whether the same parameters got gradients, and whether it turned on."""

    def loss_and_grads():
        built.model.zero_grad(set_to_none=True)
        loss = loss_and_backward(built, conversations)
        return loss, {n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None}

    plain_loss, plain_grads = loss_and_grads()
    built.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt_loss, ckpt_grads = loss_and_grads()
    same = plain_grads.keys() == ckpt_grads.keys()
    worst = max(((g - ckpt_grads[n]).abs().max().item() for n, g in plain_grads.items()), default=0.0) if same \
        else float("inf")
    return {"loss_diff": (plain_loss - ckpt_loss).abs().item(), "max_grad_diff": worst, "same_parameters": same,
            "enabled": bool(built.model.is_gradient_checkpointing), "tensors": len(plain_grads)}


@torch.no_grad()
def generate(built, conversations, max_new_tokens: int = 8) -> torch.Tensor:
    """Greedy generation of exactly `max_new_tokens` tokens; returns the new tokens."""
    model = built.model.eval()
    batch = dict(built.processing(conversations))
    blocked = built.processing.blocked_token_ids
    out = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        bad_words_ids=[[t] for t in blocked] or None,
        pad_token_id=built.tokenizer.pad_token_id,
    )
    return out[:, batch["input_ids"].shape[1]:]


@torch.no_grad()
def lora_merge_difference(built, conversations, scope: str) -> tuple[float, float]:
    """(|unmerged - merged| max, |unmerged - base| max) logits for a LoRA of `scope`
    with random (non-zero) adapter weights. The second number shows LoRA had effect.
    The merge changes the weights: `built.model` is the merged model afterwards."""
    from mmrl.lora import apply_lora, merge_lora

    model = built.model.eval()
    batch = built.inputs(conversations)
    base = logits_of(model, batch)
    torch.manual_seed(0)
    peft_model = apply_lora(model, scope=scope, rank=4, init_lora_weights=False, adapter=built.adapter).eval()
    unmerged = logits_of(peft_model, batch)
    merged_model = merge_lora(peft_model).eval()
    merged = logits_of(merged_model, batch)
    built.model = merged_model
    return (unmerged - merged).abs().max().item(), (unmerged - base).abs().max().item()
