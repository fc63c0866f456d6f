"""TrainConfig: every hyper-parameter of a training run, frozen, saved inside model.pt.

The config is split the powerful-benchmarker way: a :class:`LossConfig` block (loss name,
miner, loss options) and everything else (the *base*: data, split, backbone, embedding size,
optimiser, learning rate, augmentation, batch composition, budget). A benchmark shares one
base between all losses and varies only the loss block and the seed, so an unfair comparison
cannot be written by accident (:func:`base_config` / :func:`config_diff`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from imgret.errors import ImgretError

FASHION_MNIST = "fashion-mnist"
PROTOCOLS = ("class-disjoint", "closed-set")
# Fields that may differ between the runs of one benchmark.
PER_RUN_FIELDS = ("loss", "seed")


class TrainConfigError(ImgretError, ValueError):
    """A training option that is out of range or inconsistent with the data."""


@dataclass(frozen=True)
class LossConfig:
    """The loss block: the only part a benchmark varies between losses.

    Attributes:
        name: a key of ``training.registry.LOSSES``.
        miner: a key of ``training.registry.MINERS``; ``None`` = the loss's default.
        options: overrides of the loss's documented defaults (e.g. ``{"margin": 0.1}``).
    """

    name: str = "multi_similarity"
    miner: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        data: ``fashion-mnist`` (Debian's raw idx files), a folder (ImageFolder / Market-1501),
            or a CSV manifest ``path,label[,camera]``.
        protocol: ``class-disjoint`` (train/val/test have disjoint classes; the Reality-Check
            protocol) or ``closed-set`` (same classes, held-out images; product search).
        split_seed: seeds the class shuffle (folders) and image hold-outs; the same value gives
            the same split, whatever the training ``seed``.
        val_fraction, test_fraction: share of classes (class-disjoint) or of each class's
            images (closed-set) held out for validation and test.
        backbone, dim, image_size: the network (``imgret.backbones``), embedding size, input side.
        backbone_weights: optional local state dict for the trunk (nothing is downloaded).
        epochs: training epochs; one epoch = as many samples as the training split holds.
        time_budget_s: optional wall-clock budget for training (validation excluded); the run
            stops after the step that exceeds it, validates, and goes to the test.
        max_train_images: optional cap on training images (seeded, stratified subset).
        max_eval_images: optional cap on the validation and test images each (same rule).
        batch_size, m_per_class: MPerClassSampler batches of ``batch_size / m_per_class``
            classes x ``m_per_class`` images; ``m_per_class=None`` picks the smallest divisor
            of ``batch_size`` >= 4 that the number of training classes allows.
        lr, weight_decay, warmup_epochs: AdamW, linear warm-up then cosine decay to 0.
        augmentation: ``standard`` (random resized crop + flip, + colour jitter for colour
            data) or ``none``.
        seed: model init, sampling and augmentation.
        device: ``auto``, ``cpu`` or ``cuda`` (bf16 autocast on CUDA).
        num_workers: DataLoader workers (0 = in process).
        loss: the loss block.
    """

    data: str = FASHION_MNIST
    protocol: Literal["class-disjoint", "closed-set"] = "class-disjoint"
    split_seed: int = 0
    val_fraction: float = 0.25
    test_fraction: float = 0.25
    backbone: str = "resnet18"
    dim: int = 128
    image_size: int = 224
    backbone_weights: str | None = None
    epochs: int = 10
    time_budget_s: float | None = None
    max_train_images: int | None = None
    max_eval_images: int | None = None
    batch_size: int = 64
    m_per_class: int | None = None
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup_epochs: float = 0.5
    augmentation: Literal["standard", "none"] = "standard"
    seed: int = 0
    device: str = "auto"
    num_workers: int = 0
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        checks = [
            (self.protocol in PROTOCOLS, f"protocol must be one of {', '.join(PROTOCOLS)}"),
            (self.augmentation in ("standard", "none"), "augmentation must be standard or none"),
            (self.device in ("auto", "cpu", "cuda"), "device must be auto, cpu or cuda"),
            (0 < self.val_fraction < 1 and 0 < self.test_fraction < 1
             and self.val_fraction + self.test_fraction < 1,
             "val and test fractions must be in (0, 1) and sum to less than 1"),
            (self.dim > 0 and self.image_size >= 8, "dim must be > 0 and image size >= 8"),
            (self.epochs >= 1, "epochs must be >= 1"),
            (self.batch_size >= 2, "batch size must be >= 2"),
            (self.m_per_class is None or self.m_per_class >= 2,
             "m-per-class must be >= 2 (a class needs a positive pair in the batch)"),
            (self.m_per_class is None or self.batch_size % self.m_per_class == 0,
             "m-per-class must divide batch size"),
            (self.lr > 0 and self.weight_decay >= 0, "lr must be > 0, weight decay >= 0"),
            (self.warmup_epochs >= 0, "warmup epochs must be >= 0"),
            (self.time_budget_s is None or self.time_budget_s > 0, "time budget must be > 0"),
            (self.max_train_images is None or self.max_train_images >= 2,
             "max train images must be >= 2"),
            (self.max_eval_images is None or self.max_eval_images >= 4,
             "max eval images must be >= 4"),
            (self.num_workers >= 0, "num workers must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainConfigError(f"{message} (config: {self.short()})")

    def short(self) -> str:
        """A one-line summary for logs: loss, backbone, data, protocol, seed."""
        miner = f"/{self.loss.miner}" if self.loss.miner else ""
        return (
            f"{self.loss.name}{miner} {self.backbone}-d{self.dim}@{self.image_size}px "
            f"data={self.data} protocol={self.protocol} seed={self.seed}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (nested loss block)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are refused."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise TrainConfigError(f"unknown train config keys {sorted(unknown)}")
        data = dict(data)
        loss = data.pop("loss", {}) or {}
        if isinstance(loss, dict):
            loss_names = {f.name for f in dataclasses.fields(LossConfig)}
            if set(loss) - loss_names:
                raise TrainConfigError(f"unknown loss config keys {sorted(set(loss) - loss_names)}")
            loss = LossConfig(**loss)
        return cls(loss=loss, **data)


def default_image_size(data: str) -> int:
    """The input side when ``--image-size`` is not given: Fashion-MNIST's 28 px images are
    upsampled a little to 32 (cheap on a CPU); photos use the usual 224."""
    return 32 if data == FASHION_MNIST or data.startswith(FASHION_MNIST + ":") else 224


def base_config(config: TrainConfig | dict[str, Any]) -> dict[str, Any]:
    """The shared part of a config: everything but the loss block and the seed."""
    data = config.to_dict() if isinstance(config, TrainConfig) else dict(config)
    return {k: v for k, v in data.items() if k not in PER_RUN_FIELDS}


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two config dicts: ``{key: (a_value, b_value)}``."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
