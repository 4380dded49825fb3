"""A reward from a second model: a judge that reads each prompt (with its images), the
completion and the answer, and writes a score, generated through mmrl's rollout
backends (`mmrl.rollout`), the same code that samples the policy.

    reward:
      name: judge
      options:
        model: /ckpt/Qwen2.5-VL-7B-Instruct   # a checkpoint folder (or a family with random_init)
        template: "Question: {question}\nReference: {answer}\nResponse: {completion}\nScore 0-10:"
        score_pattern: "(\\d+(?:\\.\\d+)?)"   # the first group of the last match ...
        scale: 0.1                           # ... times scale is the reward
        max_new_tokens: 16

The judge is built on first use, once per process and set of model options, as an
inference engine (no optimizer, not sharded: under torchrun each rank holds its own
copy on its device), and answers greedily. A reply without a score gets `default`. A
judge that reads images gets the prompt's images before the template's text; a text-only
judge gets the text alone. `mmrl.rewards` names this reward by import path and imports it
on first use, so the other rewards stay free of torch and the engine.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from mmrl.build import build_model
from mmrl.config import RolloutConfig
from mmrl.engine import Engine
from mmrl.parallel import Dist
from mmrl.rollout import SamplingParams, make_rollout

DEFAULT_TEMPLATE = ("Question: {question}\nReference answer: {answer}\nResponse: {completion}\n"
                    "Rate the response from 0 to 10. Score:")
DEFAULT_PATTERN = r"(-?\d+(?:\.\d+)?)"

# One judge per process and model options: the reward is called every step.
_JUDGES: dict[tuple, Judge] = {}


class Judge:
    """A model that writes replies to judge conversations, through a rollout backend."""

    def __init__(self, model: str, *, random_init: bool = False, dtype: str = "float32", backend: str = "hf",
                 device: str | None = None, processing_options: dict | None = None,
                 tiny_vocabulary: dict | None = None):
        device = torch.device(device or _default_device())
        built = build_model(model, random_init=random_init, dtype=dtype, device=device,
                            processing_options=processing_options or {}, tiny_vocabulary=tiny_vocabulary)
        # A Dist of one: the judge is not sharded, so its generate calls are no
        # collective and each rank judges its own share.
        engine = Engine(built, Dist(rank=0, world_size=1, local_rank=0, device=device, mesh=None))
        options = {}
        if backend == "vllm":
            options = {"config": RolloutConfig()}
        self.processing = built.processing
        self.reads_images = built.adapter.is_multimodal
        self.rollout = make_rollout(backend, engine, built.processing, **options)

    def replies(self, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
        result = self.rollout.generate(conversations, SamplingParams(n=1, max_new_tokens=max_new_tokens,
                                                                     temperature=0.0))
        return self.processing.decode(result.response_ids)

    def conversation(self, prompt: list[dict] | str, completion: str, answer: str, template: str) -> list[dict]:
        """The judge's one user turn: the prompt's images (for a judge that reads them),
        then the template filled with the prompt's text, the completion and the answer."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        texts, media = [], []
        for message in messages:
            parts = [{"type": "text", "text": message["content"]}] if isinstance(message["content"], str) \
                else message["content"]
            for part in parts:
                if part.get("type") == "text":
                    texts.append(part["text"])
                elif part.get("type") == "image" and self.reads_images:
                    media.append({"type": "image", "image": part["image"]})
        text = template.format(question="\n".join(texts), completion=completion, answer=answer)
        return [{"role": "user", "content": [*media, {"type": "text", "text": text}]}]


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def get_judge(model: str, **options: Any) -> Judge:
    key = (model, *sorted((k, repr(v)) for k, v in options.items()))
    if key not in _JUDGES:
        _JUDGES[key] = Judge(model, **options)
    return _JUDGES[key]


def parse_score(reply: str, pattern: str, scale: float, default: float) -> float:
    """The first group of `pattern`'s last match in `reply`, times `scale`; else `default`."""
    matches = list(re.finditer(pattern, reply))
    if not matches:
        return default
    try:
        return float(matches[-1].group(1)) * scale
    except (IndexError, ValueError):
        return default


def judge(completions: list[str], answers: list[str], *, prompts: list, model: str,
          template: str = DEFAULT_TEMPLATE, score_pattern: str = DEFAULT_PATTERN, scale: float = 0.1,
          default: float = 0.0, max_new_tokens: int = 16, random_init: bool = False, dtype: str = "float32",
          backend: str = "hf", device: str | None = None, tiny_vocabulary: dict | None = None,
          **fields) -> list[float]:
    """A second model's score of each completion (see the module docstring)."""
    re.compile(score_pattern)  # a bad pattern fails before the judge is built
    judge_model = get_judge(model, random_init=random_init, dtype=dtype, backend=backend, device=device,
                            tiny_vocabulary=tiny_vocabulary)
    conversations = [judge_model.conversation(prompt, completion, answer, template)
                     for prompt, completion, answer in zip(prompts, completions, answers, strict=True)]
    replies = judge_model.replies(conversations, max_new_tokens)
    return [parse_score(reply, score_pattern, scale, default) for reply in replies]


__all__ = ["DEFAULT_PATTERN", "DEFAULT_TEMPLATE", "Judge", "get_judge", "judge", "parse_score"]
