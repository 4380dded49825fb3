"""Which family a checkpoint maps to, and what the support matrix verified for it.

    mmrl models --for Qwen/Qwen2.5-VL-7B-Instruct     # a hub id (config fetched into the HF cache)
    mmrl models --for /ckpt/dir --json                # a local folder
    mmrl models --for qwen2_vl                        # a family name or HF model_type

The family comes from the registry (the config's model_type, else its architectures);
the verified features from the committed support matrix (`support_matrix/results.json`
next to the package, when this is a checkout that has it), whose cells ran on the
family's tiny model, not on this checkpoint: `mmrl doctor ID_OR_PATH` runs them on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mmrl.hub import HubError, checkpoint_folder
from mmrl.registry import RegistryError, read_config, get_adapter

MATRIX_RESULTS = Path(__file__).resolve().parent.parent / "support_matrix" / "results.json"


def describe_checkpoint(target: str) -> dict[str, Any]:
    """The family `target` (hub id, local folder, family or model_type) maps to, with its
    modalities and the support matrix's verdicts for that family. Raises RegistryError
    (one line) when it maps to none."""
    try:
        folder = checkpoint_folder(target, weights=False)
    except HubError as exc:
        raise RegistryError(str(exc)) from None
    config = read_config(folder) if folder is not None else {}
    adapter = get_adapter(folder if folder is not None else target, source=target)
    model_type = config.get("model_type")
    return {
        "target": target,
        "folder": str(folder) if folder is not None else None,
        "model_type": model_type,
        "architectures": list(config.get("architectures") or []),
        "family": adapter.family,
        "matched_by": ("model_type" if model_type in adapter.model_types else "architecture") if folder else "name",
        "modalities": list(adapter.modalities),
        "declared": adapter.capabilities.declared(),
        "support_matrix": matrix_verdicts(adapter.family),
    }


def matrix_verdicts(family: str, results: Path = MATRIX_RESULTS) -> dict[str, dict[str, list[str]]] | None:
    """{platform: {status: [features]}} for `family` from the committed support matrix,
    or None where there is none to read."""
    if not results.is_file():
        return None
    try:
        cells = json.loads(results.read_text())["cells"]
    except (ValueError, KeyError):
        return None
    verdicts: dict[str, dict[str, list[str]]] = {}
    for cell in cells:
        if cell.get("family") == family:
            verdicts.setdefault(cell["platform"], {}).setdefault(cell["status"], []).append(cell["feature"])
    return verdicts


def format_description(described: dict[str, Any]) -> str:
    """`describe_checkpoint` as a few lines for the terminal."""
    d = described
    how = {"model_type": f"model_type {d['model_type']!r}",
           "architecture": f"architecture {', '.join(d['architectures'])} (model_type {d['model_type']!r})",
           "name": "its name"}[d["matched_by"]]
    lines = [f"{d['target']}: family {d['family']} (by {how}); modalities: {', '.join(d['modalities'])}"]
    if d["folder"] and d["folder"] != d["target"]:
        lines.append(f"checkpoint folder: {d['folder']}")
    matrix = d["support_matrix"]
    if matrix is None:
        lines.append("support matrix: not in this installation (`mmrl doctor` runs its probes)")
    else:
        for platform in sorted(matrix):
            verdicts = matrix[platform]
            line = f"support matrix, {platform} (the family's tiny model): verified: " + (
                ", ".join(verdicts.get("verified", [])) or "none")
            if verdicts.get("failed"):
                line += f"; failed: {', '.join(verdicts['failed'])}"
            lines.append(line)
    lines.append(f"on this checkpoint itself: mmrl doctor {d['target']}")
    return "\n".join(lines)
