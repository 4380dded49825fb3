"""Process groups and device meshes for runs under `torchrun` (or a single process)."""

from mmrl.parallel.mesh import Dist, LaunchError, init_distributed

__all__ = ["Dist", "LaunchError", "init_distributed"]
