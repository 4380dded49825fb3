"""Public datasets in their own layouts, mapped onto the row schema by the recipe.

A recipe's `data.train` (or `eval`, `validation`) may be a mapping instead of a path: it
names the dataset (a hub id, a local file or folder), which of its columns hold the
prompt, answer, images and videos, and a prompt template. No code is needed to train on
geometry3k, CLEVR counting, GSM8K or MATH as they are published:

    data:
      train:
        path: hiyouga/geometry3k          # hub id, .parquet/.jsonl/.json file, or a folder
        split: train
        columns: {prompt: problem, answer: answer, images: images}
        template: "{{ prompt }} Put the final answer in \\boxed{}."

    from mmrl.data import load_prompts
    rows = load_prompts({"path": "recipes/data/gsm8k/train.jsonl", "columns": {"prompt": "question"},
                         "answer_pattern": "####\\s*(.+)"})

Each source row becomes one schema row (`mmrl.data.schema`):
- the prompt column's text goes through the Jinja `template` (`{{ prompt }}` is the
  text; every other column of the row is a variable too), then is cut at each image
  placeholder (`<image>`) and video placeholder (`<video>`) into text and media parts,
  so an image sits where the row puts it; a row without placeholders gets its images,
  then its videos, before the text. A prompt column that already holds a conversation
  (a list of messages) is kept as it is.
- `system` adds a system message.
- the answer column is converted to a string, and `answer_pattern` (a regex) keeps its
  first group: GSM8K's "...#### 72" gives "72".
- the images column may hold one image or a list (HF Image features, `{"bytes",
  "path"}` dicts, bytes, or paths relative to the data file); images are decoded only
  when a batch is drawn.
- every other column is kept and reaches the reward function as a keyword argument.

Sources: a local file is read by its suffix, a folder written by `save_to_disk` with
`load_from_disk`, any other folder (a downloaded hub repository) and any hub id with
`datasets.load_dataset(path, name, split=...)`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from mmrl.data.schema import ANSWER, IMAGES, PROMPT, VIDEOS, Sample, check_row_lengths
from mmrl.errors import one_line, raised
from mmrl.hub import download_command, unreachable_reason

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Columns(_Frozen):
    """Which source columns hold what the schema needs (None: the row has none)."""

    prompt: str = "prompt"
    answer: str = "answer"
    images: str | None = None
    videos: str | None = None


class DataSource(_Frozen):
    """A public dataset in its own layout, and how its rows become schema rows."""

    path: str
    # None: the split the trainer asks for (train, validation or test); a single file
    # is one split whatever this says.
    split: str | None = None
    name: str | None = None  # the hub dataset's configuration (subset)
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    columns: Columns = Columns()
    template: str | None = None
    system: str | None = None
    image_placeholder: str = "<image>"
    video_placeholder: str = "<video>"
    answer_pattern: str | None = None
    limit: int | None = Field(None, gt=0)


def _first_problem(exc: ValidationError) -> str:
    """A `DataSource`'s first validation error as `field.inside: message`."""
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


def _as_source(value: Any) -> Any:
    """A recipe's data field: a string stays a path or synthetic task; a mapping becomes a
    `DataSource`, its errors naming the field inside it (`columns.prompt: ...`)."""
    if isinstance(value, (str, DataSource)):
        return value
    if isinstance(value, Mapping):
        try:
            return DataSource.model_validate(dict(value))
        except ValidationError as exc:
            raise ValueError(_first_problem(exc)) from None
    raise ValueError("expected a path, a synthetic:TASK spec or a mapping with path and columns, "
                     f"got {type(value).__name__}")


# The type of a recipe's data.train / eval / validation.
DataSpec = Annotated[str | DataSource, BeforeValidator(_as_source)]


class LayoutError(ValueError):
    """A data source or one of its rows does not fit its declared layout."""


def data_source(spec: DataSource | Mapping[str, Any]) -> DataSource:
    """Validate a mapping into a `DataSource`; errors name the field."""
    if isinstance(spec, DataSource):
        return spec
    try:
        return DataSource.model_validate(dict(spec))
    except ValidationError as exc:
        raise LayoutError(f"data source: {_first_problem(exc)}") from None


class MappedRows:
    """The rows of a HF dataset seen through a `DataSource`: `len()` and indexing give
    schema rows, computed when read (nothing is copied or decoded up front)."""

    def __init__(self, raw: Any, source: DataSource, where: str):
        self.source = source
        self.where = where
        names = set(raw.column_names)
        mapped = {"prompt": source.columns.prompt, "answer": source.columns.answer,
                  "images": source.columns.images, "videos": source.columns.videos}
        for role, column in mapped.items():
            if column is not None and column not in names:
                raise LayoutError(f"{where}: columns.{role}: no column {column!r}; "
                                  f"columns: {', '.join(sorted(names))}")
        # Media columns are read as stored ({"bytes", "path"} or a path), never decoded
        # here: a batch decodes its own images. (Casting them to decode=False would
        # rewrite the whole dataset.)
        self.media = [c for c in (source.columns.images, source.columns.videos) if c is not None]
        self.raw = raw.remove_columns(self.media) if self.media else raw
        self.stored = raw.with_format("arrow", columns=self.media) if self.media else None
        self.consumed = {c for c in mapped.values() if c is not None}
        self.template = _compile(source.template, where) if source.template else None
        self.answer_pattern = re.compile(source.answer_pattern, re.DOTALL) if source.answer_pattern else None
        placeholders = [p for p in (source.image_placeholder, source.video_placeholder) if p]
        self.splitter = re.compile("(" + "|".join(re.escape(p) for p in placeholders) + ")") if placeholders else None

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int) -> Sample:
        row = self.raw[index]
        if self.stored is not None:
            row.update(self.stored[index].to_pylist()[0])
        return map_row(row, self.source, index, template=self.template,
                       answer_pattern=self.answer_pattern, splitter=self.splitter, consumed=self.consumed)


# A recipe is data, so its templates must not be code: rendered in jinja2's immutable sandbox, a
# template cannot reach Python internals (`cycler.__init__.__globals__.os`), call methods
# that mutate, or build values past these bounds (docs/datasets.md#what-a-recipe-can-run).
TEMPLATE_MAX_CHARS = 1_000_000  # longest rendered prompt, and longest string one operation may build


def _sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox with `*` and `**` refused past TEMPLATE_MAX_CHARS."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise LayoutError(f"template: exponent {right} is too large (at most 64)")
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                            and len(seq) * times > TEMPLATE_MAX_CHARS:
                        raise LayoutError(f"template: repetition builds {len(seq) * times:,} items, "
                                          f"more than {TEMPLATE_MAX_CHARS:,}")
            return super().call_binop(context, operator, left, right)

    return BoundedSandbox


def _compile(template: str, where: str):
    import jinja2

    try:
        return _sandbox()(undefined=jinja2.StrictUndefined, keep_trailing_newline=True).from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise LayoutError(f"{where}: template: {exc.message} (line {exc.lineno})") from None


def render_template(template, variables: Mapping[str, Any], index: int) -> str:
    """A compiled template rendered for row `index`; whatever the template does wrong (an
    undefined name, a sandbox violation, an oversized result) is one LayoutError naming the row."""
    import jinja2
    from jinja2.sandbox import SecurityError

    try:
        text = template.render(variables)
    except jinja2.UndefinedError as exc:
        raise LayoutError(f"row {index}: template: {exc.message}") from None
    except SecurityError as exc:
        raise LayoutError(f"row {index}: template: refused by the sandbox ({exc}); "
                          "a template may only format the row's values") from None
    except LayoutError as exc:
        raise LayoutError(f"row {index}: {exc}") from None
    except (TypeError, ValueError, ArithmeticError, AttributeError, LookupError) as exc:
        raise LayoutError(f"row {index}: template: {raised(exc)}") from None
    if len(text) > TEMPLATE_MAX_CHARS:
        raise LayoutError(f"row {index}: template: the rendered prompt has {len(text):,} characters, "
                          f"more than {TEMPLATE_MAX_CHARS:,}")
    return text


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def map_row(row: Mapping[str, Any], source: DataSource, index: int = 0, *, template=None, answer_pattern=None,
            splitter=None, consumed: set[str] | None = None) -> Sample:
    """One source row as a schema row (see the module docstring). Errors name the row
    and the source column."""
    columns = source.columns
    if template is None and source.template:
        template = _compile(source.template, "data source")
    if answer_pattern is None and source.answer_pattern:
        answer_pattern = re.compile(source.answer_pattern, re.DOTALL)
    if splitter is None:
        placeholders = [p for p in (source.image_placeholder, source.video_placeholder) if p]
        splitter = re.compile("(" + "|".join(re.escape(p) for p in placeholders) + ")") if placeholders else None
    if consumed is None:
        consumed = {c for c in (columns.prompt, columns.answer, columns.images, columns.videos) if c}

    images = _as_list(row.get(columns.images)) if columns.images else []
    videos = _as_list(row.get(columns.videos)) if columns.videos else []
    prompt = row.get(columns.prompt)
    if isinstance(prompt, (list, tuple)):  # already a conversation
        conversation = list(prompt)
    elif isinstance(prompt, str):
        text = prompt
        if template is not None:
            text = render_template(template, {**row, "prompt": prompt}, index)
        content = _parts(text, splitter, source, len(images), len(videos), index)
        conversation = [{"role": "user", "content": content}]
    else:
        raise LayoutError(f"row {index}: {columns.prompt}: expected text or a conversation, "
                          f"got {'null' if prompt is None else type(prompt).__name__}")
    if source.system:
        conversation = [{"role": "system", "content": source.system}, *conversation]

    answer = row.get(columns.answer)
    if answer is None:
        raise LayoutError(f"row {index}: {columns.answer}: missing answer")
    answer = answer if isinstance(answer, str) else str(answer)
    if answer_pattern is not None:
        found = answer_pattern.search(answer)
        if found is None:
            raise LayoutError(f"row {index}: {columns.answer}: answer_pattern {source.answer_pattern!r} "
                              f"does not match {answer[-80:]!r}")
        answer = (found.group(1) if found.groups() else found.group(0)).strip()

    sample: Sample = {k: v for k, v in row.items() if k not in consumed and k not in (PROMPT, ANSWER, IMAGES, VIDEOS)}
    sample.update({PROMPT: conversation, ANSWER: answer})
    if images:
        sample[IMAGES] = images
    if videos:
        sample[VIDEOS] = videos
    return sample


def _parts(text: str, splitter, source: DataSource, n_images: int, n_videos: int, index: int) -> list[dict]:
    """Text cut at the placeholders into text, image and video parts."""
    pieces = splitter.split(text) if splitter is not None else [text]
    kinds = {source.image_placeholder: "image", source.video_placeholder: "video"}
    parts: list[dict] = []
    for piece in pieces:
        if piece in kinds:
            parts.append({"type": kinds[piece]})
        elif piece.strip():
            parts.append({"type": "text", "text": piece})
    counts = {"image": n_images, "video": n_videos}
    for kind, column, placeholder in (("image", source.columns.images, source.image_placeholder),
                                      ("video", source.columns.videos, source.video_placeholder)):
        placed = sum(p["type"] == kind for p in parts)
        if placed and placed != counts[kind]:
            raise LayoutError(f"row {index}: {source.columns.prompt}: {placed} {placeholder} placeholder(s) for "
                              f"{counts[kind]} {kind}(s) in column {column!r}")
    # Media a row does not place goes before the text, images first.
    front: list[dict] = []
    for kind in ("image", "video"):
        if not any(p["type"] == kind for p in parts):
            front += [{"type": kind} for _ in range(counts[kind])]
    return front + parts


def read_source(source: DataSource, split: str = "train") -> tuple[Any, Path | None, str]:
    """The raw HF dataset of `source`, the folder its relative paths resolve against, and
    a name for messages."""
    import datasets

    split = source.split or split
    path = Path(source.path).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise LayoutError(f"{path}: unsupported file type; use {', '.join(FILE_BUILDERS)} or a folder")
        check_row_lengths(path)
        return datasets.load_dataset(builder, data_files=str(path), split="train"), path.parent, str(path)
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise LayoutError(f"{path}: no split {split!r}; splits: {', '.join(loaded)}")
            loaded = loaded[split]
        return loaded, path, f"{path} ({split})"
    if not path.exists() and (source.path.startswith((".", "/", "~")) or path.suffix in FILE_BUILDERS):
        raise FileNotFoundError(f"dataset not found: {path}")
    # A downloaded hub repository or a hub id: the `datasets` builders read its layout.
    # A hub id out of reach is read from the datasets cache alone, at once: `datasets`
    # would retry each request for half a minute and then raise a long traceback.
    offline = None if path.is_dir() else _offline_reason(source.path)
    try:
        with _datasets_offline(offline is not None):
            raw = datasets.load_dataset(str(path) if path.is_dir() else source.path, source.name,
                                        data_files=source.data_files, split=split)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise LayoutError(f"{source.path}: no split {split!r} ({one_line(exc)})") from None
        raise
    except ConnectionError:  # offline, and not in the datasets cache
        why = offline or "the hub cannot be reached"
        fetch = download_command(source.path, repo_type="dataset")
        raise LayoutError(f"{source.path}: a hub dataset that is not in the datasets cache ({why}); load it once "
                          f"with network access, or download it and set path to the folder: {fetch} --local-dir DIR"
                          ) from None
    return raw, path if path.is_dir() else None, f"{source.path} ({split})"


def _offline_reason(dataset_id: str) -> str | None:
    """Why `dataset_id` must come from the datasets cache alone (`HF_DATASETS_OFFLINE`,
    `HF_HUB_OFFLINE`, or a hub out of reach), or None."""
    import datasets

    if os.environ.get("HF_DATASETS_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_DATASETS_OFFLINE=1"
    if datasets.config.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1"
    return unreachable_reason(dataset_id, repo_type="dataset")


@contextmanager
def _datasets_offline(offline: bool):
    """`datasets` in offline mode for one load. It reads `HF_HUB_OFFLINE` once, at import,
    into `datasets.config.HF_HUB_OFFLINE`, and consults that attribute on every request."""
    import datasets

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = before or offline
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before
