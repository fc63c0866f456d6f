"""The split: Fashion-MNIST in halves (5 test classes), folders in the same proportions."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.datasets import FASHION_MNIST_CLASSES
from imgret.training.config import TrainConfig
from imgret.training.data import make_split
from tests.unit.training.test_data import _classes, _fake_fashion, _Labels

SPLITS = ("train", "val", "test")


def test_fashion_mnist_is_split_in_halves_5_and_5() -> None:
    source = _fake_fashion()
    split = make_split(source, TrainConfig(data="fashion-mnist"))
    train, val, test = (_classes(split, source, s) for s in SPLITS)
    assert test == {"Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"}
    assert train | val == set(FASHION_MNIST_CLASSES[:5])
    assert (len(train), len(val)) == (3, 2)
    assert not (train & val) and not (train & test) and not (val & test)
    members = np.concatenate([split.indices[s] for s in SPLITS])
    assert sorted(members.tolist()) == list(range(len(source.labels)))  # official files pooled


def test_fashion_mnist_split_is_fixed() -> None:
    source = _fake_fashion()
    a = make_split(source, TrainConfig(data="fashion-mnist"))
    b = make_split(source, TrainConfig(data="fashion-mnist", split_seed=9, seed=4))
    for name in SPLITS:
        np.testing.assert_array_equal(a.indices[name], b.indices[name])
    assert a.summary(source)["digest"] == b.summary(source)["digest"]


@pytest.mark.parametrize(("classes", "expected"), [(10, (3, 2, 5)), (20, (6, 4, 10)),
                                                   (7, (2, 2, 3)), (6, (2, 2, 2))])
def test_folders_shuffle_classes_in_the_same_proportions(
    classes: int, expected: tuple[int, int, int]
) -> None:
    source = _Labels({f"c{i:02d}": 4 for i in range(classes)})
    split = make_split(source, TrainConfig(data="x", split_seed=3))
    sizes = tuple(len(_classes(split, source, s)) for s in SPLITS)
    assert sizes == expected  # few classes: the test share gives way so training keeps 2
    other = make_split(source, TrainConfig(data="x", split_seed=4))
    assert any(_classes(other, source, s) != _classes(split, source, s) for s in SPLITS)


def test_explicit_fractions_and_closed_set_defaults_are_kept() -> None:
    source = _Labels({f"c{i:02d}": 8 for i in range(12)})
    split = make_split(source, TrainConfig(data="x", val_fraction=0.25, test_fraction=0.25))
    assert [len(_classes(split, source, s)) for s in SPLITS] == [6, 3, 3]
    closed = TrainConfig(data="x", protocol="closed-set")
    assert closed.split_fractions == (0.25, 0.25)  # the demo's split does not move
    assert TrainConfig(data="x").split_fractions == (0.2, 0.5)
