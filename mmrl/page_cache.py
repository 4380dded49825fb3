"""The CUDA libraries read into the page cache while a GPU run builds its model (issue 28).

A process maps torch's and NVIDIA's shared libraries (several GB) but reads their pages only
when it first runs a kernel in them: with CUDA's lazy module loading, each new kernel's code
is read from the library file at its first launch. On a fresh machine those files are not in
the page cache, and a run's first step pays scattered reads from disk at every first launch
(its eager forwards, the first matrix products of each kind, cuDNN's first convolution); the
second run on the same machine finds them cached. `read_ahead` reads the files through
once, sequentially, in a daemon thread, while the run's model build keeps the process busy
elsewhere; a file already cached costs a pass over memory.

    thread = read_ahead(library_files())    # the trainer does this on a GPU

`MMRL_READ_AHEAD=0` turns it off (bench/decode_ab.sh's A/B).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

# Files smaller than this are left alone: their reads are few, and the big ones are the
# kernels' (cuBLAS, cuDNN, torch's CUDA library).
MIN_BYTES = 8 << 20
CHUNK = 8 << 20
# NVIDIA's libraries a process loads later than torch's import (cuDNN at its first
# convolution, its engines' libraries at their first use), found beside the loaded ones.
LATER = ("libcudnn",)


def library_files(min_bytes: int = MIN_BYTES) -> list[Path]:
    """The shared libraries this process maps, with the CUDA libraries it loads later
    (`LATER`) found in the folders of those it maps; largest first. Empty where the
    process's maps cannot be read (not Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    mapped = {Path(parts[5]) for parts in (line.split() for line in lines) if len(parts) >= 6 and ".so" in parts[5]}
    roots = {Path(*path.parts[:path.parts.index("nvidia") + 1]) for path in mapped if "nvidia" in path.parts}
    later = {path for root in roots for prefix in LATER for path in root.glob(f"*/lib/{prefix}*.so*")}  # nvidia/<package>/lib/
    found = []
    for path in mapped | later:
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size >= min_bytes:
            found.append((size, path))
    return [path for _, path in sorted(found, key=lambda item: (-item[0], str(item[1])))]


def read_files(paths: list[Path], chunk: int = CHUNK) -> int:
    """Read each file through (into the page cache); the bytes read."""
    total = 0
    buffer = bytearray(chunk)
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as handle:
                while True:
                    count = handle.readinto(buffer)
                    if not count:
                        break
                    total += count
        except OSError:
            continue
    return total


def read_ahead(paths: list[Path]) -> threading.Thread | None:
    """`read_files(paths)` in a daemon thread (reads release the GIL); None where turned off
    (`MMRL_READ_AHEAD=0`) or where there is nothing to read."""
    if os.environ.get("MMRL_READ_AHEAD", "1") == "0" or not paths:
        return None
    thread = threading.Thread(target=read_files, args=(paths,), name="mmrl-read-ahead", daemon=True)
    thread.start()
    return thread


def resident_fraction(path: Path) -> float | None:
    """The share of `path`'s pages in the page cache (`mincore`), None where it cannot be told."""
    try:
        size = path.stat().st_size
        if not size:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            start = ctypes.c_char.from_buffer(mapped)  # the mapping's address (no page is touched)
            failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vector)
            del start  # the mapping closes only once nothing points into it
        return None if failed else sum(byte & 1 for byte in vector) / pages
    except (OSError, ValueError, TypeError, AttributeError, BufferError):
        return None


def evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (`POSIX_FADV_DONTNEED`; pages another
    process maps stay): a cold start of those files, for a bench's A/B."""
    for path in paths:
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(descriptor)


__all__ = ["evict", "library_files", "read_ahead", "read_files", "resident_fraction"]
