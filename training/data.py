"""Training data: image sources, the class-disjoint / closed-set splits, datasets and samplers.

Sources are read through ``imgret.datasets`` (ImageFolder, CSV manifest, Market-1501,
Fashion-MNIST idx files) and decoded through ``imgret.images.load_image_file`` (the only
decode path). Bad data is reported, not crashed on:

- a missing / empty source or an unreadable idx file: :class:`imgret.datasets.DatasetError`
  naming the path (raised by the adapters);
- a CSV row pointing nowhere: skipped with a warning (by the adapter);
- a class with a single image: dropped with a warning (it can neither form a positive pair
  in training nor be a query with a relevant item in evaluation);
- Market-1501 distractors (identity 0000): left out of every split (they are nobody);
- a corrupt file: skipped with a warning naming it (training substitutes another image of
  the same class; evaluation drops it);
- too few classes or images for the protocol: :class:`~training.config.TrainConfigError`
  saying how many are needed.

Fashion-MNIST class-disjoint split (fixed, documented): the 70,000 images of the official
train and test files are pooled, then split by class

==========  ==========================================================  ======
split       classes                                                     images
==========  ==========================================================  ======
train       0 T-shirt/top, 1 Trouser, 2 Pullover, 3 Dress, 7 Sneaker,   42,000
            9 Ankle boot
validation  4 Coat, 8 Bag                                               14,000
test        5 Sandal, 6 Shirt                                           14,000
==========  ==========================================================  ======

Why this split: with 10 classes, what a class-disjoint test can measure is whether features
learned on some garments transfer to unseen ones. Each held-out class has relatives in training
(Sandal: Sneaker / Ankle boot; Shirt: T-shirt / Pullover; Coat: Pullover; Bag has none), and
neither held-out pair is solved by raw pixels (MAP@R of L2-normalised pixels: about 0.71 on
Sandal/Shirt and 0.63 on Coat/Bag), so the test has room to show learning and the validation
pair is of similar difficulty. Two rejected choices: "0-5 / 6-7 / 8-9" validates on
Shirt/Sneaker, which raw pixels already solve (MAP@R 0.96), so model selection would be blind;
holding out Coat/Shirt (raw pixels 0.33, near chance) measured nothing either, since no
training class teaches that fine distinction.

Fashion-MNIST closed-set split: train / validation from the official train file (the
validation fraction of each class held out, seeded), test = the official test file.
Folders: class-disjoint = a seeded shuffle of the class names cut by the val / test fractions;
closed-set = a seeded per-class hold-out of images.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from pytorch_metric_learning.samplers import MPerClassSampler
from pytorch_metric_learning.utils import common_functions as pml_common
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgret.checkpoint import ModelSpec
from imgret.datasets import (
    FASHION_MNIST_CLASSES,
    DatasetError,
    list_records,
    load_fashion_mnist,
)
from imgret.errors import ImageDecodeError
from imgret.images import load_image_file
from imgret.transforms import eval_transform
from training.config import FASHION_MNIST, TrainConfig, TrainConfigError

logger = logging.getLogger(__name__)

FASHION_SPLIT = {"train": (0, 1, 2, 3, 7, 9), "val": (4, 8), "test": (5, 6)}
# Fashion-MNIST pixel statistics (train file), replicated to the 3 input channels.
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
SPLITS = ("train", "val", "test")
MARKET_DISTRACTOR = "0000"


class ImageSource(Protocol):
    """Labelled images addressed by index.

    Attributes:
        name: what ``--data`` named (for messages and split.json).
        labels: ``(n,)`` object array of class names (str).
        cameras: ``(n,)`` int64 camera ids (re-ID data) or ``None``.
        grayscale: the images are greyscale (Fashion-MNIST).
    """

    name: str
    labels: np.ndarray
    cameras: np.ndarray | None
    grayscale: bool

    def image(self, index: int) -> Image.Image:
        """The decoded RGB image; raises ``ImageDecodeError`` naming the file."""
        ...

    def describe(self, index: int) -> str:
        """A stable name of one item (its path, or ``fashion-mnist[i]``)."""
        ...


class FileImageSource:
    """Image files listed by ``imgret.datasets.list_records``."""

    grayscale = False

    def __init__(self, name: str, records: Sequence[Any]):
        self.name = name
        self.paths = [Path(r.path) for r in records]
        self.labels = np.array([str(r.label) for r in records], dtype=object)
        cams = [r.camera for r in records]
        self.cameras = (
            np.array(cams, dtype=np.int64) if cams and all(c is not None for c in cams) else None
        )
        root = Path(name)
        self._root = root if root.is_dir() else root.parent

    def image(self, index: int) -> Image.Image:
        return load_image_file(self.paths[index])

    def describe(self, index: int) -> str:
        path = self.paths[index]
        with contextlib.suppress(ValueError):
            return str(path.relative_to(self._root))
        return str(path)


class ArrayImageSource:
    """Greyscale uint8 images in memory (Fashion-MNIST).

    Attributes:
        pixels: ``(n, H, W)`` uint8.
        official_test: ``(n,)`` bool, the image comes from the data set's own test file.
    """

    cameras = None
    grayscale = True

    def __init__(
        self, name: str, pixels: np.ndarray, labels: np.ndarray, official_test: np.ndarray
    ):
        self.name = name
        self.pixels = pixels
        self.labels = labels
        self.official_test = official_test

    def image(self, index: int) -> Image.Image:
        # RGB like every decoded file, so the Embedder sees one kind of input.
        return Image.fromarray(self.pixels[index]).convert("RGB")

    def describe(self, index: int) -> str:
        return f"{self.name}[{index}]"


def open_source(data: str) -> ImageSource:
    """Open ``--data``: ``fashion-mnist[:FOLDER]``, a folder, or a CSV manifest.

    Raises:
        DatasetError: missing or unreadable source (the message names the path).
    """
    if data == FASHION_MNIST or data.startswith(FASHION_MNIST + ":"):
        root = data.split(":", 1)[1] if ":" in data else None
        train_x, train_y = load_fashion_mnist(root, "train")
        test_x, test_y = load_fashion_mnist(root, "test")
        names = np.array(FASHION_MNIST_CLASSES, dtype=object)
        return ArrayImageSource(
            data,
            np.concatenate([train_x, test_x]),
            names[np.concatenate([train_y, test_y])],
            np.concatenate([np.zeros(len(train_y), bool), np.ones(len(test_y), bool)]),
        )
    return FileImageSource(data, list_records(data))


def model_spec_for(config: TrainConfig, source: ImageSource) -> ModelSpec:
    """The ModelSpec of a run: greyscale sources get their own normalisation statistics."""
    if source.grayscale:
        return ModelSpec(
            backbone=config.backbone, dim=config.dim, image_size=config.image_size,
            mean=(FASHION_MEAN,) * 3, std=(FASHION_STD,) * 3, grayscale=True,
        )
    return ModelSpec(backbone=config.backbone, dim=config.dim, image_size=config.image_size)


# ----------------------------------------------------------------------------- splits


@dataclass
class DataSplit:
    """Which source items are in train / val / test, and how they were chosen.

    Attributes:
        protocol: ``class-disjoint`` or ``closed-set``.
        indices: split name -> ``(k,)`` int64 indices into the source, sorted.
        dropped_classes: classes left out for having fewer than 2 images.
        rule: one line saying how the split was made.
    """

    protocol: str
    indices: dict[str, np.ndarray]
    dropped_classes: list[str] = field(default_factory=list)
    rule: str = ""

    def classes(self, split: str, source: ImageSource) -> list[str]:
        """Sorted class names present in one split."""
        return sorted(set(source.labels[self.indices[split]].tolist()))

    def summary(self, source: ImageSource) -> dict[str, Any]:
        """A small JSON-ready description: protocol, rule, classes and counts per split,
        and a digest of the exact membership (so two runs can be checked for the same split).
        """
        out: dict[str, Any] = {
            "protocol": self.protocol, "source": source.name, "rule": self.rule,
            "dropped_classes": self.dropped_classes, "splits": {},
        }
        digest = hashlib.sha256()
        for name in SPLITS:
            idx = self.indices[name]
            classes = self.classes(name, source)
            out["splits"][name] = {
                "classes": classes if len(classes) <= 50 else classes[:50] + ["..."],
                "num_classes": len(classes), "num_images": int(len(idx)),
            }
            digest.update(name.encode())
            digest.update(json.dumps([source.describe(int(i)) for i in idx]).encode())
        out["digest"] = digest.hexdigest()[:16]
        return out

    def to_json(self, source: ImageSource) -> dict[str, Any]:
        """The full split (summary + every member's name) for ``split.json``."""
        out = self.summary(source)
        out["members"] = {
            name: [source.describe(int(i)) for i in self.indices[name]] for name in SPLITS
        }
        return out


def describe_split(summary: dict[str, Any]) -> str:
    """One line naming the split a number came from, e.g. for printing beside MAP@R."""
    test = summary["splits"]["test"]
    return (
        f"{summary['protocol']} split {summary['digest']} of {summary['source']}: "
        f"test = {test['num_images']} images of {test['num_classes']} classes"
    )


def make_split(source: ImageSource, config: TrainConfig) -> DataSplit:
    """Split a source into train / val / test by ``config.protocol`` (seeded, deterministic).

    Raises:
        TrainConfigError: too few classes or images for the protocol.
    """
    rng = np.random.default_rng(config.split_seed)
    counts = Counter(source.labels.tolist())
    dropped = sorted(c for c, n in counts.items() if n < 2)
    if dropped:
        logger.warning(
            "%s: dropped %d classes with a single image (no positive pair possible): %s",
            source.name, len(dropped),
            ", ".join(dropped[:10]) + (" ..." if len(dropped) > 10 else ""),
        )
    keep = np.array([counts[label] >= 2 for label in source.labels], dtype=bool)
    if source.cameras is not None:
        # Re-ID data: Market-1501's distractors (identity 0000) are nobody; they are not a
        # class to train on or to query with.
        distractors = source.labels == MARKET_DISTRACTOR
        if distractors.any():
            logger.info("%s: left out %d distractor images (identity %s)", source.name,
                        int(distractors.sum()), MARKET_DISTRACTOR)
            keep &= ~distractors
    if isinstance(source, ArrayImageSource) and source.name.startswith(FASHION_MNIST):
        split = _fashion_split(source, config, rng)
    elif config.protocol == "class-disjoint":
        split = _class_disjoint(source, config, rng, keep)
    else:
        split = _closed_set(source, config, rng, keep)
    split.dropped_classes = dropped
    for name, cap in (("train", config.max_train_images), ("val", config.max_eval_images),
                      ("test", config.max_eval_images)):
        if cap is not None and len(split.indices[name]) > cap:
            split.indices[name] = stratified_subset(split.indices[name], source.labels, cap, rng)
            split.rule += f"; {name} capped at {cap} images (stratified, seeded)"
    for name in SPLITS:
        n_classes = len(split.classes(name, source))
        if n_classes < 2:
            raise TrainConfigError(
                f"{source.name}: the {name} split has {n_classes} class(es); retrieval needs "
                f"at least 2 (protocol {config.protocol}: class-disjoint needs >= 6 classes "
                "with >= 2 images each; use --protocol closed-set for fewer classes)"
            )
    return split


def _fashion_split(
    source: ArrayImageSource, config: TrainConfig, rng: np.random.Generator
) -> DataSplit:
    names = np.array(FASHION_MNIST_CLASSES, dtype=object)
    if config.protocol == "class-disjoint":
        indices = {
            split: np.flatnonzero(np.isin(source.labels, names[list(ids)]))
            for split, ids in FASHION_SPLIT.items()
        }
        rule = "Fashion-MNIST fixed class split: " + ", ".join(
            f"{s}={list(ids)}" for s, ids in FASHION_SPLIT.items()
        ) + " (official train + test files pooled)"
        return DataSplit("class-disjoint", indices, rule=rule)
    pool = np.flatnonzero(~source.official_test)
    val = _per_class_holdout(pool, source.labels, config.val_fraction, rng)
    indices = {
        "train": np.setdiff1d(pool, val), "val": val,
        "test": np.flatnonzero(source.official_test),
    }
    rule = (f"Fashion-MNIST closed-set: test = official test file; validation = "
            f"{config.val_fraction:.0%} of each class of the train file (seed {config.split_seed})")
    return DataSplit("closed-set", indices, rule=rule)


def _class_disjoint(
    source: ImageSource, config: TrainConfig, rng: np.random.Generator, keep: np.ndarray
) -> DataSplit:
    classes = sorted(set(source.labels[keep].tolist()))
    n = len(classes)
    n_val = max(2, round(n * config.val_fraction))
    n_test = max(2, round(n * config.test_fraction))
    if n - n_val - n_test < 2:
        raise TrainConfigError(
            f"{source.name}: {n} classes with >= 2 images; the class-disjoint protocol needs "
            "at least 6 (2 each for train, validation and test); use --protocol closed-set"
        )
    order = [classes[i] for i in rng.permutation(n)]
    groups = {"test": order[:n_test], "val": order[n_test : n_test + n_val],
              "train": order[n_test + n_val :]}
    indices = {
        split: np.flatnonzero(keep & np.isin(source.labels, np.array(members, dtype=object)))
        for split, members in groups.items()
    }
    rule = (f"class-disjoint: {n} classes shuffled with seed {config.split_seed}; "
            f"{len(groups['train'])} train / {n_val} val / {n_test} test classes")
    return DataSplit("class-disjoint", indices, rule=rule)


def _closed_set(
    source: ImageSource, config: TrainConfig, rng: np.random.Generator, keep: np.ndarray
) -> DataSplit:
    pool = np.flatnonzero(keep)
    held = _per_class_holdout(pool, source.labels, config.val_fraction + config.test_fraction, rng)
    # Cut each class's held-out images into val and test in the fraction ratio.
    share = config.val_fraction / (config.val_fraction + config.test_fraction)
    val_parts, test_parts = [], []
    for label in sorted(set(source.labels[held].tolist())):
        members = held[source.labels[held] == label]
        cut = int(round(len(members) * share)) if len(members) > 1 else 0
        val_parts.append(members[:cut])
        test_parts.append(members[cut:])
    indices = {
        "train": np.setdiff1d(pool, held),
        "val": np.sort(np.concatenate(val_parts)) if val_parts else np.zeros(0, np.int64),
        "test": np.sort(np.concatenate(test_parts)) if test_parts else np.zeros(0, np.int64),
    }
    rule = (f"closed-set: per class, {config.val_fraction:.0%} of images held out for "
            f"validation and {config.test_fraction:.0%} for test (seed {config.split_seed}); "
            "queries = held-out images, gallery = training images")
    return DataSplit("closed-set", indices, rule=rule)


def _per_class_holdout(
    pool: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> np.ndarray:
    """Seeded hold-out of ``fraction`` of each class (at least 1 image when the class has
    3 or more, so that 2 stay in the gallery)."""
    held = []
    for label in sorted(set(labels[pool].tolist())):
        members = pool[labels[pool] == label]
        k = int(round(len(members) * fraction))
        k = min(max(k, 1), len(members) - 2) if len(members) >= 3 else 0
        held.append(rng.permutation(members)[:k])
    return np.sort(np.concatenate(held)).astype(np.int64) if held else np.zeros(0, np.int64)


def stratified_subset(
    indices: np.ndarray, labels: np.ndarray, cap: int, rng: np.random.Generator
) -> np.ndarray:
    """A seeded subset of about ``cap`` items keeping each class's share (>= 2 per class).

    Args:
        indices: ``(k,)`` int64 source indices.
        labels: ``(n,)`` class names of the whole source.
        cap: the target size.

    Returns:
        Sorted ``(<= max(cap, 2 * classes),)`` int64 indices.
    """
    classes = sorted(set(labels[indices].tolist()))
    fraction = cap / len(indices)
    chosen = []
    for label in classes:
        members = indices[labels[indices] == label]
        k = min(len(members), max(2, int(math.floor(len(members) * fraction))))
        chosen.append(rng.permutation(members)[:k])
    return np.sort(np.concatenate(chosen)).astype(np.int64)


# ----------------------------------------------------------------------------- datasets


def train_transform(spec: ModelSpec, augmentation: str) -> v2.Compose:
    """The training augmentation for a model spec.

    ``standard``: random resized crop (scale 0.5-1, so a small image keeps most of the object)
    + horizontal flip (+ mild colour jitter for colour data), then the same float conversion
    and normalisation as ``imgret.transforms.eval_transform``. ``none``: the eval transform.
    """
    if augmentation == "none":
        return eval_transform(spec)
    steps: list[v2.Transform] = [v2.ToImage()]
    if spec.grayscale:
        steps.append(v2.Grayscale(num_output_channels=3))
    steps += [
        v2.RandomResizedCrop((spec.image_size, spec.image_size), scale=(0.5, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
    ]
    if not spec.grayscale:
        steps.append(v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2))
    steps += [
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(spec.mean), std=list(spec.std)),
    ]
    return v2.Compose(steps)


class TrainDataset(Dataset):
    """The training split as ``(image (3, S, S) float32, label int64 in 0..C-1)`` pairs.

    A file that fails to decode is logged once and replaced by the next image of its class,
    so one corrupt JPEG does not stop a long run.

    Attributes:
        class_names: the training classes; label ``i`` is ``class_names[i]``.
        targets: ``(k,)`` int64 labels of the items (for the sampler).
    """

    def __init__(self, source: ImageSource, indices: np.ndarray, transform: v2.Compose):
        self.source = source
        self.indices = np.asarray(indices, dtype=np.int64)
        self.transform = transform
        self.class_names = sorted(set(source.labels[self.indices].tolist()))
        lookup = {name: i for i, name in enumerate(self.class_names)}
        self.targets = np.array([lookup[x] for x in source.labels[self.indices]], dtype=np.int64)
        self._by_class = {c: np.flatnonzero(self.targets == c) for c in range(len(lookup))}
        self._bad: set[int] = set()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> tuple[torch.Tensor, int]:
        label = int(self.targets[position])
        candidates = self._by_class[label]
        start = int(np.searchsorted(candidates, position))
        for step in range(len(candidates)):
            pos = int(candidates[(start + step) % len(candidates)])
            if pos in self._bad:
                continue
            try:
                image = self.source.image(int(self.indices[pos]))
            except ImageDecodeError as exc:
                self._bad.add(pos)
                logger.warning("skipping undecodable training image: %s", exc)
                continue
            return self.transform(image), label
        raise DatasetError(
            f"{self.source.name}: no image of class {self.class_names[label]!r} can be decoded"
        )


class SeededMPerClassSampler(MPerClassSampler):
    """PML's MPerClassSampler with its randomness drawn from ``(seed, epoch)``.

    PML draws from a module-global NumPy generator and shuffles its label list in place, so a
    resumed run would see different batches. Here each epoch swaps in its own generator while
    the epoch's index list is built (eagerly, in ``__iter__``), so epoch ``e`` of seed ``s``
    always yields the same batches, resumed or not.
    """

    def __init__(self, labels: np.ndarray, m: int, batch_size: int, length: int, seed: int):
        super().__init__(labels, m, batch_size=batch_size, length_before_new_iter=length)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.labels = sorted(self.labels)
        previous = pml_common.NUMPY_RANDOM
        pml_common.NUMPY_RANDOM = np.random.RandomState([self.seed, self.epoch])
        try:
            return super().__iter__()
        finally:
            pml_common.NUMPY_RANDOM = previous


def resolve_m_per_class(batch_size: int, num_classes: int, m_per_class: int | None) -> int:
    """``m_per_class`` checked against the data, or chosen when ``None``.

    MPerClassSampler needs ``m * classes >= batch_size`` and ``batch_size % m == 0``. The
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


# ----------------------------------------------------------------------------- evaluation


def iter_images(
    source: ImageSource, indices: np.ndarray, chunk: int = 256
) -> Iterator[tuple[np.ndarray, list[Image.Image]]]:
    """Decode a split in chunks: yields ``(kept indices, images)``; bad files are skipped
    with a warning naming them (the caller keeps the labels of the kept indices only)."""
    for start in range(0, len(indices), chunk):
        kept, images = [], []
        for index in indices[start : start + chunk]:
            try:
                images.append(source.image(int(index)))
            except ImageDecodeError as exc:
                logger.warning("skipping undecodable evaluation image: %s", exc)
                continue
            kept.append(int(index))
        yield np.array(kept, dtype=np.int64), images
