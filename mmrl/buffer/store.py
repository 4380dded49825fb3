"""Rollout batches in memory and in the run folder: put, take under a staleness bound,
restore on resume.

    store = TrajectoryBuffer(run / "buffer", rank=0, ranks=1)
    batch_id = store.put(batch)                   # written to buffer/batch_000001.parquet
    batch, dropped = store.take(version=3, max_staleness=1)
    checkpoint_state["buffer"] = store.state()    # {"produced": M, "taken": N}
    store.restore(saved_state, rebuild)           # on resume: batches N+1..M wait again
    store.in_flight                               # partial rollouts: samples still generating

Batches are numbered 1, 2, ... as they are produced and taken in that order (first in,
first out). A batch whose weights version is more than `max_staleness` updates behind
the version training on it is dropped, and its trajectories counted (`buffer/dropped`).

Persistence: each data-parallel rank writes its share of each batch as one Parquet file
(the first rank of a sequence-parallel group, whose ranks share their rollouts), renamed
into place whole (`mmrl.atomic.replacing`); with several data-parallel ranks the name
carries the rank (`batch_000001-rank1.parquet`). One row per trajectory (`COLUMNS`); the file's
metadata holds the batch's number, weights version and the data position after its
prompts. The main rank also rewrites `state.json` after each put and take: what was
taken at which step, for `mmrl buffer show`. A checkpoint stores `state()`; resuming from
it (`restore`) makes batches produced before it and not yet taken wait again, read back
from their files, and removes the files of batches produced after it: their prompts come
again from the checkpoint's data position, sampled again by the checkpoint's weights with
its random state, so a resumed run trains on each batch exactly once and on the same data
as a run never stopped. pyarrow comes with `datasets`, a dependency.

Partial rollouts (`rollout.partial_tokens`, mmrl/buffer/partial.py) also keep the samples
still generating (`in_flight`: groups of responses, each token with the weights version
that sampled it and its behaviour log-prob). With each batch the buffer writes the set as
it stands after that batch, `in_flight_000001.parquet`, before the batch's own file; a
resume reads back the set of the checkpoint's last batch, so a carried sample is neither
lost nor continued twice.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmrl.atomic import atomic_write_text, replacing
from mmrl.errors import one_line
from mmrl.rollout.base import RolloutResult

STATE_FILE = "state.json"
FORMAT = 1
_METADATA_KEY = b"mmrl_buffer"
# One row per trajectory; `reward/<name>` columns follow for a combined reward's parts.
COLUMNS = ("batch", "version", "group", "index", "row", "media", "prompt_ids", "response_ids", "response_mask",
           "behaviour_logp", "token_version", "finish_reason", "reward", "outcome")


class BufferError(ValueError):
    """The buffer cannot be written, read or resumed; the message says why, in one line."""


@dataclass
class RolloutBatch:
    """One rank's share of one rollout round, scored: what a step trains on.

    `result` holds `n` responses per prompt (`result.prompt_index` names each one's prompt,
    its group); `rewards` are the scores the update uses (the reward function's plus the
    environment's), `outcomes` the reward function's alone; `version` counts the updates
    the sampling weights had taken; `behaviour_logp` (N * n, R) are those weights' log-
    probs of the sampled tokens, recorded when the batch may be trained on later."""

    samples: list[dict]
    rows: list[int]  # source rows of the samples (as the dataset file counts them)
    conversations: list | None
    result: RolloutResult
    rewards: torch.Tensor
    reward_parts: dict[str, list[float]]
    outcomes: torch.Tensor
    version: int
    data_end: tuple[int, int]
    behaviour_logp: torch.Tensor | None = None
    # The samples' indices in the training dataset and its name: the media reference.
    indices: list[int] = field(default_factory=list)
    dataset: str = ""
    batch_id: int = 0
    # Partial rollouts: the weights version that sampled each token (N * n, R), and the
    # figures of the rounds that made the batch (written with it, for metrics.jsonl).
    token_versions: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def older_tokens(self, version: int) -> bool:
        """Whether any response token was sampled by weights older than `version`."""
        if self.token_versions is None:
            return False
        sampled = self.result.response_mask > 0
        return bool((self.token_versions[sampled] < version).any())

    @property
    def size(self) -> int:
        return len(self.rewards)


@dataclass
class InFlightResponse:
    """One response of a partial rollout: its tokens so far, each one's sampling weights
    version and behaviour log-prob, and how it ended (None: still generating)."""

    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)
    finish: str | None = None


@dataclass
class InFlightGroup:
    """One prompt's `n` responses in a partial rollout, by the prompt's index in the
    training dataset and its source row; trained on once every response has finished."""

    index: int
    row: int
    responses: list[InFlightResponse]

    @property
    def complete(self) -> bool:
        return all(r.finish is not None for r in self.responses)


@dataclass
class TrajectoryBuffer:
    """Rollout batches waiting to be trained on (`pending`, oldest first), persisted under
    `folder` (None: in memory only)."""

    folder: Path | None
    rank: int = 0
    ranks: int = 1
    main: bool = True
    # The ranks of one sequence-parallel group hold the same batches: one of them writes.
    writer: bool = True
    pending: deque = field(default_factory=deque)
    produced: int = 0
    taken: int = 0
    # What became of each taken batch, in order: {"batch", "step", "version", "staleness", "trajectories", "dropped"}.
    log: list[dict[str, Any]] = field(default_factory=list)
    # Partial rollouts: the groups still generating, persisted with each batch.
    partial: bool = False
    in_flight: list[InFlightGroup] = field(default_factory=list)

    # -- put and take ------------------------------------------------------------------------------
    def put(self, batch: RolloutBatch, on_disk: bool = False) -> int:
        """Add a produced batch (persisted first, so a batch in memory is a batch on disk;
        `on_disk`: its file is there already, written by the rank that sampled it)."""
        batch.batch_id = self.produced + 1
        if self.folder is not None and self.writer:
            if self.partial:
                write_in_flight(self.in_flight_file(batch.batch_id), self.in_flight)
            if not on_disk:
                write_batch(self.batch_file(batch.batch_id), batch)
        self.produced = batch.batch_id
        self.pending.append(batch)
        self._write_state()
        return batch.batch_id

    def take(self, version: int, max_staleness: int) -> tuple[RolloutBatch | None, int]:
        """The oldest batch whose weights are at most `max_staleness` updates behind
        `version` (None when none waits), and how many trajectories were dropped on the
        way for being older."""
        dropped = 0
        while self.pending:
            batch = self.pending.popleft()
            self.taken = batch.batch_id
            staleness = version - batch.version
            too_old = staleness > max_staleness
            self.log.append({"batch": batch.batch_id, "step": version + 1, "version": batch.version,
                             "staleness": staleness, "trajectories": batch.size, "dropped": too_old})
            if not too_old:
                self._write_state()
                return batch, dropped
            dropped += batch.size
        self._write_state()
        return None, dropped

    # -- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict[str, int]:
        """What a checkpoint records: batches produced and taken so far."""
        return {"produced": self.produced, "taken": self.taken}

    def restore(self, state: dict[str, int] | None, rebuild: Callable[[Any, dict], RolloutBatch]) -> None:
        """Return to a checkpoint's `state()` (None: a checkpoint from before the buffer,
        which had none waiting): batches it had produced and not taken wait again, read
        back from their files through `rebuild(table, metadata)`; files of later batches
        are removed (see the module docstring)."""
        produced, taken = (state["produced"], state["taken"]) if state else (0, 0)
        self.pending.clear()
        self.in_flight = []
        if self.folder is not None:
            for path in self._batch_files() if self.writer else ():
                if batch_name(path)[0] > produced:
                    path.unlink(missing_ok=True)
            for path in self.folder.glob("in_flight_*.parquet") if self.writer else ():
                if (name := batch_name(path, _IN_FLIGHT_NAME)) is not None and name[0] > produced:
                    path.unlink(missing_ok=True)
            if self.partial and produced:
                path = self.in_flight_file(produced)
                if not path.is_file():
                    raise BufferError(f"trainer.resume: {path} is missing: it holds the samples still generating "
                                      f"after batch {produced}; restore the file, or start a new run")
                self.in_flight = read_in_flight(path)
            for batch_id in range(taken + 1, produced + 1):
                path = self.batch_file(batch_id)
                if not path.is_file():
                    raise BufferError(f"trainer.resume: {path} is missing: the checkpoint had not trained on batch "
                                      f"{batch_id} yet and it cannot be sampled again by the weights that made it; "
                                      "restore the file, or start a new run")
                table, metadata = read_batch(path)
                batch = rebuild(table, metadata)
                batch.batch_id = batch_id
                self.pending.append(batch)
        elif produced > taken:
            raise BufferError(f"trainer.resume: the checkpoint has {produced - taken} rollout batches waiting, but "
                              "this buffer keeps none on disk")
        self.produced, self.taken = produced, taken
        self.log = [entry for entry in read_state(self.folder).get("log", []) if entry["batch"] <= taken] \
            if self.folder is not None else []
        self._write_state()

    # -- files -------------------------------------------------------------------------------------
    def batch_file(self, batch_id: int) -> Path:
        suffix = f"-rank{self.rank}" if self.ranks > 1 else ""
        return self.folder / f"batch_{batch_id:06d}{suffix}.parquet"

    def in_flight_file(self, batch_id: int) -> Path:
        suffix = f"-rank{self.rank}" if self.ranks > 1 else ""
        return self.folder / f"in_flight_{batch_id:06d}{suffix}.parquet"

    def _batch_files(self) -> list[Path]:
        """This rank's batch files, any number."""
        mine = self.rank if self.ranks > 1 else None
        return sorted(p for p in self.folder.glob("batch_*.parquet")
                      if (name := batch_name(p)) is not None and name[1] == mine)

    def _write_state(self) -> None:
        if self.folder is None or not self.main:
            return
        atomic_write_text(self.folder / STATE_FILE, json.dumps(
            {"format": FORMAT, "produced": self.produced, "taken": self.taken, "log": self.log}) + "\n")


_BATCH_NAME = re.compile(r"batch_(\d+)(?:-rank(\d+))?\.parquet")
_IN_FLIGHT_NAME = re.compile(r"in_flight_(\d+)(?:-rank(\d+))?\.parquet")


def batch_name(path: Path, pattern: re.Pattern = _BATCH_NAME) -> tuple[int, int | None] | None:
    """A batch file's (number, rank) (rank None: a one-rank run's); None: not a batch file
    (`pattern`: of another kind of numbered file, the in-flight ones)."""
    match = pattern.fullmatch(path.name)
    if not match:
        return None
    return int(match[1]), int(match[2]) if match[2] is not None else None


def read_state(folder: Path) -> dict[str, Any]:
    path = folder / STATE_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BufferError(f"{path}: cannot be read ({exc})") from None


# -- Parquet ---------------------------------------------------------------------------------------
def media_references(sample: dict) -> list[str]:
    """The file paths of a sample's images and videos (in-memory media have none: the
    dataset row is their reference)."""
    out = []
    for key in ("images", "videos"):
        for item in sample.get(key) or []:
            if isinstance(item, (str, Path)):
                out.append(str(item))
            elif isinstance(item, dict) and isinstance(item.get("path"), str):
                out.append(item["path"])
    return out


def _ragged(values: torch.Tensor, keep: torch.Tensor, value_type):
    """Rows of `values` (N, T) cut to the positions `keep` (N, T) marks, as a pyarrow list
    array built from one flat buffer (a Python list per row costs seconds on a large batch)."""
    import numpy as np
    import pyarrow as pa

    offsets = np.concatenate([[0], keep.sum(-1).cumsum(0).numpy()]).astype(np.int32)
    flat = values[keep].numpy()
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, value_type))


def _prompt_ids(result: RolloutResult):
    """Each response's prompt tokens, where the backend kept its processed prompt batch."""
    import pyarrow as pa

    inputs = result.prompt_inputs
    if inputs is None or "input_ids" not in inputs:
        return pa.nulls(len(result.response_ids), pa.list_(pa.int32()))
    return _ragged(inputs["input_ids"].cpu().int(), inputs["attention_mask"].cpu().bool(), pa.int32())


def batch_table(batch: RolloutBatch):
    """The batch as a pyarrow Table, one row per trajectory (`COLUMNS`)."""
    import pyarrow as pa

    result = batch.result
    mask = result.response_mask.cpu().float()
    # Each row up to its last response token: the rest is padding.
    positions = torch.arange(mask.shape[1])
    last = torch.where(mask > 0, positions, -1).amax(-1) if mask.shape[1] else torch.full((len(mask),), -1)
    keep = positions[None, :] <= last[:, None]
    behaviour = _ragged(batch.behaviour_logp.cpu().float(), keep, pa.float32()) \
        if batch.behaviour_logp is not None else pa.nulls(batch.size, pa.list_(pa.float32()))
    versions = _ragged(batch.token_versions.cpu().long(), keep, pa.int64()) \
        if batch.token_versions is not None else pa.nulls(batch.size, pa.list_(pa.int64()))
    owners = result.prompt_index.tolist()
    columns: dict[str, Any] = {
        "batch": pa.array([batch.batch_id] * batch.size, pa.int64()),
        "version": pa.array([batch.version] * batch.size, pa.int64()),
        "group": pa.array(owners, pa.int32()),
        "index": pa.array([batch.indices[g] for g in owners], pa.int64()),
        "row": pa.array([batch.rows[g] for g in owners], pa.int64()),
        "media": pa.array([media_references(batch.samples[g]) for g in owners], pa.list_(pa.string())),
        "prompt_ids": _prompt_ids(result),
        "response_ids": _ragged(result.response_ids.cpu().int(), keep, pa.int32()),
        "response_mask": _ragged(mask, keep, pa.float32()),
        "behaviour_logp": behaviour,
        "token_version": versions,
        "finish_reason": pa.array(list(result.finish_reasons), pa.string()),
        "reward": pa.array(batch.rewards.cpu().double().numpy(), pa.float64()),
        "outcome": pa.array(batch.outcomes.cpu().double().numpy(), pa.float64()),
    }
    for name, scores in batch.reward_parts.items():
        columns[f"reward/{name}"] = pa.array([float(s) for s in scores], pa.float64())
    metadata = {"format": FORMAT, "batch": batch.batch_id, "version": batch.version,
                "data_end": list(batch.data_end), "dataset": batch.dataset, "prompts": len(batch.samples),
                **({"metrics": batch.metrics} if batch.metrics else {})}
    return pa.table(columns).replace_schema_metadata({_METADATA_KEY: json.dumps(metadata).encode()})


def _write_table(path: Path, table) -> Path:
    """Write a Parquet table whole (a temporary file, fsynced, renamed)."""
    import pyarrow.parquet as pq

    try:
        with replacing(path) as temp:
            pq.write_table(table, str(temp))
    except OSError as exc:
        raise BufferError(f"{path}: cannot be written ({exc.strerror or exc})") from None
    return path


def write_batch(path: Path, batch: RolloutBatch) -> Path:
    """Write the batch's Parquet file whole (a temporary file, fsynced, renamed)."""
    return _write_table(path, batch_table(batch))


def read_batch(path: Path):
    """A batch file's table and its metadata (`batch_table`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise BufferError(f"{path}: not a readable buffer file ({one_line(exc)})") from None
    raw = (table.schema.metadata or {}).get(_METADATA_KEY)
    if raw is None:
        raise BufferError(f"{path}: not a buffer file (no {_METADATA_KEY.decode()} metadata)")
    return table, json.loads(raw)


def rebuild_batch(table, metadata: dict, *, dataset, pad_id: int,
                  conversations: Callable[[list[dict], list[int]], list] | None) -> RolloutBatch:
    """A batch read back from its file, ready to train on: the samples from `dataset` by
    their indices, `conversations(samples, rows)` (None: a rollout that opens its own),
    the responses right-padded with `pad_id`."""
    columns = table.to_pydict()
    owners = columns["group"]
    prompts = max(owners) + 1 if owners else 0
    indices, rows = [0] * prompts, [0] * prompts
    for owner, index, row in zip(owners, columns["index"], columns["row"]):
        indices[owner], rows[owner] = index, row
    samples = [dataset[i] for i in indices]
    width = max((len(ids) for ids in columns["response_ids"]), default=0) or 1
    size = len(owners)
    ids = torch.full((size, width), pad_id, dtype=torch.long)
    mask = torch.zeros(size, width)
    behaviour = torch.zeros(size, width) if all(b is not None for b in columns["behaviour_logp"]) and size else None
    stored_versions = columns.get("token_version", [None])  # absent in files from before partial rollouts
    versions = torch.zeros(size, width, dtype=torch.long) if size and all(v is not None for v in stored_versions) \
        else None
    for i in range(size):
        n = len(columns["response_ids"][i])
        ids[i, :n] = torch.tensor(columns["response_ids"][i], dtype=torch.long)
        mask[i, :n] = torch.tensor(columns["response_mask"][i])
        if behaviour is not None:
            behaviour[i, :n] = torch.tensor(columns["behaviour_logp"][i])
        if versions is not None:
            versions[i, :n] = torch.tensor(columns["token_version"][i], dtype=torch.long)
    result = RolloutResult(response_ids=ids, response_mask=mask, finish_reasons=list(columns["finish_reason"]),
                           prompt_index=torch.tensor(owners, dtype=torch.long))
    parts = {name.removeprefix("reward/"): values for name, values in columns.items() if name.startswith("reward/")}
    return RolloutBatch(samples=samples, rows=rows, indices=indices,
                        conversations=conversations(samples, rows) if conversations is not None else None,
                        result=result, rewards=torch.tensor(columns["reward"], dtype=torch.float32),
                        reward_parts=parts, outcomes=torch.tensor(columns["outcome"], dtype=torch.float32),
                        version=metadata["version"], data_end=tuple(metadata["data_end"]), behaviour_logp=behaviour,
                        batch_id=metadata["batch"], dataset=metadata.get("dataset", ""), token_versions=versions,
                        metrics=metadata.get("metrics", {}))


def write_in_flight(path: Path, groups: list[InFlightGroup]) -> Path:
    """Write the samples still generating, one row per response, whole: its group's
    position, dataset index and source row, its tokens with their versions and behaviour
    log-probs, its finish reason (null while generating)."""
    import pyarrow as pa

    rows = [(number, group, response) for number, group in enumerate(groups) for response in group.responses]
    table = pa.table({
        "group": pa.array([number for number, _, _ in rows], pa.int32()),
        "index": pa.array([group.index for _, group, _ in rows], pa.int64()),
        "row": pa.array([group.row for _, group, _ in rows], pa.int64()),
        "response_ids": pa.array([r.tokens for _, _, r in rows], pa.list_(pa.int32())),
        "token_version": pa.array([r.versions for _, _, r in rows], pa.list_(pa.int64())),
        "behaviour_logp": pa.array([r.behaviour for _, _, r in rows], pa.list_(pa.float32())),
        "finish_reason": pa.array([r.finish for _, _, r in rows], pa.string()),
    }).replace_schema_metadata({_METADATA_KEY: json.dumps({"format": FORMAT, "groups": len(groups)}).encode()})
    return _write_table(path, table)


def read_in_flight(path: Path) -> list[InFlightGroup]:
    """The groups `write_in_flight` wrote, in order."""
    table, metadata = read_batch(path)
    columns = table.to_pydict()
    groups: list[InFlightGroup | None] = [None] * metadata["groups"]
    for i, number in enumerate(columns["group"]):
        if groups[number] is None:
            groups[number] = InFlightGroup(index=columns["index"][i], row=columns["row"][i], responses=[])
        groups[number].responses.append(InFlightResponse(
            tokens=list(columns["response_ids"][i]), versions=list(columns["token_version"][i]),
            behaviour=list(columns["behaviour_logp"][i]), finish=columns["finish_reason"][i]))
    return groups
