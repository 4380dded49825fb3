"""Does the model read its images? The check behind the `reads_media` probe and the
trainer's step-0 media check (`trainer.strict_media`).

    reading = read_media(engine, rollout, processing, conversations)
    reading.problem          # None, or one line on what is wrong
    reading.figures          # {"rollout/blank": 0.21, "training/shuffled": 0.08, ...}

The same prompts run three times: with their real images, with blank images of the same
sizes (flat grey) and with the batch's images shuffled among the prompts (each image in
the place of another of its size), on both paths a run takes:
- the rollout path: the rollout backend samples one greedy token per prompt; the model's
  output at that step (the next-token log-probs over the vocabulary that it samples
  from) is taken by a forward hook;
- the training path: the engine's log-probs of the same response tokens (teacher forced).
For every prompt whose media a variant changed, the largest log-prob difference from the
real images' must exceed `READS_MEDIA_BOUND` on both paths. The vision tower's forward
is hooked on both paths: it must be
called, and with the same pixels on both, so a processor that drops `pixel_values`,
placeholders that are not expanded or a model that loses its pixels fail in one line.
The rollout path is hooked where it runs the engine's own model (the `hf` and
`hf_compiled` backends). A backend that runs a copy of its own (vLLM) is checked through
its own scoring of the same response tokens (`rollout.log_probs`, vLLM's prompt
log-probs) with each variant's media; its vision tower's pixels cannot be seen, so they
are compared on the hooked backends only, and the reading says so (`pixels_unchecked`).
A backend that neither runs the engine's model nor scores given tokens leaves the
training path alone checked (`rollout_unchecked`). Every rank of a sharded run makes the
same calls (FSDP2's collectives).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmrl.engine import join
from mmrl.parts import part_of
from mmrl.rollout.base import SamplingParams
from mmrl.rollout.hf import HFRollout
from mmrl.wrappers import unwrapped

# The smallest log-prob difference that counts as reading the media: the same inputs give
# the same log-probs on one path (0.0 on CPU), and the zoo's tiny random-init models move
# by far more when their images change (the reads_media column of support_matrix/).
READS_MEDIA_BOUND = 1e-4
# Response tokens the probe samples for the training path when it is given none.
RESPONSE_TOKENS = 4
# Prompts the trainer's step-0 check reads (`check_prompts`): what it catches (a tower never
# called, pixels dropped or different on the two paths, placeholders not expanded) shows on
# any prompt with media, and each prompt adds to six forwards of the model (a 7B-shaped
# first step's media check: bench/results/recipe_steps_geo3k_7b_gpu.json, time/media_check).
STEP_ZERO_PROMPTS = 4
BLANK_GREY = 128
VARIANTS = ("blank", "shuffled")
# Words in the names of a processed batch's media tensors (a hint in the one-line failures).
_MEDIA_KEY_WORDS = ("pixel", "image", "video", "grid", "patch")


class MediaCheckError(ValueError):
    """The step-0 media check failed under `trainer.strict_media` (the one-line reason; the
    CLI prints it as one line, as it does every ValueError: mmrl/failures.py)."""


@dataclass
class MediaReading:
    """What `read_media` measured. `figures[f"{path}/{variant}"]` is, over the prompts
    whose media the variant changed, the smallest of each prompt's largest log-prob
    difference from the real images; `problem` is None when the model reads its media,
    else one line."""

    problem: str | None
    prompts_with_media: int = 0
    figures: dict[str, float] = field(default_factory=dict)
    tower_calls: dict[str, int] = field(default_factory=dict)
    pixel_gap: float | None = None
    # Why the rollout path was not checked (a backend that runs its own copy of the model).
    rollout_unchecked: str | None = None
    # Why the tower's pixels were not compared between the paths (the rollout path checked
    # through the backend's own scoring, e.g. vLLM's copy of the model).
    pixels_unchecked: str | None = None
    # Wall seconds of each path's calls, processing included (the trainer logs them at step 0).
    seconds: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "training": 0.0})
    # The mark of the earlier pass that stood for this check (`PassMemo`), or None: it ran.
    skipped: str | None = None

    @property
    def checked(self) -> bool:
        return self.prompts_with_media > 0

    def evidence(self) -> dict[str, Any]:
        return {"min_logprob_diff": dict(self.figures),
                "vision_tower_calls": self.tower_calls, "pixel_max_diff_rollout_vs_training": self.pixel_gap,
                "prompts_with_media": self.prompts_with_media, "bound": READS_MEDIA_BOUND,
                **({"rollout_unchecked": self.rollout_unchecked} if self.rollout_unchecked else {}),
                **({"pixels_unchecked": self.pixels_unchecked} if self.pixels_unchecked else {})}

    def summary(self) -> str:
        shown = ", ".join(f"{k} {v:.1e}" for k, v in self.figures.items())
        if self.rollout_unchecked:
            return (f"log-probs move when the images do on the training path (per prompt, smallest largest "
                    f"difference: {shown}; bound {READS_MEDIA_BOUND:.0e}); rollout path not checked: "
                    f"{self.rollout_unchecked}")
        pixels = (f"the vision tower's pixels not compared: {self.pixels_unchecked}" if self.pixels_unchecked
                  else "the vision tower gets the same pixels on both paths")
        return (f"log-probs move when the images do, on both paths (per prompt, smallest largest difference: "
                f"{shown}; bound {READS_MEDIA_BOUND:.0e}); {pixels}")


# -- the media and their variants ---------------------------------------------------------------
def _is_media(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "video") and part.get(part["type"]) is not None


def media_of(conversation: list[dict]) -> list[Any]:
    """The payloads of a conversation's image and video parts, in order."""
    return [part[part["type"]] for message in conversation if isinstance(message.get("content"), list)
            for part in message["content"] if _is_media(part)]


def with_media(conversation: list[dict], values: list[Any]) -> list[dict]:
    """A copy of `conversation` whose image and video parts hold `values`, in order."""
    values = iter(values)
    copy = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            content = [dict(part, **{part["type"]: next(values)}) if _is_media(part) else part for part in content]
        copy.append({**message, "content": content})
    return copy


def _blank(value: Any) -> Any:
    """A flat grey image (a clip of them) of the same size; a video given as a path stays."""
    from PIL import Image

    if isinstance(value, Image.Image):
        mode = value.mode if value.mode in ("RGB", "L") else "RGB"
        return Image.new(mode, value.size, BLANK_GREY if mode == "L" else (BLANK_GREY,) * 3)
    if isinstance(value, (list, tuple)):
        return [_blank(frame) for frame in value]
    return value


def _content(value: Any) -> Any:
    """What identifies a payload's pixels (equal images give equal values)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.mode, value.size, value.tobytes()
    if isinstance(value, (list, tuple)):
        return tuple(_content(v) for v in value)
    return repr(value)


def _shape(value: Any) -> Any:
    """Payloads with the same shape take the same placeholder tokens: images of one size,
    clips of as many frames of one size."""
    if isinstance(value, (list, tuple)):
        return ("frames", len(value), *(_shape(v) for v in value[:1]))
    return ("image", getattr(value, "size", None)) if hasattr(value, "size") else ("other", repr(value))


def media_variants(conversations: list[list[dict]]) -> dict[str, list[list[dict]]]:
    """{"real", "blank", "shuffled"} versions of a batch. Shuffling puts each image in the
    place of the next one of its shape in the batch (the last in the first's), so the
    token ids stay and only the pixels move; an image with no partner stays put."""
    media = [media_of(c) for c in conversations]
    groups: dict[Any, list[tuple[int, int]]] = {}
    for i, values in enumerate(media):
        for j, value in enumerate(values):
            groups.setdefault(_shape(value), []).append((i, j))
    moved = [list(values) for values in media]
    for members in groups.values():
        for (i, j), (k, m) in zip(members, members[1:] + members[:1]):
            moved[i][j] = media[k][m]
    return {"real": conversations,
            "blank": [with_media(c, [_blank(v) for v in values]) for c, values in zip(conversations, media)],
            "shuffled": [with_media(c, values) for c, values in zip(conversations, moved)]}


def changed_rows(conversations: list[list[dict]], variant: list[list[dict]]) -> list[int]:
    """Indices of the prompts whose media differ between two versions of a batch."""
    return [i for i, (a, b) in enumerate(zip(conversations, variant))
            if [_content(v) for v in media_of(a)] != [_content(v) for v in media_of(b)]]


# -- the vision tower's inputs --------------------------------------------------------------------
def tower_modules(model: torch.nn.Module, adapter) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules the adapter's `vision` part names (PEFT prefixes ignored)."""
    found = [(name, module) for name, module in model.named_modules() if name and part_of(name, adapter) == "vision"]
    return [(name, module) for name, module in found
            if not any(name.startswith(other + ".") for other, _ in found if other != name)]


@contextlib.contextmanager
def recording_tower_inputs(model: torch.nn.Module, adapter) -> Iterator[list[torch.Tensor]]:
    """Copies (fp32, CPU) of the first tensor each call of the vision tower receives."""
    seen: list[torch.Tensor] = []

    def record(_module, args, kwargs):
        first = next((v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)), None)
        if first is not None:
            seen.append(first.detach().float().cpu().clone())

    handles = [module.register_forward_pre_hook(record, with_kwargs=True) for _, module in tower_modules(model, adapter)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _pixels_differ(rollout: list[torch.Tensor], training: list[torch.Tensor]) -> tuple[float | None, str | None]:
    """(largest difference, None) between the pixels the tower got on the two paths, or
    (None, why they cannot be compared)."""
    a = torch.cat([t.flatten() for t in rollout])
    b = torch.cat([t.flatten() for t in training])
    if a.shape != b.shape:
        shapes = lambda ts: " + ".join(str(tuple(t.shape)) for t in ts)  # noqa: E731
        return None, f"{shapes(rollout)} on the rollout path, {shapes(training)} on the training path"
    return (a - b).abs().max().item() if a.numel() else 0.0, None


@contextlib.contextmanager
def recording_next_token_logprobs(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The log-probs (B, V; fp32, CPU) of the model's first forward in the block at its
    last position: what a rollout samples its first token from (a left-padded prompt
    batch ends at the last prompt token of every row)."""
    seen: list[torch.Tensor] = []
    base = unwrapped(model)  # PEFT wraps the HF model

    def record(_module, _args, output):
        logits = getattr(output, "logits", None)
        if not seen and isinstance(logits, torch.Tensor):
            seen.append(torch.log_softmax(logits[:, -1].detach().float(), -1).cpu())

    handle = base.register_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


# -- the two paths --------------------------------------------------------------------------------
def _greedy(rollout, conversations, max_new_tokens: int):
    result = rollout.generate(conversations, SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                                                            logprobs=True))
    if result.logprobs is None:
        raise ValueError(f"the rollout backend ({type(rollout).__name__}) returns no sampler log-probs")
    return result


def training_logprobs(engine, processing, conversations, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The engine's log-probs (B, R) of `ids` answering `conversations`, one row each, as
    the update computes them for rows that repeat no prompt (`PolicyUpdate.sequences`)."""
    length = max(1, int(mask.sum(-1).max()))
    seqs = join(dict(processing(conversations)), ids[:, :length], mask[:, :length], engine.adapter, engine.model,
                processing.tokenizer.pad_token_id).to(engine.dist.device)
    # The engine's compiled layers, where it has them, run eagerly here: a few rows, once a run,
    # and compiled they would add a no-grad graph that a run without no-grad passes never uses.
    layers = getattr(engine, "compiled_layers", None)
    with torch.no_grad(), layers.eager() if layers is not None else contextlib.nullcontext():
        logp, _ = engine.log_probs(seqs, with_entropy=False)
    return logp.float().cpu() * mask[:, :length].float()


def _never_called(tower: str, path: str, processing, conversations, with_media: list[int]) -> str:
    batch = dict(processing([conversations[with_media[0]]]))
    keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and any(w in k for w in _MEDIA_KEY_WORDS)]
    cause = (f"the processed batch holds {', '.join(keys)}, which never reach it (image placeholders not expanded, "
             "or the model drops them)" if keys else "the processed batch holds no media tensor (the processor "
             "drops the pixels)")
    return (f"the vision tower ({tower}) is never called on the {path} path, though {len(with_media)} of "
            f"{len(conversations)} prompts carry images or video: {cause}")


def read_media(engine, rollout, processing, conversations: list[list[dict]],
               responses: tuple[torch.Tensor, torch.Tensor] | None = None, *, collective: bool = False) -> MediaReading:
    """The check of the module docstring on `conversations`. `responses` (ids, mask; a row
    per conversation) are the tokens the training path scores, by default a few greedy
    tokens sampled with the real images. `collective`: this rank runs every forward even
    when its own batch holds no media (other ranks of a sharded run do)."""
    with_media = [i for i, c in enumerate(conversations) if media_of(c)]
    reading = MediaReading(problem=None, prompts_with_media=len(with_media))
    if not with_media and not collective:
        return reading
    tower = ", ".join(name for name, _ in tower_modules(engine.model, engine.adapter))
    variants = media_variants(conversations)
    if responses is None:  # sampled before any hook is in place (a compiled decode step sees none)
        sampled = _greedy(rollout, conversations, RESPONSE_TOKENS)
        responses = sampled.response_ids, sampled.response_mask
    ids, mask = responses

    # The rollout path is hooked where it runs the engine's own model (the HF backends);
    # a backend with its own copy (vLLM) scores the same response tokens itself; the
    # one-step-off thread's inference copy (mmrl/buffer/overlap.py) is left unchecked.
    hooked = isinstance(rollout, HFRollout) and rollout.sampling_model() is engine.model
    scored = not hooked and callable(getattr(rollout, "log_probs", None))
    if scored:
        reading.pixels_unchecked = (f"{type(rollout).__name__} runs its own copy of the model (no hooks there); "
                                    "its rollout path is checked through its own log-probs of the sampled tokens")
    elif not hooked:
        reading.rollout_unchecked = f"{type(rollout).__name__} runs its own copy of the model (no hooks there)"

    def timed(path: str, fn):
        def call(*args):
            began = time.perf_counter()
            try:
                return fn(*args)  # log-probs come back on the CPU: the device's work is in the time
            finally:
                reading.seconds[path] += time.perf_counter() - began
        return call

    def rollout_path(batch) -> torch.Tensor | None:
        if scored:
            return rollout.log_probs(batch, ids, mask).float().cpu() * mask.float()
        if not hooked:
            return None
        # One token: the prompt's forward alone, so the hook sees nothing compiled.
        with recording_next_token_logprobs(engine.model) as seen:
            _greedy(rollout, batch, 1)
        return seen[0] if seen else torch.zeros(len(batch), 0)

    rollout_path = timed("rollout", rollout_path)
    training_path = timed("training", training_logprobs)

    def tower_problem(path: str, pixels: list) -> str | None:
        reading.tower_calls[path] = len(pixels)
        if not with_media:
            return None
        if not tower:
            return f"the adapter's vision part ({engine.adapter.parts.vision}) names no module of the model"
        return None if pixels else _never_called(tower, path, processing, conversations, with_media)

    # A problem found on one path is reported before the next runs (a batch the tower never
    # saw may not run further), except where other ranks wait for this one's forwards.
    with recording_tower_inputs(engine.model, engine.adapter) as rollout_pixels:
        real_next = rollout_path(conversations)
    reading.problem = tower_problem("rollout", rollout_pixels) if hooked else None
    if reading.problem and not collective:
        return reading
    with recording_tower_inputs(engine.model, engine.adapter) as training_pixels:
        real_logp = training_path(engine, processing, conversations, ids, mask)
    reading.problem = reading.problem or tower_problem("training", training_pixels)
    if reading.problem and not collective:
        return reading
    outcomes = {}
    for variant in VARIANTS:  # every rank runs both, whatever its batch holds
        outcomes[variant] = (rollout_path(variants[variant]),
                             training_path(engine, processing, variants[variant], ids, mask))
    if reading.problem or not with_media:
        return reading
    if hooked:
        reading.pixel_gap, unlike = _pixels_differ(rollout_pixels, training_pixels)
        if unlike is not None or reading.pixel_gap > 0:
            reading.problem = (f"the vision tower ({tower}) receives other pixels on the rollout path than on the "
                               f"training path: {unlike or f'values differ by up to {reading.pixel_gap:.2e}'}")
            return reading
        if real_next.numel() == 0:
            reading.problem = "the rollout path ran no forward of the model whose output holds logits"
            return reading
    for variant, (next_logp, logp) in outcomes.items():
        rows = changed_rows(conversations, variants[variant])
        if not rows:
            continue  # e.g. one image in the batch: shuffling moves nothing
        if hooked or scored:
            reading.figures[f"rollout/{variant}"] = (next_logp - real_next).abs().amax(-1)[rows].min().item()
        reading.figures[f"training/{variant}"] = (logp - real_logp).abs().amax(-1)[rows].min().item()
    for key, value in reading.figures.items():
        if value <= READS_MEDIA_BOUND:
            path, variant = key.split("/")
            reading.problem = (f"on the {path} path, log-probs with {variant} images differ from those with the real "
                               f"images by at most {value:.1e} for a prompt (bound {READS_MEDIA_BOUND:.0e}): the model "
                               "does not read its media there")
            break
    return reading


def check_prompts(conversations: list[list[dict]], limit: int = STEP_ZERO_PROMPTS) -> list[int]:
    """At most `limit` of the prompts that carry media, in batch order: two whose first
    payloads share a shape where the batch has such a pair (shuffling needs a partner),
    then one of each other shape in turn, so several sizes are read where there are."""
    by_shape: dict[Any, list[int]] = {}
    for i, conversation in enumerate(conversations):
        media = media_of(conversation)
        if media:
            by_shape.setdefault(_shape(media[0]), []).append(i)
    queues = sorted(by_shape.values(), key=len, reverse=True)
    chosen = queues[0][:2] if queues and len(queues[0]) > 1 and limit > 1 else []
    if chosen:  # the pair's shape is read: the other shapes come first
        queues = queues[1:] + [queues[0][2:]]
    while len(chosen) < limit and any(queues):
        for queue in queues:
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return sorted(chosen)


def step_zero_media_check(engine, rollout, processing, conversations: list[list[dict]], result,
                          strict: bool, limit: int = STEP_ZERO_PROMPTS,
                          passes: PassMemo | None = None) -> MediaReading | None:
    """The trainer's check on its first batch: the first sampled response of at most `limit`
    prompts with media (`check_prompts`), scored with the real, blank and shuffled media.
    None when no rank's batch holds media; on a problem, raises `MediaCheckError` when
    `strict`, else warns in one line on stderr. With `passes`, a check that passed before on
    the same inputs (`PassMemo`) is not run again: the reading says so (`skipped`)."""
    has_media = any(media_of(c) for c in conversations)
    if not any(engine.dist.all_gather_objects(has_media)):
        return None
    first: dict[int, int] = {}
    for row, owner in enumerate(result.prompt_index.tolist()):
        first.setdefault(owner, row)
    # A rank without media still runs every forward of the others (collective): its first prompt.
    picked = check_prompts(conversations, limit) or [0]
    checked = [conversations[i] for i in picked]
    key = passes.key(checked) if passes is not None else None
    mark = passes.passed(key) if key is not None else None
    # Every rank runs the check's forwards, or none does (collective).
    if all(engine.dist.all_gather_objects(mark is not None)):
        if engine.dist.is_main:
            print(f"step 0 media check: passed before on the same checkpoint files, recipe, prompts and library "
                  f"versions, not run again (delete {mark} to run it)", file=sys.stderr, flush=True)
        return MediaReading(problem=None, prompts_with_media=sum(bool(media_of(c)) for c in checked),
                            skipped=str(mark))
    rows = torch.tensor([first[i] for i in picked])
    reading = read_media(engine, rollout, processing, checked,
                         responses=(result.response_ids[rows], result.response_mask[rows]),
                         collective=engine.dist.distributed)
    if reading.problem is not None:
        message = f"step 0 media check: {reading.problem}"
        if strict:
            raise MediaCheckError(f"{message} (trainer.strict_media=true)")
        print(f"warning: {message} (trainer.strict_media=true makes it an error)", file=sys.stderr, flush=True)
    elif key is not None and reading.checked:
        passes.remember(key)
    return reading


# -- passes remembered ----------------------------------------------------------------------------
class PassMemo:
    """The step-0 check's passes, remembered in a folder (under the compile cache, beside the
    compiled graphs a second run of the recipe reads). A pass is keyed by everything its
    outcome depends on: the recipe less how it is run (`mmrl.prewarm.recipe_key`: the model,
    data, rollout and algorithm sections, the settled values, torch's version), the
    checkpoint folder's files (names, sizes, modification times), the versions of mmrl and
    transformers, and the checked prompts themselves (their text and their media's pixels).
    Changing any of them runs the check again; a failed check is never remembered."""

    FOLDER = "mmrl-media-check"

    def __init__(self, folder: Path, base: str):
        self.folder = folder
        self.base = base

    @classmethod
    def for_run(cls, recipe, settled) -> PassMemo | None:
        """The memo of a run of `recipe`, or None where there is no compile cache folder or no
        checkpoint on disk (a random-init model: nothing to key)."""
        from mmrl import __version__
        from mmrl.hub import HubError, checkpoint_folder
        from mmrl.prewarm import cache_folder, recipe_key

        folder = cache_folder()
        if folder is None or recipe.model.random_init:
            return None
        try:
            checkpoint = checkpoint_folder(recipe.model.path)
        except (HubError, OSError):
            return None
        if checkpoint is None or not checkpoint.is_dir():
            return None
        import transformers

        files = sorted((f.name, stat.st_size, stat.st_mtime_ns) for f in checkpoint.iterdir() if f.is_file()
                       for stat in (f.stat(),))
        base = json.dumps([recipe_key(recipe, settled), str(checkpoint.resolve()), files, __version__,
                           transformers.__version__])
        return cls(folder / cls.FOLDER, base)

    def key(self, conversations: list[list[dict]]) -> str:
        digest = hashlib.sha256(self.base.encode())
        for conversation in conversations:
            keyed = [{**message, "content": [{**part, part["type"]: _media_digest(part[part["type"]])}
                                             if _is_media(part) else part for part in message["content"]]}
                     if isinstance(message.get("content"), list) else message for message in conversation]
            # An object with no stable text (its address in `repr`) makes a key no later run meets.
            digest.update(json.dumps(keyed, sort_keys=True, default=repr).encode())
        return digest.hexdigest()[:24]

    def passed(self, key: str) -> Path | None:
        """The mark of an earlier pass with this key, or None."""
        mark = self.folder / f"{key}.passed"
        return mark if mark.is_file() else None

    def remember(self, key: str) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"{key}.passed").write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        except OSError:
            pass  # a read-only cache: the next run checks again, nothing worse


def _media_digest(payload: Any) -> str:
    """A media payload as the key sees it: its pixels' hash (a PIL image, an array or a
    tensor), a file's path, size and modification time, a video's frames each so, else its
    `repr`."""
    if isinstance(payload, (list, tuple)):  # a video's frames
        return "[" + ", ".join(_media_digest(frame) for frame in payload) + "]"
    if hasattr(payload, "tobytes") and hasattr(payload, "size") and hasattr(payload, "mode"):  # PIL
        return f"image {payload.mode} {payload.size} {hashlib.sha256(payload.tobytes()).hexdigest()}"
    if isinstance(payload, torch.Tensor):
        payload = payload.detach().cpu().contiguous().numpy()
    if hasattr(payload, "tobytes") and hasattr(payload, "shape"):  # numpy
        return f"array {payload.shape} {payload.dtype} {hashlib.sha256(payload.tobytes()).hexdigest()}"
    if isinstance(payload, (str, Path)) and Path(payload).is_file():
        found = Path(payload).stat()
        return f"file {payload} {found.st_size} {found.st_mtime_ns}"
    return repr(payload)
