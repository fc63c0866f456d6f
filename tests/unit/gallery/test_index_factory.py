"""Factory-string checks, index creation, search parameters and GPU placement."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from imgret.errors import InvalidIndexFactory
from imgret.gallery.search.faiss_index import (
    TooFewVectors,
    check_factory,
    create_index,
    place_index,
    search_params,
    stored_ids,
    unwrap,
)


@pytest.mark.parametrize(
    "factory",
    ["Flat", "IVF8,Flat", "HNSW16", "PQ4x4", "SQ8", "IVF8,PQ4x4", "OPQ4,IVF8,PQ4x4",
     "IVF8,SQ8", "IVF8,Flat,RFlat", "RR16,Flat", "IDMap2,Flat", " IVF8, Flat "],
)
def test_accepted_factories_are_inner_product_and_take_gallery_ids(factory, vectors):
    info = check_factory(factory, 16)
    index = create_index(info, 16)
    if not index.is_trained:
        index.train(vectors)
    ids = np.arange(1000, 1000 + len(vectors), dtype=np.int64)
    index.add_with_ids(vectors, ids)
    assert sorted(stored_ids(index).tolist()) == ids.tolist()
    assert unwrap(index).metric_type == faiss.METRIC_INNER_PRODUCT
    # Every accepted index can give back a stored vector by gallery id (exact re-ranking).
    assert index.reconstruct_batch(ids[:3]).shape == (3, 16)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("", "empty index factory"),
        ("L2norm,Flat", "already L2-normalises"),
        ("IVF8,Flat,L2norm", "already L2-normalises"),
        ("PCA8,Flat", "subtracts the data mean"),
        ("PCAW8,IVF8,Flat", "subtracts the data mean"),
        ("LSH", "Hamming"),
        ("NSG16", "cannot take new ones"),
        ("HNSW16,PQ4", "L2 metric"),
        ("IMI2x4,Flat", "inner prod"),
        ("PQ5", "multiple of the number of subquantizers"),
        ("Bogus12", "could not parse"),
    ],
)
def test_bad_factories_are_refused_with_an_explanation(factory, message):
    with pytest.raises(InvalidIndexFactory, match=message) as caught:
        check_factory(factory, 16)
    assert "Error in" not in str(caught.value)  # FAISS's C++ signature is trimmed away


def test_ivf_with_more_lists_than_vectors_is_refused_with_a_fitting_suggestion():
    info = check_factory("IVF1024,Flat", 16)
    with pytest.raises(TooFewVectors, match=r"needs at least 1024 vectors.*has 500.*IVF"):
        info.check_vector_count(500)
    info.check_vector_count(1024)  # enough to train (with a warning below 39 per list)


def test_pq_training_needs_256_vectors_per_codebook():
    info = check_factory("PQ4", 16)
    assert info.min_train == 256
    with pytest.raises(TooFewVectors, match="Flat"):
        info.check_vector_count(100)


def test_search_params_carry_the_selector_where_the_index_supports_one(vectors):
    selector = faiss.IDSelectorRange(0, 10)
    for factory, supported in [("Flat", True), ("HNSW16", True), ("IVF8,Flat", True),
                               ("PQ4x4", False)]:
        info = check_factory(factory, 16)
        index = create_index(info, 16)
        if not index.is_trained:
            index.train(vectors)
        params, ok = search_params(index, selector, k=5)
        assert ok is supported, factory
        if supported:
            assert params.sel is not None
    ivf = create_index(check_factory("IVF8,Flat", 16), 16)
    ivf.train(vectors)
    params, _ = search_params(ivf, selector, k=5, exhaustive=True)
    assert params.nprobe == 8  # every list


def test_placement_stays_on_cpu_without_gpus(monkeypatch, caplog):
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0)  # also on a GPU machine
    index = create_index(check_factory("Flat", 16), 16)
    caplog.set_level("INFO", logger="imgret.gallery.search.faiss_index")
    gpu, device = place_index(index)
    assert (gpu, device) == (None, "cpu")
    assert "faiss.get_num_gpus() == 0" in caplog.text


def test_gpu_branch_shards_across_all_gpus(fake_gpus, vectors):
    """The GPU branch, driven through a CPU stand-in for the GPU copy."""
    calls = {}

    def fake_copy(index, options, ngpu):
        calls.update(shard=options.shard, ngpu=ngpu)
        return faiss.clone_index(index)

    fake_gpus(2, fake_copy)
    index = create_index(check_factory("Flat", 16), 16)
    index.add_with_ids(vectors, np.arange(len(vectors), dtype=np.int64))
    gpu, device = place_index(index)
    assert calls == {"shard": True, "ngpu": 2}
    assert device == "cuda x2 (sharded)" and gpu.ntotal == len(vectors)


def test_gpu_copies_share_one_capped_set_of_resources(monkeypatch, vectors):
    """Every GPU copy shares one capped set of FAISS resources per process: a set per copy
    (up to 1.5 GiB reserved each) makes FAISS abort the process after enough copies."""
    from imgret.gallery.search import faiss_index

    made, copies = [], []

    class Options:
        shard = False

    class Resources:
        def __init__(self):
            made.append(self)

        def setTempMemory(self, size):  # noqa: N802 (FAISS's name)
            self.temp = size

    def to_gpus(resources, index, co=None):
        copies.append(list(resources))
        return faiss.clone_index(index)

    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 2)
    monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", Options, raising=False)
    monkeypatch.setattr(faiss, "StandardGpuResources", Resources, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu_multiple_py", to_gpus, raising=False)
    monkeypatch.setattr(faiss_index, "_GPU_RESOURCES", [])
    for _ in range(5):
        index = create_index(check_factory("Flat", 16), 16)
        index.add_with_ids(vectors, np.arange(len(vectors), dtype=np.int64))
        gpu, device = place_index(index)
        assert device == "cuda x2 (sharded)" and gpu.ntotal == len(vectors)
    assert len(made) == 2 and all(r.temp == faiss_index.GPU_TEMP_MEMORY for r in made)
    assert copies == [made] * 5


def test_gpu_copy_failure_falls_back_to_cpu(fake_gpus, caplog):
    def failing(index, options, ngpu):
        raise RuntimeError("Error in f at x.cpp:1: HNSW not supported on GPU")

    fake_gpus(1, failing)
    gpu, device = place_index(create_index(check_factory("HNSW16", 16), 16))
    assert (gpu, device) == (None, "cpu")
    assert "stays on CPU" in caplog.text
