"""Run folders and checkpoints: who may write into a folder, and states that are whole.

    folder = RunFolder(Path("runs/x"))
    folder.claim(resume=False, overwrite=False)   # lock it; refuse another run's results
    write_checkpoint(folder.checkpoints / "step_000010", lambda tmp: save_everything(tmp))
    good, skipped = newest_checkpoint(folder.checkpoints)   # manifest-verified, newest first
    prune_checkpoints(folder.checkpoints, saved=good, keep=3)  # trainer.keep_checkpoints
    folder.release()

A folder holds one run, and the folder is mmrl's: `claim` refuses a folder holding files
mmrl did not write (anything but `RUN_RESULTS`, the lock, `OWNER_FILE` and mmrl's own
temporary names), and one where a result's name is a symbolic link (nothing is written
through a link out of the folder); `overwrite` removes only `RUN_RESULTS`. `OWNER_FILE`
marks a folder mmrl claimed, so a lone `recipe.yaml` there (a run that stopped before its
first step) is known to be mmrl's and may be replaced, while a user's own recipe is not.
`claim(resume=True)` on a folder with no checkpoint to resume from is refused.

`claim` takes `LOCK_FILE` (created exclusively, holding the pid,
host and start time) so a second process is kept out with one line naming the holder; a
lock whose process is gone is stale and taken over. Within one process the lock is shared
(a script may build a second Trainer on the folder, as the distributed tests do) and goes
when its last holder lets go. A folder that already holds a run's
results is refused unless the run resumes (and the saved recipe matches, so resume
continues the same run only) or overwrites (its results are removed first; other files
stay). A folder holding only a recipe (a run that stopped before its first step) is not
a run to protect; a folder that `claim` created and nothing was written into is removed
with the lock.

A checkpoint is written into a hidden temporary folder beside its final place, every file
fsynced, then `MANIFEST_FILE` (sizes and SHA-256 of every file) last, and renamed into
place; an existing checkpoint of the same step is moved aside first and removed after.
A folder without a manifest, or whose files do not match it, is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from mmrl.atomic import (  # noqa: F401 - some re-exported
    OLD_PREFIX, TEMP_PREFIX, fsync_path, replace_folder, replacing, usual_permissions,
)

LOCK_FILE = ".mmrl.lock"
MANIFEST_FILE = "manifest.json"
RECIPE_FILE = "recipe.yaml"
# Written by `claim`: this folder is a run folder mmrl made its own (see the docstring).
OWNER_FILE = ".mmrl-run"
# What a run writes into its folder; `overwrite` removes these and nothing else.
RUN_RESULTS = ("recipe.yaml", "metrics.jsonl", "samples.jsonl", "checkpoints", "final", "reward_curve.png",
               "tensorboard", "buffer")
_TEMP_PREFIX = TEMP_PREFIX
_OLD_PREFIX = OLD_PREFIX
_HELD: dict[str, int] = {}  # lock files this process holds -> how many holders


class RunFolderError(ValueError):
    """The output folder cannot take this run; the message says why, in one line."""


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.lock = self.path / LOCK_FILE
        self._locked = False
        self._created = False  # by `claim`: an empty folder it made goes with the lock
        self._marked = False  # `claim` wrote OWNER_FILE: it goes with the lock if no result was written

    # -- ownership --------------------------------------------------------------------------
    def check_path(self) -> None:
        """Raise when the folder cannot be one (a file, or below a file)."""
        for parent in (self.path, *self.path.parents):
            if parent.exists() and not parent.is_dir():
                where = "is a file" if parent == self.path else f"is inside {parent}, which is a file"
                raise RunFolderError(f"trainer.output_dir: {self.path} {where}; give a folder")

    def claim(self, *, resume: bool, overwrite: bool, recipe_text: str | None = None,
              same_run: Callable[[str], str | None] | None = None) -> None:
        """Lock the folder for this process, then check that it may hold this run.

        `same_run(saved_recipe_text)` returns None when the saved recipe describes the
        run being resumed, else a short reason; it is asked only when resuming."""
        self.check_path()
        self._created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunFolderError(f"trainer.output_dir: cannot create {self.path} ({exc.strerror})") from None
        try:
            self._take_lock()
        except BaseException:
            if self._created:  # a folder this claim made, with nothing in it: leave none behind
                self.path.rmdir()
            raise
        try:
            self._check_contents(resume=resume, overwrite=overwrite, same_run=same_run)
            self._mark_owned()  # only once accepted: a refused folder is left as it was
        except BaseException:
            self.release()
            raise

    def results(self) -> list[str]:
        return [name for name in RUN_RESULTS if (self.path / name).exists()]

    def back_to_recipe(self) -> None:
        """Remove every result but the recipe: a new run that stopped before it recorded
        anything (`Trainer.fit`) leaves what the next run may start over, as one whose build
        failed does (`_check_contents`)."""
        self._remove([name for name in self.results() if name != RECIPE_FILE])

    def _remove(self, names: list[str]) -> None:
        """Remove these results (a folder whole; a link itself, not what it points to)."""
        for name in names:
            target = self.path / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()

    def foreign(self) -> list[str]:
        """What the folder holds that mmrl did not write (its results, lock, owner mark and
        temporaries are mmrl's); a lone recipe.yaml counts as foreign without the owner mark."""
        names = sorted(p.name for p in self.path.iterdir())
        own = {*RUN_RESULTS, LOCK_FILE, OWNER_FILE}
        out = [n for n in names if n not in own and not n.startswith((_TEMP_PREFIX, _OLD_PREFIX))]
        if self.results() == [RECIPE_FILE] and not (self.path / OWNER_FILE).is_file():
            out.append(RECIPE_FILE)  # a user's own recipe in a project folder, not a run's
        return out

    def _check_contents(self, *, resume: bool, overwrite: bool, same_run) -> None:
        foreign = self.foreign()
        if foreign:
            shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
            raise RunFolderError(f"trainer.output_dir: {self.path} holds files mmrl did not write ({shown}); "
                                 "mmrl writes only into a new or empty folder or one of its own runs and removes "
                                 "nothing it did not write: choose another folder (e.g. a subfolder)")
        for name in (*RUN_RESULTS, OWNER_FILE):
            if (self.path / name).is_symlink():
                raise RunFolderError(f"trainer.output_dir: {self.path / name} is a symbolic link; mmrl does not "
                                     "write through links out of its run folder: remove it or choose another folder")
        found = self.results()
        if resume and not has_checkpoint(self.checkpoints):
            raise RunFolderError(f"trainer.resume: no checkpoint to resume from in {self.checkpoints} (a run saves "
                                 "them with trainer.save_every > 0, or on SIGINT/SIGTERM); drop trainer.resume to "
                                 "start a new run" + (" (with trainer.overwrite=true to replace this one)" if found
                                                      else ""))
        if found == [RECIPE_FILE] and not resume:
            # A run that stopped before its first step (a bad reward, a failed build)
            # left only its recipe: nothing to lose, so the next run may start here.
            (self.path / RECIPE_FILE).unlink()
            return
        if not found:
            return
        if overwrite:
            self._remove(found)
            return
        if resume:
            saved = self.path / RECIPE_FILE
            if same_run is not None and saved.is_file():
                reason = same_run(saved.read_text())
                if reason:
                    raise RunFolderError(f"trainer.resume: {self.path} holds another run ({reason}); resume "
                                         "continues the same run only: use another trainer.output_dir, or "
                                         "trainer.overwrite=true to start over")
            return
        raise RunFolderError(f"trainer.output_dir: {self.path} already holds a run ({', '.join(found)}); "
                             "pass trainer.resume=true to continue it, trainer.overwrite=true to replace it, "
                             "or choose another folder")

    def _mark_owned(self) -> None:
        owner = self.path / OWNER_FILE
        if not owner.is_file():
            fd = os.open(owner, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as handle:
                handle.write("a run folder of mmrl: it removes only the results it wrote here\n")
            self._marked = True

    def _take_lock(self) -> None:
        key = str(self.lock.resolve())
        if _HELD.get(key) and self.lock.is_file():
            _HELD[key] += 1
            self._locked = True
            return
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        for _ in range(3):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # stale: its process is gone
                    self.lock.unlink(missing_ok=True)
                    continue
                raise RunFolderError(f"trainer.output_dir: {self.path} is in use by another run ({holder}); "
                                     "wait for it to finish or choose another folder") from None
            with os.fdopen(fd, "w") as handle:
                handle.write(record)
            self._locked = True
            _HELD[key] = 1
            return
        raise RunFolderError(f"trainer.output_dir: could not lock {self.path} (its lock file keeps changing)")

    def _holder(self) -> str | None:
        """Who holds the lock, in words; None when the lock is stale."""
        try:
            record = json.loads(self.lock.read_text())
            pid, host = int(record["pid"]), str(record["host"])
        except (OSError, ValueError, KeyError, TypeError):
            # Unreadable: a run killed between creating and writing it, or a writer right now.
            try:
                age = time.time() - self.lock.stat().st_mtime
            except OSError:
                return None
            return None if age > 10 else "a lock being written"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
        words = f"pid {pid} on {host}, since {since}"
        if host != socket.gethostname():
            return words  # cannot tell whether it lives: keep out
        if pid == os.getpid():
            return None  # not among this process's held locks (`_take_lock` checked): left over
        return words if _alive(pid) else None

    def release(self) -> None:
        if not self._locked:
            return
        self._locked = False
        key = str(self.lock.resolve())
        _HELD[key] = _HELD.get(key, 1) - 1
        if _HELD[key] <= 0:
            del _HELD[key]
            self.lock.unlink(missing_ok=True)
            if self._marked and not self.results():
                (self.path / OWNER_FILE).unlink(missing_ok=True)
            if self._created:
                try:
                    self.path.rmdir()  # only when empty: a run that stopped before writing anything
                except OSError:
                    pass

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) holds nothing any more.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


# -- checkpoints -----------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


_fsync = fsync_path


def has_checkpoint(root: Path, pattern: str = "step_*") -> bool:
    """Whether `root` holds a checkpoint whose write finished (its manifest is there);
    cheap: the checksums are verified when it is loaded."""
    # One moved aside mid-replace (`.old-step_N`) counts: `newest_checkpoint` puts it back.
    return root.is_dir() and any((path / MANIFEST_FILE).is_file()
                                 for path in (*root.glob(pattern), *root.glob(_OLD_PREFIX + pattern)))


def temporary_for(final: Path) -> Path:
    return final.parent / f"{_TEMP_PREFIX}{final.name}"


def begin_checkpoint(final: Path) -> Path:
    """An empty temporary folder to write the checkpoint `final` into (a leftover of an
    interrupted write is removed)."""
    temp = temporary_for(final)
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir(parents=True)
    return temp


def commit_checkpoint(temp: Path, final: Path) -> Path:
    """Fsync every file of `temp`, write its manifest last, and rename it to `final`."""
    usual_permissions(temp)
    files = {}
    for path in sorted(p for p in temp.rglob("*") if p.is_file()):
        _fsync(path)
        files[path.relative_to(temp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = temp / MANIFEST_FILE
    with open(manifest, "w") as handle:
        json.dump({"files": files, "written": time.time()}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    for folder in sorted({p.parent for p in temp.rglob("*")} | {temp}, key=lambda p: len(p.parts), reverse=True):
        _fsync(folder)
    replace_folder(temp, final)
    return final


def verify_checkpoint(path: Path) -> str | None:
    """None when every file in the manifest is there with its size and checksum, else why not."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return "no manifest (its write did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if not isinstance(files, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
            for entry in files.values()):
        return "unreadable manifest (its files are not a mapping of name to bytes and sha256)"
    for name, entry in files.items():
        file = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"the manifest names {name!r}, outside the checkpoint"
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if _sha256(file) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def prune_checkpoints(root: Path, saved: Path, keep: int) -> list[Path]:
    """After `saved` was written: remove the checkpoints under `root` older than it beyond
    the newest `keep` (counting `saved`); newer ones (a run resumed from an earlier step)
    are left alone. Returns what was removed."""
    def step(path: Path) -> int:
        number = path.name.removeprefix("step_")
        return int(number) if number.isdigit() else -1  # not a step checkpoint: never removed

    older = sorted((p for p in root.glob("step_*") if p.is_dir() and 0 <= step(p) <= step(saved)), key=step)
    removed = older[:max(len(older) - keep, 0)]
    for path in removed:
        shutil.rmtree(path)
    return removed


def newest_checkpoint(root: Path, pattern: str = "step_*") -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `root` that verifies, and the newer ones skipped with why.

    A checkpoint moved aside while being replaced (the write was cut between the two
    renames) is put back first."""
    if not root.is_dir():
        return None, []
    for old in root.glob(f"{_OLD_PREFIX}*"):
        final = root / old.name[len(_OLD_PREFIX):]
        if not final.exists():
            os.rename(old, final)
    skipped = []
    for path in sorted(root.glob(pattern), reverse=True):
        if not path.is_dir():
            continue
        problem = verify_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped
