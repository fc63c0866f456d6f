"""One process or many: the collectives the training loop calls, whichever it runs as.

The loop calls every method of a :class:`Distributed` unconditionally. For one process they
do nothing (:class:`Distributed` itself: a barrier returns at once, a mean is the value, the
network is not wrapped); under ``torchrun`` (``WORLD_SIZE`` > 1) :class:`DataParallel` does the
real thing with PyTorch DDP. :func:`connect` picks one.

``torchrun --nproc_per_node=N -m imgret.cli train ...`` sets ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK``; :func:`connect` sees them and joins the process group (gloo on CPU, nccl on
CUDA, one GPU per process: ``cuda:LOCAL_RANK``). What is shared, and how:

- the network is wrapped in ``DistributedDataParallel`` (gradients averaged by DDP);
- the loss's own parameters (proxies, classifier weights) are not wrapped: rank 0's values are
  broadcast once, and their gradients are all-reduced (averaged) after each backward;
- batches: every rank builds the same seeded list of m-per-class batches for the epoch and
  takes batches ``rank::world_size`` (:class:`ShardedBatchSampler`), so each batch keeps its
  class composition and the ranks see disjoint batches;
- rank 0 alone validates, writes checkpoints / metrics / curves and shows progress; the other
  ranks wait at a barrier.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from imgret.settings import resolve_device
from imgret.training.config import TrainConfigError

logger = logging.getLogger(__name__)


class Distributed:
    """A single process: rank 0 of 1, where every collective does nothing.

    Attributes:
        device: ``cpu`` or ``cuda`` (``cuda:LOCAL_RANK`` under DDP).
        rank: global rank (0 writes the run directory).
        world_size: number of processes.
    """

    rank = 0
    world_size = 1

    def __init__(self, device: str):
        self.device = device

    @property
    def is_main(self) -> bool:
        """This process writes the run directory and reports."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every process gets here."""

    def wrap(self, model: torch.nn.Module, loss: torch.nn.Module | None) -> torch.nn.Module:
        """The network to train (``model`` itself for one process), with the loss's own
        parameters (``loss``; ``None`` when it has none) equal on every process."""
        return model

    def seed_epoch(self, seed: int, epoch: int) -> None:
        """Give this process its own augmentation stream for an epoch (one process keeps the
        stream it has, which ``last.pt`` saves for resuming)."""

    def average_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average the gradients of parameters the wrapped network does not manage."""

    def mean(self, value: float) -> float:
        """The mean of a scalar over the processes."""
        return value

    def any(self, flag: bool) -> bool:
        """True on every process when it is true on any."""
        return flag

    def report_checksums(self, model: torch.nn.Module, loss: torch.nn.Module) -> None:
        """Log the sum of the final parameters, to show the replicas stayed in step."""

    def close(self) -> None:
        """Leave the process group."""


class DataParallel(Distributed):
    """This process's place in a torchrun launch (PyTorch DDP).

    Attributes:
        local_rank: rank on this machine (picks the GPU).
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, device: str):
        super().__init__(device)
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank

    def barrier(self) -> None:
        dist.barrier()

    def wrap(self, model: torch.nn.Module, loss: torch.nn.Module | None) -> torch.nn.Module:
        # DDP averages the network's gradients; the loss's own parameters (proxies, class
        # weights) are kept equal by broadcasting them now and averaging their gradients.
        if loss is not None:
            with torch.no_grad():
                for tensor in [*loss.parameters(), *loss.buffers()]:
                    dist.broadcast(tensor, src=0)
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.local_rank] if self.device.startswith("cuda") else None
        )

    def seed_epoch(self, seed: int, epoch: int) -> None:
        # Each rank its own augmentation stream, reproducible on resume.
        torch.manual_seed(hash((seed, epoch, self.rank)) & 0xFFFF_FFFF)

    def average_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """All-reduce (mean) the gradients.

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

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._tensor_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / self.world_size

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._tensor_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def report_checksums(self, model: torch.nn.Module, loss: torch.nn.Module) -> None:
        # Equal on every rank when DDP kept the replicas in step (the DDP test compares them).
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        loss_checksum = sum(float(p.detach().double().sum()) for p in loss.parameters())
        logger.info("DDP rank %d final parameter checksum %.12e loss %.12e", self.rank,
                    checksum, loss_checksum)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def _tensor_device(self) -> str:
        return self.device if self.device.startswith("cuda") else "cpu"


def launched_by_torchrun() -> bool:
    """``WORLD_SIZE`` > 1 in the environment (torchrun, or any launcher that sets it)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def connect(device: str) -> Distributed:
    """The run's processes: this one alone, or the process group torchrun describes (joined).

    Args:
        device: the ``--device`` option (``auto``, ``cpu`` or ``cuda``).

    Raises:
        TrainConfigError: the device is unavailable, or the process group cannot be joined.
    """
    try:
        resolved = resolve_device(device)
        return _join(resolved) if launched_by_torchrun() else Distributed(resolved)
    except (RuntimeError, ValueError) as exc:
        raise TrainConfigError(str(exc)) from None


def _join(device: str) -> DataParallel:
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
    return DataParallel(rank, world_size, local_rank, device_name)


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's share of the batches an index sampler yields.

    The index sampler (seeded, identical on every rank) is cut into consecutive batches of
    ``batch_size`` (the last partial batch dropped, as ``drop_last=True`` does), the batch count
    is cut down to a multiple of ``world_size`` (every rank takes the same number of steps),
    and this rank keeps batches ``rank::world_size``. For one process (rank 0 of 1) these are
    exactly the batches of ``DataLoader(batch_size=..., drop_last=True)``.
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
