"""How many tokens an image or a clip expands into, measured, for processors that do not say.

vLLM serves a model it has no class of its own for through its Transformers backend, which
asks the processor how many placeholder tokens an image or a clip of a given size expands
into (`_get_num_multimodal_tokens(image_sizes=..., video_sizes=...)`): to size its encoder
cache and its dummy inputs, and to split an image batch's rows among its images. Many
transformers processors do not define that method, and vLLM then fails to start.

    give_measured_counts(type(processor))   # before vLLM loads the processor

gives such a class a method that measures instead: it runs the processor on a blank image
(or clip) of each size, the way vLLM calls it (`processor(text=placeholder, images=[...])`),
and counts the tokens its placeholder was replaced by (found by the processor's own
replacement offsets, as vLLM finds them) and the rows of image data it produced. A class
that defines the method keeps its own. Each size is measured once per processor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.errors import one_line

# The attribute vLLM's Transformers backend calls (transformers' name for it).
COUNTS_METHOD = "_get_num_multimodal_tokens"
# The processor's outputs that hold an image's rows, in the order vLLM looks for them.
_IMAGE_ROWS = ("pixel_values", "image_patches")


def give_measured_counts(processor_class: type) -> bool:
    """Give `processor_class` the measured counts unless it counts itself; True if it got them."""
    if hasattr(processor_class, COUNTS_METHOD):
        return False
    setattr(processor_class, COUNTS_METHOD, measured_counts)
    return True


def measured_counts(processor, image_sizes=None, video_sizes=None, audio_lengths=None, **kwargs):
    """transformers' `MultiModalData` for images of `image_sizes` ((height, width) each) and
    clips of `video_sizes` ((frames, height, width) each), measured on `processor`.

    A processor that cannot process a clip says so as transformers' processors do, with an
    AttributeError: vLLM then serves the model without video."""
    from transformers.processing_utils import MultiModalData

    data: dict[str, Any] = {}
    if image_sizes is not None:
        counts = [_measure(processor, "image", tuple(int(s) for s in size), kwargs) for size in image_sizes]
        data["num_image_tokens"] = [tokens for tokens, _ in counts]
        data["num_image_patches"] = [rows for _, rows in counts]
    if video_sizes is not None:
        try:
            data["num_video_tokens"] = [_measure(processor, "video", tuple(int(s) for s in size), kwargs)[0]
                                        for size in video_sizes]
        except Exception as exc:  # noqa: BLE001 - any failure means: cannot count clips
            raise AttributeError(f"{type(processor).__name__} cannot process a blank clip to count its "
                                 f"tokens: {one_line(exc, typed=True)}") from exc
    return MultiModalData(**data)


def _measure(processor, kind: str, size: tuple[int, ...], kwargs: dict) -> tuple[int, int]:
    """(tokens the placeholder expands into, rows of data) for one blank item of `size`."""
    cache = processor.__dict__.setdefault("_mmrl_measured_counts", {})
    key = (kind, size, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    if key not in cache:
        cache[key] = _run(processor, kind, size, kwargs)
    return cache[key]


def _run(processor, kind: str, size: tuple[int, ...], kwargs: dict) -> tuple[int, int]:
    placeholder = getattr(processor, f"{kind}_token", None)
    placeholder = getattr(placeholder, "content", placeholder)  # a tokenizers AddedToken
    if not placeholder:
        raise AttributeError(f"{type(processor).__name__} has no {kind}_token to measure its {kind}s by")
    if kind == "image":
        from PIL import Image

        height, width = size
        media = {"images": [Image.new("RGB", (width, height))]}
    else:
        frames, height, width = size
        media = {"videos": [np.zeros((frames, height, width, 3), dtype=np.uint8)]}
        video_processor = getattr(processor, "video_processor", None)
        if getattr(video_processor, "do_sample_frames", False):
            kwargs = {**kwargs, "do_sample_frames": False}  # the frames given are the clip
    kwargs = {"return_tensors": "pt", **kwargs}  # as vLLM calls it: one tensor of rows
    out = processor(text=[placeholder], **media, return_text_replacement_offsets=True, **kwargs)
    replaced = [entry for entry in (out.get("text_replacement_offsets") or [[]])[0] if entry["type"] == kind]
    if len(replaced) != 1:
        # vLLM's Transformers backend finds each item's placeholder by these offsets too.
        raise ValueError(f"{type(processor).__name__} reports {len(replaced)} replaced {kind} placeholders for a "
                         f"prompt of one {kind} (its __call__ does not return transformers' text replacement "
                         f"offsets), so vLLM's Transformers backend cannot place its {kind}s")
    # All the tokens the placeholder became, its framing markers included, as most processors
    # that count count them: at least the tokens holding embeddings, which is what vLLM sizes
    # its encoder cache by (an over-count only reserves more).
    tokens = len(processor.tokenizer(replaced[0]["replacement"], add_special_tokens=False)["input_ids"])
    shape = _rows_shape(out)
    if not shape:
        return tokens, 1
    if len(shape) > 4 and shape[0] == 1:
        # A leading dimension of one holds either the prompt (its images' rows one further in,
        # as some processors return a batch of prompts) or the image (its crops one further in): two
        # images in one prompt tell which.
        two = processor(text=[placeholder * 2], **{name: items * 2 for name, items in media.items()}, **kwargs)
        if _rows_shape(two)[0] == 1:
            return tokens, int(shape[1])
    return tokens, int(shape[0])


def _rows_shape(out) -> tuple[int, ...]:
    rows = next((out[key] for key in _IMAGE_ROWS if out.get(key) is not None), None)
    return tuple(getattr(rows, "shape", ()))
