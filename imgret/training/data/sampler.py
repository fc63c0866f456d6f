"""The batch samplers of training, each with its own seeded generator: m images per class
(pair losses), or plain random batches (proxy and classifier losses)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Sampler

from imgret.training.config import TrainConfigError


class _EpochSampler(Sampler[int]):
    """What both samplers share: whole batches of a training split, drawn per ``(seed,
    epoch)``.

    Raises:
        TrainConfigError: fewer than ``batch_size`` items.
    """

    def __init__(self, length: int, batch_size: int, seed: int):
        if length < batch_size:
            raise TrainConfigError(
                f"{length} training images, fewer than the batch size {batch_size}; "
                "lower --batch-size"
            )
        self.batch_size = batch_size
        self.length = length - length % batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose batches the next iteration yields."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length


class MPerClassSampler(_EpochSampler):
    """Indices in batches of ``batch_size // m`` distinct classes, ``m`` items each.

    What pytorch-metric-learning's ``MPerClassSampler`` promises (given a batch size):
    ``len(self)`` is ``length`` rounded down to a multiple of ``batch_size``, and each run of
    ``batch_size`` consecutive indices is one batch of ``batch_size // m`` classes drawn without
    replacement, ``m`` items of each (without replacement, or with it for a class of fewer than
    ``m`` items). Unlike PML's, which draws from a module-global generator, the randomness is
    this sampler's own: a NumPy generator seeded by ``(seed, epoch)``, so epoch ``e`` of seed
    ``s`` always yields the same batches (resumed or not, on every DDP rank) and no library's
    global random state is read or changed.

    Args:
        labels: ``(n,)`` class label of each item.
        m: items per class in a batch; divides ``batch_size``.
        batch_size: items per batch; at most ``m`` x the number of classes.
        length: items per epoch (before rounding down to whole batches).
        seed: the run's seed.

    Raises:
        TrainConfigError: fewer than ``batch_size`` items, or ``m`` does not fit the batch.
    """

    def __init__(self, labels: np.ndarray, m: int, batch_size: int, length: int, seed: int):
        classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        if batch_size % m or m * len(classes) < batch_size:
            raise TrainConfigError(
                f"m-per-class {m} does not fit batch size {batch_size} with {len(classes)} "
                "classes (it must divide the batch size, and m x classes >= batch size)"
            )
        super().__init__(length, batch_size, seed)
        # Item indices grouped by class (stable, so each group is in item order).
        order = np.argsort(inverse, kind="stable")
        self._members = np.split(order, np.cumsum(counts)[:-1])
        self.m = m

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        draws = []
        for _ in range(self.length // self.batch_size):
            for c in rng.choice(len(self._members), size=self.batch_size // self.m, replace=False):
                members = self._members[c]
                draws.append(rng.choice(members, size=self.m, replace=len(members) < self.m))
        return iter(np.concatenate(draws).tolist())


class RandomBatchSampler(_EpochSampler):
    """Indices in a random order, without repeats within an epoch: cut into consecutive
    batches (by ``ShardedBatchSampler``) they are the shuffled batches of
    ``DataLoader(shuffle=True, drop_last=True)``. Seeded by ``(seed, epoch)`` like
    :class:`MPerClassSampler`, so a resumed run and every DDP rank draw the same batches.

    Args:
        length: items in the training split.
        batch_size: items per batch (``len(self)`` is ``length`` rounded down to it).
        seed: the run's seed.

    Raises:
        TrainConfigError: fewer than ``batch_size`` items.
    """

    def __init__(self, length: int, batch_size: int, seed: int):
        super().__init__(length, batch_size, seed)
        self.items = length

    def __iter__(self) -> Iterator[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.items)
        return iter(order[: self.length].tolist())


def plan_random_batches(batch_size: int, total: int, *, world_size: int = 1) -> tuple[int,
                                                                                      list[str]]:
    """The batch size random batches can have: at most ``total // world_size`` (every process
    needs a whole batch), at least 2 (a BatchNorm neck needs two items). Returns the size and
    the changes made, each saying why.

    Raises:
        TrainConfigError: fewer than 2 images per process.
    """
    limit = total // world_size
    if limit < 2:
        raise TrainConfigError(
            f"the training split has {total} images for {world_size} process(es); random "
            "batches need at least 2 per process: add images"
        )
    if batch_size <= limit:
        return batch_size, []
    return limit, [f"batch {batch_size} -> {limit}: only {total} training images"
                   + (f" for {world_size} processes" if world_size > 1 else "")]


@dataclass(frozen=True)
class BatchPlan:
    """The batches a training split can give: ``batch_size / m_per_class`` classes x
    ``m_per_class`` images.

    Attributes:
        batch_size: images per batch (per step, over every process).
        m_per_class: images per class in a batch.
        changes: one line per option lowered to fit the data, saying why (empty when the
            requested batch fits).
    """

    batch_size: int
    m_per_class: int
    changes: tuple[str, ...] = ()

    def describe(self) -> str:
        """E.g. ``"batches of 64: 4 classes x 16 images"``."""
        return (f"batches of {self.batch_size}: {self.batch_size // self.m_per_class} classes "
                f"x {self.m_per_class} images")


def plan_batches(
    batch_size: int, m_per_class: int | None, class_sizes: Sequence[int], *, world_size: int = 1
) -> BatchPlan:
    """The batch composition that fits the training split, lowering what does not fit.

    :class:`MPerClassSampler` needs ``batch_size % m == 0`` and ``m * classes >= batch_size``;
    an epoch needs at least one whole batch per process; and a class of fewer than ``m``
    images is drawn with repeats, so ``m`` is kept at most the median class size (a repeated
    image is a free positive pair that teaches nothing). Within that:

    - the batch is at most ``len(images) // world_size``;
    - a given ``m_per_class`` is kept when it fits, else chosen as below;
    - the automatic ``m`` is the smallest divisor of the batch that is >= 4 (the common
      setting; >= 2 when the classes are smaller) and >= ``batch / classes``;
    - when no divisor fits, the batch is lowered to the largest size that has one.

    Every lowered option is named in ``changes`` with the reason (the loop logs them), e.g.
    ``"batch 64 -> 24: only 24 training images"``.

    Args:
        batch_size: the requested batch size (>= 2).
        m_per_class: the requested images per class, or ``None`` for the automatic choice.
        class_sizes: the number of training images of each class.
        world_size: processes sharing each step (DDP).

    Raises:
        TrainConfigError: fewer than 2 classes, or classes of fewer than 2 images, for every
            process (no batch can hold a positive and a negative pair); the message names the
            numbers and the fix.
    """
    sizes = np.asarray(class_sizes, dtype=np.int64)
    total, classes = int(sizes.sum()), len(sizes)
    limit = total // world_size
    if classes < 2 or int(np.median(sizes)) < 2 or limit < 2:
        raise TrainConfigError(
            f"the training split has {total} images in {classes} classes (median "
            f"{int(np.median(sizes)) if classes else 0} per class) for {world_size} "
            "process(es); training needs at least 2 classes of 2 images per process: "
            "add images or classes"
        )
    # A class smaller than m is drawn with repeats; the median keeps most classes repeat-free.
    most = int(np.median(sizes))
    changes = []
    batch = batch_size
    if batch > limit:
        batch = limit
        changes.append(f"batch {batch_size} -> {batch}: only {total} training images"
                       + (f" for {world_size} processes" if world_size > 1 else ""))
    if m_per_class is not None and _fits(batch, m_per_class, classes, most):
        return BatchPlan(batch, m_per_class, tuple(changes))
    fitted = batch
    while _choose_m(fitted, classes, most) is None:
        fitted -= 1  # ends at 2 at the latest: m = 2 fits 2 classes of 2 images
    m = _choose_m(fitted, classes, most)
    if fitted < batch:
        changes.append(f"batch {batch} -> {fitted}: {classes} training classes x at most "
                       f"{most} images each (the median class size)")
    if m_per_class is not None:
        changes.append(f"m_per_class {m_per_class} -> {m}: "
                       + (f"the median training class has {most} images" if m_per_class > most
                          else f"{m_per_class} x {classes} classes cannot fill a batch of "
                          f"{fitted}"))
    return BatchPlan(fitted, m, tuple(changes))


def _fits(batch: int, m: int, classes: int, most: int) -> bool:
    return batch % m == 0 and m * classes >= batch and m <= most


def _choose_m(batch: int, classes: int, most: int) -> int | None:
    """The smallest fitting divisor of ``batch``, >= 4 when one is; ``None`` when none fits."""
    fitting = [m for m in range(2, batch + 1) if _fits(batch, m, classes, most)]
    preferred = [m for m in fitting if m >= 4]
    return (preferred or fitting or [None])[0]
