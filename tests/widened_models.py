"""Tiny random-init models whose greedy continuations differ from token to token, their
engines and prompts: the one setup of the static-cache rollout tests
(tests/test_rollout_fast.py, tests/test_rollout_zoo.py, and the torchrun script of
tests/test_rollout_sharded.py, which imports this module through the tests folder on its
PYTHONPATH, tests/cpu_processes.py).

    built, engine = widened_engine("qwen2_vl")            # fp32, on the CPU
    rollout.generate(prompt_conversations(built, count=3), params)
"""

import torch
from PIL import Image

from mmrl import build_model
from mmrl.engine import Engine
from mmrl.parallel import Dist, init_distributed
from mmrl.registry import get_adapter

TEXTS = ["What is it?", "And this one here, a longer one?", "no", "Say something about the sea and sky"]
IMAGE_SIZES = [(56, 56), (84, 56), (56, 84), (28, 56)]

# Gemma's scaled embeddings and soft-capped logits saturate at the default spread into one
# repeated token.
SPREAD = {"gemma3_text": 0.03, "gemma3": 0.03}
DEFAULT_SPREAD = 0.3


def widened_model(family: str, device: str = "cpu", spread: float | None = None, config_overrides=None):
    """The family's tiny model with its matrices redrawn wider (the default init repeats
    one token forever), images kept to at most 56x56 pixels; seeded, so every process that
    builds it gets the same weights."""
    options = {"min_pixels": 784, "max_pixels": 56 * 56} if get_adapter(family).is_multimodal else {}
    with torch.device(device):
        built = build_model(family, random_init=True, seed=0, processing_options=options,
                            config_overrides=config_overrides)
    generator = torch.Generator().manual_seed(1)
    scale = SPREAD.get(family, DEFAULT_SPREAD) if spread is None else spread
    with torch.no_grad():
        for parameter in built.model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return built


def widened_engine(family: str, device: str = "cpu", spread: float | None = None, dist: Dist | None = None):
    """`widened_model` and its fp32 engine (no media sharing) on `device`, or on `dist`."""
    built = widened_model(family, device, spread)
    engine = Engine(built, dist or init_distributed(device), mixed_precision=False, share_media=False)
    return built, engine


def prompt_conversation(multimodal: bool, index: int) -> list[dict]:
    """Prompt `index` (0-3): text, or an image of its own size and colour before the text."""
    if not multimodal:
        return [{"role": "user", "content": TEXTS[index]}]
    image = Image.new("RGB", IMAGE_SIZES[index], (60 * index, 30, 200))
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": TEXTS[index]}]}]


def prompt_conversations(built, count: int = 2) -> list[list[dict]]:
    """The first `count` prompts for `built`'s kind of family."""
    return [prompt_conversation(built.adapter.is_multimodal, i) for i in range(count)]
