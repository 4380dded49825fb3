"""A later turn's token ids without processing the whole conversation again.

A multi-turn session (`mmrl.rollout.sessions`) needs, per sample and turn, the token ids of
its conversation processed whole, but the row's cache already holds all of them up to its
last sampled token. Processing every row again (template, tokenizer, the processor's
placeholder expansion) was most of a later turn's host time. Here each row's ids are put
together from three pieces instead:

    prompt = render(conversation)         # the chat template's text (cheap)
    earlier, split = anchor.text, anchor.split   # the last prompt's text, where its last special token ends
    middle = prompt[split : len(earlier) + q]    # the template's tail, the sampled turn, up to the
                                                  # first special token after it (at q)
    rest = prompt[len(earlier) + q :]             # that special token on: replies, new images
    ids = anchor.ids[:anchor.head] + tokenize(middle) + process(rest, new media)

Why the pieces give the whole's ids: a HuggingFace tokenizer cuts its text at its added
tokens before anything else runs (normalizer, pre-tokenizer, model run on each piece
between them), so a text cut where a special token begins or ends tokenizes as its pieces
do. A cut is only made at special tokens that neither strip the whitespace beside them
nor are normalized, and nowhere a stripped side touches whitespace. The rest holds every
new image's placeholders (special tokens), so the processor's expansion of them is the
one the whole conversation gets. Tokenizers that number the first piece of a text
differently (a prefix space on the first section) break the rule for every row alike:
the session checks the pieces against processing rows whole once per rollout before it
trusts them. Each row's ids must still begin with what its cache row holds (the agent's
prefix rule); a row where they do not, or where a piece cannot be found, sends the turn
back to processing rows whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mmrl.processing import Processing, text_aligned


@dataclass
class Anchor:
    """What a row keeps of its last prompt to continue it: the prompt's rendered text,
    where in it the last cut point ends (`split`), how many of the prompt's token ids
    come before that point (`head`), and the prompt's per-token entries other than the
    ids and mask (its real tokens'; `mm_token_type_ids`, ...)."""

    text: str
    split: int
    head: int
    entries: dict[str, torch.Tensor]


class CutPoints:
    """Where a tokenizer's text may be cut without changing its ids: at the special added
    tokens that are matched on the raw text and strip no whitespace beside them."""

    def __init__(self, tokenizer):
        tokens = [t for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                  if getattr(t, "special", False) and not getattr(t, "normalized", True) and str(t)]
        # Longest first, so a token that begins another one is not matched in its place.
        self.tokens = {str(t): t for t in sorted(tokens, key=lambda t: -len(str(t)))}
        self.pattern = re.compile("|".join(re.escape(text) for text in self.tokens)) if self.tokens else None
        self._tails: dict[str, list[int]] = {}

    def last_end(self, text: str) -> int | None:
        """Where the last cut token of `text` ends; None where it has none, or where that
        token strips whitespace on its right or can be part of a word."""
        if self.pattern is None:
            return None
        found = None
        for found in self.pattern.finditer(text):
            pass
        if found is None or not self._cuttable(found.group()):
            return None
        return found.end()

    def first_start(self, text: str) -> int | None:
        """Where the first cut token of `text` begins (None: it has none, or it strips)."""
        if self.pattern is None:
            return None
        found = self.pattern.search(text)
        if found is None or not self._cuttable(found.group()):
            return None
        return found.start()

    def tail_ids(self, processing: Processing, text: str) -> list[int]:
        """`text` tokenized alone, once per text (a prompt's tail after its last cut
        point: the same generation prompt in every row)."""
        if text not in self._tails:
            self._tails[text] = _tokenized(processing, [text])[0]["input_ids"] if text else []
        return self._tails[text]

    def _cuttable(self, content: str) -> bool:
        token = self.tokens[content]
        return not (getattr(token, "lstrip", False) or getattr(token, "rstrip", False)
                    or getattr(token, "single_word", False))


def anchor(processing: Processing, cuts: CutPoints, text: str, ids: list[int],
           entries: dict[str, torch.Tensor]) -> Anchor | None:
    """The `Anchor` of a prompt (`text` rendered, `ids` its real token ids, `entries`
    its other per-token entries), or None where it has no cut point or its ids do not
    end with its tail's ids (the tail tokenized alone)."""
    split = cuts.last_end(text)
    if split is None:
        return None
    tail = cuts.tail_ids(processing, text[split:])
    if len(tail) > len(ids) or ids[len(ids) - len(tail):] != tail:
        return None
    return Anchor(text, split, len(ids) - len(tail), entries)


def continued(processing: Processing, cuts: CutPoints, anchors: list[Anchor], ids: list[list[int]],
              texts: list[str], media: list[tuple[list, list]], media_keys: list[tuple]) -> list[dict] | None:
    """Each row's token ids and per-token entries (its real tokens', 1-D) of `texts[i]`
    (its conversation rendered now) continuing `anchors[i]` (its last prompt's, whose
    ids `ids[i]` begin with), with
    `media[i]` the images and videos of what was added since (`collect_media`) and
    `media_keys[i]` a key of what their tokens depend on (an image's mode and size): rows
    whose rest of text and media keys are equal are tokenized once. None where a row's
    text does not continue its anchor's or has no cut point after it."""
    middles, rests = [], []
    for anchor_, text in zip(anchors, texts):
        if not text.startswith(anchor_.text) or anchor_.split > len(anchor_.text):
            return None
        cut = cuts.first_start(text[len(anchor_.text):])
        if cut is None:
            return None
        middles.append(text[anchor_.split:len(anchor_.text) + cut])
        rests.append(text[len(anchor_.text) + cut:])
    middle_rows = _tokenized(processing, middles, [([], [])] * len(middles))
    distinct: dict[tuple, dict] = {}
    for rest, items, key in zip(rests, media, media_keys):
        if (rest, key) not in distinct:
            distinct[(rest, key)] = _tokenized(processing, [rest], [items])[0]
    rows = []
    for anchor_, head, middle, rest, key in zip(anchors, ids, middle_rows, rests, media_keys):
        tail = distinct[(rest, key)]
        if set(middle) != set(tail) or set(middle) - {"input_ids"} != set(anchor_.entries):
            return None
        row = {"input_ids": head[:anchor_.head] + middle["input_ids"] + tail["input_ids"]}
        for name, values in anchor_.entries.items():
            row[name] = torch.cat([values[:anchor_.head], middle[name], tail[name]])
        rows.append(row)
    return rows


def _tokenized(processing: Processing, texts: list[str], media: list | None = None) -> list[dict]:
    """Each text's real token ids (a list) and other per-token entries (1-D tensors),
    processed as rendered prompts are (`Processing.process_texts`; the tokenizer alone
    for a text-only `media` of None)."""
    if media is None:
        batch = processing.tokenizer(texts, add_special_tokens=False)
        return [{"input_ids": list(ids)} for ids in batch["input_ids"]]
    batch = dict(processing.process_texts(texts, media))
    real = batch["attention_mask"].bool()
    aligned = [k for k, v in batch.items() if k not in ("input_ids", "attention_mask")
               and isinstance(v, torch.Tensor) and text_aligned(k, v, batch)]
    return [{"input_ids": batch["input_ids"][row][real[row]].tolist(),
             **{k: batch[k][row][real[row]] for k in aligned}} for row in range(len(texts))]


__all__ = ["Anchor", "CutPoints", "anchor", "continued"]
