"""Checkpoints by hub id, through the HuggingFace cache: the one place that says what a
model name means.

`model.path`, `build_model(...)`, `mmrl doctor`, `mmrl data check` and `mmrl models --for`
all read a name the same way, in this order:

1. an existing local file or folder is that checkpoint (write `./qwen2` for a folder
   whose name is also a family's);
2. a registered family, HF model_type or architecture name (no slash) is that family;
3. `org/name` or `org/name@revision` (one slash, not an existing path) is a hub id: its
   snapshot in the HF cache (`HF_HUB_CACHE`, else `HF_HOME/hub`), downloaded there first
   when the hub can be reached, as `snapshot_download` does; with `HF_HUB_OFFLINE=1` the
   cache alone is read and nothing goes over the network;
4. anything else is left as it is, for the caller's own "not found" message.

    folder = checkpoint_folder("Qwen/Qwen2.5-VL-7B-Instruct")           # weights too
    folder = checkpoint_folder("Qwen/Qwen2.5-VL-7B-Instruct@main", weights=False)  # config, tokenizer
    checkpoint_folder("qwen2_vl")                                         # None: a family

A hub id that is neither cached nor downloadable is one `HubError` line that says what to
download (`hf download ID`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mmrl.errors import one_line

# `org/name`, optionally `@revision` (a branch, tag or commit). The hub's own rule for the
# two parts: letters, digits, `-`, `_`, `.`, not starting with a `.` or `-`.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*)(?:@(?P<revision>[^\s@]+))?$")

# What a build reads from a snapshot: config, generation config, tokenizer, processor and
# chat template files (JSON, text, sentencepiece, tiktoken, jinja) and safetensors weights.
# Pickle weights (.bin/.pt) are never fetched: mmrl loads safetensors only.
_CONFIG_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
_WEIGHT_FILES = ("*.safetensors",)
_CODE_FILES = ("*.py",)  # a trust_remote_code checkpoint's own classes


class HubError(ValueError):
    """A hub id that cannot be resolved to a folder; the message is one line."""


def split_hub_id(name: str | Path) -> tuple[str, str | None] | None:
    """(`org/name`, revision or None) when `name` reads as a hub id and is no existing
    local path, else None."""
    text = str(name)
    if text.startswith((".", "/", "~")) or Path(text).expanduser().exists():
        return None
    match = _HUB_ID.match(text)
    if match is None or ".." in match["repo"]:
        return None
    return match["repo"], match["revision"]


def is_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`), read now: huggingface_hub reads it
    once, at import, and a caller may set it after."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    if any(flag is not None for flag in flags):
        return any((flag or "").strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags)
    return bool(constants.HF_HUB_OFFLINE)


def cache_folder() -> Path:
    """The HF hub cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else huggingface_hub's
    default (read now, for the same reason as `is_offline`)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def unreachable_reason(repo: str, repo_type: str = "model") -> str | None:
    """Why the hub cannot serve `repo` now, in words (`HF_HUB_OFFLINE=1`, or the connection
    error of one request made without retries), or None when it answered. Loaders that
    retry each file for half a minute (datasets) ask this first and read their cache alone
    when it says the hub is out of reach."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if is_offline():
        return "HF_HUB_OFFLINE=1"
    try:
        HfApi().repo_info(repo, repo_type=repo_type, timeout=10)
    except HfHubHTTPError:  # the hub answered (no such repository, gated): the loader says which
        return None
    except Exception as exc:  # a connection error or a timeout; their classes vary with the HTTP client
        return f"the hub cannot be reached: {one_line(exc, 200, typed=True)}"
    return None


def download_command(repo: str, revision: str | None = None, *, repo_type: str = "model") -> str:
    """The command that puts `repo` into the HF cache (the `hf` CLI of huggingface_hub)."""
    return " ".join(["hf download", repo, *(["--repo-type", repo_type] if repo_type != "model" else []),
                     *(["--revision", revision] if revision else [])])


def checkpoint_folder(name_or_path: str | Path, *, weights: bool = True,
                      trust_remote_code: bool = False) -> Path | None:
    """The local folder that holds the checkpoint `name_or_path` names, or None when it
    names no checkpoint (a family name, or nothing; the caller says which).

    A local path is returned as it is (expanded). A hub id is resolved through the HF
    cache; `weights=False` fetches only the config, tokenizer and processor files (what a
    random init, `data check` or `models --for` need). Raises `HubError` (one line) when
    the id is neither cached nor downloadable."""
    path = Path(str(name_or_path)).expanduser()
    if path.exists():
        return path
    hub_id = split_hub_id(name_or_path)
    if hub_id is None:
        return None
    repo, revision = hub_id
    patterns = [*_CONFIG_FILES, *(_WEIGHT_FILES if weights else ()), *(_CODE_FILES if trust_remote_code else ())]
    folder = _snapshot(repo, revision, patterns, str(name_or_path))
    if not (folder / "config.json").is_file():
        raise HubError(f"{name_or_path}: the hub repository holds no config.json; it is not a transformers "
                       "checkpoint")
    if weights and not any(folder.glob("*.safetensors")):
        raise HubError(f"{name_or_path}: no *.safetensors weights in its snapshot {folder} (mmrl loads "
                       f"safetensors only); where the repository has them: {download_command(repo, revision)}")
    return folder


def _snapshot(repo: str, revision: str | None, patterns: list[str], name: str) -> Path:
    """`snapshot_download` with its failures as one `HubError` line. Offline, only the
    cache is read (`local_files_only`: no request, so no retries)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    offline = is_offline()
    cache = cache_folder()
    fetch = download_command(repo, revision)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns, cache_dir=cache,
                                      local_files_only=offline))
    except GatedRepoError:
        raise HubError(f"{name}: a gated repository on the hub; ask for access on its page and log in "
                       f"(`hf auth login`), then: {fetch}") from None
    except RevisionNotFoundError:
        raise HubError(f"{name}: the hub repository {repo} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{name}: no local folder and no model repository of that name on the hub (a private one "
                       "needs `hf auth login`)") from None
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE=1" if offline else f"the hub cannot be reached: {_cause(exc)}"
        raise HubError(f"{name} is not in the HF cache {cache} ({why}) nor a local folder; download it first: "
                       f"{fetch}") from None
    except OSError as exc:  # an incomplete snapshot, a cache folder that cannot be written
        raise HubError(f"{name}: {_cause(exc)}; download it again: {fetch}") from None


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return one_line(cause if cause is not None else exc, 200, typed=True)
