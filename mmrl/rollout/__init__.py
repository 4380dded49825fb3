"""Rollout backends behind one API (`mmrl.rollout.base`): `hf`, `hf_compiled` (the same
with a static cache and a compiled decode step, `mmrl.rollout.compiled`) and `vllm`;
`auto` picks one of the HF two for the engine (`choose_backend`, by `mmrl.settle`'s rule)."""

import sys

from mmrl.rollout.base import RolloutResult, SamplingParams, trim_responses
from mmrl.settle import backend_choice


def choose_backend(backend: str, engine, multi_turn: bool = False) -> str:
    """`backend`, with "auto" resolved for `engine`'s family, device and processes by
    `mmrl.settle.backend_choice` (a trainer settles it before the build: `mmrl.settle.resolve`).
    `multi_turn` is kept for callers; it no longer changes the choice."""
    if backend != "auto":
        return backend  # a name `make_rollout` does not know is its error, with or without an engine
    return backend_choice(backend, engine.adapter, engine.dist).value


def rollout_options(rollout, backend: str, decode: str | None = None) -> dict:
    """The keyword options the recipe's `rollout` section gives the backend `backend`;
    `decode`: `rollout.decode` as settled (`mmrl.settle.resolve`)."""
    if backend == "vllm":
        return {"config": rollout}
    if backend == "hf_compiled":
        return {"half_weights": rollout.half_weights, "merge_projections": rollout.merge_projections,
                "inference_copy": rollout.inference_copy,
                "decode": decode or rollout.decode, "prefill_once": rollout.prefill_once,
                "prefill_layers": rollout.prefill_layers}
    return {}


def make_rollout(backend: str, engine, processing, requested: str | None = None, **options):
    """The rollout backend named `backend` ("hf", "hf_compiled", "vllm" or "auto") for
    `engine`'s model; `requested` is the recipe's own name where `backend` was settled from
    it. "auto" that resolves to the compiled rollout of sharded weights whose inference copy
    does not fit in GPU memory says so in one line (main rank) and takes plain `generate`;
    "hf_compiled" named outright raises `CopyDoesNotFit` there."""
    requested, backend = requested or backend, choose_backend(backend, engine)
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


__all__ = ["RolloutResult", "SamplingParams", "choose_backend", "make_rollout", "rollout_options", "trim_responses"]
