"""The data layer of the RL trainer: the prompt sample schema (`schema`), loaders for
files, folders and synthetic tasks with resumable batches (`loaders`), and offline
Pillow-drawn tasks (`synthetic`).

    from mmrl.data import load_prompts, to_conversation
    prompts = load_prompts("synthetic:name_colour?n=128&seed=0")
    batch = next(prompts.batches(16, seed=0))
    conversations = [to_conversation(s) for s in batch.samples]

Importing it loads neither `datasets` nor torch; they load when a file is read or an
image decoded.
"""

from mmrl.data import synthetic
from mmrl.data.loaders import Batch, Position, PromptDataset, load_prompts
from mmrl.data.schema import Sample, resolve_paths, to_conversation, validate_sample

__all__ = [
    "Batch",
    "Position",
    "PromptDataset",
    "Sample",
    "load_prompts",
    "resolve_paths",
    "synthetic",
    "to_conversation",
    "validate_sample",
]
