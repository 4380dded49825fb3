"""Gemma 3 input processing (text and vision): turn-end stop token and the tiny
offline tokenizer and processor that match the real Gemma 3 special tokens.

An image part renders as `<start_of_image>`; `Gemma3Processor` expands it into
`<start_of_image>` + `image_seq_length` x `<image_soft_token>` + `<end_of_image>` and
returns `token_type_ids` (1 on soft tokens), which the model needs for the
bidirectional attention inside each image.
"""

from __future__ import annotations

from mmrl.processing import Processing
from mmrl.processors.templates import GEMMA3, GEMMA3_SPECIAL_TOKENS
from mmrl.tiny import char_tokenizer

# Tokenizer attributes Gemma3Processor reads (tokenizer.boi_token, .image_token_id, ...).
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


class Gemma3Processing(Processing):
    """Gemma's tokenizer eos is `<eos>`, but an instruction-tuned Gemma ends its turn
    with `<end_of_turn>` (generation_config lists both): stop on either."""

    extra_stop_tokens = ("<end_of_turn>",)


NEWLINE_RUNS = ("\n\n\n\n", "\n\n\n", "\n\n")


def tiny_tokenizer():
    """A character-level tokenizer with Gemma 3's special tokens, images included (the
    real text-only checkpoints carry them too). Runs of 2-4 newlines are one token each, as
    in the real vocabulary: the processor wraps every image in "\n\n", and vLLM merges
    newline tokens around images by those ids."""
    return char_tokenizer(
        special_tokens=GEMMA3_SPECIAL_TOKENS, named_tokens=IMAGE_TOKENS,
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", chat_template=GEMMA3, words=NEWLINE_RUNS,
    )


def tiny_processor(tokenizer, image_size: int, image_seq_length: int):
    """A `Gemma3Processor` that resizes every image to `image_size` squared (no pan and
    scan) and gives it `image_seq_length` soft tokens."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    image_processor = Gemma3ImageProcessor(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        do_pan_and_scan=False,
    )
    return Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3,
        image_seq_length=image_seq_length,
    )
