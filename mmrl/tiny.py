"""Offline building blocks for tiny random-init models: tokenizers without a hub.

`char_tokenizer` makes a character-level fast tokenizer with a family's special tokens
as atomic tokens, so a family's `tiny()` can build a complete processor with no
download. Named tokens (`{"image_token": "<image>"}`) become tokenizer attributes
(`tokenizer.image_token`, `tokenizer.image_token_id`) that HF processors read.
"""

from __future__ import annotations

import contextlib
import contextvars
import string
from collections.abc import Iterable, Iterator, Mapping

CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n\t"

# (characters, words) that `char_tokenizer` uses while `vocabulary()` is active.
_VOCABULARY: contextvars.ContextVar[tuple[str, tuple[str, ...]] | None] = contextvars.ContextVar(
    "tiny_vocabulary", default=None
)


@contextlib.contextmanager
def vocabulary(characters: str | None = None, words: Iterable[str] = ()) -> Iterator[None]:
    """Make every tiny tokenizer built inside this block use `characters` (instead of
    printable ASCII) and hold `words` as single tokens.

    A small vocabulary makes a random-init policy sample valid answers often enough to
    learn from; text outside it becomes `<unk>`, which is special and never sampled.
    """
    token = _VOCABULARY.set((CHARACTERS if characters is None else characters, tuple(words)))
    try:
        yield
    finally:
        _VOCABULARY.reset(token)


def char_tokenizer(
    *,
    special_tokens: Iterable[str] = (),
    named_tokens: Mapping[str, str] | None = None,
    bos_token: str | None = None,
    eos_token: str = "<|endoftext|>",
    pad_token: str | None = None,
    unk_token: str = "<unk>",
    chat_template: str | None = None,
    words: Iterable[str] = (),
    padding_side: str = "left",
    vocab_size: int | None = None,
):
    """A character-level `PreTrainedTokenizerFast`.

    Special tokens take the first ids (in the order given: unk, pad, bos, eos, then
    `special_tokens`, then `named_tokens`), characters follow, then whole `words`.
    Whole `words` are added as atomic tokens after the fillers. With `vocab_size`, filler tokens pad the vocabulary to that size so the model's
    embedding matrix and the tokenizer agree.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    named_tokens = dict(named_tokens or {})
    characters = CHARACTERS
    if (active := _VOCABULARY.get()) is not None:
        characters, more_words = active
        words = (*words, *more_words)
    specials: list[str] = []
    for token in (unk_token, pad_token, bos_token, eos_token, *special_tokens, *named_tokens.values()):
        if token and token not in specials:
            specials.append(token)
    vocab: dict[str, int] = {}
    for token in (*specials, *characters):
        vocab.setdefault(token, len(vocab))
    words = [w for w in words if w not in vocab]
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} tokens needed")
        for i in range(len(vocab), vocab_size):
            vocab[f"<filler_{i}>"] = i
    # BPE without merges splits text into single characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk_token))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=unk_token,
        pad_token=pad_token or eos_token,
        bos_token=bos_token,
        eos_token=eos_token,
        extra_special_tokens=named_tokens,
        padding_side=padding_side,
        chat_template=chat_template,
    )
    # Atomic special tokens (the vocabulary already holds their ids).
    tokenizer.add_tokens([t for t in specials if t not in named_tokens.values()], special_tokens=True)
    if words:
        # Added (non-special) tokens are matched before the character model runs.
        tokenizer.add_tokens(words)
    return tokenizer


# Shapes of every tiny text decoder: small enough for a CPU step in milliseconds, large
# enough for grouped-query attention (2 query heads over 1 key/value head), and heads of
# 32 because vLLM's CPU attention kernels have no smaller head size.
TINY_TEXT_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=1024,
)


def token_ids(tokenizer) -> dict[str, int | None]:
    """The bos/eos/pad ids a config should carry for `tokenizer`."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def tiny_text_config(config_class: str, tokenizer, **overrides):
    """A tiny random-init text config of `config_class` ("module:Class") sized to `tokenizer`."""
    from mmrl.adapter import import_object

    values = {**TINY_TEXT_SHAPES, "vocab_size": len(tokenizer), **token_ids(tokenizer), **overrides}
    return import_object(config_class)(**values)


def sized_config(config_class: str, tokenizer, **values):
    """A config of `config_class` ("module:Class") with exactly `values` (no standard
    shapes added: a scaffolded family spells out the shapes its class has), its
    vocabulary and special-token ids taken from `tokenizer` (ids the tokenizer lacks
    keep the class's defaults)."""
    from mmrl.adapter import import_object

    ids = {k: v for k, v in token_ids(tokenizer).items() if v is not None}
    return import_object(config_class)(**{"vocab_size": len(tokenizer), **ids, **values})


def as_loaded(image_processor):
    """`image_processor` as `AutoImageProcessor` would load it back from a checkpoint.

    transformers picks an image processor's backend (torchvision or PIL) when it loads
    one, and the choice depends on the installed torchvision (Lanczos resizing needs
    torchvision >= 0.27), so a directly constructed processor may resize differently
    from its saved-and-reloaded self. A tiny model's processor goes through the same
    loader once, so saving and reloading it changes nothing."""
    import tempfile

    from transformers import AutoImageProcessor

    with tempfile.TemporaryDirectory() as folder:
        image_processor.save_pretrained(folder)
        return AutoImageProcessor.from_pretrained(folder)


def redraw_zeros(model, patterns: Iterable[str]):
    """`model` with its parameters whose names match `patterns` (fnmatch, `*` any text)
    drawn from a normal distribution of the config's `initializer_range` (0.02 where it
    names none): for a random-init tiny model whose class initializes a weight to zero
    that a checkpoint replaces (a gate, a projection), which would cut every gradient
    behind it (an adapter's `prepare_model`)."""
    import fnmatch

    import torch

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    std = getattr(model.config, "initializer_range", None) or getattr(config, "initializer_range", None) or 0.02
    patterns = tuple(patterns)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
                parameter.normal_(std=std)
    return model
