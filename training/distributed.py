"""Data-parallel training under ``torchrun`` (PyTorch DDP).

``torchrun --nproc_per_node=N -m cli train ...`` sets ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK``; :func:`from_env` sees them and joins the process group (gloo on CPU, nccl on
CUDA, one GPU per process: ``cuda:LOCAL_RANK``). Without them (or with ``WORLD_SIZE=1``) it
returns ``None`` and the loop runs exactly as a single process.

What is shared, and how:

- the network is wrapped in ``DistributedDataParallel`` (gradients averaged by DDP);
- the loss's own parameters (proxies, classifier weights) are not wrapped: their gradients
  are all-reduced (averaged) by :meth:`Dist.average_grads` after each backward;
- batches: every rank builds the same seeded list of MPerClassSampler batches for the epoch
  and takes batches ``rank::world_size`` (:class:`ShardedBatchSampler`), so each batch keeps
  its class composition and the ranks see disjoint batches;
- rank 0 alone validates, writes checkpoints / metrics / curves and shows progress; the other
  ranks wait at a barrier.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

logger = logging.getLogger(__name__)


@dataclass
class Dist:
    """This process's place in a torchrun launch.

    Attributes:
        rank: global rank (0 writes the run directory).
        world_size: number of processes.
        local_rank: rank on this machine (picks the GPU).
        device: ``cpu`` or ``cuda:LOCAL_RANK``.
    """

    rank: int
    world_size: int
    local_rank: int
    device: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def average_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """All-reduce (mean) the gradients of parameters DDP does not manage.

        A parameter without a gradient on this rank contributes zeros, so every rank takes
        part in every collective (no rank is left waiting).
        """
        for p in params:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(self.world_size)

    def broadcast_params(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (for modules DDP does not wrap)."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

    def mean(self, value: float) -> float:
        """The mean of a scalar over the ranks."""
        device = self.device if self.device.startswith("cuda") else "cpu"
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / self.world_size

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank."""
        device = self.device if self.device.startswith("cuda") else "cpu"
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """``WORLD_SIZE`` > 1 in the environment (torchrun, or any launcher that sets it)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def from_env(device: str) -> Dist | None:
    """Join the process group torchrun describes, or ``None`` when not launched by it.

    Args:
        device: the resolved device type of the run (``cpu`` or ``cuda``).
    """
    if not launched_by_torchrun():
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device_name, backend = f"cuda:{local_rank}", "nccl"
    else:
        device_name, backend = "cpu", "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": torch.device(device_name)} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    logger.info("DDP: rank %d of %d (local rank %d) on %s, backend %s", rank, world_size,
                local_rank, device_name, backend)
    return Dist(rank, world_size, local_rank, device_name)


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's share of the batches an index sampler yields.

    The index sampler (seeded, identical on every rank) is cut into consecutive batches of
    ``batch_size`` (the last partial batch dropped, as ``drop_last=True`` does), the batch count
    is cut down to a multiple of ``world_size`` (every rank takes the same number of steps),
    and this rank keeps batches ``rank::world_size``.
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, rank: int, world_size: int):
        self.sampler = sampler
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(iter(self.sampler))
        n = len(indices) // self.batch_size
        n -= n % self.world_size
        batches = [indices[i * self.batch_size : (i + 1) * self.batch_size] for i in range(n)]
        return iter(batches[self.rank :: self.world_size])

    def __len__(self) -> int:
        n = len(self.sampler) // self.batch_size  # type: ignore[arg-type]
        return n // self.world_size
