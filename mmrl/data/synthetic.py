"""Offline RL tasks drawn with Pillow: small, deterministic by seed, learnable by a tiny
random-init model with a word-level vocabulary (see `vocabulary`).

Each task returns a list of samples in the schema of `mmrl.data.schema`, with a `task`
column naming it. Image tasks give one image per sample; answers are balanced, so the
majority baseline is 1 / (number of answers).

    from mmrl.data import synthetic
    train = synthetic.count_shapes(256, seed=0)
    control = synthetic.shuffle_images(train, seed=1)   # a model that reads the image
    synthetic.majority_baseline(train)                  # fails on `control`; 0.25 here
    synthetic.vocabulary("count_shapes")                # every prompt and answer word

The loader reaches them as `synthetic:TASK?key=value&...` (see `from_spec`).
"""

from __future__ import annotations

import inspect
import math
import random
import re
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from PIL import Image, ImageDraw

from mmrl.data.schema import ANSWER, IMAGES, Sample

BACKGROUND = (255, 255, 255)
# Saturated and far apart, so a colour name never depends on a judgement call.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 205, 20),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
}
COLOUR_NAMES = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle")
DIGITS = tuple("0123456789")
YES_NO = ("yes", "no")

COUNT_QUESTION = "How many shapes are in the image?"
DIGIT_QUESTION = "What digit is shown?"
COMPARE_QUESTION = "Is the left patch darker than the right one?"
COLOUR_QUESTION = "What colour is the shape?"

# Seven-segment layout: a top, b top right, c bottom right, d bottom, e bottom left,
# f top left, g middle.
SEGMENTS = {"0": "abcdef", "1": "bc", "2": "abged", "3": "abgcd", "4": "fgbc",
            "5": "afgcd", "6": "afgedc", "7": "abc", "8": "abcdefg", "9": "abcdfg"}

_WORD = re.compile(r"\w+|[^\w\s]")


def split_words(text: str) -> list[str]:
    """The words of `text` as a word-level tokenizer should cut them: runs of letters or
    digits, and each punctuation mark alone ("image?" -> "image", "?")."""
    return _WORD.findall(text)


def _image_sample(task: str, question: str, answer: str, image: Image.Image) -> Sample:
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return {"prompt": prompt, ANSWER: answer, IMAGES: [image], "task": task}


def _balanced(answers: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """n answers cycling through `answers` (counts differ by at most one), shuffled."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out = [answers[i % len(answers)] for i in range(n)]
    rng.shuffle(out)
    return out


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int],
                colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=colour)


def count_shapes(n: int, seed: int, image_size: int = 84, max_count: int = 4) -> list[Sample]:
    """1..max_count coloured shapes on a white background; the answer is the count.

    Shapes sit in distinct cells of a grid with at least 4 background pixels between
    any two, so they never touch (not even diagonally) and can be counted as blobs.
    """
    grid = math.ceil(math.sqrt(max_count))
    cell = image_size // grid
    if max_count < 1 or cell < 12:
        raise ValueError(f"{max_count} shapes do not fit in a {image_size}x{image_size} image")
    rng = random.Random(seed)
    samples = []
    for answer in _balanced([str(c) for c in range(1, max_count + 1)], n, rng):
        image = Image.new("RGB", (image_size, image_size), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for slot in rng.sample(range(grid * grid), int(answer)):
            row, col = divmod(slot, grid)
            size = rng.randint(max(6, cell * 2 // 5), cell - 4)
            # 2 px of margin inside each cell on every side keeps neighbours 4 px apart.
            x0 = col * cell + rng.randint(2, cell - size - 2)
            y0 = row * cell + rng.randint(2, cell - size - 2)
            _draw_shape(draw, rng.choice(SHAPES), (x0, y0, x0 + size - 1, y0 + size - 1),
                        PALETTE[rng.choice(COLOUR_NAMES)])
        samples.append(_image_sample("count_shapes", COUNT_QUESTION, answer, image))
    return samples


def _seven_segment(draw: ImageDraw.ImageDraw, digit: str, x: int, y: int, width: int, height: int,
                   thickness: int, colour: tuple[int, int, int]) -> None:
    mid = y + height // 2
    right = x + width - 1
    bottom = y + height - 1
    boxes = {
        "a": (x, y, right, y + thickness - 1),
        "g": (x, mid - thickness // 2, right, mid - thickness // 2 + thickness - 1),
        "d": (x, bottom - thickness + 1, right, bottom),
        "f": (x, y, x + thickness - 1, mid),
        "b": (right - thickness + 1, y, right, mid),
        "e": (x, mid, x + thickness - 1, bottom),
        "c": (right - thickness + 1, mid, right, bottom),
    }
    for segment in SEGMENTS[digit]:
        draw.rectangle(boxes[segment], fill=colour)


def read_digit(n: int, seed: int, image_size: int = 56) -> list[Sample]:
    """One large seven-segment digit in a random colour and place; the answer is it."""
    rng = random.Random(seed)
    samples = []
    for answer in _balanced(DIGITS, n, rng):
        image = Image.new("RGB", (image_size, image_size), BACKGROUND)
        height = rng.randint(image_size * 11 // 20, image_size * 4 // 5)
        width = height // 2
        x = rng.randint(0, image_size - width)
        y = rng.randint(0, image_size - height)
        _seven_segment(ImageDraw.Draw(image), answer, x, y, width, height, max(2, height // 8),
                       PALETTE[rng.choice(COLOUR_NAMES)])
        samples.append(_image_sample("read_digit", DIGIT_QUESTION, answer, image))
    return samples


def compare_colours(n: int, seed: int, image_size: int = 56) -> list[Sample]:
    """Two patches of one hue at clearly different brightness; is the left one darker?"""
    if image_size < 32:
        raise ValueError(f"two patches need an image of at least 32 pixels, got {image_size}")
    rng = random.Random(seed)
    size = image_size * 3 // 8
    half = image_size // 2
    samples = []
    for answer in _balanced(YES_NO, n, rng):
        hue = PALETTE[rng.choice(COLOUR_NAMES)]
        dark = rng.uniform(0.2, 0.6)
        light = rng.uniform(dark + 0.35, 1.0)
        left, right = (dark, light) if answer == "yes" else (light, dark)
        image = Image.new("RGB", (image_size, image_size), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for level, x_low, x_high in ((left, 2, half - size - 2), (right, half + 2, image_size - size - 2)):
            x = rng.randint(x_low, x_high)
            y = rng.randint(2, image_size - size - 2)
            draw.rectangle((x, y, x + size - 1, y + size - 1), fill=tuple(round(c * level) for c in hue))
        samples.append(_image_sample("compare_colours", COMPARE_QUESTION, answer, image))
    return samples


def name_colour(n: int, seed: int, image_size: int = 56) -> list[Sample]:
    """One shape of a colour from `COLOUR_NAMES`; the answer is the colour's name."""
    rng = random.Random(seed)
    samples = []
    for answer in _balanced(COLOUR_NAMES, n, rng):
        image = Image.new("RGB", (image_size, image_size), BACKGROUND)
        size = rng.randint(image_size * 7 // 20, image_size * 7 // 10)
        x = rng.randint(0, image_size - size)
        y = rng.randint(0, image_size - size)
        _draw_shape(ImageDraw.Draw(image), rng.choice(SHAPES), (x, y, x + size - 1, y + size - 1),
                    PALETTE[answer])
        samples.append(_image_sample("name_colour", COLOUR_QUESTION, answer, image))
    return samples


def arithmetic(n: int, seed: int, max_operand: int = 20) -> list[Sample]:
    """A text task: "What is 7 + 5?" with the answer "12"; operands 0..max_operand."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        samples.append({"prompt": prompt, ANSWER: str(a + b), "task": "arithmetic"})
    return samples


@dataclass(frozen=True, slots=True)
class Task:
    """A synthetic task: its generator, the fixed words of its prompt, and its answers
    as a function of the generator's keyword arguments."""

    generate: Callable[..., list[Sample]]
    prompt_words: tuple[str, ...]
    answers: Callable[[dict[str, Any]], tuple[str, ...]]


TASKS: dict[str, Task] = {
    "count_shapes": Task(count_shapes, tuple(split_words(COUNT_QUESTION)),
                         lambda p: tuple(str(c) for c in range(1, p["max_count"] + 1))),
    "read_digit": Task(read_digit, tuple(split_words(DIGIT_QUESTION)), lambda p: DIGITS),
    "compare_colours": Task(compare_colours, tuple(split_words(COMPARE_QUESTION)), lambda p: YES_NO),
    "name_colour": Task(name_colour, tuple(split_words(COLOUR_QUESTION)), lambda p: COLOUR_NAMES),
    # Operands 0..max_operand are among the answers 0..2*max_operand, so they need no entry.
    "arithmetic": Task(arithmetic, tuple(split_words("What is + ?")),
                       lambda p: tuple(str(s) for s in range(2 * p["max_operand"] + 1))),
}


def _task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; tasks: {', '.join(TASKS)}")
    return TASKS[name]


def _params(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """`given` completed with the generator's defaults; unknown keys are an error."""
    signature = inspect.signature(_task(name).generate)
    unknown = set(given) - set(signature.parameters)
    if unknown:
        raise ValueError(f"synthetic task {name} takes {', '.join(signature.parameters)}; "
                         f"got {', '.join(sorted(unknown))}")
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not p.empty}
    return {**defaults, **given}


def answer_words(task: str, **params: Any) -> tuple[str, ...]:
    """Every answer `task` can give with these generator arguments."""
    return _task(task).answers(_params(task, params))


def vocabulary(task: str, **params: Any) -> list[str]:
    """Every word (as `split_words` cuts them) that the prompts and answers of `task` use,
    sorted, so a word-level tokenizer can hold each as one token."""
    return sorted(set(_task(task).prompt_words) | set(answer_words(task, **params)))


def generate(task: str, n: int, seed: int, **params: Any) -> list[Sample]:
    """Samples of a task by name."""
    return _task(task).generate(n=n, seed=seed, **_params(task, params))


def _number_or_text(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


# The most rows a synthetic task builds: they are made at once and held in memory.
MAX_SYNTHETIC_ROWS = 1_000_000


def from_spec(spec: str, split: str = "train") -> list[Sample]:
    """Samples for `synthetic:TASK?key=value&...`, e.g. `synthetic:count_shapes?n=256&seed=0`.

    `n` defaults to 256 and `seed` to 0; other keys are the task's keyword arguments.
    A split other than "train" draws from another seed (derived from seed and split),
    so an evaluation set never repeats the training prompts of the same spec.
    """
    body = spec.removeprefix("synthetic:")
    name, _, query = body.partition("?")
    try:
        given = {k: _number_or_text(v) for k, v in parse_qsl(query, strict_parsing=bool(query))}
    except ValueError as error:
        raise ValueError(f"{spec}: cannot parse {query!r} as key=value&... ({error})") from None
    params = {"n": 256, "seed": 0, **given}
    if not isinstance(params["n"], int) or not 0 < params["n"] <= MAX_SYNTHETIC_ROWS:
        raise ValueError(f"{spec}: n must be a whole number from 1 to {MAX_SYNTHETIC_ROWS} (the rows are built in "
                         f"memory), got {params['n']!r}")
    if split != "train":
        params["seed"] = zlib.crc32(f"{split}:{params['seed']}".encode())
    return generate(name, **params)


def shuffle_images(samples: Sequence[Sample], seed: int) -> list[Sample]:
    """Copies of `samples` whose `images` are moved to other samples (prompts and
    answers stay): the control that shows a model reads the image, since its accuracy
    should fall to chance. Samples trade only with samples holding as many images; within
    such a group every sample gets another sample's images (a cyclic shift of a random
    order), so none keeps its own."""
    out = [dict(s) for s in samples]
    groups = _image_groups(samples)
    if max(map(len, groups.values()), default=0) < 2:
        raise ValueError("shuffle_images needs at least two samples with as many images")
    rng = random.Random(seed)
    for members in groups.values():
        order = list(members)
        rng.shuffle(order)
        for receiver, giver in zip(order, order[1:] + order[:1]):
            out[receiver][IMAGES] = list(samples[giver][IMAGES])
    return out


def _image_groups(samples: Sequence[Sample]) -> dict[int, list[int]]:
    """Sample indices by how many images they hold (samples without images left out)."""
    groups: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        if sample.get(IMAGES):
            groups.setdefault(len(sample[IMAGES]), []).append(i)
    return groups


def shuffle_control_problem(samples: Sequence[Sample]) -> str | None:
    """Why the shuffled-images control cannot run on `samples` (which hold images), or None:
    checked before training, so a run does not fail at its final evaluation."""
    groups = _image_groups(samples)
    if groups and max(map(len, groups.values())) < 2:
        counts = ", ".join(f"{len(m)} with {n}" for n, m in sorted(groups.items()))
        return (f"the shuffled-images control needs at least two rows holding as many images, but the rows with "
                f"images are {counts}; give more eval rows")
    return None


def majority_baseline(samples: Sequence[Sample]) -> float:
    """The accuracy of always giving the most common answer."""
    if not samples:
        raise ValueError("majority_baseline of no samples")
    counts = Counter(s[ANSWER] for s in samples)
    return counts.most_common(1)[0][1] / len(samples)
