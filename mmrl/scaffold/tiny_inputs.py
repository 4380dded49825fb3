"""Stage 2, config: the tiny config (and tokenizer, and for vision-language types the
processor) of a resolved type, from the stage modules that build each kind: `shrink`
for text types (the first shrunk candidate whose model runs), `media` for
vision-language types. It sits above both so that neither imports the other back.

    tiny = tiny_model_inputs(resolve("olmo2"))      # TinyInputs(config, text_overrides, media)
"""

from __future__ import annotations

from typing import Any

from mmrl.scaffold.base import Resolved, ScaffoldError
from mmrl.scaffold.media import tiny_vision_language
from mmrl.scaffold.media_plan import tiny_text_tokenizer
from mmrl.scaffold.shrink import TEXT_SHAPE_CANDIDATES, TinyInputs, build_text_config, runs, tiny_text_values
from mmrl.scaffold.vllm_fields import vllm_fields


def tiny_model_inputs(resolved: Resolved) -> TinyInputs:
    """The tiny config (and tokenizer/processor) of a resolved type."""
    if resolved.is_vision_language:
        return tiny_vision_language(resolved)
    tokenizer = tiny_text_tokenizer()
    first: ScaffoldError | None = None
    tried: list[dict[str, Any]] = []
    # Last, a stack left all linear-attention by default with one attention layer,
    # expert counts left unset by default given one, fields the class derives left to it,
    # and sizes left unset by default that the model code reads given one.
    candidates = [*({"shapes": shapes} for shapes in TEXT_SHAPE_CANDIDATES),
                  {"attend_last": True}, {"unset_experts": True}, {"derived": True}, {"unset_sizes": True}]
    for candidate in candidates:
        try:
            overrides = tiny_text_values(resolved.config_class, **candidate)
            if overrides in tried:  # a candidate that changes nothing the class has: already run
                continue
            tried.append(overrides)
            config = build_text_config(resolved.config_class, tokenizer, overrides)
            runs(resolved.model_class, config)
        except ScaffoldError as exc:
            first = first or exc
            continue
        # Fields vLLM's model reads that the class lacks, derived from the config (after
        # it ran, so they change nothing transformers builds).
        if extra := vllm_fields(config, resolved.model_class):
            overrides = {**overrides, **extra}
            config = build_text_config(resolved.config_class, tokenizer, overrides)
        return TinyInputs(config=config, text_overrides=overrides)
    raise first


__all__ = ["tiny_model_inputs"]
