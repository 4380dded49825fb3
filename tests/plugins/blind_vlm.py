"""Two vision-language families that do not read their images, for the reads_media probe
and the trainer's step-0 media check (tests/test_media_probes.py):

- `vlm_drops_pixels`: its processor drops the pixels; the image placeholders reach the
  model, the images never do, so the vision tower is never called;
- `vlm_zeroes_pixels`: its processor zeroes the pixels; the tower runs on nothing, so
  the log-probs are the same whatever the image (training still runs).

Importing this module registers both, as `--plugin plugins.blind_vlm` would.
"""

from mmrl.models.qwen2_vl import Qwen2VL
from mmrl.processors.qwen_vl import QwenVLProcessing
from mmrl.registry import register_model

PIXELS = ("pixel_values", "pixel_values_videos")


class PixelDroppingProcessing(QwenVLProcessing):
    def __call__(self, conversations, add_generation_prompt: bool = True):
        batch = super().__call__(conversations, add_generation_prompt)
        for key in (*PIXELS, "image_grid_thw", "video_grid_thw"):
            batch.pop(key, None)
        return batch


class PixelZeroingProcessing(QwenVLProcessing):
    def __call__(self, conversations, add_generation_prompt: bool = True):
        batch = super().__call__(conversations, add_generation_prompt)
        for key in PIXELS:
            if key in batch:
                batch[key] = batch[key] * 0
        return batch


@register_model
class VLMDropsPixels(Qwen2VL):
    family = "vlm_drops_pixels"
    model_types = ("vlm_drops_pixels",)
    architectures = ("VLMDropsPixelsForConditionalGeneration",)
    processing = "plugins.blind_vlm:PixelDroppingProcessing"


@register_model
class VLMZeroesPixels(Qwen2VL):
    family = "vlm_zeroes_pixels"
    model_types = ("vlm_zeroes_pixels",)
    architectures = ("VLMZeroesPixelsForConditionalGeneration",)
    processing = "plugins.blind_vlm:PixelZeroingProcessing"
