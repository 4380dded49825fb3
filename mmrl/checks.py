"""Numerical checks shared by the tests and the probes: each compares an optimized or
transformed path against the plain one on the same inputs and returns the difference.

    conversations = sample_conversations(adapter)           # two prompts, two image sizes
    padded_vs_single(built, conversations)                  # max |logit diff|
"""

from __future__ import annotations

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
    model = built.model.eval()
    batch = built.inputs(conversations)
    padded = logits_of(model, batch)
    mask = batch["attention_mask"].bool()
    packed = logits_of(model, pack(batch))
    return (padded[mask] - packed[0]).abs().max().item()


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
