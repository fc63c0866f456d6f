"""Fixtures of the index unit tests."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.threads import omp_threads
from tests.unit.gallery.vectors import clustered_vectors


@pytest.fixture
def vectors() -> np.ndarray:
    """600 clustered 16-d unit vectors."""
    return clustered_vectors(600)


@pytest.fixture(autouse=True, scope="session")
def _one_faiss_thread():
    """FAISS's OpenMP threads spin on a loaded CI machine; the tiny test data needs one."""
    with omp_threads(1):
        yield


class _FakeClonerOptions:
    shard = False


@pytest.fixture
def fake_gpus(monkeypatch):
    """``install(ngpu, copy)``: ``place_index`` sees ``ngpu`` GPUs and copies with
    ``copy(index, options, ngpu)``, a CPU stand-in for FAISS's GPU copy."""
    import faiss

    from imgret.gallery.search import faiss_index

    def install(ngpu, copy):
        monkeypatch.setattr(faiss, "get_num_gpus", lambda: ngpu)
        monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", _FakeClonerOptions, raising=False)
        monkeypatch.setattr(faiss_index, "_copy_to_gpus", copy)

    return install
