"""Input and output processing: conversational samples <-> batched model inputs.

A sample is a list of chat messages; a message's content is a string or a list of
parts `{"type": "text", "text": ...}`, `{"type": "image", "image": ...}` or
`{"type": "video", "video": ...}`. Images may be PIL images, file paths or bytes (or
a HF datasets `{"bytes", "path"}` dict); videos are lists of frames (families with a
video reader also take file paths) and become `Clip`s with their frame metadata.

`Processing` works for any HF tokenizer or processor with a chat template; a family
subclasses it (in `mmrl.processors`) only for what differs: the pixel-budget keyword
arguments, video files, extra model inputs.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Message = dict[str, Any]
Conversation = list[Message]


def text_aligned(key: str, value, batch: dict) -> bool:
    """Whether a batch entry runs along the token sequence ((B, S) like `input_ids`)."""
    ids = batch.get("input_ids")
    return key == "input_ids" or (ids is not None and isinstance(value, torch.Tensor) and value.dim() == 2
                                  and value.shape == ids.shape)


def _align_to_tokens(batch) -> None:
    """Move per-token entries a processor laid out from each row's first slot, whatever
    the padding (a mask of where image embeddings go that one processor builds for an
    unpadded row), onto the row's real tokens. An entry is moved only where it holds values in padding slots
    and nothing past the row's length, so correctly padded entries stay as they are."""
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or bool(mask.all()):
        return
    real = mask.bool()
    for key in list(batch):
        value = batch[key]
        if (key in ("input_ids", "attention_mask") or key.endswith(("_input_ids", "_attention_mask"))
                or not text_aligned(key, value, batch) or value.is_floating_point()):
            continue
        rows = []
        for row, keep in zip(value, real):
            count = int(keep.sum())
            if not row[~keep].any() or row[count:].any():
                rows.append(row)
                continue
            aligned = torch.zeros_like(row)
            aligned[keep] = row[:count]
            rows.append(aligned)
        batch[key] = torch.stack(rows)


def batch_differences(batch: dict, reference: dict) -> list[str]:
    """Keys where `batch` differs from `reference` (missing, other shape or other values
    once cast to the reference's dtype and device); empty when they hold the same tensors."""
    differ = [k for k in reference if k not in batch or batch[k].shape != reference[k].shape
              or not torch.equal(batch[k].to(device=reference[k].device, dtype=reference[k].dtype), reference[k])]
    return differ + sorted(set(batch) - set(reference))


def media_kinds(conversation: Conversation) -> set[str]:
    """The media part types ("image", "video") a conversation holds, without loading them."""
    return {p.get("type") for m in conversation for p in _parts(m)} & {"image", "video"}


def stack_media(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Media tensors of several batches as one processor call lays them out: joined along
    the first dimension, the others zero-padded to the largest (tiles, patches or images
    per row; the models drop all-zero padding, as they do the processor's own)."""
    if all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        return torch.cat(tensors)
    dims = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        gap = [x for d in reversed(range(1, t.dim())) for x in (0, dims[d - 1] - t.shape[d])]
        padded.append(torch.nn.functional.pad(t, gap))
    return torch.cat(padded)


def load_image(source) -> Any:
    """A PIL RGB image from a PIL image, a path, bytes or a `{"bytes"|"path"}` dict."""
    from PIL import Image

    if isinstance(source, Image.Image):
        if source.mode == "RGB":
            # The image itself, not a copy: a processor does not change it, and a copy
            # would be a new object each time (a multi-turn session knows an image's
            # content by its object: `mmrl.rollout.sessions`).
            return source
        image = source
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"image file not found: {path}")
        image = Image.open(path)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        image = Image.open(io.BytesIO(bytes(source)))
    elif isinstance(source, dict) and (source.get("bytes") or source.get("path")):
        return load_image(source.get("bytes") or source["path"])
    else:
        raise TypeError(f"cannot read an image from {type(source).__name__}")
    return image.convert("RGB")


def _video_processor_takes(processor, argument: str) -> bool:
    """Whether `processor`'s video processor declares `argument` among its call's arguments."""
    valid = getattr(getattr(processor, "video_processor", None), "valid_kwargs", None)
    return argument in getattr(valid, "__annotations__", {})


@dataclass
class Clip:
    """A video's frames (PIL images or an array) and, when known, the HF `VideoMetadata`
    saying which frames of how many, at what fps, they are; processors that place frames
    in time (timestamps, temporal positions) read it."""

    frames: Any
    metadata: Any = None


def _parts(message: Message) -> list[dict[str, Any]]:
    content = message.get("content", "")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


class Processing:
    """Conversations -> left-padded prompt batches; token ids -> text.

    Options: `min_pixels` / `max_pixels` bound each image's pixel count (families map
    them onto their processor's arguments in `image_kwargs`); `video_fps` and
    `max_frames` bound videos.
    """

    padding_side = "left"

    def __init__(
        self,
        processor,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_fps: float = 2.0,
        max_frames: int = 16,
        stop_token_ids: list[int] | None = None,
    ):
        self.processor = processor
        # End-of-turn ids of the checkpoint's generation config (often more than the
        # tokenizer's eos: a chat model ends its turn with its own token).
        self.extra_stop_ids = list(stop_token_ids or [])
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.video_fps = video_fps
        self.max_frames = max_frames
        self.is_multimodal = self.tokenizer is not processor
        # Whether `collate` has matched processing on this processor (None: not checked yet).
        self.collate_matches: bool | None = None

    # -- media ---------------------------------------------------------------------------
    def load_video(self, source) -> Clip:
        """A video as a `Clip`. The generic reader takes a list of frames, `video_fps`
        apart, keeping at most `max_frames` evenly spaced ones; families that can decode
        files override this."""
        if isinstance(source, (list, tuple)):
            from transformers.video_utils import VideoMetadata

            step = max(1.0, len(source) / self.max_frames)
            indices = [int(i * step) for i in range(min(len(source), self.max_frames))]
            metadata = VideoMetadata(total_num_frames=len(source), fps=self.video_fps, frames_indices=indices)
            return Clip([load_image(source[i]) for i in indices], metadata)
        raise TypeError(
            f"{type(self).__name__} reads videos given as lists of frames, not {type(source).__name__}"
        )

    def collect_media(self, conversation: Conversation) -> tuple[list[Any], list[Any]]:
        images, videos = [], []
        for message in conversation:
            for part in _parts(message):
                kind = part.get("type")
                if kind == "image":
                    images.append(load_image(part.get("image", part.get("path"))))
                elif kind == "video":
                    videos.append(self.load_video(part.get("video", part.get("path"))))
        return images, videos

    def image_kwargs(self) -> dict[str, Any]:
        """Image-processor arguments that apply the pixel budget for this family."""
        return {}

    def processor_with_budget(self):
        """The processor with this pixel budget as its own defaults (`image_kwargs` set
        on a copy of its image processor), so the processor saved from it, loaded by
        plain transformers, makes the image tokens training made. A budget applied
        outside the processor (llava_onevision rescales images first) is not held by
        this; the export checks the result (`mmrl.export.budget_problem`) and warns."""
        kwargs = self.image_kwargs()
        image_processor = getattr(self.processor, "image_processor", None)
        if not kwargs or image_processor is None:
            return self.processor
        processor = copy.deepcopy(self.processor)
        image_processor = processor.image_processor
        for key, value in kwargs.items():
            current = getattr(image_processor, key, None)
            if isinstance(value, dict) and current is not None and not isinstance(current, dict):
                value = type(current)(**value)  # transformers' SizeDict where the processor keeps one
            setattr(image_processor, key, value)
        return processor

    def video_kwargs(self) -> dict[str, Any]:
        """Video-processor arguments (the clips' metadata is added to these)."""
        return {}

    def text_kwargs(self) -> dict[str, Any]:
        """Extra tokenizer-side arguments of this family's processor."""
        return {}

    # -- text ------------------------------------------------------------------------------
    def render(self, conversation: Conversation, add_generation_prompt: bool = True) -> str:
        """The chat-template text, with one placeholder per image/video part."""
        stripped = [
            {
                "role": m["role"],
                "content": [
                    {"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})}
                    for p in _parts(m)
                ],
            }
            for m in conversation
        ]
        if not self.is_multimodal:
            # Text tokenizers' templates usually expect string content.
            stripped = [
                {"role": m["role"], "content": "".join(p.get("text", "") for p in m["content"])}
                for m in stripped
            ]
        kwargs = self.template_kwargs()
        tokenizer = getattr(self.processor, "tokenizer", None)
        if getattr(self.processor, "chat_template", None) is None and getattr(tokenizer, "chat_template", None):
            # Processor classes that keep no template of their own (it is not saved with
            # them) render with their tokenizer's.
            kwargs.setdefault("chat_template", tokenizer.chat_template)
        return self.processor.apply_chat_template(
            stripped, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def template_kwargs(self) -> dict[str, Any]:
        """Extra arguments of the processor's `apply_chat_template` (none by default)."""
        return {}

    def __call__(self, conversations: list[Conversation], add_generation_prompt: bool = True):
        """Batch of prompts (left-padded), ready for `generate` or a forward pass."""
        if not conversations:
            raise ValueError("no conversations to process")
        texts = [self.render(c, add_generation_prompt) for c in conversations]
        if not self.is_multimodal:
            return self.tokenizer(
                texts, padding=True, padding_side=self.padding_side, return_tensors="pt",
                add_special_tokens=False,
            )
        return self.process_texts(texts, [self.collect_media(c) for c in conversations])

    def process_texts(self, texts: list[str], media: list[tuple[list[Any], list[Any]]]):
        """Rendered texts (`render`: one placeholder per image/video part) with each one's
        media (`collect_media`: images, videos), processed as `__call__` processes the
        conversations they were rendered from; a multimodal processor's only."""
        images = [m[0] for m in media]
        videos = [m[1] for m in media]
        kwargs: dict[str, Any] = self.text_kwargs()
        if any(images):
            kwargs["images"] = self.arrange_images(images)
            kwargs["images_kwargs"] = self.image_kwargs()
        if any(videos):
            kwargs["videos"] = self.arrange_videos([[clip.frames for clip in clips] for clips in videos])
            video_kwargs = self.video_kwargs()
            clips = [clip for per_sample in videos for clip in per_sample]
            if all(clip.metadata is not None for clip in clips):
                # The frames are already sampled: the processor must not sample again.
                video_kwargs.update(video_metadata=[clip.metadata for clip in clips], do_sample_frames=False)
                if _video_processor_takes(self.processor, "return_metadata"):
                    # Processors that place frames in time read the metadata back from their
                    # video processor's output, which holds it only when asked.
                    video_kwargs.setdefault("return_metadata", True)
            kwargs["videos_kwargs"] = video_kwargs
        batch = self.processor(
            text=texts, padding=True, padding_side=self.padding_side, return_tensors="pt",
            add_special_tokens=False, **kwargs,
        )
        # Labels some processors add for their own fine-tuning recipe are not inputs here:
        # the trainer scores responses itself.
        batch.pop("labels", None)
        batch.pop("video_metadata", None)  # asked for above, for the processor: not a model input
        # A second text encoder's inputs (`qformer_input_ids` beside `input_ids`) are padded
        # on the right whatever the decoder's side: such encoders number positions from the
        # first slot, so left padding would shift every prompt's positions.
        for key in [k for k in batch if k.endswith("_input_ids") and k != "input_ids"]:
            mask_key = key.removesuffix("input_ids") + "attention_mask"
            if isinstance(batch.get(mask_key), torch.Tensor) and batch[mask_key].dim() == 2:
                order = torch.sort((batch[mask_key] == 0).int(), dim=1, stable=True).indices
                batch[key], batch[mask_key] = batch[key].gather(1, order), batch[mask_key].gather(1, order)
        _align_to_tokens(batch)
        # Media in float32 whatever precision a processor hands out (some emit bfloat16
        # pixels): the model, or autocast, decides the compute precision.
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
                batch[key] = value.float()
        return batch

    def collate(self, batches: list[dict]) -> dict[str, torch.Tensor]:
        """One batch from batches of one prompt each, equal to processing those prompts
        together (checked for every zoo VLM by the media_sharing probe): sequence entries
        padded on the padding side (`input_ids` with the pad id, the rest with zeros),
        media tensors stacked (`stack_media`). Every batch must hold the same keys."""
        keys = set(batches[0])
        if any(set(b) != keys for b in batches):
            raise ValueError("cannot collate batches with different keys (some prompts have media others lack)")
        length = max(b["input_ids"].shape[1] for b in batches)
        left = self.padding_side == "left"
        out = {}
        for key in batches[0]:
            values = [b[key] for b in batches]
            if text_aligned(key, values[0], batches[0]):
                fill = self.tokenizer.pad_token_id if key == "input_ids" else 0
                out[key] = torch.cat([torch.nn.functional.pad(
                    v, (length - v.shape[1], 0) if left else (0, length - v.shape[1]), value=fill) for v in values])
            else:
                out[key] = stack_media(values)
        return out

    def collate_rows(self, batches: list[dict], conversations: list[Conversation]) -> dict[str, torch.Tensor]:
        """The batch of `conversations`, collated from `batches` (each row's prompt
        processed alone; rows that repeat a prompt share its batch object). The first time
        rows of two or more prompts come, collating is checked against processing one row of
        each prompt together; if they differ (a processor whose batch layout `collate` does
        not know), this warns once and processes rows from then on. A GRPO batch repeats each
        prompt n times, and the repeats hold no layout the check could see (the same lengths
        and media sizes): processing them all would cost n times as much."""
        if self.collate_matches is False:
            return dict(self(conversations))
        collated = self.collate(batches)
        prompts: dict[int, int] = {}  # each prompt's batch -> its first row
        for row, batch in enumerate(batches):
            prompts.setdefault(id(batch), row)
        first = list(prompts.values())
        if self.collate_matches is None and len(first) > 1:
            distinct = collated if len(first) == len(batches) else self.collate([batches[row] for row in first])
            self.collate_matches = not batch_differences(distinct, dict(self([conversations[row] for row in first])))
            if not self.collate_matches:
                import warnings

                warnings.warn(f"{type(self).__name__}: rows collated from each prompt's batch differ from processing "
                              "them; processing every row instead (set the family's media_sharing to False)",
                              stacklevel=2)
                return dict(self(conversations))
        return collated

    def arrange_images(self, images: list[list[Any]]) -> list[Any]:
        """Images as the HF processor wants them: one list per sample by default."""
        return images

    def arrange_videos(self, videos: list[list[Any]]) -> list[Any]:
        """Videos (frame lists, one list of them per sample) as the HF processor wants
        them: one flat list by default."""
        return [video for per_sample in videos for video in per_sample]

    # -- output ----------------------------------------------------------------------------
    def decode(self, token_ids, skip_special_tokens: bool = True) -> list[str]:
        """Decode each row of response ids; special tokens and surrounding space dropped."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        pad = self.tokenizer.pad_token_id
        rows = [[t for t in row if t != pad] for row in token_ids]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)
        return [t.strip() for t in texts]

    @property
    def stop_token_ids(self) -> list[int]:
        ids = self.tokenizer.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        ids += [i for i in self.extra_stop_ids if i not in ids]
        for token in getattr(self, "extra_stop_tokens", ()):
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return ids

    @property
    def blocked_token_ids(self) -> list[int]:
        """Special tokens a policy must never sample (image/video placeholders, pad,
        chat scaffolding): sampling one breaks the next multimodal forward pass."""
        special = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        special |= set(self.tokenizer.all_special_ids)
        return sorted(special - set(self.stop_token_ids))
