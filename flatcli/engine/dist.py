"""Data-parallel ranks: the one place the engine talks to `torch.distributed`.

Under ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; SLURM through submitit sets them too) each rank holds the whole
measurement set but computes over its own contiguous shard of rows; every sum over
data (losses, gradients, curvature products, forward metrics, per-unit values) is
reduced across ranks here, so every rank ends every product with the same numbers,
equal to one process up to float rounding. Random draws need no communication:
they come from seeded generators, identical on every rank. gloo on the CPU, nccl
with one GPU per rank (``cuda:LOCAL_RANK``).

A single process uses `Dist()` (rank 0 of 1), whose reductions do nothing.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass

import torch

from ..errors import RankFailure

__all__ = [
    "Dist",
    "RankFailure",
    "current",
    "env_rank",
    "init_from_env",
    "launched",
    "leave",
    "shutdown",
]

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
TIMEOUT_MINUTES = 30


@dataclass(frozen=True)
class Dist:
    """The place of this process among the ranks (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    backend: str = ""

    @property
    def active(self) -> bool:
        """Whether there is more than one rank."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and prints tables."""
        return self.rank == 0

    # ------------------------------------------------------------ work split
    def shard(self, rows: int) -> slice:
        """The contiguous rows of ``rows`` this rank computes (shard sizes differ by at most one)."""
        base, extra = divmod(rows, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    # ------------------------------------------------------------ reductions
    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks, in place; returns it (a CPU tensor travels through the GPU with nccl)."""
        if self.active:
            dev = self._comm_device()
            if t.device == dev:
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
            else:
                u = t.to(dev)
                torch.distributed.all_reduce(u, op=torch.distributed.ReduceOp.SUM)
                t.copy_(u)
        return t

    def sum_float(self, *values: float) -> tuple[float, ...]:
        """Python floats summed over ranks (in float64)."""
        if not self.active:
            return tuple(float(v) for v in values)
        t = self.sum_(torch.tensor(values, dtype=torch.float64, device=self._comm_device()))
        return tuple(float(v) for v in t.cpu())

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``s (a collective when active)."""
        if not self.active:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.long, device=self._comm_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())

    def gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """Each rank's ``t`` (same trailing shape, any first dimension) concatenated in rank order."""
        if not self.active:
            return t
        dev = self._comm_device()
        src = t.to(dev)
        sizes = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(self.world)]
        torch.distributed.all_gather(sizes, torch.tensor([len(src)], dtype=torch.long, device=dev))
        most = int(max(int(s) for s in sizes))
        pad = torch.zeros((most, *src.shape[1:]), dtype=src.dtype, device=dev)
        pad[: len(src)] = src
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        torch.distributed.all_gather(parts, pad)
        return torch.cat([p[: int(s)] for p, s in zip(parts, sizes, strict=True)]).to(t.device)

    def gather_objects(self, obj):
        """Every rank's picklable ``obj``, in rank order (``[obj]`` on one process)."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        return self.sum_float(1.0 if flag else 0.0)[0] > 0

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.active:
            torch.distributed.barrier()

    def _comm_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )


_CURRENT = Dist()
_OWNED = False  # whether flatcli created the process group (and so must destroy it)


def env_rank() -> int:
    """The rank a launcher assigned to this process (``RANK``; 0 without a launcher)."""
    return int(os.environ.get("RANK", "0")) if launched() else 0


def launched() -> bool:
    """Whether a launcher asked for more than one rank (``WORLD_SIZE`` > 1 with ``RANK`` set)."""
    return all(k in os.environ for k in ENV_KEYS) and int(os.environ.get("WORLD_SIZE", "1")) > 1


def current() -> Dist:
    """The process's `Dist` (set by `init_from_env`; rank 0 of 1 otherwise)."""
    return _CURRENT


def init_from_env(device: torch.device) -> tuple[Dist, torch.device]:
    """Join the ranks a launcher set up (once per process) and return (dist, device): gloo for
    the CPU, nccl for CUDA with this rank's GPU ``cuda:LOCAL_RANK``. Without a launcher,
    rank 0 of 1 and ``device`` unchanged."""
    global _CURRENT
    if not launched():
        return Dist(), device
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        global _OWNED
        torch.distributed.init_process_group(
            backend=backend, timeout=datetime.timedelta(minutes=TIMEOUT_MINUTES)
        )
        _OWNED = True
        # A process that ends with its group alive can abort in gloo's threads during interpreter
        # teardown (SIGABRT, "terminate called without an active exception"), failing the launch.
        atexit.register(shutdown)
    _CURRENT = Dist(
        rank=rank, world=world, local_rank=local, local_world=local_world, backend=backend
    )
    return _CURRENT, device


def shutdown() -> None:
    """Leave the process group flatcli created (a group the caller created is left alone)."""
    global _CURRENT, _OWNED
    if _OWNED and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _OWNED = False
    _CURRENT = Dist()


def leave(world: Dist) -> None:
    """End of a distributed command: wait for every rank (their last collective is done), then
    destroy the group if flatcli created it, so that no rank exits with gloo/nccl threads alive."""
    if world.active:
        world.barrier()
    shutdown()
