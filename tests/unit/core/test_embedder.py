"""The Embedder on the tiny CNN: shape, norm, determinism, checkpoint round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from imgret.backbones import build_backbone
from imgret.checkpoint import (
    EmbeddingNet,
    ModelSpec,
    load_checkpoint,
    model_version_of,
    save_checkpoint,
)
from imgret.embedder import Embedder
from imgret.errors import CheckpointError, UnknownName
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image
from tests.support.threads import Overlap, run_in_threads

SPEC = ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)


@pytest.fixture
def images() -> list:
    return [class_image(label, i, size=40) for label in range(3) for i in range(3)]


def _model(seed: int = 0) -> EmbeddingNet:
    torch.manual_seed(seed)
    return EmbeddingNet(SPEC)


def test_embed_shape_dtype_and_unit_norm(images) -> None:
    vectors = Embedder.from_model(_model(), device=TEST_DEVICE).embed(images)
    assert vectors.shape == (9, 16)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_a_forked_child_can_embed_while_the_parent_is_mid_forward(images) -> None:
    """A child forked while another thread of the parent holds the forward lock (as an
    ingest's workers would be, forked beside a search batch) embeds, and gets the parent's
    vectors: without the at-fork reset its forward pass waits forever on a copied lock."""
    import multiprocessing
    import threading

    embedder = Embedder.from_model(_model(), device="cpu")
    expected = embedder.embed(images)
    held, release = threading.Event(), threading.Event()

    def mid_forward() -> None:
        with embedder._forward_lock:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=mid_forward)
    thread.start()
    held.wait(10)
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def child() -> None:
        torch.set_num_threads(1)
        results.put(embedder.embed(images))

    process = context.Process(target=child)
    try:
        process.start()
        got = results.get(timeout=60)
        process.join(30)
    finally:
        release.set()
        thread.join()
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert not embedder._forward_lock.locked()  # the parent's lock was the parent's


def test_embed_is_deterministic_and_batch_independent(images) -> None:
    embedder = Embedder.from_model(_model(), device=TEST_DEVICE, batch_size=4)
    first = embedder.embed(images)
    np.testing.assert_array_equal(first, embedder.embed(images))
    one_by_one = np.concatenate([embedder.embed([image]) for image in images])
    np.testing.assert_allclose(first, one_by_one, atol=1e-5)


def test_empty_input_gives_empty_matrix() -> None:
    embedder = Embedder.from_model(_model(), device=TEST_DEVICE)
    assert embedder.embed([]).shape == (0, 16)
    empty = embedder.embed_tensors(torch.zeros((0, 3, 32, 32)))
    assert (empty.shape, empty.dtype) == ((0, 16), np.float32)


def test_checkpoint_round_trip_gives_same_vectors_and_version(tmp_path: Path, images) -> None:
    model = _model()
    version = save_checkpoint(tmp_path / "run", model, extra={"note": "x"})
    live = Embedder.from_model(model, device=TEST_DEVICE)
    for path in (tmp_path / "run", tmp_path / "run" / "model.pt"):
        loaded = Embedder.from_checkpoint(path, device=TEST_DEVICE)
        assert loaded.model_version == version == live.model_version
        np.testing.assert_allclose(loaded.embed(images), live.embed(images), atol=1e-6)
    assert load_checkpoint(tmp_path / "run").extra == {"note": "x"}


def test_model_version_follows_weights_and_config() -> None:
    assert model_version_of(_model(0), SPEC) == model_version_of(_model(0), SPEC)
    assert model_version_of(_model(0), SPEC) != model_version_of(_model(1), SPEC)
    other = ModelSpec(backbone="tiny_cnn", dim=16, image_size=48)
    assert model_version_of(_model(0), SPEC) != model_version_of(_model(0), other)


def test_from_model_restores_training_mode(images) -> None:
    model = _model()
    model.train()
    Embedder.from_model(model, device=TEST_DEVICE).embed(images[:2])
    assert model.training


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        Embedder.from_checkpoint(tmp_path)
    junk = tmp_path / "model.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(junk)
    torch.save({"format": "something-else"}, junk)
    with pytest.raises(CheckpointError, match="not an imgret checkpoint"):
        load_checkpoint(junk)


def test_unknown_backbone_lists_valid_ones() -> None:
    with pytest.raises(ValidationError, match="(?s)backbone.*must be one of .*resnet18"):
        ModelSpec(backbone="resnet9000")
    with pytest.raises(UnknownName, match="resnet18"):
        build_backbone("resnet9000", image_size=32)


def test_backbone_weights_load_from_a_local_file(tmp_path: Path) -> None:
    torch.manual_seed(3)
    source = EmbeddingNet(SPEC)
    weights = tmp_path / "tiny.pth"
    torch.save(source.trunk.state_dict(), weights)
    target = EmbeddingNet(SPEC, backbone_weights=weights)
    for key, value in source.trunk.state_dict().items():
        torch.testing.assert_close(target.trunk.state_dict()[key], value)
    torch.save({"unrelated.weight": torch.zeros(1)}, weights)
    with pytest.raises(CheckpointError, match="do not fit"):
        EmbeddingNet(SPEC, backbone_weights=weights)


@pytest.mark.parametrize(
    ("backbone", "size"),
    [("resnet18", 32), ("resnet50", 32), ("efficientnet_b0", 32), ("convnext_tiny", 32),
     ("mobilenet_v2", 32), ("vit_b_16", 32)],
)
def test_every_backbone_embeds(backbone: str, size: int) -> None:
    spec = ModelSpec(backbone=backbone, dim=8, image_size=size)
    vectors = Embedder.from_model(EmbeddingNet(spec), device=TEST_DEVICE).embed(
        [class_image(0, 0)]
    )
    assert vectors.shape == (1, 8)


def test_forward_passes_from_many_threads_never_overlap(images) -> None:
    """Concurrent uploads and search batches share one Embedder: one forward pass at a time
    (concurrent passes only multiply activation memory on a CPU), each chunk on its own."""
    model = _model()
    overlap = Overlap()
    # 10 ms in a slow layer; always_call: a pass that raises must not look like an overlap.
    model.register_forward_pre_hook(lambda *_: overlap.enter(linger_s=0.01))
    model.register_forward_hook(lambda *_: overlap.leave(), always_call=True)
    embedder = Embedder.from_model(model, batch_size=2, device=TEST_DEVICE)
    expected = embedder.embed(images)
    results, errors = run_in_threads(lambda: embedder.embed(images), 6)
    assert not errors, errors
    assert overlap.most == 1
    assert len(results) == 6 and all(np.allclose(r, expected, atol=1e-6) for r in results)


@pytest.mark.parametrize("rows, size", [(10, 4), (8, 4), (3, 64), (0, 4)])
def test_device_chunks_cover_the_batch_in_order(rows: int, size: int) -> None:
    """The chunking the Embedder runs through: on CUDA (TEST_DEVICE there) copies from pinned
    memory on a side stream, the next one under way while a chunk is used; on the CPU plain
    slices."""
    from imgret.embedder import device_chunks

    batch = torch.arange(rows * 3 * 2 * 2, dtype=torch.float32).reshape(rows, 3, 2, 2)
    chunks = [c.cpu() for c in device_chunks(batch, size, TEST_DEVICE)]
    assert [len(c) for c in chunks] == [min(size, rows - s) for s in range(0, rows, size)]
    assert torch.equal(torch.cat(chunks) if chunks else batch, batch)
