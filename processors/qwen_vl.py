"""Qwen-VL input processing, shared by Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

- `QwenVLProcessing`: the pixel budget, videos as frame lists or files, per-video
  metadata (the sampled frames' indices and fps: Qwen2.5-VL turns it into
  `second_per_grid_ts`, Qwen3-VL into timestamp text), `mm_token_type_ids`, and
  `<|im_end|>` as a stop token.
- `mrope_position_ids`: multimodal rope positions of a padded batch, with a leading
  text-position row so a packed batch still shows its sequence boundaries.
- `tiny_processor` and the chat templates: an offline processor for random-init models.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from mmrl.adapter import import_object
from mmrl.positions import sequential_positions
from mmrl.processing import Clip, Processing
from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS
from mmrl.tiny import char_tokenizer

TEXT, IMAGE, VIDEO = 0, 1, 2  # the values of `mm_token_type_ids`

# Tokenizer attributes the Qwen-VL processors read (`tokenizer.image_token`, ...).
QWEN_VL_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}

# Qwen3-VL renders ChatML with vision placeholders and no default system turn, which is
# `CHATML`; Qwen2-VL and Qwen2.5-VL add a system turn when the conversation has none.
QWEN3_VL_TEMPLATE = CHATML
QWEN2_VL_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}" + CHATML
)


class QwenVLProcessing(Processing):
    """Conversations -> Qwen-VL batches (`input_ids`, `pixel_values`, `image_grid_thw`,
    `pixel_values_videos`, `video_grid_thw`, `mm_token_type_ids`, ...).

    `video_fps` is the rate of frames given as a list, and the rate at which video
    files are sampled (qwen-vl-utils' rule); `max_frames` caps both.
    """

    extra_stop_tokens = ("<|im_end|>",)

    def image_kwargs(self) -> dict[str, Any]:
        if self.min_pixels is None and self.max_pixels is None:
            return {}
        size = self.processor.image_processor.size
        return {"size": {
            "shortest_edge": self.min_pixels if self.min_pixels is not None else size.shortest_edge,
            "longest_edge": self.max_pixels if self.max_pixels is not None else size.longest_edge,
        }}

    def load_video(self, source) -> Clip:
        """A `Clip` from a list of frames (taken to be `video_fps` apart) or a file."""
        if isinstance(source, (str, Path)):
            return self.read_video_file(Path(source))
        return super().load_video(source)

    def read_video_file(self, path: Path) -> Clip:
        """Decode with PyAV, keeping the frames qwen-vl-utils would keep (its fps rule).

        qwen-vl-utils' own readers need torchcodec or decord, or torchvision's
        `read_video`, which torchvision 0.26 removed; PyAV is what this stack has."""
        import numpy as np
        from qwen_vl_utils.vision_process import smart_nframes
        from transformers.video_utils import load_video

        if not path.is_file():
            raise FileNotFoundError(f"video file not found: {path}")

        def frame_indices(metadata, **_):
            total = metadata.total_num_frames
            count = smart_nframes({"fps": self.video_fps, "max_frames": self.max_frames}, total, metadata.fps)
            return np.linspace(0, total - 1, count).round().astype(int)

        frames, metadata = load_video(str(path), backend="pyav", sample_indices_fn=frame_indices)
        return Clip(frames, metadata)

    def text_kwargs(self) -> dict[str, Any]:
        return {"return_mm_token_type_ids": True}


def mrope_position_ids(batch: dict[str, torch.Tensor], config) -> torch.Tensor:
    """(4, B, L) position ids for a padded Qwen-VL batch: row 0 counts each sequence's
    tokens (transformers reads it to find packed-sequence boundaries), rows 1-3 are the
    temporal/height/width mrope positions the model's `get_rope_index` computes.

    Token kinds come from `input_ids` and the config's placeholder ids (as the processor
    makes `mm_token_type_ids`), so a batch with appended responses needs nothing more.
    A run of video tokens holds a whole video (Qwen2/2.5-VL) or one frame group
    (Qwen3-VL puts timestamp text between groups); its length says how many frames."""
    # Built on the host and moved to the batch's device once: the walk over each row's
    # runs of token kinds reads them there, and on a GPU each row's reads and writes
    # were a few waits on the device (a multi-turn session's 64 rows: hundreds).
    device = batch["input_ids"].device
    ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].bool().cpu()
    types = (ids == config.image_token_id).long() + VIDEO * (ids == config.video_token_id).long()
    merge = config.vision_config.spatial_merge_size
    # Qwen2.5-VL spaces video frames in time; the others step by one.
    tokens_per_second = getattr(config.vision_config, "tokens_per_second", None)
    seconds = batch.get("second_per_grid_ts")
    seconds = seconds.cpu() if seconds is not None else None
    grids = {kind: (None if grid is None else grid.cpu()) for kind, grid in
             ((IMAGE, batch.get("image_grid_thw")), (VIDEO, batch.get("video_grid_thw")))}
    cursor = {IMAGE: [0, 0], VIDEO: [0, 0]}  # [grid index, frames of it already placed]

    positions = torch.zeros(4, *ids.shape, dtype=torch.long)
    positions[0] = sequential_positions(mask)
    # Rows whose runs of token kinds and media grids are alike (a GRPO group's samples, a
    # session's suffixes) share their positions, built once.
    built: dict[tuple, torch.Tensor] = {}
    for row in range(ids.shape[0]):
        start, pieces, key = 0, [], []
        for kind, run in itertools.groupby(types[row][mask[row]].tolist()):
            length = len(list(run))
            if kind == TEXT:
                pieces.append((_text_run, start, length))
                key.append((TEXT, start, length))
                start += length
                continue
            index, placed = cursor[kind]
            frames, height, width = grids[kind][index].tolist()
            height, width = height // merge, width // merge
            run_frames = length // (height * width)
            interval = 1
            if kind == VIDEO and tokens_per_second is not None:
                interval = tokens_per_second * (seconds[index] if seconds is not None else 1)
            pieces.append((_media_run, start, run_frames, height, width, interval))
            key.append((kind, start, run_frames, height, width, float(interval)))
            start += max(height, width)
            placed += run_frames
            cursor[kind] = [index + 1, 0] if placed >= frames else [index, placed]
        key = tuple(key)
        if key not in built:
            built[key] = torch.cat([run(*args) for run, *args in pieces], dim=1)
        positions[1:, row, mask[row]] = built[key]
    return positions.to(device)


def _text_run(start: int, length: int) -> torch.Tensor:
    """(3, length) mrope positions of a text run: counting from `start` on every axis."""
    return torch.arange(start, start + length).expand(3, -1)


def _media_run(start: int, frames: int, height: int, width: int, interval) -> torch.Tensor:
    """(3, frames * height * width) mrope positions of a media run: its grid from `start`,
    frames `interval` apart in time."""
    temporal = (torch.arange(frames) * interval).long() + start
    t, h, w = torch.meshgrid(temporal, torch.arange(height) + start, torch.arange(width) + start, indexing="ij")
    return torch.stack([t, h, w]).reshape(3, -1)


def tiny_processor(
    processor_class: str,
    video_processor_class: str,
    *,
    patch_size: int,
    chat_template: str,
    merge_size: int = 2,
):
    """A Qwen-VL processor with a character tokenizer and a pixel budget that turns the
    test images (56x56, 84x112) into 4 and 12 image tokens."""
    from transformers import Qwen2VLImageProcessor

    tokenizer = char_tokenizer(
        special_tokens=CHATML_SPECIAL_TOKENS, named_tokens=QWEN_VL_TOKENS,
        eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template,
    )
    token_area = (patch_size * merge_size) ** 2  # pixels per merged token
    shapes = dict(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": 4 * token_area, "longest_edge": 16 * token_area}, **shapes
    )
    # Qwen3-VL's video budget spans all frames, Qwen2-VL's is per frame: both give the
    # 56x56 test frames 4 tokens each. The per-frame cap is qwen-vl-utils' behaviour
    # (and silences transformers' warning that it will become the default).
    video_processor = import_object(video_processor_class)(
        size={"shortest_edge": 4 * token_area, "longest_edge": 64 * token_area}, cap_pixels_per_frame=True,
        **shapes,
    )
    return import_object(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
        chat_template=chat_template,
    )
