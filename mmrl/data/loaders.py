"""Load RL prompt datasets and iterate them in resumable batches.

    from mmrl.data import load_prompts
    prompts = load_prompts("data/train.jsonl", limit=1000, shuffle_seed=0)
    prompts = load_prompts("synthetic:count_shapes?n=256&seed=0&max_count=4")
    for batch in prompts.batches(16, seed=0, start=saved_position):
        step(batch.samples)
        saved_position = batch.end          # checkpoint this; resume with start=it

Sources, all read through HF `datasets` except synthetic tasks and in-memory lists:
- `*.jsonl`, `*.json`, `*.parquet`: a file is one split, so `split` is not consulted.
- a folder holding `{split}.jsonl|.json|.parquet` or else `data.jsonl|.json|.parquet`,
  with its image files beside it; or a folder written by `Dataset.save_to_disk` or
  `DatasetDict.save_to_disk` (`split` picks from the latter).
- `synthetic:TASK?key=value&...`: a task of `mmrl.data.synthetic` (see `from_spec`;
  a split other than "train" gets other prompts).
- a list of samples.
- a mapping (or `mmrl.data.layouts.DataSource`): a public dataset in its own layout, its
  columns mapped onto the schema by the recipe (see `mmrl.data.layouts`).
Relative media paths resolve against the folder of the file. Every selected row is
validated at load (each image opened and verified, not decoded), so a bad row fails
before training starts, with the error of `validate_sample` after the dataset's name;
row numbers count from 0 in the source. JSON files are read through once first, so an
empty file, a line that is not JSON (`file:line`), bytes that are not UTF-8 or a file of
blank lines is one line naming the file.

The last few datasets loaded from a synthetic spec, a path or a `DataSource` are kept
(`_RECENT`), keyed by the source, the split, the options and the local files' sizes and
modification times, so the recipe check before the model build
(`mmrl.recipe_checks.check_reward_and_data`) and the trainer share one load and one validation
pass.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mmrl.data.layouts import DataSource, LayoutError, MappedRows, data_source, read_source
from mmrl.data.schema import (ANSWER, MEDIA_COLUMNS, Sample, check_row_lengths, resolve_paths, to_conversation,
                               validate_sample)
from mmrl.errors import one_line

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SYNTHETIC_PREFIX = "synthetic:"


class Position(NamedTuple):
    """Where an iteration stands: `index` samples of epoch `epoch`'s order are consumed.
    A plain tuple, so it round-trips through JSON as `[epoch, index]`."""

    epoch: int
    index: int


@dataclass(frozen=True, slots=True)
class Batch:
    """Samples in order, their indices in the dataset, and the positions before and after
    them; resuming at `end` yields the batch that would have followed."""

    samples: list[Sample]
    indices: list[int]
    start: Position
    end: Position


def _row_bytes(sample: Any) -> bytes:
    """A row as bytes for `PromptDataset.fingerprint`: its JSON, keys sorted, media bytes and
    arrays by their hash; a value of another type by its type name only (a repr can hold a
    memory address, which would differ at every load)."""

    def plain(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return hashlib.blake2b(bytes(value), digest_size=16).hexdigest()
        if isinstance(value, np.ndarray):
            return [value.dtype.str, list(value.shape), hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest()]
        if hasattr(value, "tobytes") and hasattr(value, "mode") and hasattr(value, "size"):  # a PIL image
            return [value.mode, list(value.size), hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest()]
        return f"<{type(value).__name__}>"

    try:
        return json.dumps(sample, sort_keys=True, default=plain).encode() + b"\n"
    except (TypeError, ValueError):  # keys that are not text: the row counts by its place only
        return b"?\n"


class PromptDataset:
    """Validated prompt samples: `len()`, indexing (paths resolved), `batches()`.

    `rows` is anything with `len()` and integer indexing that yields samples (a HF
    `Dataset`, a list); `root` is the folder relative media paths resolve against.
    `shuffle_seed` shuffles the source rows once, then `limit` keeps the first ones.
    """

    def __init__(self, rows: Sequence[Any], *, root: str | Path | None = None, name: str = "",
                 limit: int | None = None, shuffle_seed: int | None = None):
        self.rows = rows
        self.root = Path(root).resolve() if root is not None else None
        self.name = name
        order = (list(range(len(rows))) if shuffle_seed is None
                 else np.random.default_rng(shuffle_seed).permutation(len(rows)).tolist())
        if limit is not None:
            if limit < 0:
                raise ValueError(f"limit must be >= 0, got {limit}")
            order = order[:limit]
        if not order:
            raise ValueError(f"{name or 'dataset'}: no rows to load")
        self.source_rows = order  # dataset index -> row number in the source
        content = hashlib.blake2b(digest_size=16)
        for source, sample in self._rows_for_validation():
            try:
                validate_sample(sample, source, root=self.root)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}" if name else str(exc)) from None
            content.update(_row_bytes(sample))
        # The selected rows' content in order, as stored (media paths or bytes): a checkpoint
        # records it, so resuming on data edited since is refused, not continued at a
        # position that now means other rows.
        self.fingerprint = content.hexdigest()

    def _rows_for_validation(self) -> Iterator[tuple[int, Any]]:
        media = _decoded_media_columns(self.rows)
        if not media:
            for source in self.source_rows:
                yield source, self.rows[source]
            return
        # Read images as stored (bytes or paths): decoding every image only to check
        # that it is there would make loading as slow as a pass over the data.
        plain = self.rows.remove_columns(media)
        raw = self.rows.with_format("arrow", columns=media)
        for source in self.source_rows:
            yield source, {**plain[source], **raw[source].to_pylist()[0]}

    def __len__(self) -> int:
        return len(self.source_rows)

    def __getitem__(self, index: int) -> Sample:
        source = self.source_rows[index]
        return resolve_paths(self.rows[source], self.root)

    def __iter__(self) -> Iterator[Sample]:
        for index in range(len(self)):
            yield self[index]

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, {len(self)} samples)"

    def conversation(self, index: int) -> list[dict[str, Any]]:
        """Sample `index`'s prompt with its media loaded (see `to_conversation`)."""
        return to_conversation(self[index])

    def epoch_order(self, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
        """The order of dataset indices in `epoch`: a permutation fixed by (seed, epoch)."""
        if not shuffle:
            return list(range(len(self)))
        if seed < 0 or epoch < 0:
            raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
        return np.random.default_rng([seed, epoch]).permutation(len(self)).tolist()

    def batches_per_epoch(self, batch_size: int, drop_last: bool = True) -> int:
        whole, rest = divmod(len(self), batch_size)
        return whole + (0 if drop_last or not rest else 1)

    def batches(self, batch_size: int, seed: int = 0, *, start: Position | tuple[int, int] = (0, 0),
                epochs: int | None = None, shuffle: bool = True, drop_last: bool = True) -> Iterator[Batch]:
        """Batches from `start` on, epoch after epoch (until epoch `epochs` when given).

        The order depends only on (seed, epoch), so the same seed and a saved
        `Batch.end` resume exactly. With `drop_last` every batch is full and the few
        samples left at an epoch's end are skipped; `end` then points at the next epoch.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(self):
            raise ValueError(f"batch_size {batch_size} exceeds the {len(self)} samples of "
                             f"{self.name or 'the dataset'}")
        epoch, index = start
        if epoch < 0 or not 0 <= index <= len(self):
            raise ValueError(f"start {tuple(start)} is outside epochs >= 0 and indices 0..{len(self)}")
        while epochs is None or epoch < epochs:
            order = self.epoch_order(seed, epoch, shuffle)
            while self._fits(index, batch_size, drop_last):
                chosen = order[index:index + batch_size]
                end = index + len(chosen)
                after = (Position(epoch, end) if self._fits(end, batch_size, drop_last)
                         else Position(epoch + 1, 0))
                yield Batch([self[i] for i in chosen], chosen, Position(epoch, index), after)
                index = end
            epoch, index = epoch + 1, 0

    def _fits(self, index: int, batch_size: int, drop_last: bool) -> bool:
        left = len(self) - index
        return left >= batch_size if drop_last else left > 0


def _decoded_media_columns(rows: Any) -> list[str]:
    """Media columns that a HF dataset decodes on access (Image / Video features)."""
    features = getattr(rows, "features", None)
    if not features:
        return []
    return [c for c in MEDIA_COLUMNS.values() if c in features and _decodes_media(features[c])]


def _decodes_media(feature: Any) -> bool:
    import datasets

    if isinstance(feature, (datasets.Image, datasets.Video)):
        return feature.decode
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        return _decodes_media(feature.feature)
    if isinstance(feature, dict):
        return any(_decodes_media(f) for f in feature.values())
    return False


def _check_answer_type(rows: Any, path: Path) -> None:
    """Reject an `answer` column of mixed JSON types: `datasets` stores it as a Json
    feature that reads the string "1" back as the number 1, so no row could be blamed."""
    import datasets

    if isinstance(rows.features.get(ANSWER), datasets.Json):
        raise ValueError(f"{path}: answer: values of several types across rows; "
                         "every answer must be a string")


def _load_file(path: Path) -> Any:
    import datasets

    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"{path}: unsupported file type; use {', '.join(FILE_BUILDERS)} or a folder")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file (0 bytes)")
    if builder == "json":
        _check_json_file(path)
    try:
        with _datasets_logs_off():
            return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets' errors: pyarrow, its own, JSON; none names the file
        raise ValueError(f"{path}: cannot be read as {builder} ({one_line(exc)})") from None


@contextmanager
def _datasets_logs_off():
    """`datasets` logs an error before it raises one (a second, longer line about the same
    file); the exception comes back here and becomes the one line, so its log is off."""
    import logging

    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_json_file(path: Path) -> None:
    """One line naming `path` (and the line) when it is not UTF-8 JSON rows: a JSON
    Lines file of objects, or one JSON document (which `datasets` also reads)."""
    check_row_lengths(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        bad = raw[exc.start:exc.start + 1]
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {exc.start}: {bad!r})") from None
    if not text.strip():
        raise ValueError(f"{path}: no rows (the file holds only blank lines)")
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return
        except json.JSONDecodeError as whole:
            first = next(line for line in text.splitlines() if line.strip())
            try:
                json.loads(first)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{whole.lineno}: not valid JSON ({whole.msg}, column {whole.colno})") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a row is a JSON object, got {type(row).__name__}")


def _load_folder(folder: Path, split: str) -> Any:
    import datasets

    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        loaded = datasets.load_from_disk(str(folder))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{folder}: no split {split!r}; splits: {', '.join(loaded)}")
            return loaded[split]
        return loaded
    for stem in (split, "data"):
        for suffix in FILE_BUILDERS:
            if (folder / f"{stem}{suffix}").is_file():
                return _load_file(folder / f"{stem}{suffix}")
    raise FileNotFoundError(f"{folder}: no {split}.jsonl/.json/.parquet or data.jsonl/.json/.parquet, "
                            "and not a folder written by save_to_disk")


_RECENT: dict[tuple, PromptDataset] = {}
_RECENT_SIZE = 3  # train, validation and eval of one recipe


def _recent_key(source: Any, split: str, limit: int | None, shuffle_seed: int | None) -> tuple | None:
    """What identifies a load for `_RECENT`, or None for sources that are not kept."""
    if isinstance(source, str) and source.startswith(SYNTHETIC_PREFIX):
        return (source, split, limit, shuffle_seed)
    if hasattr(source, "model_dump_json"):  # a `DataSource`: its fields and its local files
        path = Path(source.path).expanduser()
        stamps = _stamps(path) if path.exists() else ()
        return None if stamps is None else (source.model_dump_json(), split, limit, shuffle_seed, stamps)
    if not isinstance(source, (str, Path)):
        return None
    path = Path(source).expanduser()
    stamps = _stamps(path)
    return None if stamps is None else (str(path.resolve()), split, limit, shuffle_seed, stamps)


def _stamps(path: Path) -> tuple | None:
    """Name, size and modification time of a file, or of a folder and its entries."""
    try:
        files = [path, *sorted(path.iterdir())] if path.is_dir() else [path]
        return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    except OSError:
        return None


def load_prompts(source: str | Path | Sequence[Sample], split: str = "train", *,
                 limit: int | None = None, shuffle_seed: int | None = None) -> PromptDataset:
    """A validated `PromptDataset` from a file, a folder, a synthetic task or a list."""
    key = _recent_key(source, split, limit, shuffle_seed)
    if key is not None and key in _RECENT:
        return _RECENT[key]
    dataset = _load_prompts(source, split, limit=limit, shuffle_seed=shuffle_seed)
    if key is not None:
        _RECENT[key] = dataset
        while len(_RECENT) > _RECENT_SIZE:
            del _RECENT[next(iter(_RECENT))]
    return dataset


def _load_prompts(source: str | Path | Sequence[Sample], split: str, *, limit: int | None,
                  shuffle_seed: int | None) -> PromptDataset:
    if not isinstance(source, (str, Path, list, tuple)):
        # A public dataset's own layout with a column mapping: `mmrl.data.layouts`.
        return load_layout(source, split, limit=limit, shuffle_seed=shuffle_seed)
    if isinstance(source, str) and source.startswith(SYNTHETIC_PREFIX):
        from mmrl.data.synthetic import from_spec

        return PromptDataset(from_spec(source, split), name=source, limit=limit, shuffle_seed=shuffle_seed)
    if isinstance(source, (list, tuple)):
        return PromptDataset(list(source), name="samples", limit=limit, shuffle_seed=shuffle_seed)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {path}")
    rows = _load_folder(path, split) if path.is_dir() else _load_file(path)
    _check_answer_type(rows, path)
    root = path if path.is_dir() else path.parent
    return PromptDataset(rows, root=root, name=str(path), limit=limit, shuffle_seed=shuffle_seed)


def load_layout(spec: DataSource | Mapping[str, Any], split: str = "train", *, limit: int | None = None,
                shuffle_seed: int | None = None):
    """A validated `PromptDataset` of a dataset in its public layout (`DataSource`)."""
    source = data_source(spec)
    raw, root, name = read_source(source, split)
    rows = MappedRows(raw, source, name)
    limit = min(x for x in (limit, source.limit) if x is not None) if (limit or source.limit) else None
    try:
        return PromptDataset(rows, root=root, name=name, limit=limit, shuffle_seed=shuffle_seed)
    except LayoutError as exc:
        raise LayoutError(f"{name}: {exc}") from None
