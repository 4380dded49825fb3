"""Rollout backends behind one API (`mmrl.rollout.base`): `hf`, `hf_compiled` (the same
with a static cache and a compiled decode step, `mmrl.rollout.compiled`) and `vllm`."""

from mmrl.rollout.base import RolloutResult, SamplingParams, trim_responses


def make_rollout(backend: str, engine, processing, **options):
    """The rollout backend named `backend` ("hf", "hf_compiled" or "vllm") for `engine`'s model."""
    if backend == "hf":
        from mmrl.rollout.hf import HFRollout

        return HFRollout(engine, processing)
    if backend == "hf_compiled":
        from mmrl.rollout.compiled import CompiledHFRollout

        return CompiledHFRollout(engine, processing, **options)
    if backend == "vllm":
        from mmrl.rollout.vllm import VLLMRollout

        return VLLMRollout(engine, processing, **options)
    raise ValueError(f"rollout.backend must be 'hf', 'hf_compiled' or 'vllm', got {backend!r}")


__all__ = ["RolloutResult", "SamplingParams", "make_rollout", "trim_responses"]
