"""Incremental clustering of kept unknowns, in SQL on both databases: who joins whom, the
cluster's template and cohesion, and what removing members leaves."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.gallery.storage import unknowns_store
from imgret.gallery.storage.tables import ModelVersion, UnknownCluster


def _unit(*values: float) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def _keep(sessions, version_id: int, vector: np.ndarray, threshold: float = 0.9):
    with sessions.begin() as session:
        version = session.get(ModelVersion, version_id)
        return unknowns_store.keep_unknown(
            session=session, sha256=f"{np.random.default_rng().integers(1 << 62):064x}",
            media_path="p", content_type="image/png", vector=vector, model_version=version,
            threshold=threshold, score=None)


@pytest.fixture
def version_id(sessions) -> int:
    with sessions.begin() as session:
        version = ModelVersion(version="v-unknowns", dim=3, config={})
        session.add(version)
        session.flush()
        return int(version.id)


def test_an_unknown_joins_the_nearest_template_above_the_threshold(sessions, version_id):
    a = _keep(sessions, version_id, _unit(1, 0, 0))
    b = _keep(sessions, version_id, _unit(1, 0.1, 0))  # cos 0.995 with a: joins
    c = _keep(sessions, version_id, _unit(0, 1, 0))  # cos ~0.1: a cluster of its own
    d = _keep(sessions, version_id, _unit(0.1, 1, 0))  # nearer c's template than a's
    assert a.new_cluster and not b.new_cluster and b.cluster_id == a.cluster_id
    assert c.new_cluster and c.cluster_id != a.cluster_id
    assert d.cluster_id == c.cluster_id and d.similarity == pytest.approx(0.995, abs=1e-3)
    with sessions() as session:
        views, total = unknowns_store.clusters(session=session)
    assert total == 2 and [v.size for v in views] == [2, 2]
    expected = np.linalg.norm(_unit(1, 0, 0) + _unit(1, 0.1, 0)) / 2
    by_id = {v.id: v for v in views}
    assert by_id[a.cluster_id].cohesion == pytest.approx(expected, abs=1e-6)
    assert set(by_id[a.cluster_id].member_ids) == {a.id, b.id}


def test_removing_members_updates_the_template_and_drops_an_empty_cluster(sessions,
                                                                          version_id):
    a = _keep(sessions, version_id, _unit(1, 0, 0))
    b = _keep(sessions, version_id, _unit(1, 0.2, 0))
    c = _keep(sessions, version_id, _unit(0, 0, 1))
    with sessions.begin() as session:
        hashes = unknowns_store.remove([b.id, c.id], session=session)
    assert len(hashes) == 2
    with sessions() as session:
        clusters = session.query(UnknownCluster).all()
        assert [(cl.id, cl.size) for cl in clusters] == [(a.cluster_id, 1)]
        summed = np.frombuffer(clusters[0].vector_sum, dtype="<f4")
        np.testing.assert_allclose(summed, _unit(1, 0, 0), atol=1e-6)
    # The next one near b's old place is measured against a alone.
    e = _keep(sessions, version_id, _unit(1, 0.2, 0), threshold=0.98)
    assert e.cluster_id == a.cluster_id
    assert e.similarity == pytest.approx(1 / np.sqrt(1.04), abs=1e-6)


def test_expiry_keeps_at_most_the_cap_oldest_first(sessions, version_id):
    kept = [_keep(sessions, version_id, _unit(1, i, 0), threshold=1.1) for i in range(5)]
    with sessions.begin() as session:
        removed = unknowns_store.expire(365, session=session, keep_at_most=3)
    assert len(removed) == 2
    with sessions() as session:
        views, total = unknowns_store.clusters(session=session)
    assert total == 3
    assert sorted(m for v in views for m in v.member_ids) == [k.id for k in kept[2:]]
