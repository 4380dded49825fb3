"""What machine and software a result came from, and writing a result down.

    versions()            # {"python": "3.12.3", "mmrl": ..., "torch": ..., ...}
    device_name("cuda:0") # "NVIDIA H200", or "cpu (x86_64)"
    host()                # "x86_64, 16 CPUs"
    today()               # "2026-12-03" (UTC)
    write_report(path, report)  # JSON, indent 2, its folder made, "wrote PATH" printed

The probes record these beside every support-matrix cell, the benches beside every
figure in bench/results/, and the scaffold's sweep beside every row of its page; all read
them from here so the records agree.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

# The packages whose versions decide a probe's or a bench's outcome.
PACKAGES = ("mmrl", "torch", "transformers", "peft", "vllm")


def versions(packages: tuple[str, ...] = PACKAGES, *, missing: str | None = None) -> dict[str, str]:
    """Python's version and those of `packages`; one not installed reads as `missing`
    (None: omitted)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            if missing is not None:
                out[name] = missing
    return out


def device_name(device: str = "cpu") -> str:
    """The GPU's name for a CUDA device, else `cpu (machine)`."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.machine()})"


def host() -> str:
    """The machine's architecture and CPU count, as `x86_64, 16 CPUs`."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs"


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def write_report(path: str | Path, report: dict[str, Any], *, lead: str = "") -> Path:
    """Write `report` as indented JSON (ending in a newline) to `path` (its folder made) and say so on stdout;
    `lead` goes before the message (a blank line after a table: "\\n")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{lead}wrote {path}")
    return path


__all__ = ["PACKAGES", "device_name", "host", "today", "versions", "write_report"]
