"""Readable rollouts: a few sampled completions of a step as rows of `samples.jsonl`.

    rows = sample_rows(step=10, split="train", samples=prompts, source_rows=rows, result=rollout,
                       texts=completions, rewards=scores, advantages={0: 1.2, 1: -1.2}, limit=8)
    log.write_samples(10, rows)           # mmrl.run_log: samples.jsonl, and each logger backend
    samples_markdown(rows)                # the same rows as a Markdown table (TensorBoard text)

A row holds what a reader needs to judge a completion: the step and split, the dataset
row and its prompt as text, the prompt's media as references (a path, or the size of an
in-memory image; never pixels), the completion, its reward (and the parts of a weighted
reward when they are given), its advantage (the mean over its response tokens), its
length in tokens and why it stopped. The rows of a step are the first `limit` responses
in rollout order, so whole prompt groups come first: their rewards and advantages can be
compared within the group.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SAMPLES_FILE = "samples.jsonl"
SPLITS = ("train", "validation", "eval")
# Columns of the Markdown table, and how many characters of a text cell it shows
# (samples.jsonl keeps the whole text).
TABLE_COLUMNS = ("row", "prompt", "media", "answer", "completion", "reward", "reward_parts", "advantage", "length",
                 "finish_reason")
TABLE_CELL_CHARS = 400
_MEDIA = (("image", "images"), ("video", "videos"))


def sample_rows(*, step: int, split: str, samples: Sequence[Mapping[str, Any]], source_rows: Sequence[int],
                result, texts: Sequence[str], rewards: Sequence[float],
                advantages: Mapping[int, float] | None = None,
                reward_parts: Mapping[str, Sequence[float]] | None = None, dataset: str = "",
                limit: int) -> list[dict[str, Any]]:
    """Rows of the first `limit` responses of a rollout. `samples` and `source_rows` are the
    prompts the rollout answered (indexed by `result.prompt_index`); `texts`, `rewards` and
    each list of `reward_parts` ({part name: one score per response}) hold one entry per
    response; `advantages` maps a response's index to its advantage (None: not computed,
    as in validation)."""
    owners = result.prompt_index.tolist()
    order = sorted(range(len(owners)), key=lambda i: owners[i])[:limit]  # stable: groups stay whole
    lengths = result.lengths.tolist()
    rows = []
    for index in order:
        sample = samples[owners[index]]
        row = {"step": step, "split": split, "row": int(source_rows[owners[index]]),
               **({"dataset": dataset} if dataset else {}),
               "prompt": prompt_text(sample.get("prompt", "")), "media": media_references(sample),
               "answer": sample.get("answer"), "completion": texts[index], "reward": float(rewards[index])}
        if reward_parts:
            row["reward_parts"] = {name: float(scores[index]) for name, scores in reward_parts.items()}
        advantage = advantages.get(index) if advantages is not None else None
        row["advantage"] = None if advantage is None else float(advantage)
        row["length"] = int(lengths[index])
        row["finish_reason"] = result.finish_reasons[index]
        rows.append(row)
    return rows


def prompt_text(prompt) -> str:
    """The conversation as a reader sees it: `role: text` lines, media parts as <image>."""
    if isinstance(prompt, str):
        return prompt
    lines = []
    for message in prompt or []:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            text = content or ""
        else:
            text = "".join((part.get("text") or "") if part.get("type") == "text" else f"<{part.get('type')}>"
                           for part in content)
        lines.append(f"{message.get('role')}: {text}")
    return "\n".join(lines)


def media_references(sample: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each media item of the prompt, in order, as a reference: a file path, or the size of
    an image held in memory; never its pixels."""
    pending = {kind: iter(sample.get(column) or []) for kind, column in _MEDIA}
    references = []
    prompt = sample.get("prompt")
    for message in prompt if isinstance(prompt, list) else []:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type")
            if kind not in pending:
                continue
            payload = part.get(kind) if part.get(kind) is not None else part.get("path")
            if payload is None:
                payload = next(pending[kind], None)
            references.append({"type": kind, **_describe(payload)})
    return references


def _describe(payload) -> dict[str, Any]:
    if payload is None:
        return {}
    if isinstance(payload, (str, Path)):
        return {"path": str(payload)}
    if isinstance(payload, Mapping):  # a HF datasets Image: {"bytes", "path"}
        if payload.get("path"):
            return {"path": str(payload["path"])}
        payload = payload.get("bytes")
    if isinstance(payload, (bytes, bytearray)):
        return {"bytes": len(payload), **_encoded_size(payload)}
    if isinstance(payload, (list, tuple)):  # a video as frames
        return {"frames": len(payload)}
    size = getattr(payload, "size", None)  # a PIL image
    if isinstance(size, tuple) and len(size) == 2:
        return {"size": list(size)}
    return {"kind": type(payload).__name__}


def _encoded_size(data: bytes) -> dict[str, Any]:
    """The width and height an encoded image's header states (nothing is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return {"size": list(image.size)}
    except Exception:  # a reference is best effort: an unreadable header keeps the byte count alone
        return {}


def samples_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as one Markdown table (text cells cut at TABLE_CELL_CHARS)."""
    columns = [c for c in TABLE_COLUMNS if c != "reward_parts" or any(row.get(c) for row in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(_shown(row, column)) for column in columns) + " |")
    return "\n".join(lines)


def _shown(row: Mapping[str, Any], column: str):
    value = row.get(column)
    if column == "media":
        return ", ".join(m.get("path") or "x".join(map(str, m.get("size", []))) or m.get("type", "")
                         for m in value or [])
    if column == "reward_parts" and value:
        return ", ".join(f"{name} {score:.4g}" for name, score in value.items())
    return value


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    if len(text) > TABLE_CELL_CHARS:
        text = text[:TABLE_CELL_CHARS] + "..."
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def table(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The rows as (columns, data) for the table types of wandb and trackio: nested
    values (media, reward parts) as JSON text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    data = [[json.dumps(row.get(c)) if isinstance(row.get(c), (list, dict)) else row.get(c) for c in columns]
            for row in rows]
    return columns, data
