"""Splits (class-disjoint really disjoint and seeded; closed-set), data checks, sampler."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from imgret.datasets import FASHION_MNIST_CLASSES, DatasetError
from imgret.training.config import TrainConfig, TrainConfigError
from imgret.training.data import (
    MPerClassSampler,
    TrainDataset,
    make_split,
    open_source,
    plan_batches,
    train_transform,
)
from imgret.training.data import model_spec_for as spec_for
from imgret.training.data.sources import ArrayImageSource
from imgret.training.data.splits import FASHION_SPLIT


class _Labels:
    """A source with labels only (the split never decodes images)."""

    cameras = None
    grayscale = False

    def __init__(self, counts: dict[str, int]):
        self.name = "synthetic"
        self.labels = np.array([c for c, n in counts.items() for _ in range(n)], dtype=object)

    def describe(self, index: int) -> str:
        return f"item{index}"


def _classes(split, source, name):
    return set(source.labels[split.indices[name]].tolist())


@pytest.mark.parametrize("split_seed", [0, 1, 7])
def test_class_disjoint_split_is_disjoint_and_covers_everything(split_seed: int) -> None:
    source = _Labels({f"c{i:02d}": 5 for i in range(12)})
    split = make_split(source, TrainConfig(data="x", split_seed=split_seed))
    train, val, test = (_classes(split, source, s) for s in ("train", "val", "test"))
    assert not (train & val) and not (train & test) and not (val & test)
    assert train | val | test == set(source.labels.tolist())
    # Half of the classes for test, a fifth for validation.
    assert (len(train), len(val), len(test)) == (4, 2, 6)
    all_idx = np.concatenate([split.indices[s] for s in ("train", "val", "test")])
    assert sorted(all_idx.tolist()) == list(range(len(source.labels)))


def test_class_disjoint_split_is_seeded() -> None:
    source = _Labels({f"c{i:02d}": 3 for i in range(20)})
    a = make_split(source, TrainConfig(data="x", split_seed=3))
    b = make_split(source, TrainConfig(data="x", split_seed=3, seed=99))  # training seed: no effect
    c = make_split(source, TrainConfig(data="x", split_seed=4))
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(a.indices[name], b.indices[name])
    assert a.summary(source)["digest"] == b.summary(source)["digest"]
    assert a.summary(source)["digest"] != c.summary(source)["digest"]


def test_closed_set_split_shares_classes_and_holds_out_images() -> None:
    source = _Labels({f"c{i}": 20 for i in range(3)})
    split = make_split(source, TrainConfig(data="x", protocol="closed-set"))
    for name in ("val", "test"):
        assert _classes(split, source, name) == _classes(split, source, "train")
    sets = [set(split.indices[s].tolist()) for s in ("train", "val", "test")]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert [len(s) for s in sets] == [30, 15, 15]


def test_single_image_class_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    counts = {f"c{i}": 4 for i in range(6)} | {"lonely": 1}
    source = _Labels(counts)
    with caplog.at_level(logging.WARNING):
        split = make_split(source, TrainConfig(data="x"))
    assert split.dropped_classes == ["lonely"]
    assert "lonely" in caplog.text
    kept = np.concatenate([split.indices[s] for s in ("train", "val", "test")])
    assert "lonely" not in set(source.labels[kept].tolist())


def test_too_few_classes_for_class_disjoint_says_what_to_do() -> None:
    with pytest.raises(TrainConfigError, match="closed-set"):
        make_split(_Labels({f"c{i}": 5 for i in range(4)}), TrainConfig(data="x"))


def test_caps_are_stratified_and_seeded() -> None:
    source = _Labels({f"c{i:02d}": 40 for i in range(8)})
    # Quarter shares keep 4 training classes (the defaults would leave 2 of 8).
    config = TrainConfig(data="x", max_train_images=40, max_eval_images=20,
                         val_fraction=0.25, test_fraction=0.25)
    split = make_split(source, config)
    assert len(split.indices["train"]) == 40
    counts = np.unique(source.labels[split.indices["train"]], return_counts=True)[1]
    assert set(counts.tolist()) == {10}
    again = make_split(source, config)
    np.testing.assert_array_equal(split.indices["train"], again.indices["train"])


def test_a_class_cap_keeps_whole_classes_seeded_and_validation_untouched() -> None:
    """``train_cap="classes"``: the cap picks whole training classes (every image of each),
    seeded, and leaves the validation and test splits as the image cap would."""
    source = _Labels({f"c{i:02d}": 24 for i in range(40)})
    options = {"data": "x", "max_train_images": 100, "max_eval_images": 50,
               "val_fraction": 0.25, "test_fraction": 0.25}
    config = TrainConfig(**options, train_cap="classes")
    split = make_split(source, config)
    classes, counts = np.unique(source.labels[split.indices["train"]], return_counts=True)
    assert len(classes) == 4 and set(counts.tolist()) == {24}  # 4 x 24 = 96 <= 100 < 120
    assert "whole classes" in split.rule
    again = make_split(source, config)
    np.testing.assert_array_equal(split.indices["train"], again.indices["train"])
    other = make_split(source, TrainConfig(**options, train_cap="classes", split_seed=1))
    assert set(source.labels[other.indices["train"]]) != set(classes)
    by_images = make_split(source, TrainConfig(**options))
    for name in ("val", "test"):
        np.testing.assert_array_equal(split.indices[name], by_images.indices[name])
    assert len(set(source.labels[by_images.indices["train"]])) > 4


def _fake_fashion(per_class: int = 3) -> ArrayImageSource:
    labels = np.repeat(np.arange(10), per_class * 2)
    official_test = np.tile(np.r_[np.zeros(per_class, bool), np.ones(per_class, bool)], 10)
    names = np.array(FASHION_MNIST_CLASSES, dtype=object)[labels]
    pixels = np.zeros((len(labels), 28, 28), np.uint8)
    return ArrayImageSource("fashion-mnist", pixels, names, official_test)


def test_fashion_mnist_class_split_is_the_documented_one() -> None:
    source = _fake_fashion()
    split = make_split(source, TrainConfig(data="fashion-mnist", split_seed=5))
    for name, ids in FASHION_SPLIT.items():
        assert _classes(split, source, name) == {FASHION_MNIST_CLASSES[i] for i in ids}
    # The Reality Check's halves (classes 0-4 train + validation, 5-9 test).
    assert split.summary(source)["splits"]["test"]["classes"] == [
        "Ankle boot", "Bag", "Sandal", "Shirt", "Sneaker"]


def test_fashion_mnist_closed_set_tests_on_the_official_test_file() -> None:
    source = _fake_fashion(per_class=10)
    split = make_split(source, TrainConfig(data="fashion-mnist", protocol="closed-set"))
    assert source.official_test[split.indices["test"]].all()
    assert not source.official_test[split.indices["train"]].any()
    assert not source.official_test[split.indices["val"]].any()


@pytest.mark.parametrize(
    ("batch", "classes", "given", "expected"),
    [(64, 100, None, 4), (64, 6, None, 16), (32, 8, None, 4), (60, 6, None, 10), (64, 6, 16, 16)],
)
def test_m_per_class_fits_the_sampler(batch, classes, given, expected) -> None:
    plan = plan_batches(batch, given, [500] * classes)
    assert (plan.batch_size, plan.m_per_class, plan.changes) == (batch, expected, ())


def test_m_per_class_too_small_for_the_classes_is_replaced_and_said() -> None:
    plan = plan_batches(64, 4, [500] * 6)
    assert (plan.batch_size, plan.m_per_class) == (64, 16)
    assert plan.changes == ("m_per_class 4 -> 16: 4 x 6 classes cannot fill a batch of 64",)


def test_sampler_is_deterministic_per_epoch() -> None:
    labels = np.repeat(np.arange(6), 10)
    a = MPerClassSampler(labels, 4, 16, 60, seed=1)
    b = MPerClassSampler(labels, 4, 16, 60, seed=1)
    a.set_epoch(2)
    first = list(a)
    a.set_epoch(1)
    other_epoch = list(a)  # another epoch in between must not change epoch 2
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == first == list(b)
    assert other_epoch != first
    b.set_epoch(1)
    assert list(b) == other_epoch
    c = MPerClassSampler(labels, 4, 16, 60, seed=2)
    c.set_epoch(2)
    assert list(c) != first


@pytest.mark.parametrize(("per_class", "m", "batch", "length"),
                         [(10, 4, 16, 60), (3, 4, 8, 30), (7, 2, 6, 50)])
def test_sampler_batches_hold_m_items_of_distinct_classes(per_class, m, batch, length) -> None:
    labels = np.repeat(np.arange(5), per_class)
    sampler = MPerClassSampler(labels, m, batch, length, seed=0)
    indices = np.array(list(sampler))
    assert len(sampler) == len(indices) == length - length % batch  # whole batches only
    for batch_indices in indices.reshape(-1, batch):
        classes, counts = np.unique(labels[batch_indices], return_counts=True)
        assert len(classes) == batch // m and set(counts.tolist()) == {m}
        if per_class >= m:  # without replacement when the class has enough items
            assert len(set(batch_indices.tolist())) == batch


def test_sampler_leaves_global_random_state_alone() -> None:
    from pytorch_metric_learning.utils import common_functions as pml_common

    np.random.seed(123)
    torch.manual_seed(123)
    numpy_before, torch_before = np.random.get_state()[1].copy(), torch.get_rng_state()
    pml_before = pml_common.NUMPY_RANDOM
    sampler = MPerClassSampler(np.repeat(np.arange(6), 10), 4, 16, 60, seed=1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        list(sampler)
    assert pml_common.NUMPY_RANDOM is pml_before
    np.testing.assert_array_equal(np.random.get_state()[1], numpy_before)
    assert torch.equal(torch.get_rng_state(), torch_before)


def test_sampler_refuses_what_cannot_fill_a_batch() -> None:
    labels = np.repeat(np.arange(3), 4)
    with pytest.raises(TrainConfigError, match="divide"):
        MPerClassSampler(labels, 3, 8, 12, seed=0)
    with pytest.raises(TrainConfigError, match="m x classes"):
        MPerClassSampler(labels, 2, 8, 12, seed=0)
    with pytest.raises(TrainConfigError, match="batch size 16"):
        MPerClassSampler(np.repeat(np.arange(4), 3), 4, 16, 12, seed=0)


def test_empty_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no images found"):
        open_source(str(tmp_path / "empty"))


def test_corrupt_training_file_is_skipped(
    image_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = image_folder / "class_0" / "000.png"
    bad.write_bytes(b"not a png")
    source = open_source(str(image_folder))
    spec = spec_for(TrainConfig(data="x", backbone="tiny_cnn", image_size=16), source)
    dataset = TrainDataset(source, np.arange(len(source.labels)), train_transform(spec, "none"))
    position = int(np.flatnonzero(np.array([p == bad for p in source.paths]))[0])
    with caplog.at_level(logging.WARNING):
        image, label = dataset[position]
    assert image.shape == (3, 16, 16)
    assert dataset.class_names[label] == "class_0"
    assert "000.png" in caplog.text


def test_market_folder_keeps_cameras_and_leaves_out_distractors(tmp_path: Path) -> None:
    from tests.support.images import write_market_folder

    source = open_source(str(write_market_folder(tmp_path / "market", identities=6)))
    assert source.cameras is not None and "0000" in set(source.labels.tolist())
    split = make_split(source, TrainConfig(data="x"))
    used = np.concatenate([split.indices[s] for s in ("train", "val", "test")])
    assert "0000" not in set(source.labels[used].tolist())
    assert all(len(_classes(split, source, s)) == 2 for s in ("train", "val", "test"))


def test_in_memory_greyscale_items_equal_the_decoded_image_path() -> None:
    """Arrays (the glyphs, Fashion-MNIST) skip PIL through the transform's grey table: the
    training items and the evaluation embeddings must be those of the decoded images."""
    from imgret.checkpoint import EmbeddingNet
    from imgret.embedder import Embedder
    from imgret.training.scoring import embed_split

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (40, 32, 32), dtype=np.uint8)
    labels = np.array([f"c{i % 5}" for i in range(40)], dtype=object)
    source = ArrayImageSource("arrays", pixels, labels, np.zeros(40, bool), stats=(0.2, 0.3))
    spec = spec_for(TrainConfig(data="x", backbone="tiny_cnn", image_size=32, dim=16), source)
    transform = train_transform(spec, "none")
    dataset = TrainDataset(source, np.arange(40), transform)
    for position in (0, 17, 39):
        image, label = dataset[position]
        assert torch.equal(image, transform(source.image(position)))
        assert dataset.class_names[label] == labels[position]

    torch.manual_seed(0)
    model = EmbeddingNet(spec)
    indices = np.array([3, 1, 4, 15, 9, 26, 5, 35])
    fast = embed_split(model, source, indices, batch_size=3)
    decoded = Embedder.from_model(model, model_version="t").embed(
        [source.image(int(i)) for i in indices])
    np.testing.assert_allclose(fast.embeddings, decoded, atol=1e-6)
    assert fast.labels.tolist() == labels[indices].tolist()


def test_the_fast_split_helpers_equal_their_plain_definitions() -> None:
    """``member_mask`` is ``np.isin``; ``stratified_subset`` picks, class by class in sorted
    order, a seeded permutation's first k of the class's members in index order."""
    import math

    from imgret.training.data.splits import member_mask, stratified_subset

    rng = np.random.default_rng(5)
    labels = np.array([f"U+{c:04X}" for c in rng.integers(0, 60, 3000)], dtype=object)
    members = sorted(set(labels[:700].tolist()))[:20]
    assert np.array_equal(member_mask(labels, members),
                          np.isin(labels, np.array(members, dtype=object)))

    indices = np.sort(rng.choice(3000, 1800, replace=False)).astype(np.int64)
    reference_rng, rng_a = np.random.default_rng(9), np.random.default_rng(9)
    chosen = []
    for label in sorted(set(labels[indices].tolist())):
        group = indices[labels[indices] == label]
        k = min(len(group), max(2, int(math.floor(len(group) * 500 / len(indices)))))
        chosen.append(reference_rng.permutation(group)[:k])
    assert np.array_equal(stratified_subset(indices, labels, 500, rng_a),
                          np.sort(np.concatenate(chosen)))
