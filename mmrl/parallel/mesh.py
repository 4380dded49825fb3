"""Distributed setup from torchrun's environment: one process per device.

    dist = init_distributed()        # world size 1 without torchrun
    dist.rank, dist.world_size, dist.device, dist.mesh

On CPU the backend is gloo, on CUDA nccl. A single process gets no process group and no
mesh, so nothing pays for distribution it does not use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: object | None  # torch.distributed.device_mesh.DeviceMesh when world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            torch_dist.barrier()

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over ranks (a copy; single process returns the input)."""
        if not self.distributed:
            return values
        out = values.detach().clone().to(self.device)
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM)
        return (out / self.world_size).to(values.device)

    def all_reduce_sum(self, value: float) -> float:
        """Sum of a scalar over ranks."""
        if not self.distributed:
            return value
        out = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM)
        return float(out)

    def all_gather_objects(self, value) -> list:
        if not self.distributed:
            return [value]
        out = [None] * self.world_size
        torch_dist.all_gather_object(out, value)
        return out


def init_distributed(device: str | None = None) -> Dist:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun) and set up the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if not torch_dist.is_initialized():
            torch_dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        mesh = init_device_mesh(dev.type, (world_size,), mesh_dim_names=("dp",))
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, mesh=mesh)
