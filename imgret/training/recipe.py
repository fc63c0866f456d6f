"""How each loss is trained: the recipe of its family, from the loss's own paper and code.

``TrainConfig.recipe`` picks one of two:

- ``family`` (the default): what the loss's authors do, by family
  (``imgret.training.registry.LossSpec.family``; docs/training.md cites each choice):

  ============  =============  ==============  ==========================  ================
  family        batches        embedding head  loss-parameter rate         scale
  ============  =============  ==============  ==========================  ================
  pair          m per class    linear          (no parameters)             -
  proxy         random         linear + BN     absolute, ``param_lr``      the paper's
  classifier    random         linear + BN     absolute, ``param_lr``      by class count
  ============  =============  ==============  ==========================  ================

  Pair losses need positives in the batch, hence m images per class (PK sampling: FaceNet,
  Hermans et al. 2017, the Reality Check's trainer). Proxy and classifier losses compare each
  image with every class's proxy / weight, so any batch has its negatives: Proxy Anchor's code
  and the face-recognition classifiers draw plain shuffled batches. Their heads get a
  BatchNorm1d before the L2 normalisation (BNNeck, Luo et al. 2019; ArcFace's BN-FC-BN
  output, Deng et al. 2019): a linear map of non-negative pooled features puts every
  embedding in one cone, which these losses pull into a collapse; batch statistics centre
  each dimension. Their parameters have their own AdamW at an absolute rate (the Reality
  Check's ``metric_loss_optimizer``; Proxy Anchor's 1e-4 x 100 = 1e-2), not a multiple of the
  trunk's, which would make proxies random-walk under a fast trunk rate and class weights
  barely move under a slow one. ArcFace and CosFace use AdaCos's fixed scale for the number
  of classes (Zhang et al. 2019), ``cross_entropy`` becomes NormFace (Wang et al. 2017), each
  unless the loss block sets ``scale``. Proxy Anchor's code trains only the head and the
  proxies for its first epoch (``--warm 1``).
- ``shared``: one recipe for every loss, what runs made before the recipes used: m-per-class
  batches, a bare linear head, loss parameters at ``param_lr_mult`` x the trunk's rate, the
  registry's fixed scales, no warm-up.

An explicit ``param_lr_mult`` in the loss block (set by tuning, or by hand) means
``param_lr_mult`` x the trunk's rate under either recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from imgret.training.config import TrainConfig
from imgret.training.registry import LossSpec, loss_spec

RANDOM, M_PER_CLASS = "random", "m_per_class"
BN_NECK, NO_NECK = "bn", "none"
# Kim et al. 2020's code, `--warm 1` in every dataset's command: the first epoch trains the
# embedding layer and the proxies with the trunk frozen.
HEAD_WARMUP_EPOCHS = {"proxy_anchor": 1}
# NormFace's bound is taken for a reachable softmax probability of 0.9 on the right class.
NORMFACE_PROBABILITY = 0.9


@dataclass(frozen=True)
class Recipe:
    """How one run of one loss trains.

    Attributes:
        name: ``family`` or ``shared`` (``TrainConfig.recipe``).
        family: the loss's family (``pair``, ``proxy``, ``classifier``).
        sampler: ``m_per_class`` or ``random`` batches.
        neck: ``bn`` (BatchNorm1d between the linear head and the L2 normalisation) or
            ``none``; saved in the model spec, so a checkpoint rebuilds it.
        head_warmup_epochs: first epochs in which only the head (and the loss's
            parameters) learn; the trunk's gradients are dropped.
    """

    name: str
    family: str
    sampler: str
    neck: str
    head_warmup_epochs: int


def recipe_for(config: TrainConfig) -> Recipe:
    """The recipe of ``config``'s loss under ``config.recipe``."""
    spec = loss_spec(config.loss.name)
    if config.recipe == "shared":
        return Recipe("shared", spec.family, M_PER_CLASS, NO_NECK, 0)
    pairs = spec.family == "pair"
    return Recipe("family", spec.family, M_PER_CLASS if pairs else RANDOM,
                  NO_NECK if pairs else BN_NECK, HEAD_WARMUP_EPOCHS.get(config.loss.name, 0))


def loss_param_lr(config: TrainConfig, spec: LossSpec | None = None) -> float:
    """The learning rate of the loss's own parameters (proxies, class weights).

    An explicit ``param_lr_mult`` in the loss block: that multiple of the network's rate.
    Otherwise the family recipe's absolute ``LossSpec.param_lr``, or under the shared recipe
    the registry's ``param_lr_mult`` x the network's rate.
    """
    spec = spec or loss_spec(config.loss.name)
    if config.loss.param_lr_mult is not None:
        return config.network_lr * config.loss.param_lr_mult
    if config.recipe == "family" and spec.param_lr is not None:
        return spec.param_lr
    return config.network_lr * spec.param_lr_mult


def adacos_scale(num_classes: int) -> float:
    """AdaCos's fixed scale (Zhang et al. 2019, eq. 13): sqrt(2) ln(C - 1), floored by
    :func:`normface_scale` because the formula tends to 0 as C falls to 2 (it assumes many
    classes: the non-target cosines near 0 sum to about C - 1)."""
    adacos = math.sqrt(2) * math.log(max(num_classes - 1, 1))
    return max(adacos, normface_scale(num_classes))


def normface_scale(num_classes: int, probability: float = NORMFACE_PROBABILITY) -> float:
    """NormFace's lower bound on the scale (Wang et al. 2017, Proposition 2): with C classes
    and normalised features and weights, the softmax can reach ``probability`` on the right
    class only if s >= (C - 1) / C x ln((C - 1) p / (1 - p))."""
    c = max(num_classes, 2)
    return (c - 1) / c * math.log((c - 1) * probability / (1 - probability))


# The loss options the family recipe derives from the number of training classes, and how.
CLASS_COUNT_OPTIONS: dict[str, dict[str, Callable[[int], float]]] = {
    "arcface": {"scale": adacos_scale},
    "cosface": {"scale": adacos_scale},
    "cross_entropy": {"scale": normface_scale},
}


def class_count_options(config: TrainConfig, num_classes: int) -> dict[str, Any]:
    """Loss options the family recipe sets from the number of training classes (the loss
    block's own options win): ``scale`` of ArcFace / CosFace (AdaCos) and of
    ``cross_entropy`` (NormFace). Empty under the shared recipe."""
    if config.recipe != "family":
        return {}
    derived: Mapping[str, Callable[[int], float]] = CLASS_COUNT_OPTIONS.get(
        config.loss.name, {})
    return {**{key: rule(num_classes) for key, rule in derived.items()},
            **config.loss.options}
