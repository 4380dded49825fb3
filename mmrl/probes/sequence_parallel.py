"""The Ulysses sequence-parallelism probe: 2 processes under torchrun split every sequence
(`mmrl.probes.sp_step`, one launch for all subjects), against one process on the same
batch: log-probs (atol 1e-5), gradients and AdamW-updated weights.

    check_sequence_parallel(subject)            # Verified, or raises
    check_sequence_parallel_many(subjects)      # [(outcome, seconds)], one launch
"""

from __future__ import annotations

from mmrl.adapter import ModelAdapter
from mmrl.probes.base import Subject, Verified
from mmrl.parallel.mesh import backend
from mmrl.probes.launcher import PROCESSES, require_processes, torchrun_many

SP_PROCESSES = PROCESSES


def sequence_parallel_inapplicable(adapter: ModelAdapter) -> str | None:
    return None if adapter.sequence_parallel is not None else "the adapter sets sequence_parallel = None"


def check_sequence_parallel_many(subjects: list[Subject]) -> list[tuple[Verified | BaseException, float]]:
    require_processes(subjects[0].device)
    return torchrun_many("mmrl.probes.sp_step", subjects,
                         f"Ulysses over {SP_PROCESSES} processes ({backend(subjects[0].device)}, fp32; sequence of "
                         "odd length) equals one process: log-probs (1e-5), gradients and AdamW-updated weights",
                         processes=SP_PROCESSES)


def check_sequence_parallel(subject: Subject) -> Verified:
    outcome, _ = check_sequence_parallel_many([subject])[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


__all__ = ["check_sequence_parallel", "check_sequence_parallel_many", "sequence_parallel_inapplicable"]
