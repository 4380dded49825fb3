"""Process groups and device meshes for runs under `torchrun` (or a single process)."""

from mmrl.parallel.mesh import Dist, LaunchError, PeerFailed, init_distributed

__all__ = ["Dist", "LaunchError", "PeerFailed", "init_distributed"]
