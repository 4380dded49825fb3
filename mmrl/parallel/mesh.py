"""Distributed setup from torchrun's environment: one process per device.

    dist = init_distributed()        # world size 1 without torchrun
    dist.rank, dist.world_size, dist.device, dist.mesh

With `sequence_parallel=P` the ranks form a 2-D ("dp", "sp") mesh, rank = dp_rank * P +
sp_rank: the P ranks of one "sp" group share each sequence (Ulysses, mmrl.parallel.
ulysses) and receive the same batch; FSDP2 still shards over all ranks (`mesh`).

On CPU the backend is gloo, on CUDA nccl. A single process gets no process group and no
mesh, so nothing pays for distribution it does not use.

Where one rank writes and the others wait (a checkpoint, an export), the wait carries the
writer's failure, so no rank waits forever for a rank that gave up:

    with dist.together():            # a barrier at the end of the block
        if dist.is_main:
            write(files)             # raises on rank 0: every rank raises (PeerFailed elsewhere)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


def backend(device: str) -> str:
    """The process-group backend for `device` ("cpu", "cuda", "cuda:1", ...)."""
    return "nccl" if device.startswith("cuda") else "gloo"


class LaunchError(ValueError):
    """The processes torchrun started do not fit this machine (more than its GPUs)."""


class PeerFailed(RuntimeError):
    """Another rank failed in a block every rank runs together (`Dist.together`); the
    message is its rank and its one-line error."""


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: object | None  # torch.distributed.device_mesh.DeviceMesh when world_size > 1
    # Ranks that share one sequence (Ulysses), and their process group (None when 1).
    sequence_parallel: int = 1
    sp_group: object | None = None
    # The process group of this Dist's collectives: None is every process; the train ranks'
    # group when other ranks only roll out (`mmrl.parallel.disaggregated`).
    group: object | None = None

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank works on: the same for the ranks of one SP group."""
        return self.rank // self.sequence_parallel

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sequence_parallel

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sequence_parallel

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            torch_dist.barrier(group=self.group)

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over ranks (a copy; single process returns the input)."""
        if not self.distributed:
            return values
        out = values.detach().clone().to(self.device)
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM, group=self.group)
        return (out / self.world_size).to(values.device)

    def all_reduce_sum(self, value: float) -> float:
        """Sum of a scalar over ranks."""
        if not self.distributed:
            return value
        out = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM, group=self.group)
        return float(out)

    def all_gather_objects(self, value) -> list:
        if not self.distributed:
            return [value]
        out = [None] * self.world_size
        torch_dist.all_gather_object(out, value, group=self.group)
        return out

    @contextmanager
    def together(self) -> Iterator[None]:
        """Run the block on every rank, then wait for all of them (a barrier); if the block
        raised on any rank, every rank raises: that rank its own exception, the others
        `PeerFailed` with its one-line error. A plain barrier would leave the others
        waiting for a rank that gave up (a full disk while rank 0 writes). Collectives do
        not belong in the block: a rank that failed before one would not join it."""
        failure = None
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised again
            failure = exc
        if self.distributed:
            from mmrl.errors import one_line
            from mmrl.failures import explain

            said = None if failure is None else (explain(failure) or one_line(failure, 300, typed=True))
            failed = [(rank, text) for rank, text in enumerate(self.all_gather_objects(said)) if text is not None]
            if failure is None and failed:
                rank, text = failed[0]
                failure = PeerFailed(f"rank {rank} failed: {text}")
            if failure is not None:
                failure.on_every_rank = True  # see `leave_together`
        if failure is not None:
            raise failure


def exit_cleanly(code: int = 0) -> None:
    """End a torchrun process once its outputs are written and its process group destroyed,
    skipping interpreter teardown: under load, gloo's threads were seen to abort it there
    ('terminate called without an active exception', exit -6) after all the work had
    succeeded, which failed the launch (probes, benches, `mmrl train` and `mmrl eval`), or
    replaced a failure's exit code 2 with that abort (`leave_together`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_together(failure: BaseException, code: int | None) -> None:
    """After a rank has said a failure that every rank raised together (`Dist.together`):
    wait for the others to say theirs, close the process group and exit with `code`, skipping
    the interpreter's teardown (`exit_cleanly`; None: return, for a traceback to follow).
    torchrun stops the other processes as soon as one exits, which could cut a rank off
    before its line. Outside a process group it returns, and the caller exits as it would have."""
    if getattr(failure, "on_every_rank", False) and torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()
        if code is not None:
            exit_cleanly(code)


def init_distributed(device: str | None = None, sequence_parallel: int = 1) -> Dist:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun) and set up the process group;
    with `sequence_parallel` > 1 also the ("dp", "sp") mesh and the SP group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise LaunchError(f"this process has LOCAL_RANK {local_rank}, but {torch.cuda.device_count()} GPU(s) are "
                             "visible: start one process per GPU (torchrun --nproc_per_node), or hide the GPUs "
                             "(CUDA_VISIBLE_DEVICES=) to run on CPU")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if sequence_parallel < 1 or world_size % sequence_parallel:
        raise ValueError(f"sequence_parallel={sequence_parallel} must divide the world size {world_size} "
                         "(torchrun --nproc_per_node)")
    mesh = sp_group = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if not torch_dist.is_initialized():
            torch_dist.init_process_group(backend=backend(dev.type))
        mesh = init_device_mesh(dev.type, (world_size,), mesh_dim_names=("dp",))
        if sequence_parallel > 1:
            grid = init_device_mesh(dev.type, (world_size // sequence_parallel, sequence_parallel),
                                    mesh_dim_names=("dp", "sp"))
            sp_group = grid.get_group("sp")
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, mesh=mesh,
                sequence_parallel=sequence_parallel, sp_group=sp_group)
