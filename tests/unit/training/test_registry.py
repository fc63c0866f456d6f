"""The loss / miner registry: every entry builds and trains one step; bad names are refused."""

from __future__ import annotations

import pytest
import torch

from imgret.errors import UnknownName
from imgret.training.config import TrainConfigError
from imgret.training.registry import LOSSES, MINERS, NO_MINER, build_loss, resolve_miner

BATCH, DIM, CLASSES = 16, 8, 4


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(BATCH, DIM, generator=generator, requires_grad=True)
    labels = torch.arange(CLASSES).repeat_interleave(BATCH // CLASSES)  # 4 classes x 4 images
    return embeddings, labels


def _step(name: str, miner: str | None = None) -> None:
    bundle = build_loss(name, num_classes=CLASSES, embedding_size=DIM, miner=miner)
    embeddings, labels = _batch()
    normalized = torch.nn.functional.normalize(embeddings, dim=1)
    loss = bundle(normalized, labels)
    assert loss.ndim == 0 and torch.isfinite(loss), f"{name}: loss {loss}"
    loss.backward()
    assert embeddings.grad is not None and torch.isfinite(embeddings.grad).all()
    params = list(bundle.loss.parameters())
    assert bool(params) == LOSSES[name].has_params
    if params:
        # The loss's own parameters get gradients too (they have their own optimiser).
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_builds_and_steps(name: str) -> None:
    _step(name)


@pytest.mark.parametrize("miner", sorted(MINERS))
def test_triplet_with_every_miner(miner: str) -> None:
    _step("triplet", miner)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_documents_its_defaults(name: str) -> None:
    spec = LOSSES[name]
    assert spec.source and spec.reason
    assert spec.default_miner in MINERS
    assert spec.needs_classes == spec.has_params  # proxies / class weights need the classes


def test_triplet_defaults_to_semihard_like_facenet() -> None:
    bundle = build_loss("triplet", num_classes=CLASSES, embedding_size=DIM)
    assert bundle.miner_name == "semihard"
    assert bundle.miner.type_of_triplets == "semihard"
    assert bundle.options == {"margin": 0.2}


def test_unknown_loss_lists_the_valid_ones() -> None:
    with pytest.raises(UnknownName) as info:
        build_loss("tripplet", num_classes=CLASSES, embedding_size=DIM)
    message = str(info.value)
    assert "tripplet" in message
    for name in LOSSES:
        assert name in message


def test_unknown_miner_lists_the_valid_ones() -> None:
    with pytest.raises(UnknownName) as info:
        build_loss("triplet", num_classes=CLASSES, embedding_size=DIM, miner="hardest")
    for name in MINERS:
        assert name in str(info.value)


def test_miner_refused_for_a_loss_that_mines_nothing() -> None:
    with pytest.raises(UnknownName, match="valid: none"):
        resolve_miner("arcface", "hard")
    assert resolve_miner("arcface", NO_MINER) == NO_MINER


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(UnknownName, match="valid: alpha, margin"):
        build_loss("proxy_anchor", num_classes=CLASSES, embedding_size=DIM,
                   options={"temperature": 0.1})


def test_option_override_is_cast_and_used() -> None:
    bundle = build_loss("triplet", num_classes=CLASSES, embedding_size=DIM,
                        options={"margin": "0.1"})
    assert bundle.loss.margin == pytest.approx(0.1)
    with pytest.raises(TrainConfigError, match="expects a float"):
        build_loss("triplet", num_classes=CLASSES, embedding_size=DIM, options={"margin": "x"})
