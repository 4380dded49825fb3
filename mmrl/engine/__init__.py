"""Training engines (FSDP2) and the prompt+response sequences they consume."""

from mmrl.engine.engine import Engine, token_log_probs
from mmrl.engine.sequences import Sequences, join

__all__ = ["Engine", "Sequences", "join", "token_log_probs"]
