"""The m-per-class batch sampler of metric learning, with its own seeded generator."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from training.config import TrainConfigError


class MPerClassSampler(Sampler[int]):
    """Indices in batches of ``batch_size // m`` distinct classes, ``m`` items each.

    The contract of pytorch-metric-learning's ``MPerClassSampler`` (given a batch size):
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
        if length < batch_size:
            raise TrainConfigError(
                f"{length} training images, fewer than the batch size {batch_size}; "
                "lower --batch-size"
            )
        # Item indices grouped by class (stable, so each group is in item order).
        order = np.argsort(inverse, kind="stable")
        self._members = np.split(order, np.cumsum(counts)[:-1])
        self.m = m
        self.batch_size = batch_size
        self.length = length - length % batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose batches the next iteration yields."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        draws = []
        for _ in range(self.length // self.batch_size):
            for c in rng.choice(len(self._members), size=self.batch_size // self.m, replace=False):
                members = self._members[c]
                draws.append(rng.choice(members, size=self.m, replace=len(members) < self.m))
        return iter(np.concatenate(draws).tolist())


def resolve_m_per_class(batch_size: int, num_classes: int, m_per_class: int | None) -> int:
    """``m_per_class`` checked against the data, or chosen when ``None``.

    :class:`MPerClassSampler` needs ``m * classes >= batch_size`` and ``batch_size % m == 0``. The
    automatic choice is the smallest divisor of ``batch_size`` that is >= 4 (the common
    setting) and >= ``batch_size / classes``.

    Raises:
        TrainConfigError: no valid ``m`` (with the numbers and a fix).
    """
    if m_per_class is not None:
        if m_per_class * num_classes < batch_size:
            raise TrainConfigError(
                f"--m-per-class {m_per_class} x {num_classes} training classes < batch size "
                f"{batch_size}; raise --m-per-class or lower --batch-size"
            )
        return m_per_class
    need = max(4, math.ceil(batch_size / num_classes))
    for m in range(need, batch_size + 1):
        if batch_size % m == 0:
            return m
    raise TrainConfigError(f"no m-per-class fits batch size {batch_size}")
