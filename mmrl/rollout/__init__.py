"""Rollout backends behind one API (`mmrl.rollout.base`): `hf`, `hf_compiled` (the same
with a static cache and a compiled decode step, `mmrl.rollout.compiled`) and `vllm`;
`auto` picks one of the HF two for the engine (`choose_backend`)."""

import sys

from mmrl.rollout.base import RolloutResult, SamplingParams, trim_responses


def choose_backend(backend: str, engine, multi_turn: bool = False) -> str:
    """`backend`, with "auto" resolved: the compiled HF rollout on a GPU
    (bench/results/rollout_speed_gpu.json), single-turn or multi-turn (each turn re-prefills
    its conversation; the decode step's batch width and cache length are dynamic sizes, so a
    new prompt length is not a new graph), under FSDP2 too (each rank decodes on an
    inference copy of the full weights, `mmrl.rollout.inference_copy`; `make_rollout` takes
    plain `generate` where the copy does not fit); plain `generate` on the CPU (compiling
    there costs more than it saves) and for a family that cannot take left padding (its
    prompts generate one length at a time). `multi_turn` is kept for callers; it no longer
    changes the choice."""
    if backend != "auto":
        return backend
    on_gpu = engine.dist.device.type == "cuda"
    return "hf_compiled" if on_gpu and engine.adapter.left_padding else "hf"


def make_rollout(backend: str, engine, processing, **options):
    """The rollout backend named `backend` ("hf", "hf_compiled", "vllm" or "auto") for
    `engine`'s model. "auto" that resolves to the compiled rollout of sharded weights whose
    inference copy does not fit in GPU memory says so in one line (main rank) and takes
    plain `generate`; "hf_compiled" named outright raises `CopyDoesNotFit` there."""
    requested, backend = backend, choose_backend(backend, engine)
    if backend == "hf":
        from mmrl.rollout.hf import HFRollout

        return HFRollout(engine, processing)
    if backend == "hf_compiled":
        from mmrl.rollout.compiled import CompiledHFRollout
        from mmrl.rollout.inference_copy import CopyDoesNotFit

        try:
            return CompiledHFRollout(engine, processing, **options)
        except CopyDoesNotFit as error:
            if requested != "auto":
                raise CopyDoesNotFit(f"rollout.backend=hf_compiled: {error}; set rollout.backend=hf "
                                     "(plain generate) or free memory") from None
            if engine.dist.is_main:
                print(f"rollout.backend=auto: {error}: plain generate instead", file=sys.stderr, flush=True)
            from mmrl.rollout.hf import HFRollout

            return HFRollout(engine, processing)
    if backend == "vllm":
        from mmrl.rollout.vllm import VLLMRollout

        return VLLMRollout(engine, processing, **options)
    raise ValueError(f"rollout.backend must be 'auto', 'hf', 'hf_compiled' or 'vllm', got {backend!r}")


__all__ = ["RolloutResult", "SamplingParams", "choose_backend", "make_rollout", "trim_responses"]
