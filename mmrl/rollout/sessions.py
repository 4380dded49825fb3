"""Multi-turn decoding on the compiled rollout's kept KV cache: a session per agent rollout.

    session = session_for(rollout)                         # None unless rollout is `hf_compiled`
    first = session.generate(keys, conversations, params)  # turn 1: every prompt prefilled whole
    # ... each conversation grows by its sampled turn and the environment's reply ...
    later = session.generate(still, grown, params)         # only what is new is prefilled
    session.stats    # tokens prefilled against re-prefilling whole, rows per turn, reasons

`keys` name the samples (any hashable, one per conversation); a key's row of the static
cache holds its conversation between calls. The first call (no cache kept yet) prefills
each distinct opening once where samples repeat it (GRPO's n samples of a prompt:
`mmrl.rollout.prefix`, as the one-turn rollout does) and copies its cache rows out to
its samples'; openings count as repeats when their texts are equal and their images and
videos are the same objects, and their processed tokens and media are checked as the
one-turn path checks them. With `timed` (benches; off by default, so a run never waits
for the device) each call appends where its seconds went to `stats["phases"]`, the
device synchronized at each phase's end. The agent loop (`mmrl.rollout.agent`) opens
one session per rollout on the `hf_compiled` backend; results are the backend's
`RolloutResult`s, `prompt_inputs` being each conversation processed whole (without the
pixel tensors on light turns, below). Partial
rollouts (`mmrl.buffer.partial`) keep one session for the whole run and pass each carried
response's tokens so far as `prefixes` (appended to its processed prompt, as
`continue_from` appends them): a carried response's conversation then begins with what
its row holds, and only its last sampled token is prefilled, under whatever weights the
model has now. Between calls the kept cache leaves the rollout's pool of caches, which
any other call of the rollout (a validation between two rounds) would reset and reuse,
and rejoins it for the session's next call.

What a later turn does, per sample:
- its conversation is processed whole, as plain `generate` would get it: token ids, the
  adapter's positions (3-D for mrope), media tensors of every image so far (each row
  processed alone, each list of images once per content, then collated: `_process`);
- when those tokens begin with the ones its row holds (the previous prompt and what was
  sampled from it: the agent's prefix rule), only the rest is prefilled: the last sampled
  token (the decode loop samples it but never feeds it), the environment's reply, the
  template's tokens, with their positions and per-token entries sliced from the whole
  conversation's, and the media tensors of the images that arrived since, cut out of the
  whole conversation's tensors (so they are the ones processing it whole gives); once
  that cut was checked to be the new images' pixels processed alone, joined along the
  first dimension, and the positions were checked not to need the pixels
  (`_light_matches`, once per rollout), later turns leave the whole batch's pixel tensors
  out and take the new images' alone ("light_turns" in `stats`), and the suffixes'
  positions come from the suffixes alone, shifted by each row's last position (checked
  once per rollout against the whole rows': `_suffix_positions`, "alone_positions");
  once both hold, a later turn processes no row whole: each row's ids are put together
  from its last prompt's and the text added since (`mmrl.rollout.text_suffix`: the
  template's text after the row's last prompt, tokenized in pieces cut at special
  tokens, the new images' placeholders expanded once per distinct rest), checked once
  per rollout against processing the rows whole (`_text_batch`, "text_turns"), the
  media tensors of the suffixes being the new images' alone;
- where the rule fails, the sample prefills its whole conversation and its old slots
  are masked ("reprefilled_samples" in `stats`);
- samples not in the call (finished: the environment said done, or out of turns or
  tokens) leave the cache, which narrows to the samples still running (continuous
  batching), and within a turn the decode loop moves finished rows out as for one turn,
  writing their slots back into the session's cache.

The suffixes are left-padded together and written at the cache's fill; the attention
mask covers each row's real slots only (a suffix's padding, the tokens a finished row was
fed after its stop). When the next turn would overflow the cache, each row's real slots
move to the front, in order, and the cache grows only if that is not enough.

Where the new images' part of the media tensors cannot be found exactly (each new
chunk's images are processed alone for their sizes and checked against the whole
conversation's tensors: joined along the first dimension, or per row) the whole batch is
prefilled anew (`stats["reprefill_reason"]` says why). New images whose content repeats
across rows (a tool's same crop for every sample of a prompt; processed alone once per
content) go through the encoder once, where the family shares media
(`mmrl.engine.media.sharing`; `stats["shared_media_rows"]`). A backend that cannot keep a cache
between turns (sharded weights decoding on an inference copy, sliding-window cache
layers) serves each turn by its own `generate`, the reason in `stats` too.
"""

from __future__ import annotations

import contextlib
import copy
import time
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from mmrl.engine.media import SharedMedia, placeholder_tokens, sharing
from mmrl.errors import one_line
from mmrl.processing import Processing, batch_differences, text_aligned
from mmrl.rollout.base import RolloutResult, SamplingParams, extend_prompts, trim_responses
from mmrl.rollout.compiled import CompiledHFRollout, DecodeRun, next_positions
from mmrl.rollout.prefix import DistinctPrompts, distinct_prompts
from mmrl.rollout.text_suffix import Anchor, CutPoints, anchor, continued

MEDIA_TYPES = ("image", "video")
# Per rollout: whether later turns may leave the pixel tensors out, and their keys
# (`DecodeSession._light_matches`); weak, so a rollout let go takes its entry along.
_LIGHT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Per rollout: whether a suffix's positions, computed from the suffix alone and its row's
# `next_position`, are checked to be the whole rows' (`DecodeSession._suffix_positions`).
_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Per rollout: whether a light turn's token ids may be put together from each row's last
# prompt and the new text alone (`mmrl.rollout.text_suffix`), checked once against
# processing the rows whole (`DecodeSession._text_batch`).
_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Images whose pixels agree at every `_SAMPLED`th byte are compared whole (`DecodeSession._content`).
_SAMPLED = 997


def session_for(backend, reserve: int = 0) -> DecodeSession | None:
    """A session over `backend` where it can keep caches between turns (the compiled
    rollout), else None. `reserve`: tokens a conversation may still grow by after its
    first prompt (the agent's `max_tokens`), so the first cache is sized for the turns."""
    return DecodeSession(backend, reserve) if isinstance(backend, CompiledHFRollout) else None


@dataclass
class _Row:
    """What a sample's cache row holds."""

    tokens: list[int]  # its last prompt's tokens and the ones sampled from it
    messages: int  # messages of the conversation that prompt was processed from
    # Media items its conversation holds so far, per media key: (along the first dimension,
    # along the second where each chunk is one row of it, else None). None: not learned yet.
    media: dict[str, tuple[int, int | None]] | None = None
    # The position its last sampled token has in its conversation processed whole (per
    # axis: mrope's three): where its next suffix's positions start (`_suffix_positions`).
    next_position: torch.Tensor | None = None
    # Its last prompt's text and where its ids can be continued from (`_text_batch`).
    anchor: Anchor | None = None

    @property
    def cached(self) -> int:
        """Tokens whose keys and values the row holds (the last sampled one never went in)."""
        return len(self.tokens) - 1


@dataclass
class _Chunk:
    """Media parts processed alone: their tensors and placeholder-token counts."""

    tensors: dict[str, torch.Tensor]
    placeholders: dict[int, int]
    processed: dict | None = None  # the parts' one-row batch (tensors on the device), for `SharedMedia`

    def sizes(self) -> dict[str, tuple[int, int | None]]:
        return {key: (t.shape[0], t.shape[1] if t.dim() > 1 and t.shape[0] == 1 else None)
                for key, t in self.tensors.items()}


class _Reprefill(Exception):
    """This turn prefills every sample whole (the message says why)."""


class DecodeSession:
    """The kept cache of one multi-turn rollout on a `CompiledHFRollout` (module docstring)."""

    def __init__(self, rollout: CompiledHFRollout, reserve: int = 0, timed: bool = False):
        self.rollout = rollout
        # Per-phase seconds of each call in `stats["phases"]`, the device synchronized at
        # each phase's end (benches only: the waits cost a run its overlap of host and device).
        self.timed = timed
        self.processing = rollout.processing
        self.reserve = reserve
        self.cache = None  # the static cache: one row per key of `rows`
        self.mask: torch.Tensor | None = None  # (rows, length): the cache's real slots
        self.length = 0
        self.fill = 0  # slots written so far (every row's; the mask says which are real)
        self.rows: list[Hashable] = []
        self.samples: dict[Hashable, _Row] = {}
        self._chunks: dict[tuple, tuple[_Chunk, list]] = {}  # media content -> chunk (and the parts, kept alive)
        self._digests: dict[int, tuple[object, tuple]] = {}  # id -> (image, its content key), kept alive
        self._contents: dict[tuple, list[bytes]] = {}  # (mode, size, sampled hash) -> the distinct pixels
        self._image_memo: _ImageMemo | None = None  # the processor's image outputs by content (`_process`)
        self._per_row_failed = False  # processing rows alone raised once: every row together from then on
        self._cuts: CutPoints | None = None  # the tokenizer's cut points (`_text_batch`), made once
        self._texts: list[str] | None = None  # this turn's conversations rendered, where the text path rendered them
        self._text_only = False  # this turn's batch holds token entries alone (`_text_batch`)
        self._check_text = False  # this turn checks the text path's media against the whole rows'
        self._forward_began = 0.0  # (timed) when this turn's prefill forward began
        self._anchorable = True  # this turn's rows may keep an `Anchor` (no carried responses)
        self._pool_key: tuple | None = None  # the kept cache's key in the rollout's pool, while out of it
        self.stats: dict = {"turns": 0, "prefill_tokens": 0, "whole_tokens": 0, "reprefilled_samples": 0,
                            "cache_rows": [], "reprefill_reason": None, "shared_openings": 0, "shared_media_rows": 0,
                            "light_turns": 0, "alone_positions": 0, "text_turns": 0, "phases": [],
                            "turn_by_turn": rollout.session_unsupported()}

    # Later turns without the whole conversations' pixel tensors (`_light_matches`): None
    # until checked on the first turn that continues rows with new media, then trusted for
    # every session of the rollout (an agent opens one per rollout), as `collate_rows` is.
    @property
    def _light(self) -> bool | None:
        return _LIGHT.get(self.rollout, (None, ()))[0]

    @property
    def _pixel_keys(self) -> tuple[str, ...]:
        return _LIGHT.get(self.rollout, (None, ()))[1]

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the cache (the rollout keeps it for reuse) and what the rows held."""
        self._rejoin_pool()
        self.cache = self.mask = None
        self.rows, self.samples, self._chunks, self._digests, self._contents = [], {}, {}, {}, {}
        self._image_memo = None

    @torch.no_grad()
    def generate(self, keys: Sequence[Hashable], conversations: list[list[dict]],
                 params: SamplingParams, prefixes: list[list[int]] | None = None) -> RolloutResult:
        """One turn: a response per conversation (`params.n` must be 1), `keys[i]` naming
        conversation i's sample; samples of earlier calls missing from `keys` are freed.
        `prefixes[i]`: response tokens conversation i already has (a partial rollout's
        carried sample, `mmrl.buffer.partial`), appended after its processed prompt as the
        rollout's `continue_from` appends them; the result holds the new tokens only."""
        if params.n != 1:
            raise ValueError(f"a decode session samples one response per conversation, got n={params.n}")
        if len(keys) != len(conversations) or len(set(keys)) != len(keys):
            raise ValueError("a decode session needs one distinct key per conversation")
        rollout = self.rollout
        if self.stats["turn_by_turn"] is None and rollout.fallback_reason is None:
            began = self._clock()
            # The first call's openings, each distinct one processed once (None: no repeats).
            shared = self._opening_sharing(conversations) if self.cache is None and prefixes is None else None
            light = self._light is True and self.cache is not None and prefixes is None
            first_call = self.cache is None
            self._texts, self._text_only, self._check_text = None, False, False
            self._anchorable = prefixes is None  # a carried response's ids are not its text's
            # Trusted light turns whose suffix positions are trusted too may skip processing
            # the rows whole (`mmrl.rollout.text_suffix`), once checked: on the rollout's first
            # turn that continues rows, beside the pixels' and positions' checks.
            trusted = light and _POSITIONS.get(rollout) is True and _TEXT.get(rollout) is True
            text = (self._text_batch(keys, conversations) if self.cache is not None and prefixes is None
                    and (trusted or _TEXT.get(rollout) is None) else None)
            if text is not None and trusted:
                batch, self._text_only = text, True
                self.stats["text_turns"] += 1
            elif isinstance(shared, SharedMedia) and rollout.engine.shares_media:
                batch = shared.rows(self.processing, conversations, device=rollout.engine.dist.device)
            else:
                batch = self._process(conversations, per_row=self.cache is not None, light=light)
                if text is not None:  # the check: the text path's ids and entries are the whole rows'
                    aligned = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and text_aligned(k, v, batch)}
                    if set(aligned) == set(text) and not batch_differences(text, aligned):
                        self._check_text = True  # trusted once its media are the whole rows' too (`_suffix_media`)
                    else:
                        _TEXT[rollout] = False
            if prefixes is not None:
                batch = extend_prompts(batch, prefixes, self.processing.tokenizer.pad_token_id)
            processed = self._clock()
            try:
                self._rejoin_pool()
                generated, logprobs, phases = self._turn(list(keys), conversations, batch, params, shared)
            except Exception as error:  # noqa: BLE001 - as the rollout's own path: plain generate, once, loudly
                self.close()
                rollout.give_up(one_line(error, typed=True)[:300])
            else:
                self._leave_pool()
                stops, pad = self.processing.stop_token_ids, self.processing.tokenizer.pad_token_id
                ids, mask, reasons = trim_responses(generated, stops, pad)
                if self.timed:
                    total = self._clock() - began
                    # How the batch was made: the first call's openings, a later turn's ids put
                    # together from the rows' last prompts ("text"), or its rows processed whole.
                    batch_kind = "first" if first_call else "text" if self._text_only else "rows"
                    phases = {"rows": len(keys), "batch": batch_kind, "process_s": processed - began, **phases,
                              "total_s": total}
                    parts = ("total_s", "decode_wait_s", "inputs_media_s")  # parts of others, or the whole
                    phases["rest_s"] = total - sum(v for k, v in phases.items() if k.endswith("_s") and k not in parts)
                    self.stats["phases"].append(phases)
                return RolloutResult(response_ids=ids, response_mask=mask, finish_reasons=reasons,
                                     prompt_index=torch.arange(len(conversations)),
                                     logprobs=None if logprobs is None else logprobs * mask,
                                     prompt_inputs=batch if prefixes is None else None)
        self.stats["turns"] += 1
        if prefixes is not None:
            return rollout.continue_from(conversations, prefixes, params)
        return rollout.generate(conversations, params)

    def _clock(self) -> float:
        """The host clock; with `timed`, after the device finished what was queued."""
        device = self.rollout.engine.dist.device
        if self.timed and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()

    def _opening_sharing(self, conversations: list[list[dict]]) -> SharedMedia | bool | None:
        """How the first call's repeated openings are shared: a `SharedMedia` of the
        distinct ones where they hold media (each processed alone once), True where they
        repeat without media (`distinct_prompts` then finds the equal rows by their
        tokens), None where none repeats or the rollout prefills every row."""
        if not self.rollout.prefill_once:
            return None
        owners = [_opening_key(conversation) for conversation in conversations]
        if len(set(owners)) == len(owners):
            return None
        if not any(_media_parts(conversation) for conversation in conversations):
            return True
        return SharedMedia.of(self.processing, conversations, owners)

    def _process(self, conversations: list[list[dict]], per_row: bool, light: bool = False) -> dict:
        """The conversations processed whole, as plain `generate` gets them. With `per_row`
        (later turns) and images: each row processed alone with each list of images processed once per
        content (`_ImageMemo`: a tool's reply is often the same crop for every sample of a
        prompt), then collated (`Processing.collate_rows`, checked once against processing
        the rows together); one processor call over every row where that cannot be done.
        With `light` (trusted by `_light_matches`), the pixel tensors of `_pixel_keys` are left
        out of the collated batch: the suffix takes them from its new chunks alone."""
        images = getattr(getattr(self.processing, "processor", None), "image_processor", None)
        if (not per_row or images is None or self.processing.collate_matches is False or self._per_row_failed
                or not any(_media_parts(conversation) for conversation in conversations)):
            return dict(self.processing(conversations))
        rows = None
        try:
            with self._memoized_images():
                rows = [dict(self.processing([conversation])) for conversation in conversations]
        except Exception:  # noqa: BLE001 - a processor that will not take the wrapper: process as before
            self._per_row_failed = True
        if rows is None:
            return dict(self.processing(conversations))
        if any(row.keys() != rows[0].keys() for row in rows):  # rows with media beside rows without
            return dict(self.processing(conversations))
        if light and self.processing.collate_matches:
            self.stats["light_turns"] += 1
            return self.processing.collate([{k: v for k, v in row.items() if k not in self._pixel_keys}
                                            for row in rows])
        return self.processing.collate_rows(rows, conversations)

    def _text_path(self) -> bool:
        """Whether later turns may put their ids together from the rows' last prompts
        (`_text_batch`): a processor of images, processed by `Processing`'s own path
        (which `process_texts` is part of), not found to differ from processing whole."""
        processing = self.processing
        return (_TEXT.get(self.rollout) is not False and self._light is not False and processing.is_multimodal
                and getattr(getattr(processing, "processor", None), "image_processor", None) is not None
                and type(processing).__call__ is Processing.__call__)

    def _text_batch(self, keys: list, conversations: list[list[dict]]) -> dict | None:
        """The turn's batch of token entries (ids, mask, per-token entries; no media) with
        each row's ids put together from its last prompt's and the text added since
        (`mmrl.rollout.text_suffix`), the new images processed once per content; None
        where a row cannot be continued that way (a new sample, a template that rewrites
        earlier turns, ids that do not begin with the row's: the prefix rule)."""
        rows = [self.samples.get(key) for key in keys]
        if not self._text_path() or any(row is None or row.anchor is None for row in rows):
            return None
        try:
            return self._pieced(rows, conversations)
        except Exception:  # noqa: BLE001 - a text the processor refuses in pieces: processed whole, as before
            return None

    def _pieced(self, rows: list[_Row], conversations: list[list[dict]]) -> dict | None:
        """`_text_batch`'s batch of the continuing `rows` (None where one does not continue)."""
        texts = [self.processing.render(conversation) for conversation in conversations]
        added = [conversation[row.messages:] for row, conversation in zip(rows, conversations)]
        media = [self.processing.collect_media(messages) for messages in added]
        layouts = [tuple(tuple(sorted((k, self._layout(v)) for k, v in part.items())) for part in _media_parts(messages))
                   for messages in added]
        with self._memoized_images():
            pieces = continued(self.processing, self._cuts, [row.anchor for row in rows], [row.tokens for row in rows],
                               texts, media, layouts)
        if pieces is None or any(piece["input_ids"][:len(row.tokens)] != row.tokens for piece, row in zip(pieces, rows)):
            return None
        self._texts = texts
        return self.processing.collate([{"input_ids": torch.tensor([piece["input_ids"]]),
                                         "attention_mask": torch.ones(1, len(piece["input_ids"]), dtype=torch.long),
                                         **{k: v[None] for k, v in piece.items() if k != "input_ids"}}
                                        for piece in pieces])

    def _anchors(self, conversations: list[list[dict]], ids: list[list[int]], batch: dict) -> list[Anchor | None]:
        """Each row's `Anchor` of its prompt this turn (None each where the text path is off)."""
        if not self._anchorable or not self._text_path():
            return [None] * len(ids)
        if self._cuts is None:
            self._cuts = CutPoints(self.processing.tokenizer)
        texts = self._texts or [self.processing.render(conversation) for conversation in conversations]
        real = batch["attention_mask"].bool().cpu()
        aligned = [k for k, v in batch.items() if k not in ("input_ids", "attention_mask")
                   and isinstance(v, torch.Tensor) and text_aligned(k, v, batch)]
        return [anchor(self.processing, self._cuts, text, row_ids, {k: batch[k][row].cpu()[real[row]] for k in aligned})
                for row, (text, row_ids) in enumerate(zip(texts, ids))]

    @contextlib.contextmanager
    def _memoized_images(self):
        """Within the block the processor processes each list of images once by content
        (`_ImageMemo`, kept for the session): the rows of a later turn and the new images
        processed alone (`_chunk`) share one processing of each reply image."""
        processor = getattr(self.processing, "processor", None)
        images = getattr(processor, "image_processor", None)
        if images is None or self._per_row_failed:
            yield
            return
        if self._image_memo is None or self._image_memo.inner is not images:
            self._image_memo = _ImageMemo(images, self._content)
        processor.image_processor = self._image_memo
        try:
            yield
        finally:
            processor.image_processor = images

    def _leave_pool(self) -> None:
        """Between calls the kept cache is the session's alone: the rollout reuses (and
        resets) the caches of its pool for any other call, such as a validation between
        two rounds of a partial rollout."""
        pool = self.rollout.caches
        self._pool_key = next((key for key, cache in pool.items() if cache is self.cache), None)
        if self._pool_key is not None:
            del pool[self._pool_key]

    def _rejoin_pool(self) -> None:
        """The kept cache back in the rollout's pool for this call, where the decode loop
        and its recorded graphs (`GraphedStep.start`) count it as live."""
        if self.cache is not None and self._pool_key is not None:
            self.rollout.caches[self._pool_key] = self.cache
        self._pool_key = None

    # -- a turn ------------------------------------------------------------------------------
    def _turn(self, keys: list, conversations: list, batch: dict, params: SamplingParams, shared=None):
        """One turn's tokens and log-probs, and (with `timed`) its phases' seconds.
        `shared`: the first call's repeated openings (`_opening_sharing`)."""
        rollout = self.rollout
        rollout.check_supported(params)
        began = self._clock()
        model = rollout.decoder_model()
        device = rollout.engine.dist.device
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        distinct = None
        if shared is not None:
            media = shared.on(device) if isinstance(shared, SharedMedia) else None
            distinct = distinct_prompts(inputs, media, placeholder_tokens(model))
        # Light later turns whose suffix positions are trusted skip the whole rows' positions.
        skip = self.cache is not None and self._light is not None and _POSITIONS.get(rollout) is True
        if distinct is None:
            positions = distinct_positions = None if skip else rollout.position_ids(model, inputs)
        else:  # a row's positions depend on that row alone
            distinct_positions = rollout.position_ids(model, distinct.batch)
            positions = distinct.expand(distinct_positions)
        real = inputs["attention_mask"].bool()
        # From the host's batch: no copy back from the device.
        ids = [row[keep].tolist() for row, keep in zip(batch["input_ids"].cpu(), batch["attention_mask"].bool().cpu())]
        was_training = model.training
        model.eval()
        try:
            with rollout.decoding(model, params) as run:
                starts = media = chunks = None
                media_began = media_ended = self._clock()
                if self.cache is not None:
                    try:
                        starts, media, chunks = self._continuation(keys, conversations, inputs, ids, run)
                    except _Reprefill as reason:
                        self.stats["reprefill_reason"] = str(reason)
                    media_ended = self._clock()
                    if starts is None and any(key not in inputs for key in self._pixel_keys):
                        # A light batch (`_process`) prefilled whole: its pixel tensors processed after all.
                        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                  for k, v in self._process(conversations, per_row=True).items()}
                    if starts is None and positions is None:
                        positions = distinct_positions = rollout.position_ids(model, inputs)
                    if self._light is None and media:
                        _LIGHT[rollout] = self._light_matches(model, inputs, positions, media, chunks)
                prefill_began = self._forward_began = self._clock()
                if starts is None:
                    logits, end, prefill_rows = self._prefill_whole(run, inputs, positions, params, distinct,
                                                                    distinct_positions)
                else:
                    offsets = [self.samples[key].next_position if start else None for key, start in zip(keys, starts)]
                    logits, end, prefill_rows, begin = self._prefill_suffix(run, inputs, positions, ids, starts, media,
                                                                            chunks, params, offsets)
                if positions is not None:  # the whole rows' (else the trusted suffixes')
                    begin = next_positions(positions, real)
                decode_began = self._clock()
                decoded = rollout.decode_tokens(run, self.cache, logits, self.mask, begin,
                                          inputs["input_ids"], self.length, end, home=self.cache)
                decode_ended = self._clock()
        finally:
            model.train(was_training)
        generated, logprobs = decoded.trimmed(run.stops)
        _, response_mask, _ = trim_responses(generated, self.processing.stop_token_ids,
                                             self.processing.tokenizer.pad_token_id)
        lengths = response_mask.sum(-1).long().tolist()
        self._record(keys, conversations, ids, generated, lengths, end, decoded.steps, starts, begin, batch)
        rollout.stats = {"steps": decoded.steps, "final_rows": decoded.final_rows}
        self.stats["turns"] += 1
        self.stats["whole_tokens"] += sum(map(len, ids))
        self.stats["cache_rows"].append(len(keys))
        # Host work before the prefill (positions, finding each row's suffix and its media),
        # the prefill, the decode loop (`decode_wait_s` of it: the host waiting at its looks
        # at the running rows) and what follows (tokens to the host, the rows' records).
        # `suffix_s`: a later turn's suffixes laid out before its prefill's forward (their
        # gather, positions, media sharing, room made in the cache).
        # `inputs_media_s` (of `inputs_s`): finding each continuing row's suffix and its new
        # media (the new images processed once per content, cut or joined).
        phases = {"inputs_s": prefill_began - began, "inputs_media_s": media_ended - media_began,
                  "suffix_s": self._forward_began - prefill_began,
                  "prefill_s": decode_began - self._forward_began,
                  "decode_s": decode_ended - decode_began, "decode_wait_s": decoded.waited_s,
                  "record_s": self._clock() - decode_ended, "prefill_rows": prefill_rows,
                  "decode_steps": decoded.steps} if self.timed else {}
        return generated, logprobs, phases

    def _prefill_whole(self, run: DecodeRun, inputs: dict, positions: torch.Tensor, params: SamplingParams,
                       distinct: DistinctPrompts | None = None, distinct_positions: torch.Tensor | None = None):
        """Every conversation into a fresh cache, as the one-turn loop does: with `distinct`
        (the rows' distinct openings, `distinct_positions` theirs), each one once, its cache
        rows copied out to the rows that repeat it. Returns the last logits, the fill and
        the rows prefilled."""
        rows, width = inputs["input_ids"].shape
        self.length = self.rollout.cache_length(width + max(params.max_new_tokens, self.reserve))
        mask = inputs["attention_mask"]
        self.mask = torch.cat([mask, mask.new_ones(rows, self.length - width)], 1)
        if distinct is None:
            self.cache = self.rollout.static_cache(rows, self.length, run.dtype)
            logits = self.rollout.prefill(run, self.cache, inputs, positions)
            prefilled_rows = rows
            self.stats["prefill_tokens"] += int(mask.sum())
        else:
            self.cache, logits = self.rollout.prefill_distinct(run, distinct, distinct_positions, self.length)
            prefilled_rows = distinct.count
            self.stats["prefill_tokens"] += int(distinct.batch["attention_mask"].sum())
            self.stats["shared_openings"] += rows - distinct.count
        self.fill = width
        return logits, width, prefilled_rows

    def _prefill_suffix(self, run: DecodeRun, inputs: dict, positions: torch.Tensor | None, ids: list[list[int]],
                        starts: list[int], media: dict, chunks: list[_Chunk], params: SamplingParams,
                        offsets: list[torch.Tensor | None]):
        """Each row's tokens from `starts[row]` on (its real tokens' order), left-padded
        together, into the kept cache at its fill. Where rows' new media repeat (`chunks`:
        one per row, a chunk per content) and the family shares media, each distinct
        chunk is encoded once (`mmrl.engine.media.sharing`). `positions`: the whole rows'
        (None: trusted to be `_suffix_positions`, from each row's `offsets`). Returns the last
        logits, the fill, the rows prefilled and the decode loop's first positions."""
        rows = len(ids)
        width = max(len(row) - start for row, start in zip(ids, starts))
        if self.fill + width + params.max_new_tokens > self.length:
            self._make_room(run, width + params.max_new_tokens)
        whole = positions if positions is not None else inputs["attention_mask"]  # a stand-in: not used
        suffix, places, suffix_mask = _suffixes(inputs, whole, starts, width, self.processing.tokenizer.pad_token_id)
        alone = self._suffix_positions(run.model, {**suffix, **media}, suffix_mask, offsets)
        if positions is None:
            places = alone
            self.stats["alone_positions"] += 1
        elif self._light is True and _POSITIONS.get(self.rollout) is None and alone is not None:
            _POSITIONS[self.rollout] = bool(torch.equal(alone, places)) and torch.equal(
                next_positions(alone, suffix_mask), next_positions(positions, inputs["attention_mask"].bool()))
        self.mask[:, self.fill:self.fill + width] = suffix_mask.to(self.mask.dtype)
        self.mask[:, self.fill + width:] = 1  # the decode steps' slots
        shared = self._suffix_sharing({**suffix, **media}, chunks, run.model) if media else None
        self._forward_began = self._clock()
        with sharing(run.model, {**suffix, **media}, shared):
            logits = self.rollout.prefill(run, self.cache, {**suffix, "attention_mask": self.mask, **media}, places,
                                          layers=True)
        self.fill += width
        self.stats["prefill_tokens"] += int(suffix_mask.sum())
        return logits, self.fill, rows, next_positions(places, suffix_mask)

    def _suffix_positions(self, model, suffix: dict, mask: torch.Tensor,
                          offsets: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The suffixes' positions from the suffixes alone (the adapter's positions of the
        suffix batch, each row's shifted by where its last sampled token sits: rope's
        positions after a text token are the earlier ones' largest plus what follows),
        zero in padding as `_suffixes` lays them out; None where a continuing row's start
        is not known. Checked once per rollout against the whole rows' (`_POSITIONS`)."""
        if all(offset is None for offset in offsets):
            return None
        alone = self.rollout.position_ids(model, {**suffix, "attention_mask": mask.long()})
        known = next(offset for offset in offsets if offset is not None)
        # A row prefilled whole (no offset) gets its positions from itself: no shift.
        shift = torch.stack([known.new_zeros(known.shape) if offset is None else offset for offset in offsets],
                            -1)  # (axes..., rows)
        return torch.where(mask, alone + shift[..., None], torch.zeros_like(alone))

    def _suffix_sharing(self, suffix: dict, chunks: list[_Chunk], model) -> SharedMedia | None:
        """Each distinct chunk of the suffixes' new media as one piece (`SharedMedia.of_singles`,
        which checks they lay out `suffix`'s media), where the family shares media and one repeats."""
        if not self.rollout.engine.shares_media:
            return None
        distinct: dict[int, _Chunk] = {}
        for chunk in chunks:
            if chunk.tensors:
                distinct.setdefault(id(chunk), chunk)
        if len(distinct) == sum(1 for chunk in chunks if chunk.tensors):
            return None  # no chunk repeats: nothing to share
        index = {key: i for i, key in enumerate(distinct)}
        parts = [[index[id(chunk)]] if chunk.tensors else [] for chunk in chunks]
        singles = [chunk.processed for chunk in distinct.values()]
        if self._text_only:
            # The suffixes' media are these chunks' joined (`_suffix_media`), which also
            # checked each row's placeholder counts: laid out as `of_singles` checks.
            shared = SharedMedia(list(range(len(parts))), singles, parts)
        else:
            shared = SharedMedia.of_singles(singles, parts, suffix, placeholder_tokens(model))
        self.stats["shared_media_rows"] += 0 if shared is None else len(chunks) - len(distinct)
        return shared

    def _record(self, keys: list, conversations: list, ids: list[list[int]], generated: torch.Tensor,
                lengths: list[int], end: int, steps: int, starts: list[int] | None, begin: torch.Tensor,
                batch: dict) -> None:
        """What each row holds after the turn: its prompt and sampled tokens, of which the
        last is not in the cache; slots after it (the stop token fed to a finished row,
        padding) leave the mask. `batch`: the turn's processed prompts (for each row's
        `Anchor`)."""
        # Per row, the slots from its last sampled token's on (one masked fill, not a write per row).
        last = torch.tensor([end + length - 1 for length in lengths], device=self.mask.device)
        self.mask.masked_fill_(torch.arange(self.mask.shape[1], device=self.mask.device) >= last[:, None], 0)
        anchors = self._anchors(conversations, ids, batch)
        for row, (key, length) in enumerate(zip(keys, lengths)):
            previous = self.samples.get(key)
            continued = starts is not None and starts[row] > 0 and previous is not None
            self.samples[key] = _Row(tokens=ids[row] + generated[row, :length].tolist(),
                                     messages=len(conversations[row]),
                                     media=self._grown_media(previous, conversations[row]) if continued else None,
                                     next_position=begin[..., row] + length, anchor=anchors[row])
        self.fill = end + steps - 1
        self.rows = list(keys)
        # Samples missing from this call left the cache: what their rows held goes too (a
        # partial rollout's session lives for the whole run).
        self.samples = {key: self.samples[key] for key in keys}

    # -- what continues --------------------------------------------------------------------
    def _continuation(self, keys: list, conversations: list, inputs: dict, ids: list[list[int]], run: DecodeRun):
        """Where each row's prefill starts (0: its whole conversation) and the media inputs
        of what it prefills; the cache's rows rearranged to `keys` first."""
        starts = []
        for key, row_ids in zip(keys, ids):
            row = self.samples.get(key)
            starts.append(row.cached if row is not None and row_ids[:len(row.tokens)] == row.tokens else 0)
        if not any(starts):
            raise _Reprefill("no sample's conversation continues the tokens its cache row holds")
        reprefilled = sum(1 for start in starts if start == 0)
        media, chunks = self._suffix_media(keys, conversations, inputs, ids, starts)
        self._keep_rows([self.rows.index(key) if key in self.samples else 0 for key in keys], run)
        for row, start in enumerate(starts):
            if start == 0:
                self.mask[row] = 0
        if reprefilled:
            self.stats["reprefilled_samples"] += reprefilled
            self.stats["reprefill_reason"] = "a conversation does not begin with its cache row's tokens"
        return starts, media, chunks

    def _suffix_media(self, keys: list, conversations: list, inputs: dict, ids: list[list[int]],
                      starts: list[int]) -> tuple[dict[str, torch.Tensor], list[_Chunk]]:
        """The media inputs of the rows' suffixes: the part of each media tensor of the whole
        batch that belongs to the images each suffix holds; and per row, the chunk of media
        its suffix holds (none where the batch has no media)."""
        media_keys = [k for k, v in inputs.items()
                      if k != "attention_mask" and isinstance(v, torch.Tensor) and not text_aligned(k, v, inputs)]
        others = [k for k, v in inputs.items() if not isinstance(v, torch.Tensor) and v is not None]
        if others:
            raise _Reprefill(f"processed inputs that are not tensors: {', '.join(others)}")
        if not media_keys and not self._text_only:
            if self._check_text:  # no row holds media: the text path's media (none) are the whole rows'
                _TEXT[self.rollout] = True
            return {}, []
        placeholders = placeholder_tokens(self.rollout.decoder_model())
        before, new = [], []
        for key, conversation, row_ids, start in zip(keys, conversations, ids, starts):
            row = self.samples.get(key)
            if start:
                if row.media is None:
                    row.media = self._chunk(_media_parts(conversation[:row.messages])).sizes()
                chunk = self._chunk(_media_parts(conversation[row.messages:]))
                before.append(row.media)
            else:
                chunk = self._chunk(_media_parts(conversation))
                before.append({})
            new.append(chunk)
            suffix = row_ids[start:]
            for token in placeholders:
                if suffix.count(token) != chunk.placeholders.get(token, 0):
                    raise _Reprefill("the new images' placeholder tokens are not those the suffix holds")
        # Every media tensor of a text-only batch (`_text_batch`), the pixel tensors a light
        # batch left out (`_process`): the new chunks' alone, joined.
        keys = list(dict.fromkeys(k for chunk in new for k in chunk.tensors))
        if self._text_only:
            return {key: _joined(key, new) for key in keys}, new
        cut = {key: _cut(key, inputs[key], before, new) for key in media_keys
               if any(key in chunk.tensors for chunk in new)}
        media = {**cut, **{key: _joined(key, new) for key in self._pixel_keys if key not in inputs and key in keys}}
        if self._check_text:  # the text path's media (the new chunks joined) must be the whole rows'
            joined = {key: media[key] if key in self._pixel_keys and key not in inputs else _joined(key, new)
                      for key in keys}
            _TEXT[self.rollout] = media.keys() == joined.keys() and all(torch.equal(media[key], joined[key])
                                                                        for key in media)
        return media, new

    def _light_matches(self, model, inputs: dict, positions: torch.Tensor, media: dict,
                       chunks: list[_Chunk]) -> tuple[bool, tuple[str, ...]]:
        """Whether later turns may leave the whole conversations' pixel tensors out (checked
        once, then trusted, as `Processing.collate_rows` is): each floating or boolean media
        tensor of this turn's suffixes, cut from the whole batch, equals its new chunks'
        tensors joined along the first dimension (not a layout of one row per
        sample, whose padding depends on every row's images), and the adapter's positions of the whole
        rows are the same without those tensors. Returns (whether, those tensors' keys)."""
        keys = tuple(k for k, v in media.items() if v.is_floating_point() or v.dtype == torch.bool)
        if not keys or any(k not in inputs for k in keys):
            return False, ()
        if any(chunk.sizes()[k][1] is not None for chunk in chunks for k in keys if k in chunk.tensors):
            return False, ()  # a row-per-image layout (padded to the batch's images): only the whole batch gives it
        if not all(torch.equal(_joined(key, chunks), media[key]) for key in keys):
            return False, ()
        without = {k: v for k, v in inputs.items() if k not in keys}
        if not torch.equal(self.rollout.position_ids(model, without), positions):
            return False, ()
        return True, keys

    def _chunk(self, parts: list[dict]) -> _Chunk:
        """`parts` (media parts of a conversation) processed alone, once per session and
        content: the samples of one prompt often get equal images in distinct objects (a
        tool's crop of the prompt's image), processed once for all of them. Its tensors
        are kept on the device, where the batch's tensors they are checked against live."""
        identity = tuple(tuple(sorted((k, self._content(v)) for k, v in part.items())) for part in parts)
        if identity not in self._chunks:
            if not parts:
                chunk = _Chunk({}, {})
            else:
                conversation = [{"role": "user", "content": parts}]
                try:
                    with self._memoized_images():
                        processed = dict(self.processing([conversation]))
                except Exception:  # noqa: BLE001 - a processor that will not take the wrapper (`_process`)
                    self._per_row_failed = True
                    processed = dict(self.processing([conversation]))
                device = self.rollout.engine.dist.device
                tensors = {k: v.to(device) for k, v in processed.items()
                           if k != "attention_mask" and isinstance(v, torch.Tensor)
                           and not text_aligned(k, v, processed)}
                counted = processed["input_ids"][0]
                chunk = _Chunk(tensors, {int(t): int((counted == t).sum()) for t in counted.unique()},
                               {**processed, **tensors})
            self._chunks[identity] = (chunk, parts)
        return self._chunks[identity][0]

    def _layout(self, value) -> object:
        """What of a media part's field its tokens depend on: an image's mode and size (a
        processor lays out an image's placeholder tokens by its size, not its pixels; the
        text path's first turn checks the ids against processing the rows whole), anything
        else its `_content`."""
        if _is_image(value):
            return ("layout", value.mode, tuple(value.size))
        return self._content(value)

    def _content(self, value) -> object:
        """What a media part's field holds, comparable across objects: an image's mode,
        size and which of the session's distinct pixel contents it has (once per object),
        a text or number as it is, anything else by identity."""
        if isinstance(value, (str, int, float, bool, type(None))):
            return value
        if not _is_image(value):
            return ("object", id(value))
        known = self._digests.get(id(value))
        if known is None or known[0] is not value:
            # Every sample's reply image is a new object, so a turn looks at one per row: its
            # pixels are compared whole with the earlier ones that agree with them at every
            # `_SAMPLED`th byte (a few hundred bytes hashed), with no digest of the whole.
            pixels = value.tobytes()
            bucket = (value.mode, tuple(value.size), hash(pixels[::_SAMPLED]))
            alike = self._contents.setdefault(bucket, [])
            index = next((i for i, seen in enumerate(alike) if seen == pixels), None)
            if index is None:
                index = len(alike)
                alike.append(pixels)
            known = self._digests[id(value)] = (value, (*bucket, index))
        return known[1]

    def _grown_media(self, row: _Row, conversation: list) -> dict[str, tuple[int, int | None]] | None:
        """A continued row's media sizes with the chunk its turn added (None where its
        earlier media were never learned: a text-only family, or no media key yet)."""
        if row.media is None:
            return None
        chunk = self._chunk(_media_parts(conversation[row.messages:]))
        grown = dict(row.media)
        for key, (joined, per_row) in chunk.sizes().items():
            had_joined, had_per_row = grown.get(key, (0, 0))
            items = None if per_row is None or had_per_row is None else had_per_row + per_row
            grown[key] = (had_joined + joined, items)
        return grown

    # -- the cache ---------------------------------------------------------------------------
    def _keep_rows(self, index: list[int], run: DecodeRun) -> None:
        """The cache's rows `index`, in that order (rows of finished samples leave)."""
        if index == list(range(len(self.rows))):
            return
        chosen = torch.tensor(index, device=run.device)
        if len(index) != len(self.rows):
            self.cache = self.rollout.moved(self.cache, chosen, self.length)
        else:  # as many rows (rearranged): the rollout keeps one cache per width, this one
            for layer in self.cache.layers:
                layer.keys.copy_(layer.keys.index_select(0, chosen))
                layer.values.copy_(layer.values.index_select(0, chosen))
        self.mask = self.mask[chosen]

    def _make_room(self, run: DecodeRun, needed: int) -> None:
        """Room for `needed` more slots: each row's real slots move to the front (in order,
        right-aligned to the longest row), in a longer cache only where that is not enough."""
        real = self.mask != 0
        rows, filled = len(real), int(real.sum(-1).max())
        length = self.length if filled + needed <= self.length else self.rollout.cache_length(filled + needed)
        # Per row: its holes first, then its real slots in order; the last `filled` of them.
        order = torch.sort(real.int(), dim=1, stable=True).indices[:, self.length - filled:]
        target = self.cache if length == self.length else self.rollout.static_cache(rows, length, run.dtype)
        for old, new in zip(self.cache.layers, target.layers, strict=True):
            moved = [t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                     for t in (old.keys, old.values)]
            if not new.is_initialized:
                new.lazy_initialization(*moved)
            new.keys[:, :, :filled].copy_(moved[0])
            new.values[:, :, :filled].copy_(moved[1])
            new.cumulative_length.fill_(filled)
        mask = self.mask.new_zeros(rows, length)
        mask[:, :filled] = self.mask.gather(1, order)
        self.cache, self.mask, self.length, self.fill = target, mask, length, filled


class _ImageMemo:
    """A processor's image processor that processes each list of images once by content
    (`content`: a key per image) and keyword arguments; every other attribute is the
    wrapped one's. A processor that calls another method of it processes as before."""

    def __init__(self, inner, content):
        self.inner, self.content = inner, content
        self.outputs: dict[tuple, object] = {}
        self.calls = 0  # the wrapped processor's calls (tests)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, images, *args, **kwargs):
        flat, pending = [], [images]
        while pending:  # images, or lists of them (per sample), in order
            item = pending.pop(0)
            if isinstance(item, (list, tuple)):
                pending[:0] = list(item)
            else:
                flat.append(item)
        key = (tuple(self.content(image) for image in flat), repr(args), repr(sorted(kwargs.items())),
               repr(_nesting(images)))
        if key not in self.outputs:
            self.outputs[key] = self.inner(images, *args, **kwargs)
            self.calls += 1
        out = self.outputs[key]
        # A fresh mapping each call, the first included: a processor may pop or add entries
        # of what it gets (Idefics3 pops the images' rows and columns).
        return copy.copy(out)  # UserDict (BatchFeature) and dict copy their mapping


def _is_image(value) -> bool:
    """Whether a media part's field holds a PIL image (what `_content` and `_layout` key by)."""
    return all(hasattr(value, name) for name in ("tobytes", "mode", "size"))


def _nesting(images) -> object:
    """The list structure of `images` without the images (part of what a call is)."""
    return [_nesting(item) for item in images] if isinstance(images, (list, tuple)) else None


def _suffixes(inputs: dict, positions: torch.Tensor, starts: list[int], width: int, pad: int):
    """Each row's real tokens from its `starts[row]`-th on, left-padded to `width`: the
    token ids (`pad` where none), every other per-token entry (zeros), the positions
    (`positions`: (rows, S) or (axes, rows, S)) and a mask of the real slots (bool); one
    gather for all rows (a row's real tokens may lie anywhere in it, in order)."""
    real = inputs["attention_mask"].bool()
    rows = real.shape[0]
    rank = real.long().cumsum(1) - 1  # each real token's place among its row's real tokens
    begin = torch.tensor(starts, device=real.device)
    take = real & (rank >= begin[:, None])
    row, column = take.nonzero(as_tuple=True)
    slot = width - take.sum(1)[row] + rank[row, column] - begin[row]
    aligned = [k for k, v in inputs.items() if k not in ("input_ids", "attention_mask") and text_aligned(k, v, inputs)]
    suffix = {"input_ids": inputs["input_ids"].new_full((rows, width), pad),
              **{k: inputs[k].new_zeros(rows, width) for k in aligned}}
    for key, value in suffix.items():
        value[row, slot] = inputs[key][row, column]
    places = positions.new_zeros((*positions.shape[:-2], rows, width))
    places[..., row, slot] = positions[..., row, column]
    mask = torch.zeros(rows, width, dtype=torch.bool, device=real.device)
    mask[row, slot] = True
    return suffix, places, mask


def _opening_key(conversation: list[dict]) -> tuple:
    """What makes two openings the same: their messages' texts and fields, their media by
    identity (equal pixels in two objects are not looked at: such openings prefill apart)."""
    def value(v):
        return v if isinstance(v, (str, int, float, bool, type(None))) else ("object", id(v))

    def part(p):
        return tuple(sorted((k, value(v)) for k, v in p.items())) if isinstance(p, dict) else value(p)

    return tuple((message.get("role"), message["content"] if isinstance(message.get("content"), str)
                  else tuple(part(p) for p in message.get("content") or ()),
                  tuple(sorted((k, value(v)) for k, v in message.items() if k not in ("role", "content"))))
                 for message in conversation)


def _media_parts(messages: Sequence[dict]) -> list[dict]:
    return [part for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if part.get("type") in MEDIA_TYPES]


def _cut(key: str, whole: torch.Tensor, before: list[dict], new: list[_Chunk]) -> torch.Tensor:
    """The part of `whole` (a media tensor of the batch) that the rows' new chunks hold,
    laid out as the processor lays out a batch: joined along the first dimension (each
    row's items after the row's earlier ones), or one row each along the first dimension
    with items along the second (rows without new items get one all-zero item, as the
    processor gives a row without media). Each cut is checked against its chunk processed
    alone; `_Reprefill` where neither layout gives the chunks back."""
    sizes = [(row.get(key, (0, 0)), chunk.sizes().get(key, (0, 0))) for row, chunk in zip(before, new)]
    totals = [old[0] + added[0] for old, added in sizes]
    if sum(totals) == whole.shape[0]:
        parts, offset = [], 0
        for (old, added), total, chunk in zip(sizes, totals, new):
            if added[0]:
                part = whole[offset + old[0]:offset + old[0] + added[0]]
                if not _same(chunk.tensors[key], part):
                    break
                parts.append(part)
            offset += total
        else:
            return torch.cat(parts)
    if whole.shape[0] == len(new) and whole.dim() > 2 and all(
            old[1] is not None and added[1] is not None and old[1] + added[1] <= whole.shape[1]
            for old, added in sizes):
        count = max(max(added[1] for _, added in sizes), 1)
        cut = whole.new_zeros(len(new), count, *whole.shape[2:])
        for row, ((old, added), chunk) in enumerate(zip(sizes, new)):
            if added[1]:
                part = whole[row, old[1]:old[1] + added[1]]
                if not _same(chunk.tensors[key][0], part):
                    break
                cut[row, :added[1]] = part
        else:
            return cut
    raise _Reprefill(f"the new images' part of {key!r} is not where their sizes put it")


def _joined(key: str, chunks: list[_Chunk]) -> torch.Tensor:
    """The chunks' `key` tensors joined along the first dimension, in row order (the
    layout `_cut` finds first; `_light_matches` checks it is the one the batch has)."""
    return torch.cat([chunk.tensors[key] for chunk in chunks if key in chunk.tensors])


def _same(alone: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether `part` (cut from a batch's tensor) is `alone` (processed by itself), up to
    the zeros a batch pads every dimension but the first with."""
    if alone.dim() != part.dim() or alone.shape[0] != part.shape[0] or any(
            a > b for a, b in zip(alone.shape[1:], part.shape[1:])):
        return False
    gap = [x for d in reversed(range(1, alone.dim())) for x in (0, part.shape[d] - alone.shape[d])]
    padded = torch.nn.functional.pad(alone, gap) if any(gap) else alone
    return torch.equal(padded.to(device=part.device, dtype=part.dtype), part)


__all__ = ["DecodeSession", "session_for"]
