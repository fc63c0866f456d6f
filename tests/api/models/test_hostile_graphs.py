"""Uploaded ONNX graphs through the service (SQLite and PostgreSQL): a hostile graph is a 422
at ``POST /models`` that quotes nothing of the file and registers nothing, so what registers
also embeds; a graph that gives NaN or infinite vectors on real images fails its job, its
searches and its uploads in imgret's words and stores nothing; vectors of that kind stored by
an older release make an evaluation a 409, never a 500 or a ``null`` score."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import update

from imgret.checkpoint import (
    EmbeddingNet,
    ModelSpec,
    Quantized,
    checkpoint_bytes,
    load_checkpoint,
    save_checkpoint,
)
from imgret.embedder import Embedder
from imgret.gallery.search.ranking import to_hits
from imgret.gallery.storage.tables import Embedding, QueryEmbedding
from imgret.gallery.storage.vector_store import encode_vector
from imgret.gallery.versions import version_store
from tests.api.conftest import add_gallery, png, search
from tests.support.images import write_image_folder

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
hostile = pytest.importorskip("tests.support.hostile_graphs")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path):
    return load_checkpoint(tiny_checkpoint)


def _upload(client, tiny, graph: bytes):
    _, data = checkpoint_bytes(tiny.model, None, Quantized("int8", graph))
    return client.post("/models", files={"checkpoint": ("model.pt", data)})


def test_every_hostile_graph_is_a_422_that_quotes_nothing_and_registers_nothing(
        make_client, tiny) -> None:
    size, dim = tiny.spec.image_size, tiny.spec.dim
    with make_client() as client:
        add_gallery(client, classes=2, per_class=2)
        before = client.get("/models").json()
        failures = []
        for case, build in hostile.GRAPHS.items():
            refused = _upload(client, tiny, build(size, dim))
            detail = refused.json().get("detail", "")
            if refused.status_code != 422 or "quantized.graph" not in str(detail):
                failures.append(f"{case}: {refused.status_code} {refused.text[:300]}")
            if hostile.SECRET in refused.text:
                failures.append(f"{case}: the answer quotes the file: {refused.text[:300]}")
        assert client.get("/models").json() == before
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", sorted(hostile.NON_FINITE_ON_IMAGES))
def test_a_graph_with_non_finite_vectors_fails_its_job_in_our_words(make_client, tiny,
                                                                    case: str) -> None:
    graph = hostile.NON_FINITE_ON_IMAGES[case](tiny.spec.image_size, tiny.spec.dim)
    with make_client(embed_duty=1.0) as client:
        add_gallery(client, classes=2, per_class=3)
        uploaded = _upload(client, tiny, graph)
        assert uploaded.status_code == 201, uploaded.text
        version = uploaded.json()["version"]
        assert client.post(f"/models/{version}/embed").status_code == 202
        client.app.state.resources.jobs.wait(version, timeout=60)
        info = client.get(f"/models/{version}").json()
        assert info["embedding"]["state"] == "failed"
        assert "produced non-finite vectors" in info["embedding"]["error"]
        assert hostile.SECRET not in str(info)
        assert info["coverage"]["embedded"] == 0  # nothing stored
        refused = client.post(f"/models/{version}/activate")
        assert refused.status_code == 409


def test_a_served_graph_with_non_finite_vectors_refuses_searches_and_uploads(make_client,
                                                                             tiny) -> None:
    graph = hostile.nan_on_images(tiny.spec.image_size, tiny.spec.dim)
    with make_client() as client:  # an empty gallery: the version switches at once
        version = _upload(client, tiny, graph).json()["version"]
        assert client.post(f"/models/{version}/activate").status_code == 200
        refused = search(client, png(1, 0), k=3)
        assert refused.status_code == 409 and "non-finite vectors" in refused.json()["detail"]
        upload = client.post("/gallery", files=[("images", ("a.png", png(0, 0), "image/png"))],
                             data={"labels": ["0"]})
        assert upload.status_code == 409 and "non-finite vectors" in upload.json()["detail"]
        assert client.get("/gallery").json()["count"] == 0


def test_non_finite_vectors_stored_before_make_evaluation_a_409(make_client, tmp_path: Path
                                                                ) -> None:
    """Vectors an older release stored from a model that gave NaN: the evaluation of that
    version answers 409 with what to do, and searches on the served version go on."""
    from imgret.gallery.ingest import ingest_source

    torch.manual_seed(1)
    save_checkpoint(tmp_path / "other", EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16,
                                                               image_size=32)))
    other = Embedder.from_checkpoint(tmp_path / "other", device="cpu")
    gallery = write_image_folder(tmp_path / "gallery", classes=3, per_class=3)
    queries = write_image_folder(tmp_path / "q", classes=3, per_class=2, seed=5)
    with make_client() as client:
        resources = client.app.state.resources
        for embedder in (resources.embedder, other):
            ingest_source(gallery, session_factory=resources.sessions, media=resources.media,
                          embedder=embedder, progress=False)
            ingest_source(queries, session_factory=resources.sessions, media=resources.media,
                          embedder=embedder, query_set="q", progress=False)
        nan = encode_vector(np.full(16, np.nan, dtype=np.float32))
        with resources.sessions.begin() as session:
            row = version_store.get_version(other.model_version, session=session)
            for table in (Embedding, QueryEmbedding):
                session.execute(update(table).where(table.model_version_id == row.id)
                                .values(vector=nan))
        refused = client.post("/evaluate", json={"query_set": "q",
                                                 "model_version": other.model_version})
        assert refused.status_code == 409, refused.text
        assert "NaN or infinite" in refused.json()["detail"]
        served = search(client, png(1, 0), k=3)
        assert served.status_code == 200
        assert all(isinstance(hit["score"], float) for hit in served.json()["results"])


def test_a_non_finite_score_is_never_a_hit() -> None:
    """An index built by an older release from NaN vectors: those neighbours are left out
    rather than served with a ``null`` score."""
    hits = to_hits(np.array([[np.nan, 0.5, -np.inf]], dtype=np.float32),
                   np.array([[3, 7, 9]]), None, 3)
    assert [(hit.id, hit.score) for hit in hits[0]] == [(7, 0.5)]
