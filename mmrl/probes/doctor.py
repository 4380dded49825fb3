"""What `mmrl doctor PATH_OR_FAMILY` probes: a local checkpoint folder or config.json, a
hub id in the HF cache, or a registered family (its tiny model), as one probe Subject.

    subject = doctor_subject("runs/x/final", device="cpu")   # or "qwen2_vl", "org/name@rev"

Every problem with the target is one DoctorTargetError line naming the file or the
target, before any probe runs (not every probe failing on the same file).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.adapter import ModelAdapter
from mmrl.errors import one_line
from mmrl.hub import HubError, checkpoint_folder
from mmrl.probes.base import Subject
from mmrl.recipe_checks import weights_problem
from mmrl.registry import RegistryError, adapter_for_config, get_adapter


class DoctorTargetError(ValueError):
    """The doctor's target cannot be probed; the message is one line."""


def doctor_subject(target: str, device: str = "cpu") -> Subject:
    """The Subject `mmrl doctor` probes for `target` (DoctorTargetError when it cannot)."""
    try:
        torch_device = torch.device(device)
    except RuntimeError:
        torch_device = None
    if torch_device is None or torch_device.type not in ("cpu", "cuda"):
        raise DoctorTargetError(f"--device {device!r}: give cpu, cuda or cuda:N")
    try:
        path = checkpoint_folder(target)  # a hub id: its snapshot in the HF cache
        if path is None:
            adapter = get_adapter(target)
            return Subject(adapter=adapter, source=adapter.family, device=device)
        adapter = _checkpoint_adapter(target, path)
    except (HubError, RegistryError) as exc:
        raise DoctorTargetError(str(exc)) from exc
    folder = path.resolve() if path.is_dir() else path.parent.resolve()
    problem = weights_problem(folder)
    if problem:
        raise DoctorTargetError(f"{target}: {problem}")
    return Subject(adapter=adapter, source=str(folder), random_init=False, device=device)


def _checkpoint_adapter(target: str, path: Path) -> ModelAdapter:
    """The registered family of the checkpoint at `path` (a folder or its config.json)."""
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise DoctorTargetError(f"{target}: no config.json found")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:  # cut short by an interrupted copy, or not JSON at all
        raise DoctorTargetError(f"{config_file}: not a readable config ({one_line(exc)}); copy the checkpoint again")
    if not isinstance(config, dict):
        raise DoctorTargetError(f"{config_file}: a config is a JSON object, got {type(config).__name__}")
    try:
        return adapter_for_config(config, source=str(path))
    except RegistryError:
        model_type = config.get("model_type")
        if not model_type:
            raise DoctorTargetError(f"{config_file}: no model_type (every transformers config names its model "
                                    "type); copy the checkpoint again or add the field") from None
        raise DoctorTargetError(f"{target}: model type {model_type!r} is not registered with mmrl; "
                                f"add it with `mmrl add-model {model_type}` (docs/adding_a_model.md)") from None
