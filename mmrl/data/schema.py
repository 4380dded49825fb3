"""The sample schema of RL prompt datasets: what a row holds, its validation, and its
conversion into a conversation that `mmrl.processing.Processing` consumes.

A sample (one row) is a mapping of columns:

    {"prompt": [{"role": "system", "content": "Answer with one word."},
                {"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "How many shapes?"}]}],
     "answer": "3",                    # the ground truth, a string
     "images": ["img/0001.png"],       # optional: fills payload-less image parts, in order
     "videos": [...],                  # optional: the same for video parts
     "level": 2}                       # any other column is kept and given to rewards

`prompt` is a conversation without the answer: it must not end with an assistant
message. A part carries its own payload (`{"type": "image", "image": ...}`, or `"path"`)
or takes the next one from the `images` / `videos` column. An image is a PIL image, a
file path (relative paths resolve against the dataset file's folder), bytes, or a HF
datasets Image dict `{"bytes", "path"}`; a video is a list of such frames or a file
path. Keys whose value is None are ignored: Arrow gives every struct the union of the
keys seen in a column, so a text part read back by `datasets` carries `"image": None`.

Images are checked when a dataset loads (each file or byte string opened and verified,
its size read from the header) and decoded reduced: `to_conversation(..., max_pixels=)`
asks JPEG decoders for a smaller scale (`Image.draft`) and shrinks other formats by an
integer factor (`Image.reduce`) while keeping at least 4x `max_pixels` for the
processor's own resize, so memory does not grow with the source resolution. Formats
that cannot be decoded reduced are refused above `MAX_DECODE_PIXELS`.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mmrl.errors import one_line

Sample = dict[str, Any]
Message = dict[str, Any]

PROMPT, ANSWER, IMAGES, VIDEOS = "prompt", "answer", "images", "videos"
ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image", "video")
# Where a part may carry its payload; `path` is what `Processing.collect_media` also reads.
PAYLOAD_KEYS = {"image": ("image", "path"), "video": ("video", "path")}
MEDIA_COLUMNS = {"image": IMAGES, "video": VIDEOS}
_ARTICLE = {"image": "an", "video": "a"}
# Images of formats decoded at full size first (all but JPEG) are refused above this.
MAX_DECODE_PIXELS = 100_000_000
# Without a max_pixels, images are decoded reduced to no fewer pixels than this.
DEFAULT_DECODE_PIXELS = 4096 * 4096
_DRAFTABLE = ("JPEG",)


def _fail(index: int, field: str, problem: str) -> None:
    raise ValueError(f"row {index}: {field}: {problem}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _payload(part: Mapping[str, Any], kind: str) -> Any:
    """The part's own payload, or None when it takes one from the media column."""
    for key in PAYLOAD_KEYS[kind]:
        if part.get(key) is not None:
            return part[key]
    return None


def _resolve(path: str | Path, root: Path | None) -> Path:
    path = Path(path).expanduser()
    return path if path.is_absolute() or root is None else root / path


def _image_problem(value: Any, root: Path | None) -> str | None:
    """Why `value` cannot be an image, or None. Files are checked only when `root` is
    known (the loader passes it), so a bare sample can be validated anywhere."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return None
    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            return None
        if value.get("path") is None:
            return "image dict without bytes or path"
        value = value["path"]
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            return "empty image bytes"
        return _unreadable(bytes(value), "image bytes") if root is not None else None
    if isinstance(value, (str, Path)):
        if not str(value):
            return "empty image path"
        if root is not None:
            path = _resolve(value, root)
            if not path.is_file():
                return f"image file not found: {path}" + (" is a folder" if path.is_dir() else "")
            return _unreadable(path, str(path))
        return None
    return f"cannot read an image from {_type_name(value)}"


def _open(source: Path | bytes):
    from PIL import Image

    with warnings.catch_warnings():  # a large JPEG is fine: it is decoded reduced
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)


def _unreadable(source: Path | bytes, name: str) -> str | None:
    """Why the image in `source` cannot be decoded, from its header and a verify pass
    (no full decode), or None."""
    from PIL import Image

    if isinstance(source, Path) and source.stat().st_size == 0:
        return f"{name}: empty image file (0 bytes)"
    try:
        with _open(source) as image:
            problem = _size_problem(image, name)
            if problem:
                return problem
            image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return f"{name}: not a readable image ({_why_unreadable(exc)})"
    return None


# Images at least this many times wider than tall (or taller than wide) are refused when the
# data is checked: vision processors refuse them at the first step (Qwen's at 200).
MAX_ASPECT_RATIO = 200


def _size_problem(image, name: str) -> str | None:
    width, height = image.size
    if width < 1 or height < 1:
        return f"{name}: image of {width}x{height} pixels"
    ratio = max(width, height) / min(width, height)
    if ratio >= MAX_ASPECT_RATIO:
        return (f"{name}: image of {width}x{height} pixels, an aspect ratio of {ratio:.0f}:1; vision processors "
                f"take below {MAX_ASPECT_RATIO}:1 (crop or pad it)")
    if width * height > MAX_DECODE_PIXELS and image.format not in _DRAFTABLE:
        return (f"{name}: {width}x{height} pixels ({image.format}) is above the {MAX_DECODE_PIXELS:,} pixels "
                "decoded at full size; shrink it (JPEG images of any size are decoded reduced)")
    return None


def _why_unreadable(exc: BaseException) -> str:
    """Pillow's reason on one line, in words where its own would only name the file."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image format Pillow knows, or a corrupt header"
    return one_line(exc)


def decode_image(source: Any, max_pixels: int | None = None) -> Any:
    """A PIL RGB image from a PIL image, a path, bytes or a `{"bytes"|"path"}` dict,
    decoded reduced so it keeps at least 4x `max_pixels` (or `DEFAULT_DECODE_PIXELS`)
    pixels but not many more; raise ValueError naming the file when it cannot be read."""
    from PIL import Image

    if isinstance(source, Mapping) and (source.get("bytes") or source.get("path")):
        source = source.get("bytes") or source["path"]
    if isinstance(source, Image.Image):
        return _rgb(_reduced(source, max_pixels))
    if isinstance(source, (bytes, bytearray, memoryview)):
        raw, name = bytes(source), "image bytes"
    elif isinstance(source, (str, Path)):
        raw, name = Path(source), str(source)
        if not raw.is_file():
            raise FileNotFoundError(f"image file not found: {raw}")
    else:
        raise TypeError(f"cannot read an image from {_type_name(source)}")
    try:
        with _open(raw) as image:
            problem = _size_problem(image, name)
            if problem:
                raise ValueError(problem)
            target = _decode_target(max_pixels)
            factor = _reduce_factor(image.size, target)
            if factor > 1 and image.format in _DRAFTABLE:
                width, height = image.size
                image.draft("RGB", (math.ceil(width / factor), math.ceil(height / factor)))
            image.load()
            return _rgb(_reduced(image, max_pixels))
    except (OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{name}: not a readable image ({_why_unreadable(exc)})") from None


def _rgb(image):
    """RGB with 8 bits a channel. 16-bit greyscale (PNG's `I;16`, or `I` holding 0..65535) is
    scaled down first: Pillow's own conversion clips it, so most of it turns pure white."""
    from PIL import Image

    if image.mode.startswith("I;16") or image.mode == "I":
        import numpy as np

        values = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8), mode="L")
    # An RGB image is itself, not a copy (Pillow's convert copies): the samples of one prompt
    # then share their images, which a rollout processes once by object.
    return image if image.mode == "RGB" else image.convert("RGB")


def _decode_target(max_pixels: int | None) -> int:
    return 4 * max_pixels if max_pixels is not None else DEFAULT_DECODE_PIXELS


def _reduce_factor(size: tuple[int, int], target: int) -> int:
    """The largest integer shrink that keeps at least `target` pixels."""
    width, height = size
    return max(1, math.isqrt(width * height // max(target, 1)))


def _reduced(image, max_pixels: int | None):
    factor = _reduce_factor(image.size, _decode_target(max_pixels))
    return image.reduce(factor) if factor > 1 else image


def _check_image(value: Any, index: int, field: str, root: Path | None) -> None:
    problem = _image_problem(value, root)
    if problem:
        _fail(index, field, problem)


def _check_video(value: Any, index: int, field: str, root: Path | None) -> None:
    if isinstance(value, (str, Path)):
        if root is not None and not _resolve(value, root).is_file():
            _fail(index, field, f"video file not found: {_resolve(value, root)}")
        return
    if not isinstance(value, (list, tuple)) or not value:
        _fail(index, field, f"a video is a file path or a non-empty list of frames, got {_type_name(value)}")
    for j, frame in enumerate(value):
        _check_image(frame, index, f"{field}[{j}]", root)


_CHECK_PAYLOAD = {"image": _check_image, "video": _check_video}


def _check_part(part: Any, index: int, field: str, root: Path | None) -> str | None:
    """Check one content part; return its kind when it waits for a media column payload."""
    if not isinstance(part, Mapping):
        _fail(index, field, f"expected a part mapping, got {_type_name(part)}")
    kind = part.get("type")
    if kind not in PART_TYPES:
        _fail(index, f"{field}.type", f"unknown part type {kind!r} (expected text, image or video)")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            _fail(index, f"{field}.text", f"expected a string, got {_type_name(part.get('text'))}")
        return None
    payload = _payload(part, kind)
    if payload is None:
        return kind
    _CHECK_PAYLOAD[kind](payload, index, field, root)
    return None


def _check_prompt(prompt: Any, index: int, root: Path | None) -> dict[str, list[str]]:
    """Check the conversation; return, per media kind, the fields of payload-less parts."""
    if prompt is None:
        _fail(index, PROMPT, "missing")
    if isinstance(prompt, str):
        _fail(index, PROMPT,
              'expected a list of messages, got a string (write [{"role": "user", "content": ...}])')
    if not isinstance(prompt, (list, tuple)):
        _fail(index, PROMPT, f"expected a list of messages, got {_type_name(prompt)}")
    if not prompt:
        _fail(index, PROMPT, "empty conversation")
    waiting: dict[str, list[str]] = {"image": [], "video": []}
    for i, message in enumerate(prompt):
        field = f"{PROMPT}[{i}]"
        if not isinstance(message, Mapping):
            _fail(index, field, f"expected a message mapping, got {_type_name(message)}")
        if message.get("role") not in ROLES:
            _fail(index, f"{field}.role", f"expected one of {', '.join(ROLES)}, got {message.get('role')!r}")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, (list, tuple)):
            _fail(index, f"{field}.content",
                  f"expected a string or a list of parts, got {_type_name(content)}")
        for j, part in enumerate(content):
            part_field = f"{field}.content[{j}]"
            kind = _check_part(part, index, part_field, root)
            if kind:
                waiting[kind].append(part_field)
    if prompt[-1].get("role") == "assistant":
        _fail(index, f"{PROMPT}[{len(prompt) - 1}].role",
              "the prompt ends with an assistant message; the answer belongs in `answer`")
    return waiting


def _check_media_column(sample: Mapping[str, Any], kind: str, waiting: list[str], index: int,
                        root: Path | None) -> None:
    column = MEDIA_COLUMNS[kind]
    values = sample.get(column)
    values = [] if values is None else values
    if not isinstance(values, (list, tuple)):
        _fail(index, column, f"expected a list, got {_type_name(values)}")
    for i, value in enumerate(values):
        _CHECK_PAYLOAD[kind](value, index, f"{column}[{i}]", root)
    if len(values) < len(waiting):
        _fail(index, waiting[len(values)], f"{kind} part without {_ARTICLE[kind]} {kind}")
    if len(values) > len(waiting):
        _fail(index, column, f"{len(values)} {kind}(s) for {len(waiting)} {kind} part(s) without a payload")


def validate_sample(sample: Any, index: int, *, root: str | Path | None = None) -> None:
    """Raise ValueError, one line naming the row and the field, if `sample` breaks the
    schema. With `root` (the dataset's folder) image and video files must exist too."""
    root = Path(root) if root is not None else None
    if not isinstance(sample, Mapping):
        _fail(index, "sample", f"expected a mapping of columns, got {_type_name(sample)}")
    waiting = _check_prompt(sample.get(PROMPT), index, root)
    if sample.get(ANSWER) is None:
        _fail(index, ANSWER, "missing")
    if not isinstance(sample[ANSWER], str):
        _fail(index, ANSWER, f"expected a string, got {_type_name(sample[ANSWER])} (quote it in the data)")
    for kind in ("image", "video"):
        _check_media_column(sample, kind, waiting[kind], index, root)


def resolve_paths(sample: Mapping[str, Any], root: str | Path | None) -> Sample:
    """A copy of `sample` whose relative media paths are absolute (against `root`), so the
    sample means the same thing wherever it travels."""
    if root is None:
        return dict(sample)
    root = Path(root)

    def fix(value: Any) -> Any:
        if isinstance(value, (str, Path)):
            return str(_resolve(value, root))
        if isinstance(value, Mapping) and value.get("bytes") is None and value.get("path") is not None:
            return {**value, "path": str(_resolve(value["path"], root))}
        if isinstance(value, (list, tuple)):  # video frames
            return [fix(frame) for frame in value]
        return value

    def fix_part(part: Any) -> Any:
        if not isinstance(part, Mapping) or part.get("type") not in PAYLOAD_KEYS:
            return part
        return {k: fix(v) if k in PAYLOAD_KEYS[part["type"]] else v for k, v in part.items()}

    out = dict(sample)
    out[PROMPT] = [
        m if isinstance(m.get("content"), str) else {**m, "content": [fix_part(p) for p in m["content"]]}
        for m in sample[PROMPT]
    ]
    for column in MEDIA_COLUMNS.values():
        if sample.get(column) is not None:
            out[column] = [fix(v) for v in sample[column]]
    return out


def _open_image(value: Any, root: Path | None, max_pixels: int | None = None) -> Any:
    if isinstance(value, (str, Path)):
        value = _resolve(value, root)
    elif isinstance(value, Mapping) and value.get("bytes") is None and value.get("path") is not None:
        value = _resolve(value["path"], root)
    return decode_image(value, max_pixels)


def _open_video(value: Any, root: Path | None, max_pixels: int | None = None) -> Any:
    if isinstance(value, (str, Path)):
        return str(_resolve(value, root))  # families with a video reader decode files
    return [_open_image(frame, root, max_pixels) for frame in value]


def _resolved_part(part: Mapping[str, Any], pending: dict[str, Iterator[Any]], root: Path | None,
                   max_pixels: int | None = None) -> dict:
    part = {k: v for k, v in part.items() if v is not None}
    kind = part["type"]
    if kind == "text":
        return part
    payload = _payload(part, kind)
    if payload is None:
        payload = next(pending[kind], None)
        if payload is None:
            raise ValueError(f"{kind} part without {_ARTICLE[kind]} {kind}: validate the sample first")
    for key in PAYLOAD_KEYS[kind]:
        part.pop(key, None)
    if kind == "image":
        return {**part, "image": _open_image(payload, root, max_pixels)}
    return {**part, "video": _open_video(payload, root, max_pixels)}


def to_conversation(sample: Mapping[str, Any], *, root: str | Path | None = None,
                    max_pixels: int | None = None) -> list[Message]:
    """The prompt as a conversation whose media parts hold their payloads: every image
    part a PIL RGB image, every video part a list of PIL frames or an absolute path.
    Relative paths resolve against `root` (the current folder when None); the sample
    should have passed `validate_sample`. Images are decoded reduced toward
    `max_pixels` (see `decode_image`); one that cannot be read is a ValueError naming it."""
    root = Path(root) if root is not None else None
    pending = {kind: iter(sample.get(column) or []) for kind, column in MEDIA_COLUMNS.items()}
    conversation = []
    for message in sample[PROMPT]:
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message["content"], str):
            message["content"] = [_resolved_part(p, pending, root, max_pixels) for p in message["content"]]
        conversation.append(message)
    return conversation


# The longest row of a JSON Lines file, in characters: a 10 MB line would be tokenized and
# padded into every batch before its length is found out (docs/training.md#limits).
MAX_ROW_CHARS = 1_000_000


def check_row_lengths(path: Path) -> None:
    """Raise ValueError naming the file and line when a line of a .jsonl/.json file is
    longer than MAX_ROW_CHARS (read in blocks: the long line itself is never held whole)."""
    if Path(path).suffix.lower() not in (".jsonl", ".json"):
        return
    number, length = 1, 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            parts = block.split(b"\n")
            for index, part in enumerate(parts):
                length += len(part)
                if length > MAX_ROW_CHARS:
                    raise ValueError(f"{path}:{number}: a row of more than {MAX_ROW_CHARS} bytes, the limit "
                                     "(far beyond any model's context; mmrl.data.schema.MAX_ROW_CHARS)")
                if index < len(parts) - 1:  # a newline ends this line
                    number, length = number + 1, 0
