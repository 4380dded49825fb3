"""The transformers model under the wrappers mmrl puts around it (PEFT's, one class for
every family). A leaf module: anything in mmrl can import it."""

from __future__ import annotations

import torch


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper; the model itself otherwise."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
