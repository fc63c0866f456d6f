"""Query sets belong to their collection, on both databases: two collections hold different
query sets, and every route and job of one (listing, images, evaluation,
calibration, coverage, the re-embedding job) reads, embeds and counts only its own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from imgret.gallery.media.files import sha256_hex
from imgret.gallery.storage import item_store, query_set_store
from imgret.gallery.storage.db import make_sessionmaker
from imgret.gallery.storage.scope import ALL_COLLECTIONS
from imgret.gallery.storage.tables import ModelVersion, QueryEmbedding, QueryItem, QuerySet
from imgret.gallery.tenancy import collections
from imgret.gallery.versions import version_store
from imgret.images import DecodeLimits, embed_encoded
from tests.api.conftest import png
from tests.api.models.test_models import _checkpoint

# (collection, query set, how many query images, their first image index)
SETS = (("alpha", "faces", 6, 100), ("beta", "cams", 4, 200))


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("scope_run"), seed=3)


def _sessions_of(client: TestClient, name: str):
    resources = client.app.state.resources
    with resources.sessions() as session:
        collection_id = collections.get(name, session=session).id
    return make_sessionmaker(resources.sessions.kw["bind"], collection_id)


def _add_query_set(client: TestClient, collection: str, name: str, size: int, first: int
                   ) -> list[int]:
    """Store a labelled query set in ``collection`` as ``imgret ingest --query-set`` does."""
    resources = client.app.state.resources
    sessions = _sessions_of(client, collection)
    blobs = [png(i % 2, first + i) for i in range(size)]
    rows = [item_store.NewRow(sha256_hex(b), resources.media.put(b), "image/png", str(i % 2))
            for i, b in enumerate(blobs)]
    vectors = embed_encoded(blobs, embedder=resources.serving.embedder, limits=DecodeLimits())
    with sessions.begin() as session:
        version = version_store.active_model_version(session=session)
        query_set = query_set_store.get_or_create_query_set(name, session=session)
        return item_store.insert_items(rows, vectors, session=session, model_version=version,
                                       query_set=query_set)


def _wait_done(client: TestClient, prefix: str, version: str) -> dict:
    deadline = time.monotonic() + 120
    info = client.get(f"{prefix}/models/{version}").json()
    while info["embedding"]["state"] not in ("done", "failed") and time.monotonic() < deadline:
        time.sleep(0.05)
        info = client.get(f"{prefix}/models/{version}").json()
    assert info["embedding"]["state"] == "done", info
    return info


def test_query_sets_are_read_embedded_and_counted_only_in_their_collection(
        make_client, other_checkpoint: Path) -> None:
    with make_client(embed_duty=1.0, model_roots=[other_checkpoint.parent]) as client:
        for name in ("alpha", "beta", "pub"):
            assert client.post("/collections", json={"name": name}).status_code == 201
        ids = {}
        for collection, query_set, size, first in SETS:
            prefix = f"/collections/{collection}"
            files = [("images", (f"{i}.png", png(i % 2, first + 50 + i), "image/png"))
                     for i in range(4)]
            assert client.post(f"{prefix}/gallery", files=files,
                               data={"labels": [str(i % 2) for i in range(4)]}
                               ).status_code == 201
            ids[collection] = _add_query_set(client, collection, query_set, size, first)
        sizes = {c: size for c, _, size, _ in SETS} | {"pub": 0, "default": 0}
        names = {c: [q] for c, q, _, _ in SETS} | {"pub": [], "default": []}

        for collection in ("alpha", "beta", "pub", "default"):
            prefix = "" if collection == "default" else f"/collections/{collection}"
            listed = client.get(f"{prefix}/query-sets").json()["query_sets"]
            assert [s["name"] for s in listed] == names[collection], collection
            version = client.get(f"{prefix}/models").json()["models"][0]["version"]
            described = client.get(f"{prefix}/models/{version}").json()
            assert described["query_items"]["total"] == sizes[collection], collection
            # Another collection's query set and query images are not there.
            for other, query_set, _, _ in SETS:
                if other == collection:
                    continue
                image = client.get(f"{prefix}/query-sets/{query_set}/items/{ids[other][0]}"
                                   "/image")
                assert image.status_code == 404, (collection, other)
                evaluated = client.post(f"{prefix}/evaluate", json={"query_set": query_set})
                assert evaluated.status_code == 404, (collection, other, evaluated.text)
                calibrated = client.post(f"{prefix}/models/{version}/calibrate",
                                         json={"query_set": query_set, "target_fpir": 0.5})
                assert calibrated.status_code == 404, (collection, other, calibrated.text)
        for collection, query_set, size, _ in SETS:
            evaluated = client.post(f"/collections/{collection}/evaluate",
                                    json={"query_set": query_set})
            assert evaluated.status_code == 200, evaluated.text
            assert evaluated.json()["num_queries"] == size

        # A second version in beta: its job embeds beta's queries and nobody else's.
        registered = client.post("/collections/beta/models", json={"path": str(other_checkpoint)})
        assert registered.status_code == 201, registered.text
        b = registered.json()["version"]
        assert client.post(f"/collections/beta/models/{b}/embed").status_code == 202
        info = _wait_done(client, "/collections/beta", b)
        assert info["query_items"] == {"embedded": sizes["beta"], "total": sizes["beta"]}
        with client.app.state.resources.sessions() as session:
            embedded = session.execute(
                select(QuerySet.name, func.count())
                .select_from(QueryEmbedding)
                .join(QueryItem, QueryItem.id == QueryEmbedding.query_item_id)
                .join(QuerySet, QuerySet.id == QueryItem.query_set_id)
                .join(ModelVersion, ModelVersion.id == QueryEmbedding.model_version_id)
                .where(ModelVersion.version == b)
                .group_by(QuerySet.name).execution_options(**{ALL_COLLECTIONS: True})
            ).all()
        assert dict(embedded) == {"cams": sizes["beta"]}
        compared = client.post("/collections/beta/evaluate",
                               json={"query_set": "cams", "compare": [
                                   client.get("/collections/beta").json()["active_version"], b]})
        assert compared.status_code == 200, compared.text
