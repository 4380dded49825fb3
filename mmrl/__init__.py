"""mmrl: RL training for HuggingFace text and vision-language models.

A model family registers one adapter (`mmrl.models`); everything else, from building
and freezing to rollout and training, reads only that adapter. Importing this package
is cheap: heavy modules load when first used.

    import mmrl
    built = mmrl.build_model("qwen2_vl", random_init=True)
    summary = mmrl.train("recipes/tiny_vlm_count.yaml", reward=my_reward, train_dataset=rows)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "register_model": "mmrl.registry",
    "get_adapter": "mmrl.registry",
    "families": "mmrl.registry",
    "load_plugin": "mmrl.registry",
    "ModelAdapter": "mmrl.adapter",
    "VisionLanguageAdapter": "mmrl.adapter",
    "Parts": "mmrl.adapter",
    "LoraTargets": "mmrl.adapter",
    "Capabilities": "mmrl.adapter",
    "RopeSpec": "mmrl.rope",
    "build_model": "mmrl.build",
    "load_model": "mmrl.build",
    "freeze": "mmrl.parts",
    "apply_lora": "mmrl.lora",
    "merge_lora": "mmrl.lora",
    "Processing": "mmrl.processing",
    "train": "mmrl.api",
    "load_recipe": "mmrl.config",
    "Recipe": "mmrl.config",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from mmrl.adapter import Capabilities, LoraTargets, ModelAdapter, Parts, VisionLanguageAdapter
    from mmrl.api import train
    from mmrl.build import build_model, load_model
    from mmrl.config import Recipe, load_recipe
    from mmrl.lora import apply_lora, merge_lora
    from mmrl.parts import freeze
    from mmrl.processing import Processing
    from mmrl.registry import families, get_adapter, load_plugin, register_model
    from mmrl.rope import RopeSpec


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mmrl' has no attribute {name!r}")
