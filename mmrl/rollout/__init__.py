"""Rollout backends behind one API (`mmrl.rollout.base`): `hf`, `hf_compiled` (the same
with a static cache and a compiled decode step, `mmrl.rollout.compiled`) and `vllm`;
`auto` picks one of the HF two for the engine (`choose_backend`)."""

from mmrl.rollout.base import RolloutResult, SamplingParams, trim_responses


def choose_backend(backend: str, engine, multi_turn: bool = False) -> str:
    """`backend`, with "auto" resolved: the compiled HF rollout for one GPU process
    (bench/results/rollout_speed_gpu.json), single-turn or multi-turn (each turn re-prefills
    its conversation; the decode step's batch width and cache length are dynamic sizes, so a
    new prompt length is not a new graph), and plain `generate` on the CPU (compiling there
    costs more than it saves), under FSDP2 (every rank steps together) and for a family that
    cannot take left padding (its prompts generate one length at a time). `multi_turn` is
    kept for callers; it no longer changes the choice."""
    if backend != "auto":
        return backend
    one_gpu = engine.dist.device.type == "cuda" and not engine.sharded
    return "hf_compiled" if one_gpu and engine.adapter.left_padding else "hf"


def make_rollout(backend: str, engine, processing, **options):
    """The rollout backend named `backend` ("hf", "hf_compiled", "vllm" or "auto") for
    `engine`'s model."""
    backend = choose_backend(backend, engine)
    if backend == "hf":
        from mmrl.rollout.hf import HFRollout

        return HFRollout(engine, processing)
    if backend == "hf_compiled":
        from mmrl.rollout.compiled import CompiledHFRollout

        return CompiledHFRollout(engine, processing, **options)
    if backend == "vllm":
        from mmrl.rollout.vllm import VLLMRollout

        return VLLMRollout(engine, processing, **options)
    raise ValueError(f"rollout.backend must be 'auto', 'hf', 'hf_compiled' or 'vllm', got {backend!r}")


__all__ = ["RolloutResult", "SamplingParams", "choose_backend", "make_rollout", "trim_responses"]
