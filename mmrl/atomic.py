"""Files and folders that appear whole or not at all: written under a temporary name in the
same folder, fsynced, then renamed over the final name.

    atomic_write_text(run / "recipe.yaml", text)
    with replacing(run / "reward_curve.png") as temp:   # any writer that takes a path
        figure.savefig(temp)
    with atomic_folder(run / "final") as temp:          # a folder: every file fsynced, then renamed
        model.save_pretrained(temp)

A write cut short (a full disk, a kill) leaves the old file or folder as it was and no
half-written one. The rename replaces the final name itself: a symbolic link planted there
is replaced, never followed, so nothing outside the folder is written through it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(final: Path) -> Iterator[Path]:
    """A temporary file beside `final` to write into: fsynced and renamed over `final` when
    the block ends, removed if the block raises, so `final` is never half-written."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.with_name(f"{TEMP_PREFIX}{final.name}.{os.getpid()}")
    try:
        yield temp
        fsync_path(temp)
        os.replace(temp, final)
        fsync_path(final.parent)
    finally:
        temp.unlink(missing_ok=True)


def atomic_write_bytes(final: Path, data: bytes) -> Path:
    with replacing(final) as temp:
        temp.write_bytes(data)
    return Path(final)


def atomic_write_text(final: Path, text: str) -> Path:
    return atomic_write_bytes(final, text.encode())


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """An empty temporary folder beside `final` to write into: when the block ends every
    file in it is fsynced and it replaces `final` (an old `final` is moved aside first and
    removed after); if the block raises it is removed and `final` stays as it was."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.with_name(f"{TEMP_PREFIX}{final.name}")
    if temp.is_symlink() or temp.is_file():
        temp.unlink()
    elif temp.exists():
        shutil.rmtree(temp)  # left over by an interrupted write
    temp.mkdir()
    try:
        yield temp
        usual_permissions(temp)
        fsync_tree(temp)
        replace_folder(temp, final)
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)


def process_umask() -> int:
    """This process's umask (read where Linux shows it, else set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_permissions(folder: Path) -> None:
    """Every file under `folder` gets the mode a file this process opens would get
    (0o666 less the umask): safetensors 0.8 writes its files owner-only (0o600), and a
    run's weights should be as readable as the run's other files."""
    mode = 0o666 & ~process_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fsync_path(path)
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}, key=lambda p: len(p.parts), reverse=True):
        fsync_path(sub)


def replace_folder(temp: Path, final: Path) -> None:
    """Rename the finished folder `temp` to `final` (a folder cannot be renamed over a
    non-empty one: an old `final` is moved aside, then removed)."""
    old = final.with_name(f"{OLD_PREFIX}{final.name}")
    if old.exists():
        shutil.rmtree(old)
    if final.is_symlink() or final.is_file():
        final.unlink()  # a link (or file) in the way: replaced, never followed
    elif final.exists():
        os.rename(final, old)
    os.rename(temp, final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)
