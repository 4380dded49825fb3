"""HF rollout with a static KV cache and a compiled decode step (`rollout.backend: hf_compiled`).

    rollout = make_rollout("hf_compiled", engine, processing)
    result = rollout.generate(conversations, SamplingParams(n=8, max_new_tokens=256))

The same prompts, tokens and log-probs as the `hf` backend (greedy output is identical to
plain `generate`), sampled by a decode loop of our own over `model.forward`:

- the prompt batch (with its images) runs once, eagerly, into a transformers
  `StaticCache`, each distinct prompt once where samples repeat it (`mmrl.rollout.prefix`:
  its cache rows are copied out to its samples'; `prefill_once=False` prefills every row);
  every later step feeds one text token per row, so its shapes never
  change and `torch.compile(mode="reduce-overhead")` replays it as a CUDA graph;
- in those steps the text decoder's SDPA attention runs as two batched matmuls per
  layer, one query per row against its key/value heads (`decode_attention`): SDPA
  with a mask would first copy the whole cache out to every query head (grouped-query
  models), which took more of a GPU decode step than the rest of the layer; on CUDA the
  products read a bf16 cache as stored and return fp32 (an fp32 copy of the cache per
  step was a large share of a decode step: bench/rollout_speed.py measures both);
- positions come from the family's adapter (`position_ids`, 3-D for mrope): a new token
  sits one past its row's largest prompt position on every axis, which is what
  transformers' rope deltas give;
- token choice (the generation config's repetition penalty, blocked tokens,
  temperature, top-p, sampling) and the raw log-prob run inside the compiled step;
  finished rows emit padding;
- every few steps the loop looks at how many rows are still running: it stops when none
  are, and when half of them have finished it moves the running rows (and their cache)
  into a batch half as wide, so finished rows stop costing compute.

The prefill (`prefill`) and the decode loop (`decode_tokens`) are pieces a caller can run on a
cache it keeps: a multi-turn session (`mmrl.rollout.sessions`, what the agent loop opens
on this backend) prefills only a turn's new tokens and images into each sample's kept
row, and the loop writes the rows it moves out back into that cache.

Under FSDP2 each rank decodes its own prompts on an unsharded inference copy of the
weights, gathered from the shards after each update (`mmrl.rollout.inference_copy`;
`inference_copy` says whether it stays between rollouts): the decode loop is the same,
and no forward waits for another rank.

Where this cannot run (a family that computes its own positions or cannot take left
padding, a generation config with logits processors this loop lacks) or compiling fails,
the backend warns once and uses plain `generate` (under FSDP2 every rank at once, when
any rank fails). Speed: `python bench/rollout_speed.py`.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from dataclasses import dataclass

import torch

from mmrl.engine.compiled_layers import CompiledLayers
from mmrl.engine.media import placeholder_tokens, sharing
from mmrl.engine.surgery import decoder_layers
from mmrl.errors import one_line
from mmrl.compile_watch import watch
from mmrl.rollout.base import SamplingParams
from mmrl.rollout.graphs import GraphedStep, fill_counters, through_layers, viewed, with_update
from mmrl.rollout.hf import HFRollout
from mmrl.rollout.inference_copy import InferenceCopy
from mmrl.rollout.merged import MergedProjections
from mmrl.rollout.prefix import DistinctPrompts, distinct_prompts
from mmrl.wrappers import unwrapped

# Rows are compacted only in batches wider than this: below it a step costs about the
# same whatever the width. The widths the loop moves rows into are powers of two from here
# up: the batch width is a dynamic size of the one compiled graph, but triton specializes
# its kernels on sizes that divide by 16, so a width of 8 would compile them all again.
MIN_COMPACT_ROWS = 16
# Steps between looks at the running rows where a look waits for the device (the CPU).
CHECK_EVERY = 8
# On a GPU the loop reads each step's count of running rows from host memory, copied there
# behind the step's kernels, and waits only for the count of the step this many steps back:
# the device keeps that many steps queued while the host waits (no drained queue, no idle
# gap at a look), and a batch whose rows all stopped runs at most this many steps more.
LOOK_LEAD = 2
# Cache lengths are rounded up to a multiple of this, so prompts of similar length share
# their caches and compiled graphs.
CACHE_LENGTH_STEP = 256

# Generation-config fields whose logits processors plain `generate` would apply and this
# loop does not, with their no-op values.
_UNSUPPORTED = {
    "no_repeat_ngram_size": (None, 0), "min_length": (None, 0),
    "min_new_tokens": (None, 0), "bad_words_ids": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "sequence_bias": (None,), "begin_suppress_tokens": (None,),
    "suppress_tokens": (None,), "encoder_repetition_penalty": (None, 1.0),
    "exponential_decay_length_penalty": (None,), "num_beams": (None, 1), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
}
_UNSUPPORTED_SAMPLING = {"min_p": (None, 0.0), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0),
                         "eta_cutoff": (None, 0.0)}


DECODE_ATTENTION = "mmrl_decode"
DECODE_MODES = ("auto", "graphs", "compiled")
# What "auto" takes: bench/trl_grpo_step.py --whole-run measures both on a GPU.
AUTO_DECODE = "compiled"


class Unsupported(Exception):
    """This batch or model cannot take the compiled path (the message says why)."""


def choose_tokens(logits, unfinished, blocked, stops, pad_id: int, temperature: float, top_p: float,
                  want_logprobs: bool, seen=None, penalty: float = 1.0, noise=None):
    """One token per row from its last logits (float32), as `generate`'s processors
    choose it: the repetition penalty on tokens already in the row (`seen`, a (B, V)
    mask, where the generation config sets one), blocked tokens removed, then
    temperature and top-p, then a sample (greedy at temperature 0). Finished rows get
    `pad_id`. Returns the tokens, their log-probs under the raw logits (or None), which
    rows are still running, and `seen` with the new tokens (None without a penalty).
    `noise`: the sample's Exp(1) draws (B, V), drawn by the caller from a generator of its
    own (`SamplingParams.seed`); None draws them here from the default generator."""
    scores = logits
    if seen is not None:
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    scores = scores + blocked
    if temperature > 0:
        if temperature != 1.0:
            scores = scores / temperature
        if top_p < 1.0:
            ordered, order = scores.sort(dim=-1)
            drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
            drop[:, -1] = False  # the likeliest token always stays
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probs = scores.softmax(-1)
        # probs / Exp(1) noise: its argmax is a draw from probs (no host sync, graph-safe).
        if noise is None:
            noise = torch.empty_like(probs).exponential_()
        tokens = (probs / noise).argmax(-1)
    else:
        tokens = scores.argmax(-1)
    tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad_id))
    logprobs = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1) if want_logprobs else None
    unfinished = unfinished & ~(tokens[:, None] == stops).any(-1)
    if seen is not None:
        seen = seen.scatter(1, tokens[:, None], True)
    return tokens, logprobs, unfinished, seen


@dataclass
class DecodeRun:
    """What one rollout call decodes with: the model, the token choice's settings
    (`choose_tokens`' keywords), the stop tokens, and the dtype the caches store
    (autocast's, or None)."""

    model: torch.nn.Module
    params: SamplingParams
    pick: dict
    stops: torch.Tensor
    keep_last: dict
    dtype: torch.dtype | None
    device: torch.device
    # Draws the samples' noise where `SamplingParams.generator_seed` is set (None: the
    # default generator, inside the step).
    generator: torch.Generator | None = None

    def noise(self, rows: int, vocabulary: int) -> torch.Tensor | None:
        """The Exp(1) draws of one step's samples (`choose_tokens`' `noise`), or None."""
        if self.generator is None:
            return None
        return torch.empty(rows, vocabulary, device=self.device).exponential_(generator=self.generator)

    @property
    def penalty(self) -> float:
        return self.pick["penalty"]


@dataclass
class Decoded:
    """A decode loop's output: tokens (rows, max_new_tokens), right-padded, their
    log-probs (or None), the steps it ran, the rows still in its batch at the end, and the
    seconds the host waited for the device when it looked at the running rows (the rest
    of the loop's time the host spent launching steps)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    steps: int
    final_rows: int
    waited_s: float = 0.0

    def trimmed(self, stops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens and log-probs on the CPU, cut where `generate` ends its loop."""
        width = _used_width(self.tokens, stops)
        return self.tokens[:, :width].cpu(), None if self.logprobs is None else self.logprobs[:, :width].cpu()


def next_positions(positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's largest position over its real tokens, axis by axis (mrope's, and a
    text axis where the family adds one): the loop's step t sits at this + t, which is
    what transformers' rope deltas give (padding may hold any position)."""
    return positions.masked_fill(attention_mask == 0, -1).amax(-1)


class CompiledHFRollout(HFRollout):
    """`HFRollout` with a static-cache decode loop; `compile=False` runs the same loop
    eagerly (what CPU tests check), `compile_options` go to `torch.compile`. With sharded
    weights it decodes on an `InferenceCopy` ("auto", "keep" or "free" between rollouts);
    building one that does not fit raises `CopyDoesNotFit`."""

    backend = "hf_compiled"
    copy: InferenceCopy | None = None  # the sharded engine's inference copy (None: one process)
    takes_generator_seed = True  # `SamplingParams.generator_seed` (not where it gave up: plain generate)

    def __init__(self, engine, processing, compile: bool = True, compile_options: dict | None = None,
                 min_compact_rows: int = MIN_COMPACT_ROWS, check_every: int = CHECK_EVERY,
                 half_weights: bool = True, inference_copy: str = "auto", decode: str = "auto",
                 prefill_once: bool = True, merge_projections: bool | str = "auto", prefill_layers: bool = True):
        super().__init__(engine, processing)
        self.copy = InferenceCopy(engine, keep=inference_copy) if engine.sharded else None
        self.compile = compile
        # fp32 weights under autocast: cast the linear layers' weights once per rollout
        # instead of at every step (`_half_linears`): faster decoding, same tokens as
        # per-step casting (bench/results/rollout_speed_gpu_half.json holds the figure).
        self.half_weights = half_weights
        self._half_store: dict[str, torch.nn.Parameter] = {}
        # The decode steps' merged projections (`mmrl.rollout.merged`): True, False, or
        # "auto" (on a GPU when decoding in bf16/fp16); off for good after one runs out of memory.
        if merge_projections not in (True, False, "auto"):
            raise ValueError(f"rollout.merge_projections must be true, false or auto, got {merge_projections!r}")
        self.merge_projections = merge_projections
        self.merging = MergedProjections(engine.adapter.rollout.merged_projections,
                                         lambda model: decoder_layers(model, engine.adapter))
        self.merged_groups = 0  # how many groups the last decode merged
        self.min_compact_rows = min_compact_rows
        self.check_every = check_every
        self.compile_options = compile_options or {"mode": "reduce-overhead", "fullgraph": True}
        # How the decode step runs fast: "graphs" records the eager step as CUDA graphs
        # (`mmrl.rollout.graphs`, seconds), "compiled" compiles it (tens of seconds per graph).
        if decode not in DECODE_MODES:
            raise ValueError(f"rollout.decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
        self.decode = AUTO_DECODE if decode == "auto" else decode
        # The longest cache a compiled step has run on: shorter prompts reuse it (see
        # `cache_length`).
        self._longest_cache = 0
        self.fallback_reason: str | None = None  # set once the compiled path is given up
        self._step = None
        # The inference copy's decoder layers, compiled as the engine compiles its own
        # (`_step_layers`); built at the first recording that uses them.
        self._copy_layers: CompiledLayers | None = None
        self.caches: dict[tuple[int, int], object] = {}
        self._blocked: tuple | None = None  # ((vocabulary, device), the blocked ids, their mask): `_blocked_mask`
        # Rows that repeat a prompt (GRPO's n samples) are prefilled once per distinct prompt
        # (`mmrl.rollout.prefix`); False prefills every row (what the bench compares against).
        self.prefill_once = prefill_once
        # A later turn's prefill into a kept cache (`mmrl.rollout.sessions`) runs through the
        # compiled decoder layers the decode step records through (`prefill(layers=True)`);
        # False keeps it eager (what the bench compares against). Set False for good where a
        # layer's compile fails there.
        self.prefill_layers = prefill_layers
        # What the last call did: its decode steps and final batch width, and where its
        # seconds went (host clock; the loop's looks at the running rows wait for the device).
        self.stats: dict[str, float] = {}

    # -- the switch --------------------------------------------------------------------------
    def _sample(self, batch, shared, params: SamplingParams):
        if self.fallback_reason is None:
            result = failure = None
            try:
                if self.copy is not None:
                    # Collective: every rank gathers before anything that may fail on one rank alone.
                    self.copy.refresh(self.engine)
                result = self._fast_sample(batch, shared, params)
            except Exception as error:  # noqa: BLE001 - any failure falls back, once, loudly
                failure = one_line(error, typed=True)[:300]
            finally:
                if self.copy is not None and not self.copy.keep:
                    # Memory is short: the update gets the copy's and the caches' memory.
                    self.copy.release()
                    self.caches.clear()
            if self.copy is not None:
                # The ranks decode apart but fall back together: plain generate is collective.
                others = [f for f in self.engine.dist.all_gather_objects(failure) if f]
                failure = failure or (f"on another rank: {others[0]}" if others else None)
            if failure is None:
                return result
            self.give_up(failure)
        return super()._sample(batch, shared, params)

    def give_up(self, reason: str) -> None:
        """Plain `generate` from now on, said once (`reason`: why the compiled path failed)."""
        self.fallback_reason = reason
        self.caches.clear()
        if self.copy is not None:
            self.copy.keep = False
            self.copy.release()
        warnings.warn(f"rollout.backend=hf_compiled: using plain generate ({reason})", stacklevel=3)

    def session_unsupported(self) -> str | None:
        """Why a multi-turn session (`mmrl.rollout.sessions`) cannot keep this rollout's
        caches between turns, or None where it can."""
        from transformers import StaticCache

        if self.fallback_reason is not None:
            return f"the compiled path was given up ({self.fallback_reason})"
        if self.copy is not None:
            # Each rank decodes its own samples, and turns end at different times on different
            # ranks; the per-turn path keeps the ranks' collectives in step.
            return "sharded weights (each rank decodes on an inference copy)"
        if any(getattr(layer, "is_sliding", False)
               for layer in StaticCache(config=self._decoder_config(), max_cache_len=1).layers):
            return "sliding-window cache layers (their slots wrap around)"
        return None

    def sync(self, engine) -> None:
        """After an update: the inference copy (FSDP2) gathers the new weights, now when it
        is kept between rollouts, else at the next rollout."""
        if self.copy is None or self.fallback_reason is not None:
            return
        self.copy.stale()
        if self.copy.keep:
            self.copy.refresh(engine)

    def decoder_model(self) -> torch.nn.Module:
        """The model the loop runs: the engine's, or under FSDP2 the refreshed inference copy."""
        return self.engine.model if self.copy is None else self.copy.refresh(self.engine)

    def check_supported(self, params: SamplingParams) -> None:
        """Raise `Unsupported` where this loop cannot sample as plain `generate` would."""
        if not self.engine.adapter.left_padding:
            raise Unsupported("the family cannot take left padding (left_padding=False)")
        config = self.engine.model.generation_config
        fields = dict(_UNSUPPORTED, **({} if params.greedy else _UNSUPPORTED_SAMPLING))
        for name, neutral in fields.items():
            value = getattr(config, name, None)
            if name == "suppress_tokens" and value and set(value) <= set(self.processing.blocked_token_ids):
                continue  # an mmrl export's (`mmrl.export`): the loop blocks these anyway
            if value not in neutral and value != []:
                raise Unsupported(f"generation_config.{name}={value!r} has no equivalent here")

    # -- the loop ----------------------------------------------------------------------------
    def _fast_sample(self, batch, shared, params: SamplingParams):
        self.check_supported(params)
        began = time.perf_counter()
        recordings = self._recordings()
        model = self.decoder_model()
        if self.copy is not None:
            # What FSDP2 does to the root's floating inputs (pixels) under mixed precision.
            batch = {k: v.to(self.copy.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for k, v in batch.items()}
        device = self.engine.dist.device
        distinct = None
        if self.prefill_once:
            distinct = distinct_prompts(batch, shared.on(device) if shared else None, placeholder_tokens(model))
        # A row's positions depend on that row alone: the distinct prompts' are computed.
        positions = self.position_ids(model, batch if distinct is None else distinct.batch)
        rows, prompt_length = batch["input_ids"].shape
        length = self.cache_length(prompt_length + params.max_new_tokens)
        with self.decoding(model, params) as run:
            prefill_began = time.perf_counter()
            if distinct is not None:
                cache, logits = self.prefill_distinct(run, distinct, positions, length)
                positions = distinct.expand(positions)
            else:
                cache = self.static_cache(rows, length, run.dtype)
                with sharing(model, batch, shared.on(device) if shared and self.engine.shares_media else None):
                    logits = self.prefill(run, cache, batch, positions)
            if device.type == "cuda":
                # The prefill's device time counted as the prefill's (`stats`), not as the
                # decode's first wait; this stream only, and the device idles a few launches.
                torch.cuda.current_stream(device).synchronize()
            prompt_mask = batch["attention_mask"]
            mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, length - prompt_length)], 1)
            decode_began = time.perf_counter()
            decoded = self.decode_tokens(run, cache, logits, mask, next_positions(positions, prompt_mask),
                                   batch["input_ids"], length, prompt_length)
        decode_ended = time.perf_counter()
        out = decoded.trimmed(run.stops)  # waits for the device's last steps
        ended = time.perf_counter()
        # What the last call did (tests, benches and the overlap metrics read it).
        self.stats = {"steps": decoded.steps, "final_rows": decoded.final_rows,
                      "prefill_rows": rows if distinct is None else distinct.count,
                      "setup_s": prefill_began - began, "prefill_s": decode_began - prefill_began,
                      "decode_s": decode_ended - decode_began, "decode_wait_s": decoded.waited_s,
                      "trim_s": ended - decode_ended, "graphs_recorded": self._recordings() - recordings,
                      "merged_groups": self.merged_groups,
                      **self._decode_flags()}
        return out

    def position_ids(self, model, batch) -> torch.Tensor:
        """The adapter's position ids of `batch` (3-D for mrope); `Unsupported` where the family computes its own."""
        positions = self.engine.adapter.position_ids(model, batch)
        if positions is None:
            raise Unsupported("the family computes its own position ids")
        return positions

    @contextlib.contextmanager
    def decoding(self, model, params: SamplingParams):
        """The settings one rollout call decodes `model` with (a `DecodeRun`), inside the
        engine's autocast and, where it applies, with the linear layers' half copies."""
        device = self.engine.dist.device
        penalty = getattr(model.generation_config, "repetition_penalty", None) or 1.0
        pick = dict(pad_id=self.processing.tokenizer.pad_token_id, temperature=params.temperature,
                    top_p=params.top_p, want_logprobs=params.logprobs, penalty=penalty)
        keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        stops = torch.tensor(self.processing.stop_token_ids, device=device)
        generator = None
        if params.generator_seed is not None and not params.greedy:
            generator = torch.Generator(device).manual_seed(params.generator_seed)
        with self.engine.autocast(), contextlib.ExitStack() as stack:
            computes_in = _autocast_dtype()
            if self.half_weights and computes_in is not None:
                stack.enter_context(_half_linears(model, computes_in, self._half_store))
            yield DecodeRun(model, params, pick, stops, keep_last, computes_in, device, generator)

    def prefill(self, run: DecodeRun, cache, inputs: dict, positions: torch.Tensor,
                layers: bool = False) -> torch.Tensor:
        """One forward of `inputs` (token ids, their attention mask over the cache, media,
        per-token entries) into `cache` at its fill: the last position's logits, float32,
        (rows, vocab). Eager, or with `layers` through the compiled decoder layers the decode
        step uses (`prefill_layers`: the norms, rotary and activations fused, as in the decode
        step), where they exist and every layer of `cache` is written already (`viewed`):
        each layer then writes its own view of the cache in its graph. A first prefill is
        eager: its cache is not written yet, and a run of one turn per sample would pay the
        prefill graphs' compile for little (its prompts are prefilled once per distinct
        prompt)."""
        compiled = self._prefill_layers(cache) if layers else None
        failed_before = None if compiled is None else compiled.failed
        with through_layers(compiled):
            out = run.model(**inputs, position_ids=positions, past_key_values=cache, use_cache=True, **run.keep_last)
        if compiled is not None and compiled.failed and not failed_before:
            # The engine's updates keep their compiled layers; later prefills stay eager.
            warnings.warn(f"rollout: later turns' prefills eager from now on ({compiled.failed})"[:300], stacklevel=2)
            compiled.failed, self.prefill_layers = failed_before, False
        _unguarded(cache)
        return out.logits[:, -1].float()

    def _prefill_layers(self, cache) -> CompiledLayers | None:
        """The compiled layers a prefill into `cache` runs through (`prefill`), or None."""
        if not (self.prefill_layers and self.compile) or not viewed(cache):
            return None
        layers = self._step_layers()
        return None if layers is None or layers.failed else layers

    def prefill_distinct(self, run: DecodeRun, distinct: DistinctPrompts, positions: torch.Tensor, length: int):
        """The prefill of each distinct prompt once (`mmrl.rollout.prefix`; `positions`:
        theirs), into a cache of their rows, then copied out to every row that repeats one:
        the wide cache and the last position's logits `prefill` gives for the whole batch."""
        narrow = self.static_cache(distinct.count, length, run.dtype)
        logits = self.prefill(run, narrow, distinct.batch, positions)
        return self.moved(narrow, distinct.owners, length), logits.index_select(0, distinct.owners)

    def decode_tokens(self, run: DecodeRun, cache, logits: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
                prompt_ids: torch.Tensor, length: int, fill: int, home=None) -> Decoded:
        """Tokens from `logits` (the prefill's) on: the first chosen from them, then one
        decode step per token on `cache` (length `length`, its first `fill` slots written)
        until every row stopped or `max_new_tokens` are out. `mask` (rows, length) covers
        the cache's slots, the steps' included; `last` is each row's largest position so far (per axis);
        `prompt_ids` seed the repetition penalty. Rows that finished leave for a narrower
        cache (`moved`) when half of them have; with `home` (the cache a session keeps,
        `mmrl.rollout.sessions`), the rows' slots are written back into it before each
        move and at the end, so every row's cache survives the turn."""
        params, device, pick = run.params, run.device, run.pick
        rows, new_tokens = len(logits), params.max_new_tokens
        blocked = self._blocked_mask(logits.shape[-1], device)
        running = torch.ones(rows, dtype=torch.bool, device=device)
        # The penalty's memory of each row: its prompt (padding included, as `generate`
        # sees it) and every token it samples.
        seen = None
        if run.penalty != 1.0:
            seen = torch.zeros(rows, logits.shape[-1], dtype=torch.bool, device=device)
            seen.scatter_(1, prompt_ids.clamp(max=logits.shape[-1] - 1), True)
        vocabulary = logits.shape[-1]
        token, logprob, running, seen = choose_tokens(logits, running, blocked, run.stops, seen=seen,
                                                      noise=run.noise(rows, vocabulary), **pick)
        tokens = torch.full((rows, new_tokens), pick["pad_id"], dtype=torch.long, device=device)
        logprobs = torch.zeros(rows, new_tokens, device=device) if params.logprobs else None
        tokens[:, 0] = token
        if logprobs is not None:
            logprobs[:, 0] = logprob
        index = torch.arange(rows, device=device)  # row of the full batch each cache row holds
        step = self._compiled_step()
        # A step that keeps state between rollouts (a GraphedStep, or a bench's timer around
        # one: bench/decode_profile.py) starts each rollout here.
        start = getattr(step, "start", None)
        if start is not None:
            start(run.model, fill, self.caches.values())
        steps = 1
        lookout = _Lookout(device, self.check_every, LOOK_LEAD)
        with _decode_attention(run.model), self._merged(run):
            for t in range(1, new_tokens):
                alive = lookout.alive(running, t)
                if alive is not None:
                    if alive == 0:
                        break
                    width = len(index)
                    if width > self.min_compact_rows and alive <= width // 2:
                        keep = _compact_rows(running, max(self.min_compact_rows, 1 << (alive - 1).bit_length()))
                        if home is not None and cache is not home:
                            _write_back(home, cache, index)
                        cache = self.moved(cache, keep, length)
                        index, token, running, mask = (x[keep] for x in (index, token, running, mask))
                        seen = None if seen is None else seen[keep]
                        last = last[..., keep]
                place = (last + t).unsqueeze(-1)
                if self.compile and device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                ids = token[:, None]
                noise = run.noise(len(index), vocabulary)
                if self.compile:
                    _mark_dynamic_sizes(ids, place, mask, running, seen, cache, noise)
                token, logprob, running, seen = step(run.model, ids, place, mask, cache, running, blocked,
                                                     run.stops, seen, noise=noise, **pick)
                # The graph's outputs are overwritten by its next replay: keep copies.
                token, running = token.clone(), running.clone()
                seen = None if seen is None else seen.clone()
                tokens[index, t] = token
                if logprobs is not None:
                    logprobs[index, t] = logprob
                lookout.post(running)
                steps += 1
        if home is not None and cache is not home:
            _write_back(home, cache, index)
        return Decoded(tokens, logprobs, steps, len(index), lookout.waited)

    # -- pieces ------------------------------------------------------------------------------
    def _blocked_mask(self, vocabulary: int, device: torch.device) -> torch.Tensor:
        """The additive mask of the tokens never sampled (`processing.blocked_token_ids`: 0,
        or -inf where blocked), (vocabulary,), read-only: made again only where those ids,
        the vocabulary or the device changed since the last call (a list of every id but a
        few, as a vocabulary-restricting run has, takes tens of milliseconds to lay out)."""
        ids = self.processing.blocked_token_ids
        made = self._blocked
        if made is not None and made[0] == (vocabulary, device) and made[1] == ids:
            return made[2]
        mask = torch.zeros(vocabulary)
        index = torch.tensor(ids, dtype=torch.long)
        mask[index[index < vocabulary]] = float("-inf")
        mask = mask.to(device)
        self._blocked = ((vocabulary, device), list(ids), mask)
        return mask

    def cache_length(self, needed: int) -> int:
        """The cache length for `needed` positions: rounded up to CACHE_LENGTH_STEP and, when
        compiling, never shorter than the longest cache so far. The cache length is a python
        int inside transformers' StaticCache, so dynamo compiles the step again for the first
        new length (then treats the length as dynamic); that second compile costs about as
        much as the first (docs/performance.md, "What compiling costs a run"), so a shorter batch reuses
        the longer cache (its extra positions are masked) rather than pay it. Eager decoding
        (compile=False) takes the rounded length itself."""
        length = -(-needed // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP
        if self.compile:
            length = self._longest_cache = max(length, self._longest_cache)
        return length

    def _compiled_step(self):
        if self._step is None:
            step = decode_step_for(type(self.engine.model if self.copy is None else self.copy.model))

            def compiled():
                return torch.compile(step, **self.compile_options) if self.compile else step

            if self.decode == "graphs":
                capture = self.compile and self.engine.dist.device.type == "cuda"
                self._step = GraphedStep(choose_tokens, capture=capture, fallback=compiled,
                                         attention=DECODE_ATTENTION, on_record=watch().record,
                                         layers=self._step_layers())
            else:
                self._step = compiled()
        return self._step

    def merges(self, run: DecodeRun) -> bool:
        """Whether `run`'s decode steps merge projections (`rollout.merge_projections`)."""
        if self.merge_projections != "auto":
            return bool(self.merge_projections)
        dtype = run.dtype or next((p.dtype for p in run.model.parameters() if p.is_floating_point()), None)
        return run.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)

    @contextlib.contextmanager
    def _merged(self, run: DecodeRun):
        """The merged projections around the decode steps, where `merges`; yields how many
        groups run merged (0: none; also kept as `merged_groups`). Merged copies that do
        not fit in memory warn once and leave merging off from then on."""
        with contextlib.ExitStack() as stack:
            groups = 0
            if self.merges(run):
                try:
                    groups = stack.enter_context(self.merging.merged(run.model))
                except torch.OutOfMemoryError as error:
                    self.merge_projections = False
                    warnings.warn(f"rollout.merge_projections: the merged weights do not fit ({one_line(error)}); "
                                  "decoding unmerged from now on", stacklevel=3)
            self.merged_groups = groups
            yield groups

    def _step_layers(self) -> CompiledLayers | None:
        """The compiled decoder layers the recorded decode step runs through, where the
        engine compiles its own: the engine's when the loop decodes the engine's model; on
        an inference copy, the copy's layers compiled the same way. Without them a copy's
        recorded step replays the layers' eager kernels, dozens of small ones per layer
        (docs/performance.md, "Recording the decode step instead of compiling it"): the
        concurrent one-step-off rollout (mmrl/buffer/overlap.py) decoded that much slower
        than the sequential one on the engine's model."""
        if self.engine.compiled_layers is None:
            return None
        if self.copy is None:
            return self.engine.compiled_layers
        if self._copy_layers is None:
            layers = decoder_layers(self.copy.model, self.engine.adapter)
            self._copy_layers = CompiledLayers(layers) if layers else None
        return self._copy_layers

    def _recordings(self) -> int:
        """CUDA graphs the recorded decode step has recorded so far (0 for other steps)."""
        return self._step.recordings if isinstance(self._step, GraphedStep) else 0

    def _decode_flags(self) -> dict[str, float]:
        """Whether the decode step replays CUDA graphs, and through compiled layers (1 or 0)."""
        step = self._step
        graphs = isinstance(step, GraphedStep) and step.capture and step.fallback is None
        layers = graphs and step.layers is not None and not step.layers.failed
        return {"decode_graphs": float(graphs), "decode_compiled_layers": float(layers)}

    def decode_path(self) -> str:
        """How this rollout's decode steps run, in a few words (benches, the overlap
        metrics): plain generate, the eager or compiled step, or CUDA graphs through the
        compiled or the eager decoder layers."""
        if self.fallback_reason is not None:
            return f"plain generate ({self.fallback_reason})"
        step = self._step
        if step is None:
            return f"not decoded yet (rollout.decode={self.decode})"
        if isinstance(step, GraphedStep):
            if step.fallback is not None:
                return f"compiled step (graphs gave up: {step.fallback_reason})"
            layers = "compiled layers" if step.layers is not None and not step.layers.failed else "eager layers"
            return f"{'CUDA graphs' if step.capture else 'eager step (no capture)'} through {layers}, " \
                   f"{step.recordings} recorded"
        return "torch.compile step" if self.compile else "eager step"

    def static_cache(self, rows: int, length: int, dtype: torch.dtype | None = None):
        """A reset static cache for `rows` x `length`, kept between calls: a compiled graph
        replays on the same cache tensors. With `dtype` (autocast's), every layer stores its
        keys and values in it: under autocast a family's keys may leave rope in fp32 while
        its values are bf16, and attention reads both in autocast's dtype anyway."""
        from transformers import StaticCache

        if any(key[1:] != (length, dtype) for key in self.caches):
            self.caches = {key: c for key, c in self.caches.items() if key[1:] == (length, dtype)}
        cache = self.caches.get((rows, length, dtype))
        if cache is None:
            cache = StaticCache(config=self._decoder_config(), max_cache_len=length)
            if dtype is not None:
                for layer in cache.layers:
                    _cast_updates(layer, dtype)
            self.caches[(rows, length, dtype)] = cache
        else:
            cache.reset()
        return cache

    def _decoder_config(self):
        return (self.engine.model if self.copy is None else self.copy.model).config

    def moved(self, cache, keep: torch.Tensor, length: int):
        """The cache rows `keep` in a (kept) cache of len(keep) rows."""
        smaller = self.static_cache(len(keep), length, _autocast_dtype())
        for old, new in zip(cache.layers, smaller.layers, strict=True):
            keys, values = old.keys.index_select(0, keep), old.values.index_select(0, keep)
            if not new.is_initialized:
                new.lazy_initialization(keys, values)
            new.keys.copy_(keys)
            new.values.copy_(values)
            # How far the layer is filled (a tensor, or an int for sliding windows).
            for name, value in vars(old).items():
                if name.startswith("cumulative_length"):
                    if isinstance(value, torch.Tensor):
                        getattr(new, name).copy_(value)
                    else:
                        setattr(new, name, value)
        _unguarded(smaller)
        return smaller


def decode_step(model, input_ids, position_ids, attention_mask, cache, running, blocked, stops, seen, noise=None,
                **pick):
    """One decode step, eager: one token per row through `model` into `cache`, then
    `choose_tokens` on the last logits. The rollout compiles or records a copy of it per
    model class (`decode_step_for`); a test or bench that needs the step as plain Python
    (a `GraphedStep`'s fallback, what its graphs record) calls this one."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                past_key_values=cache, use_cache=True)
    return choose_tokens(out.logits[:, -1].float(), running, blocked, stops, seen=seen, noise=noise, **pick)


_STEPS_BY_CLASS: dict[type, object] = {}


def decode_step_for(model_class: type):
    """The decode step for models of `model_class`, with a code object of its own per class.
    Dynamo keeps a code object's compiled entries under one recompile limit (8) and guards
    each on the model's class, so one shared step would fill the limit after 8 model classes
    in a process (a test over the zoo, a probe sweep, a notebook that trains two models)
    and every later class would fall back to plain `generate`. Models of one class share
    their step, so its compiled entries serve every rollout of them."""
    step = _STEPS_BY_CLASS.get(model_class)
    if step is None:
        name = f"decode_step_{model_class.__name__}"
        code = decode_step.__code__.replace(co_name=name, co_qualname=name)
        step = type(decode_step)(code, decode_step.__globals__, name, decode_step.__defaults__)
        step.__kwdefaults__ = decode_step.__kwdefaults__
        _STEPS_BY_CLASS[model_class] = step
    return step


def _write_back(home, cache, index: torch.Tensor) -> None:
    """Rows of `cache` into the rows `index` of `home` (a wider cache of the same length),
    with its fill."""
    for wide, narrow in zip(home.layers, cache.layers, strict=True):
        wide.keys.index_copy_(0, index, narrow.keys)
        wide.values.index_copy_(0, index, narrow.values)
        wide.cumulative_length.copy_(narrow.cumulative_length)


def _unguarded(cache) -> None:
    """Mark the cache's tensors (keys, values, fill counters) as static addresses without
    an identity guard: CUDA graphs still read them in place, and a new cache (another
    length, a narrower batch) records a new graph instead of compiling one, as does each
    layer's own view in the decode step (`mmrl.rollout.graphs.LayerCache`; transformers
    marks them, with a guard on torch versions whose default guards)."""
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None), *fill_counters(layer)):
            if isinstance(tensor, torch.Tensor):
                torch._dynamo.mark_static_address(tensor, guard=False)


def _mark_dynamic_sizes(ids, place, mask, running, seen, cache, noise=None) -> None:
    """Mark the batch width and the cache length as dynamic before the step is traced, so
    the first compile already serves every width the loop moves rows into and every cache
    length bucket: without it, dynamo compiles the first shape static and recompiles once per
    dimension that later changes (each compile of a real model is tens of seconds on a GPU).
    `maybe_mark_dynamic`: where a family's code does fix a size, it stays static silently."""
    mark = torch._dynamo.maybe_mark_dynamic
    for tensor in (ids, running, seen, noise):
        if tensor is not None:
            mark(tensor, 0)
    mark(place, place.dim() - 2)
    mark(mask, 0)
    mark(mask, 1)
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                mark(tensor, 0)
                mark(tensor, 2)


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast computes in here (the engine's bf16 autocast over fp32 weights),
    or None outside autocast."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


@contextlib.contextmanager
def _half_linears(model: torch.nn.Module, dtype: torch.dtype, store: dict):
    """While open, every `nn.Linear` of `model` with an fp32 weight holds `dtype` copies of
    its weight and bias: the values autocast casts them to at each call, cast once per
    rollout instead of once per decode step (in fp32 under bf16 autocast that cast read
    and wrote every weight of the decoder at every step). Results are those of autocast
    to the bit. `store` keeps the copies between rollouts, refreshed in place, so a
    compiled graph replays on the same addresses."""
    swapped = []
    try:
        with torch.no_grad():
            for name, module in model.named_modules():
                if not isinstance(module, torch.nn.Linear) or module.weight.dtype != torch.float32:
                    continue
                for attr in ("weight", "bias"):
                    own = module._parameters.get(attr)
                    if own is None:
                        continue
                    key = f"{name}.{attr}"
                    half = store.get(key)
                    if half is None or half.shape != own.shape or half.device != own.device or half.dtype != dtype:
                        half = store[key] = torch.nn.Parameter(own.detach().to(dtype), requires_grad=False)
                    else:
                        half.copy_(own.detach())
                    module._parameters[attr] = half
                    swapped.append((module, attr, own))
        yield
    finally:
        for module, attr, own in swapped:
            module._parameters[attr] = own


def _cast_updates(layer, dtype: torch.dtype) -> None:
    """Make a cache layer store its keys and values in `dtype` (`with_update`: the layer's
    class becomes a subclass whose `update` casts them first)."""

    def update_of(base):
        def update(self, key_states, value_states, *args, **kwargs):
            return base.update(self, key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

        return update

    with_update(layer, f"cast {dtype}", update_of)


class _Lookout:
    """How many rows of a decode loop still run, as the loop looks before each step.

    On the CPU a look every `check_every` steps counts the running rows then and there. On
    a GPU such a look waits for every queued step, and the device idles until the host has
    launched the next one; here each step's count instead goes to pinned host memory behind
    that step's kernels (`post`), and a look takes the newest count the device has written,
    waiting only where the host is more than `lead` steps ahead of it. Counts only fall, so
    a count some steps old never understates the running rows: the loop stops at most
    `lead` steps after the last row did, and narrows no further than the rows it holds."""

    def __init__(self, device: torch.device, check_every: int, lead: int):
        self.queued = device.type == "cuda"
        self.event = torch.cuda.Event if self.queued else None  # the device's marks (a test's stand-in on the CPU)
        self.check_every, self.lead = check_every, lead
        self.pending: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self.waited = 0.0  # seconds the host waited for the device at its looks

    def alive(self, running: torch.Tensor, t: int) -> int | None:
        """The running rows as last known before step `t`; None where nothing new is known."""
        if not self.queued:
            if t % self.check_every:
                return None
            looked = time.perf_counter()
            alive = int(running.sum())
            self.waited += time.perf_counter() - looked
            return alive
        newest = None
        while self.pending and (len(self.pending) > self.lead or self.pending[0][1].query()):
            count, done = self.pending.pop(0)
            looked = time.perf_counter()
            done.synchronize()
            self.waited += time.perf_counter() - looked
            newest = count
        return None if newest is None else int(newest)

    def post(self, running: torch.Tensor) -> None:
        """Queue the count of `running` (after the step just launched) to the host."""
        if not self.queued:
            return
        count = torch.empty((), dtype=torch.long, pin_memory=running.is_cuda)
        count.copy_(running.sum(), non_blocking=True)
        done = self.event()
        done.record()
        self.pending.append((count, done))


def _compact_rows(running: torch.Tensor, width: int) -> torch.Tensor:
    """`width` row indices: every running row, then finished rows to fill the width."""
    order = torch.argsort((~running).to(torch.int8), stable=True)
    return order[:width]


def _used_width(tokens: torch.Tensor, stops: torch.Tensor) -> int:
    """Columns up to the last row's first stop token when every row stopped (where
    `generate` ends its loop), else all of them."""
    is_stop = torch.isin(tokens, stops)
    if not bool(is_stop.any(-1).all()):
        return tokens.shape[1]
    return int(is_stop.int().argmax(-1).max()) + 1


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The decode steps' attention function: one query per row, (B, H, 1, D), against the
    static cache's (B, H_kv, L, D) keys and values, as two batched matmuls over each key
    head's group of query heads with fp32 results and softmax (on CUDA straight from a
    bf16/fp16 cache, elsewhere from an fp32 copy of it). Any other call (a prompt, dropout,
    soft-capping, attention sinks, mismatched head sizes) goes to transformers' SDPA."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    softcap = getattr(module, "attn_logit_softcapping", None) or getattr(
        getattr(module, "config", None), "attn_logit_softcapping", None)
    mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                                         and attention_mask.shape[2] == 1)
    if (queries != 1 or dropout or softcap or heads % kv_heads or key.shape[-1] != dim or not mask_ok
            or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    # Inputs rounded to the cache's dtype as SDPA's kernels take them, products and
    # softmax in fp32 as they compute them.
    dtype = value.dtype
    scale = dim ** -0.5 if scaling is None else scaling
    group = heads // kv_heads
    with torch.autocast(query.device.type, enabled=False):  # autocast would round the products
        grouped = query.to(dtype).reshape(rows, kv_heads, group, dim)  # head h: key head h // group
        key = key.to(dtype)
        if _low_precision_products(query, dtype):
            # bf16/fp16 products into fp32 results on the tensor cores, reading the cache
            # as it is stored; the probabilities are rounded to the cache's dtype for the
            # second product, as flash attention rounds them.
            length = key.shape[-2]
            scores = torch.bmm(grouped.reshape(-1, group, dim), key.reshape(-1, length, dim).transpose(1, 2),
                               out_dtype=torch.float32).view(rows, kv_heads, group, length) * scale
            probs = _masked(scores, attention_mask).softmax(-1).to(dtype)
            out = torch.bmm(probs.view(-1, group, length), value.reshape(-1, length, dim), out_dtype=torch.float32)
        else:
            scores = torch.matmul(grouped.float(), key.float().transpose(-1, -2)) * scale  # (B, H_kv, group, L)
            out = torch.matmul(_masked(scores, attention_mask).softmax(-1), value.float())  # (B, H_kv, group, D)
    return out.to(dtype).reshape(rows, 1, heads, dim), None


def _masked(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return scores
    if attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask, float("-inf"))
    return scores + attention_mask


def _low_precision_products(query: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether bf16/fp16 matrix products can return fp32 here (CUDA's `bmm(out_dtype=)`;
    elsewhere the inputs are widened to fp32 first, a copy of the cache per step)."""
    return (query.is_cuda and dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten.bmm, "dtype"))


@contextlib.contextmanager
def _decode_attention(model):
    """While open, the text decoder of `model` (where its attention is SDPA, or the
    engine's varlen-where-possible SDPA of packed updates) runs `decode_attention`; the
    name is registered with SDPA's masks."""
    from mmrl.engine import varlen

    base = unwrapped(model)
    config = base.config.get_text_config()
    before = config._attn_implementation
    if before in ("sdpa", varlen.NAME):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(DECODE_ATTENTION, decode_attention)
        AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
        config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
