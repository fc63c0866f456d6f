"""Loss and miner registry: CLI name -> a pytorch-metric-learning object with documented defaults.

Every entry records where its default hyper-parameters come from (the paper, or PML's own
default when the paper has none that fits unit-norm embeddings) and why it is in the list. The
names are the values of ``imgret train --loss/--miner`` and ``imgret benchmark --losses``.

Losses that own parameters (proxies, class weights) need an optimiser of their own; their
``LossSpec.has_params`` says so and ``param_lr_mult`` gives their learning rate relative to the
trunk's (proxies must move much faster than a network's weights, Kim et al. 2020).

Each loss also declares, beside its defaults, the ``space`` that equal-budget tuning
(``imgret.training.tune``) searches: the learning rate for every loss, and its margins, scales,
temperatures, proxy learning-rate multiplier and miner settings as it has them. The ranges
bracket the documented defaults by the spread the papers and Musgrave et al. 2020 searched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses, miners
from torch import nn

from imgret.errors import UnknownName
from imgret.training.config import TrainConfigError

NO_MINER = "none"


class SoftmaxClassifierLoss(nn.Module):
    """A softmax classifier on the embedding, trained with cross-entropy.

    The baseline every metric-learning loss should beat (Musgrave et al. 2020 found well-tuned
    classification losses hard to beat). Same call signature as PML losses.

    With ``scale`` 0 it is a plain linear layer (weights and bias) on the embedding. The
    embeddings are unit vectors, so its logits are bounded by the weights' norms, which start
    small: the softmax starts near uniform and its loss near ln C. With ``scale`` > 0 it is
    NormFace (Wang et al. 2017): the weight rows are normalised too, there is no bias, and the
    logits are ``scale`` x the cosines, so how peaked the softmax can get is set by the scale
    and not left to the weights' norm.

    Args:
        num_classes: number of training classes (labels are ``0..num_classes-1``).
        embedding_size: the embedding dimension ``d``.
        label_smoothing: cross-entropy label smoothing (0 = plain cross-entropy).
        scale: 0 = the plain linear classifier; > 0 = NormFace's cosine classifier at this
            scale.
    """

    def __init__(self, num_classes: int, embedding_size: int, label_smoothing: float = 0.0,
                 scale: float = 0.0):
        super().__init__()
        self.scale = float(scale)
        self.classifier = nn.Linear(embedding_size, num_classes, bias=self.scale == 0)
        self.label_smoothing = float(label_smoothing)

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: Any = None
    ) -> torch.Tensor:
        """Mean cross-entropy of ``(n, d)`` embeddings against ``(n,)`` int64 labels."""
        if self.scale > 0:
            cosines = F.normalize(embeddings.float(), dim=1) @ F.normalize(
                self.classifier.weight, dim=1).T
            logits = self.scale * cosines
        else:
            logits = self.classifier(embeddings.float())
        return F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)


# Search-space keys: "lr" (the network), "param_lr_mult" (the loss's own parameters),
# "miner.<option>" (the miner), anything else = an option of the loss.
LR, PARAM_LR_MULT, MINER_PREFIX = "lr", "param_lr_mult", "miner."


@dataclass(frozen=True)
class Param:
    """One tuned hyper-parameter: a float in ``[low, high]``, sampled on a log scale if ``log``.

    ``also`` names further search-space keys that take the same value (the semi-hard miner's
    margin follows the triplet loss's margin, as in FaceNet).
    """

    low: float
    high: float
    log: bool = False
    also: tuple[str, ...] = ()


# Every loss tunes the network's learning rate over the same range (default 1e-3 in the middle).
LR_RANGE = Param(1e-4, 1e-2, log=True)
# Loss parameters (proxies, class weights) move at 1-1000x the network's rate (default 1 or 100).
PARAM_LR_RANGE = Param(1.0, 1000.0, log=True)


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """How to build one loss.

    Attributes:
        family: ``pair`` (losses over the batch's pairs / triplets), ``proxy`` (a learned
            proxy per class) or ``classifier`` (a softmax over class weights): what the
            family recipe (``imgret.training.recipe``) keys on.
        factory: ``factory(num_classes=..., embedding_size=..., **options) -> nn.Module``; the
            module is called as ``loss(embeddings (n, d), labels (n,), indices_tuple)``.
        needs_classes: the factory needs the number of training classes (proxies/classifier).
        has_params: the loss owns trainable parameters -> its own optimiser.
        default_miner: a key of :data:`MINERS` used when ``--miner`` is not given.
        accepts_miner: tuple-based losses take mined pairs/triplets; proxy and classifier
            losses do not (a miner there would be silently meaningless, so it is refused).
        defaults: the documented default hyper-parameters (the only options accepted).
        param_lr_mult: learning rate of the loss's own parameters relative to the trunk's
            (the shared recipe).
        param_lr: the absolute learning rate of the loss's own parameters (the family
            recipe).
        source: where the defaults come from.
        reason: one line on why this loss is in the comparison.
        space: what tuning searches: ``{key: Param}`` (keys: see :data:`LR`); always the
            learning rate, the loss-parameter rate for losses that own parameters.
    """

    family: str
    factory: Callable[..., nn.Module]
    needs_classes: bool
    has_params: bool
    default_miner: str
    accepts_miner: bool
    defaults: Mapping[str, Any]
    param_lr_mult: float
    source: str
    reason: str
    space: Mapping[str, Param]
    param_lr: float | None = None


@dataclass(frozen=True, kw_only=True)
class MinerSpec:
    """How to build one miner: ``factory(**defaults)`` (``None`` factory = no mining)."""

    factory: Callable[..., nn.Module] | None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    reason: str


def _pml(cls: type, *, with_classes: bool) -> Callable[..., nn.Module]:
    def build(*, num_classes: int, embedding_size: int, **options: Any) -> nn.Module:
        if with_classes:
            return cls(num_classes=num_classes, embedding_size=embedding_size, **options)
        return cls(**options)

    build.__name__ = f"build_{cls.__name__}"
    return build


def _softmax(*, num_classes: int, embedding_size: int, **options: Any) -> nn.Module:
    return SoftmaxClassifierLoss(num_classes, embedding_size, **options)


def _tuple_loss(
    cls: type, *, defaults: Mapping[str, Any], source: str, reason: str,
    space: Mapping[str, Param], default_miner: str = NO_MINER,
) -> LossSpec:
    """A PML loss over pairs / triplets of the batch: it takes a miner and owns no parameters.
    Tuning searches ``space`` and the learning rate."""
    return LossSpec(
        family="pair", factory=_pml(cls, with_classes=False), needs_classes=False,
        has_params=False,
        default_miner=default_miner, accepts_miner=True, defaults=defaults, param_lr_mult=1.0,
        source=source, reason=reason, space={LR: LR_RANGE, **space},
    )


# The family recipe's absolute rate for proxies and class weights: Proxy Anchor's own code
# trains its proxies at lr 1e-4 x lr_mult 100 = 1e-2 (AdamW), whatever the trunk does.
CLASS_PARAM_LR = 1e-2


def _class_loss(
    factory: Callable[..., nn.Module], *, family: str, defaults: Mapping[str, Any],
    source: str, reason: str, space: Mapping[str, Param], param_lr_mult: float = 1.0,
) -> LossSpec:
    """A proxy or classifier loss: a trainable weight vector per class, nothing to mine.
    Tuning searches ``space``, the learning rate and the class weights' rate multiplier."""
    return LossSpec(
        family=family, factory=factory, needs_classes=True, has_params=True,
        default_miner=NO_MINER, accepts_miner=False, defaults=defaults,
        param_lr_mult=param_lr_mult, source=source, reason=reason,
        space={LR: LR_RANGE, PARAM_LR_MULT: PARAM_LR_RANGE, **space}, param_lr=CLASS_PARAM_LR,
    )


LOSSES: dict[str, LossSpec] = {
    "contrastive": _tuple_loss(
        losses.ContrastiveLoss, defaults={"pos_margin": 0.0, "neg_margin": 1.0},
        source="PML defaults (Hadsell et al. 2006 margin loss on L2 distance of unit vectors)",
        reason="the oldest pair loss; Musgrave et al. 2020 found it competitive when tuned",
        space={"pos_margin": Param(0.0, 0.5), "neg_margin": Param(0.5, 1.5)},
    ),
    "triplet": _tuple_loss(
        losses.TripletMarginLoss, default_miner="semihard", defaults={"margin": 0.2},
        source="FaceNet (Schroff et al. 2015): margin 0.2 with semi-hard negative mining",
        reason="the classic triplet baseline, with FaceNet's own mining",
        space={"margin": Param(0.01, 0.5, log=True, also=(MINER_PREFIX + "margin",))},
    ),
    "multi_similarity": _tuple_loss(
        losses.MultiSimilarityLoss, default_miner="multi_similarity",
        defaults={"alpha": 2.0, "beta": 50.0, "base": 0.5},
        source="Wang et al. 2019: alpha 2, beta 50, miner eps 0.1; base 0.5 = PML default "
        "(paper: 1)",
        reason="a strong pair loss in the Reality Check; weights pairs by their relative "
        "similarity",
        space={"alpha": Param(0.5, 10.0, log=True), "beta": Param(10.0, 100.0, log=True),
               "base": Param(0.0, 1.0), MINER_PREFIX + "epsilon": Param(0.01, 0.5, log=True)},
    ),
    "proxy_anchor": _class_loss(
        _pml(losses.ProxyAnchorLoss, with_classes=True), family="proxy", param_lr_mult=100.0,
        defaults={"margin": 0.1, "alpha": 32.0},
        source="Kim et al. 2020: margin 0.1, alpha 32, proxies at 100x the trunk learning rate",
        reason="fast-converging proxy loss; one proxy per class instead of mined pairs",
        # alpha down to 1: tuned from scratch the winner sat at the old lower edge (4).
        space={"margin": Param(0.0, 0.5), "alpha": Param(1.0, 64.0, log=True)},
    ),
    "proxy_nca": _class_loss(
        _pml(losses.ProxyNCALoss, with_classes=True), family="proxy", param_lr_mult=100.0,
        defaults={"softmax_scale": 9.0},
        source="ProxyNCA++ (Teh et al. 2020): temperature 1/9 (scale 9), fast-moving proxies",
        reason="the first proxy loss (Movshovitz-Attias et al. 2017)",
        space={"softmax_scale": Param(1.0, 64.0, log=True)},
    ),
    "normalized_softmax": _class_loss(
        _pml(losses.NormalizedSoftmaxLoss, with_classes=True), family="classifier",
        defaults={"temperature": 0.05},
        source="Zhai & Wu 2019: temperature 0.05 (= PML default)",
        reason="cosine softmax classifier; 'classification is a strong baseline' for retrieval",
        space={"temperature": Param(0.01, 0.5, log=True)},
    ),
    "cross_entropy": _class_loss(
        _softmax, family="classifier", defaults={"label_smoothing": 0.0, "scale": 0.0},
        source="softmax cross-entropy over the embedding: a linear classifier (scale 0, the "
        "shared recipe) or NormFace's cosine classifier (Wang et al. 2017) at a scale set by "
        "the number of classes (the family recipe)",
        reason="the baseline: what a classification network gives without metric learning",
        space={"label_smoothing": Param(0.0, 0.3)},
    ),
    "cosface": _class_loss(
        _pml(losses.CosFaceLoss, with_classes=True), family="classifier",
        defaults={"margin": 0.35, "scale": 64.0},
        source="Wang et al. 2018 (CosFace): additive cosine margin 0.35, scale 64",
        reason="large-margin cosine classifier from face recognition",
        # margins up to 0.8: the winner sat at the old upper edge (0.5).
        space={"margin": Param(0.05, 0.8), "scale": Param(8.0, 64.0, log=True)},
    ),
    "arcface": _class_loss(
        _pml(losses.ArcFaceLoss, with_classes=True), family="classifier",
        defaults={"margin": math.degrees(0.5), "scale": 64.0},
        source="Deng et al. 2019 (ArcFace): additive angular margin 0.5 rad (28.6 deg), scale 64",
        reason="the standard face / re-ID classifier loss",
        # degrees; up to 60: the winner sat at the old upper edge (40).
        space={"margin": Param(5.0, 60.0), "scale": Param(8.0, 64.0, log=True)},
    ),
    "ntxent": _tuple_loss(
        losses.NTXentLoss, defaults={"temperature": 0.07},
        source="PML default temperature 0.07 (MoCo / InfoNCE); positives = same-label pairs",
        reason="InfoNCE / SimCLR loss used with labels: the contrastive-learning family",
        space={"temperature": Param(0.01, 0.5, log=True)},
    ),
    "supcon": _tuple_loss(
        losses.SupConLoss, defaults={"temperature": 0.1},
        source="Khosla et al. 2020 (SupCon): temperature 0.1 (= PML default)",
        reason="supervised contrastive learning, many positives per anchor",
        space={"temperature": Param(0.01, 0.5, log=True)},
    ),
    "circle": _tuple_loss(
        losses.CircleLoss, defaults={"m": 0.4, "gamma": 80.0},
        source="Sun et al. 2020 (Circle loss): m 0.4, gamma 80 (= PML defaults)",
        reason="unified pair-similarity loss with self-paced weighting",
        space={"m": Param(0.0, 0.5), "gamma": Param(10.0, 256.0, log=True)},
    ),
}

MINERS: dict[str, MinerSpec] = {
    NO_MINER: MinerSpec(factory=None, reason="every pair / triplet in the batch"),
    "semihard": MinerSpec(
        factory=miners.TripletMarginMiner, defaults={"margin": 0.2, "type_of_triplets": "semihard"},
        reason="FaceNet: negatives farther than the positive but inside the margin",
    ),
    "hard": MinerSpec(
        factory=miners.TripletMarginMiner, defaults={"margin": 0.2, "type_of_triplets": "hard"},
        reason="negatives closer than the positive (can collapse early in training)",
    ),
    "all": MinerSpec(
        factory=miners.TripletMarginMiner, defaults={"margin": 0.2, "type_of_triplets": "all"},
        reason="every triplet that violates the margin",
    ),
    "multi_similarity": MinerSpec(
        factory=miners.MultiSimilarityMiner, defaults={"epsilon": 0.1},
        reason="Wang et al. 2019: pairs that are informative relative to the hardest of the "
        "other kind",
    ),
    "batch_hard": MinerSpec(
        factory=miners.BatchHardMiner,
        reason="Hermans et al. 2017: hardest positive + hardest negative",
    ),
}


@dataclass
class LossBundle:
    """A built loss: the module, its miner (or ``None``), and the optimiser rule.

    ``loss(embeddings (n, d) float32, labels (n,) int64, indices_tuple) -> scalar``.
    """

    name: str
    loss: nn.Module
    miner: nn.Module | None
    miner_name: str
    options: dict[str, Any]
    has_params: bool
    param_lr_mult: float

    def __call__(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        indices = self.miner(embeddings, labels) if self.miner is not None else None
        return self.loss(embeddings, labels, indices)


def loss_spec(name: str) -> LossSpec:
    """The registry entry of a loss; unknown names raise :class:`UnknownName`."""
    if name not in LOSSES:
        raise UnknownName("loss", name, list(LOSSES))
    return LOSSES[name]


def resolve_miner(loss: str, miner: str | None) -> str:
    """The miner a loss runs with: ``miner`` if given (and valid for it), else its default.

    Raises:
        UnknownName: an unknown miner, or any miner but ``none`` for a loss that takes none.
    """
    spec = loss_spec(loss)
    if miner is None:
        return spec.default_miner
    if miner not in MINERS:
        raise UnknownName("miner", miner, list(MINERS))
    if not spec.accepts_miner and miner != NO_MINER:
        raise UnknownName(f"miner for loss {loss!r} (it mines nothing)", miner, [NO_MINER])
    return miner


def resolve_options(loss: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The loss's defaults updated with ``options``; an unknown option raises UnknownName.

    Values are cast to the default's type (the CLI gives strings).
    """
    return _overlay(loss_spec(loss).defaults, options, f"loss {loss!r}")


def resolve_miner_options(miner: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The miner's defaults updated with ``options`` (cast to the defaults' types).

    Raises:
        UnknownName: an option the miner does not have.
    """
    return _overlay(MINERS[miner].defaults, options, f"miner {miner!r}")


def _overlay(
    defaults: Mapping[str, Any], overrides: Mapping[str, Any] | None, owner: str
) -> dict[str, Any]:
    resolved = dict(defaults)
    for key, value in (overrides or {}).items():
        if key not in defaults:
            raise UnknownName(f"option of {owner}", key, list(defaults))
        default = defaults[key]
        try:
            resolved[key] = type(default)(value)
        except (TypeError, ValueError):
            raise TrainConfigError(
                f"option {key!r} of {owner} expects a {type(default).__name__}, got {value!r}"
            ) from None
    return resolved


def build_loss(
    name: str,
    *,
    num_classes: int,
    embedding_size: int,
    miner: str | None = None,
    options: Mapping[str, Any] | None = None,
    miner_options: Mapping[str, Any] | None = None,
    param_lr_mult: float | None = None,
) -> LossBundle:
    """Build a registry loss (and its miner) for ``num_classes`` training classes.

    Args:
        name: a key of :data:`LOSSES`.
        num_classes: training classes; labels must be ``0..num_classes-1``.
        embedding_size: the embedding dimension ``d``.
        miner: a key of :data:`MINERS`; ``None`` = the loss's default.
        options: overrides of the loss's documented defaults.
        miner_options: overrides of the miner's defaults.
        param_lr_mult: the loss parameters' learning-rate multiplier; ``None`` = the
            registry's.

    Raises:
        UnknownName: unknown loss, miner or option (the message lists the valid ones).
    """
    spec = loss_spec(name)
    miner_name = resolve_miner(name, miner)
    resolved = resolve_options(name, options)
    module = spec.factory(num_classes=num_classes, embedding_size=embedding_size, **resolved)
    miner_spec = MINERS[miner_name]
    miner_settings = resolve_miner_options(miner_name, miner_options)
    miner_module = None if miner_spec.factory is None else miner_spec.factory(**miner_settings)
    return LossBundle(
        name, module, miner_module, miner_name, resolved, spec.has_params,
        spec.param_lr_mult if param_lr_mult is None else param_lr_mult,
    )


def describe_registry() -> str:
    """A plain-text table of the losses and miners (for ``--help`` and the docs)."""
    lines = ["losses:"]
    for name, spec in LOSSES.items():
        opts = ", ".join(f"{k}={v:g}" for k, v in spec.defaults.items())
        lines.append(f"  {name:<19} miner={spec.default_miner:<16} {opts}  ({spec.source})")
    lines.append("miners: " + ", ".join(MINERS))
    return "\n".join(lines)
