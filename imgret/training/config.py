"""TrainConfig: every hyper-parameter of a training run, frozen, validated, saved inside model.pt.

The config is split the powerful-benchmarker way: a :class:`LossConfig` block (loss name,
miner, loss options) and everything else (the *base*: data, split, backbone, embedding size,
optimiser, learning rate, augmentation, batch composition, budget). A benchmark shares one
base between all losses and varies only the loss block and the seed, so an unfair comparison
cannot be written by accident (:func:`base_config` / :func:`config_diff`).

Both are pydantic dataclasses: the field constraints check every value when a config is built
(``dataclasses.replace`` included) and a bad one raises :class:`TrainConfigError`. A field's
description is the help of its ``imgret train`` / ``imgret benchmark`` option: the CLI builds
those options from these fields (``imgret/cli/train.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from imgret.config_rules import MAX_DIM, MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, raising
from imgret.datasets import DatasetError
from imgret.errors import ImgretError

FASHION_MNIST = "fashion-mnist"
# CJK characters rendered from Debian's fonts (imgret.training.data.glyphs).
GLYPHS = "glyphs"
# Fields that may differ between the runs of one benchmark.
PER_RUN_FIELDS = ("loss", "seed", "fold", "control")
# Fields saved only when they differ from these defaults, so a run made before they existed
# saves (and resumes with) the keys it always did.
OPTIONAL_FIELDS: dict[str, Any] = {"cv_folds": 0, "fold": None, "patience": None,
                                   "control": None, "recipe": "shared", "train_cap": "images"}
# How each loss is trained (imgret.training.recipe): "family" = its family's recipe from the
# loss's own paper and code (batches, embedding head, loss-parameter rate, scale, warm-up);
# "shared" = one recipe for every loss (m-per-class batches, a bare linear head, loss
# parameters at a multiple of the network's rate, the registry's fixed scales), which is what
# every run made before the recipes existed used; such a run's saved config has no "recipe"
# key, which is why "shared" is the value left unsaved.
RECIPES = ("family", "shared")
# The controls a benchmark can run beside the losses (under the same base config):
# shuffled_labels = training labels permuted (nothing to learn: must land near the untrained
# network); oracle = trained on the test classes themselves (a held-out share of their images
# is the test): the ceiling.
CONTROLS = ("shuffled_labels", "oracle")
# The loss block's fields that equal-budget tuning sets per loss (unset: the base's values).
TUNING_FIELDS = ("lr", "param_lr_mult", "miner_options")
# The losses `imgret benchmark` and `imgret tune` compare by default: ten of the Reality
# Check's families (pairs, triplets with FaceNet's semi-hard mining, proxies, classifiers,
# supervised contrastive); names of imgret.training.registry.LOSSES.
DEFAULT_LOSSES = ("contrastive", "triplet", "multi_similarity", "proxy_anchor", "proxy_nca",
                  "normalized_softmax", "cross_entropy", "cosface", "arcface", "supcon")
# (validation, test) shares when --val-fraction / --test-fraction are not given. Class-disjoint
# follows the Reality Check: half of the classes for test, 2 of the other 5 for validation
# (Fashion-MNIST's fixed split has these proportions); closed-set holds out a quarter of each
# class's images for each.
SPLIT_FRACTIONS = {"class-disjoint": (0.2, 0.5), "closed-set": (0.25, 0.25)}


class TrainConfigError(ImgretError, ValueError):
    """A training option that is out of range or inconsistent with the data."""


@dataclasses.dataclass(frozen=True)
class GlyphOptions:
    """The options of ``--data glyphs[:classes=N,per_class=N,seed=N]``.

    Attributes:
        classes: characters (one class each), evenly spaced over those every face covers.
        per_class: images per character: every face the same number of times, so a multiple
            of the number of faces (checked by the renderer, which knows the faces).
        seed: seeds the distortions (not the split, not the training).

    Raises:
        DatasetError: a value out of range (one line naming it).
    """

    classes: int = 1000
    per_class: int = 24
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low, high in (("classes", 2, None), ("per_class", 1, 4096),
                                ("seed", 0, 2**32 - 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (
                    high is not None and value > high):
                bound = f">= {low}" if high is None else f"in {low}..{high}"
                raise DatasetError(f"{GLYPHS}: {name} must be an integer {bound} (got {value!r})")

    def spec(self) -> str:
        """The ``--data`` text that gives these options."""
        return f"{GLYPHS}:classes={self.classes},per_class={self.per_class},seed={self.seed}"


def parse_glyphs(data: str) -> GlyphOptions | None:
    """The glyph options ``--data`` names, or ``None`` when it names another source.

    ``glyphs`` alone takes the defaults; ``glyphs:classes=2000,per_class=24`` overrides some.

    Raises:
        DatasetError: an unknown key, a repeated key, a value that is not an integer or is
            out of range.
    """
    if data != GLYPHS and not data.startswith(GLYPHS + ":"):
        return None
    keys = [f.name for f in dataclasses.fields(GlyphOptions)]
    values: dict[str, int] = {}
    for item in data[len(GLYPHS) + 1:].split(",") if data != GLYPHS else []:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in keys or key in values:
            problem = ("repeated" if key in values else "unknown") if sep else "expected KEY=VALUE"
            raise DatasetError(f"{data!r}: {problem}: {item!r}; write glyphs:KEY=VALUE,... "
                               f"with KEY among {', '.join(keys)}")
        try:
            values[key] = int(value)
        except ValueError:
            raise DatasetError(f"{GLYPHS}: {key} must be an integer (got {value!r})") from None
    return GlyphOptions(**values)


@raising(TrainConfigError)
@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class LossConfig:
    """The loss block: the only part a benchmark varies between losses.

    Equal-budget tuning (``imgret.training.tune``) gives each loss its own learning rate, proxy
    learning-rate multiplier and miner settings; they live here, in the loss block, so that the
    shared base config stays identical for every loss (and :func:`base_config` still proves it).

    Attributes:
        name: a key of ``imgret.training.registry.LOSSES``.
        miner: a key of ``imgret.training.registry.MINERS``; ``None`` = the loss's default.
        options: overrides of the loss's documented defaults (e.g. ``{"margin": 0.1}``).
        lr: the network's learning rate for this loss; ``None`` = the base ``lr``.
        param_lr_mult: learning rate of the loss's own parameters relative to the network's;
            ``None`` = the registry's.
        miner_options: overrides of the miner's defaults (e.g. ``{"epsilon": 0.05}``).
    """

    name: str = "multi_similarity"
    miner: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    lr: float | None = Field(None, gt=0)
    param_lr_mult: float | None = Field(None, gt=0)
    miner_options: dict[str, Any] = Field(default_factory=dict)


@raising(TrainConfigError)
@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TrainConfig:
    """One training run; each field's description is its command-line help.

    Beyond the help:
        data: ``fashion-mnist`` reads Debian's raw idx files; ``glyphs`` renders CJK
            characters from Debian's fonts (:func:`parse_glyphs` reads its options).
        split_seed: the same value gives the same split, whatever the training ``seed``.
        val_fraction, test_fraction: shares of classes (class-disjoint) or of each class's
            images (closed-set); together less than 1; ``None`` = the protocol's default
            (:attr:`split_fractions`).
        image_size: ``None`` = from a sample of the training images, resolved when the run
            starts and saved resolved (:func:`imgret.training.defaults.auto_image_size`);
            ``imgret train`` leaves it ``None`` unless ``--image-size`` is given, ``imgret
            benchmark`` and ``imgret tune`` default it by data set (:func:`default_image_size`).
        epochs: one epoch = as many samples as the training split holds.
        time_budget_s: the run stops after the step that exceeds it, validates, and tests.
        batch_size, m_per_class: MPerClassSampler batches of ``batch_size / m_per_class``
            classes x ``m_per_class`` images (``m_per_class`` divides ``batch_size``).
        lr, weight_decay, warmup_epochs: AdamW, linear warm-up then cosine decay to 0.
        augmentation: ``standard`` = random resized crop + flip (+ colour jitter for colour
            data); ``none`` = the images as they are (``imgret train``'s default: a crop or
            a flip can change what a character or a glyph is).
        device: ``cuda`` trains under bf16 autocast.
        cv_folds: ``k`` > 0 = the Reality Check's cross-validation: test = a seeded half of
            the classes, the other half cut into ``k`` class-disjoint folds; a run trains on
            ``k - 1`` folds and validates on fold ``fold`` (:mod:`imgret.training.data.splits`).
        fold: which fold validates (set per run by the benchmark and tuning; not an option).
        patience: early stopping on validation MAP@R; the best epoch's checkpoint is kept.
        recipe: :data:`RECIPES`; ``imgret.training.recipe`` says what each one sets.
        control: a control run of the benchmark (:data:`CONTROLS`), set per run; not an
            option.
        loss: the loss block.
    """

    data: str = Field(
        FASHION_MNIST, description="fashion-mnist[:FOLDER], glyphs[:classes=N,per_class=N,"
        "seed=N], an ImageFolder / Market-1501 folder, or a CSV manifest (path,label[,camera])")
    protocol: Literal["class-disjoint", "closed-set"] = Field(
        "class-disjoint", description="class-disjoint (train/val/test classes disjoint; "
        "Reality Check) or closed-set (same classes, held-out images; product search)")
    split_seed: int = Field(
        0, description="seeds the class shuffle / hold-out (not the training)")
    val_fraction: float | None = Field(
        None, gt=0, lt=1, description="share of classes (or images) for validation; default "
        "0.2 of the classes (class-disjoint) or 0.25 of each class's images (closed-set)")
    test_fraction: float | None = Field(
        None, gt=0, lt=1, description="share of classes (or images) for test; default 0.5 of "
        "the classes (class-disjoint) or 0.25 of each class's images (closed-set)")
    backbone: str = Field(
        "resnet18",
        description="tiny_cnn, small_cnn, resnet18, resnet50, efficientnet_b0, mobilenet_v2, "
        "convnext_tiny, vit_b_16")
    dim: int = Field(128, gt=0, le=MAX_DIM, description="embedding size")
    image_size: int | None = Field(
        224, ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE,
        description="input side in px; none: from the training images"
    )
    backbone_weights: str | None = Field(
        None, description="local torchvision state dict for the trunk, or imagenet: the "
        "ImageNet weights an installed package ships (mobilenet_v2; the pretrained extra); "
        "nothing is downloaded; default: random init")
    epochs: int = Field(10, ge=1)
    time_budget_s: float | None = Field(
        None, gt=0,
        description="training wall-clock budget in seconds (validation excluded)")
    max_train_images: int | None = Field(
        None, ge=2, description="cap on the training split's images (see train_cap)")
    train_cap: Literal["images", "classes"] = Field(
        "images", description="how max_train_images caps the training split: images = a "
        "seeded stratified subset of every class's images; classes = seeded whole classes "
        "with all their images (for losses with per-class parameters)")
    max_eval_images: int | None = Field(
        None, ge=4, description="seeded stratified subset of validation and test (each)")
    batch_size: int = Field(64, ge=2)
    m_per_class: int | None = Field(
        None, ge=2,  # a class needs a positive pair in the batch
        description="images per class in a batch (default: smallest divisor of the batch "
        "size >= 4 that the classes allow)")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the network")
    weight_decay: float = Field(1e-4, ge=0)
    warmup_epochs: float = Field(0.5, ge=0, description="linear warm-up, then cosine")
    augmentation: Literal["standard", "none"] = Field(
        "standard", description="standard or none")
    seed: int = Field(0, description="init, sampling, augmentation")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto, cpu or cuda")
    num_workers: int = Field(0, ge=0, description="DataLoader workers")
    cv_folds: int = Field(
        0, ge=0, description="class-disjoint cross-validation folds of the non-test half of "
        "the classes (0 = one validation split; 4 = the Reality Check)")
    patience: int | None = Field(
        None, ge=1, description="stop after this many epochs without a better validation "
        "MAP@R (default: train every epoch)")
    fold: int | None = Field(
        None, ge=0, description="the fold a cross-validated run validates on (set per run)")
    recipe: Literal["family", "shared"] = Field(
        "family", description="family (each loss trained the way its paper and code do: "
        "batches, embedding head, loss-parameter rate, scale) or shared (one recipe for "
        "every loss: m-per-class batches, a linear head, the registry's scales)")
    control: Literal["shuffled_labels", "oracle"] | None = Field(
        None, description="a control run of the benchmark (set per run): shuffled_labels or "
        "oracle")
    loss: LossConfig = Field(default_factory=LossConfig)

    @field_validator("data")
    @classmethod
    def _known_glyph_options(cls, value: str) -> str:
        parse_glyphs(value)  # refused now, before torch and the fonts load
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if sum(self.split_fractions) >= 1:
            raise ValueError("val_fraction + test_fraction must be less than 1")
        if self.m_per_class is not None and self.batch_size % self.m_per_class:
            raise ValueError("m_per_class must divide batch_size")
        if self.cv_folds == 1:
            raise ValueError("cv_folds must be 0 (one validation split) or at least 2")
        if self.cv_folds and self.protocol != "class-disjoint":
            raise ValueError("cv_folds needs the class-disjoint protocol")
        if self.cv_folds and self.val_fraction is not None:
            raise ValueError("with cv_folds the validation classes are one fold; drop "
                             "val_fraction")
        if self.fold is not None and not self.fold < self.cv_folds:
            raise ValueError(f"fold {self.fold} needs cv_folds > {self.fold}")
        return self

    @property
    def split_fractions(self) -> tuple[float, float]:
        """``(val, test)`` shares: the options, else the protocol's :data:`SPLIT_FRACTIONS`."""
        val, test = SPLIT_FRACTIONS[self.protocol]
        return (val if self.val_fraction is None else self.val_fraction,
                test if self.test_fraction is None else self.test_fraction)

    @property
    def network_lr(self) -> float:
        """The network's learning rate: the loss block's (tuned) one, else the base ``lr``."""
        return self.loss.lr if self.loss.lr is not None else self.lr

    def short(self) -> str:
        """A one-line summary for logs: loss, backbone, data, protocol, seed."""
        miner = f"/{self.loss.miner}" if self.loss.miner else ""
        fold = f" fold={self.fold}/{self.cv_folds}" if self.fold is not None else ""
        control = f" control={self.control}" if self.control else ""
        return (
            f"{self.loss.name}{miner} {self.backbone}-d{self.dim}@{self.image_size}px "
            f"data={self.data} protocol={self.protocol} seed={self.seed}{fold}{control}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (nested loss block), in field order. The loss block's tuning
        fields are saved only when set, so an untuned run saves the keys it always did (and a
        run saved before tuning existed still resumes); so are :data:`OPTIONAL_FIELDS`."""
        data = dataclasses.asdict(self)
        for key, default in OPTIONAL_FIELDS.items():
            if data[key] == default:
                del data[key]
        data["loss"] = {k: v for k, v in data["loss"].items()
                        if k not in TUNING_FIELDS or v not in (None, {})}
        return data


def default_image_size(data: str) -> int:
    """The input side when ``--image-size`` is not given: Fashion-MNIST's 28 px images are
    upsampled a little to 32 (cheap on a CPU), the glyphs are rendered at 32; photos use the
    usual 224."""
    small = (FASHION_MNIST, GLYPHS)
    return 32 if data in small or data.startswith(tuple(name + ":" for name in small)) else 224


def base_config(config: TrainConfig | dict[str, Any]) -> dict[str, Any]:
    """The shared part of a config: everything but the loss block and the seed."""
    data = config.to_dict() if isinstance(config, TrainConfig) else dict(config)
    return {k: v for k, v in data.items() if k not in PER_RUN_FIELDS}


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two config dicts: ``{key: (a_value, b_value)}``."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
