"""vLLM's model registry, read as text (no vLLM import, so checking costs nothing): the
architecture a scaffolded adapter names for rollout, and the rule that says where the
scaffold runs the `vllm` probe.

    vllm_architecture("OPTForCausalLM")   # ("OPTForCausalLM", "vLLM serves OPTForCausalLM")
    vllm_model_class("OPTForCausalLM")    # ("opt:OPTForCausalLM", "") or (None, why not)

Where the scaffold runs the `vllm` probe (`vllm_serves`, used by `mmrl add-model`'s depth
stage, the coverage sweep and bench/vllm_scaffolded.py): vLLM serves the architecture for
generation, with a model class of its own (`vllm_model_class`: its text-generation or
multimodal table maps it to a module other than `transformers`) or through its
Transformers backend (a registry entry naming that module, or, for an architecture the
registry lacks, vLLM's fallback to it: vLLM runs transformers' own class inside its
engine). The probe then decides, by the log-probs vLLM samples with against the
trainer's; `vllm_model_class` alone says which module's config reads to follow.

    vllm_serves("ArceeForCausalLM")      # (True, "through its Transformers backend")
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

# The registry's tables that serve generation (the others embed, classify, score or draft).
GENERATION_TABLES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")
# The module vLLM's Transformers backend entries name.
TRANSFORMERS_BACKEND = "transformers"

_TABLE = re.compile(r"^(_[A-Z_]+)\s*=\s*\{(.*?)^\}", re.MULTILINE | re.DOTALL)
_ENTRY = re.compile(r'"([^"]+)":\s*\(\s*"([^"]+)",\s*"([^"]+)"')


def parse_registry(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{table: {architecture: (module, class)}} from the text of vLLM's registry.py, in
    the file's order."""
    return {name: {arch: (module, cls) for arch, module, cls in _ENTRY.findall(body)}
            for name, body in _TABLE.findall(text)}


@functools.lru_cache(maxsize=1)
def registry_tables() -> dict[str, dict[str, tuple[str, str]]] | str:
    """The tables of the installed vLLM's registry, or one line saying why there are none."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "vLLM is not installed here, so its registry was not checked"
    path = Path(spec.submodule_search_locations[0]) / "model_executor" / "models" / "registry.py"
    if not path.is_file():
        return f"vLLM's model registry was not found at {path}"
    return parse_registry(path.read_text())


def vllm_architecture(architecture: str, tables=None) -> tuple[str | None, str]:
    """(architecture, note) where any table of vLLM's registry names `architecture` (the
    adapter's `Rollout(vllm_architecture=...)`); (None, why) where vLLM is absent or lacks it."""
    tables = registry_tables() if tables is None else tables
    if isinstance(tables, str):
        return None, tables
    entry = next((table[architecture] for table in tables.values() if architecture in table), None)
    if entry is None:
        return architecture, (f"vLLM's model registry has no {architecture}: its Transformers backend serves it "
                              "where transformers' class allows")
    backend = " (its Transformers backend)" if entry[0] == TRANSFORMERS_BACKEND else ""
    return architecture, f"vLLM serves {architecture}{backend}"


def vllm_model_class(architecture: str, tables=None) -> tuple[str | None, str]:
    """The rule (module docstring): ("module:Class", "") where vLLM serves `architecture`
    for generation with a model class of its own, else (None, one line saying why not)."""
    tables = registry_tables() if tables is None else tables
    if isinstance(tables, str):
        return None, tables
    for name in GENERATION_TABLES:
        module, cls = tables.get(name, {}).get(architecture, (None, None))
        if module is not None and module != TRANSFORMERS_BACKEND:
            return f"{module}:{cls}", ""
    entries = [table[architecture] for table in tables.values() if architecture in table]
    if any(module == TRANSFORMERS_BACKEND for module, _ in entries):
        return None, (f"vLLM serves {architecture} only through its Transformers backend, not with a model class of "
                      "its own")
    if entries:
        return None, f"vLLM's model registry names {architecture} outside its generation tables"
    return None, f"vLLM's model registry has no {architecture}"


def vllm_serves(architecture: str, tables=None) -> tuple[bool, str]:
    """(True, how) where vLLM may serve `architecture` for generation: with a model class
    of its own (""), or through its Transformers backend, named by a registry entry or, for
    an architecture the registry lacks, the one vLLM falls back to (transformers' class
    decides there, and the probe finds out); (False, one line saying why not) where the
    registry names it only outside its generation tables, or vLLM is not installed."""
    tables = registry_tables() if tables is None else tables
    served, why = vllm_model_class(architecture, tables)
    if served is not None or isinstance(tables, str):
        return served is not None, why
    modules = [table[architecture][0] for table in tables.values() if architecture in table]
    if not modules:
        return True, "through its Transformers backend, which vLLM falls back to for an architecture it lacks"
    if TRANSFORMERS_BACKEND in modules:
        return True, "through its Transformers backend"
    return False, why


__all__ = ["GENERATION_TABLES", "parse_registry", "registry_tables", "vllm_architecture", "vllm_model_class",
           "vllm_serves"]
