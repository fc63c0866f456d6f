"""The unknowns pool through the API on SQLite and PostgreSQL: off by default, kept and
clustered when a collection opts in, listed only to writers, enrolled under a name or
dismissed, expired by retention."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from imgret.gallery.storage.tables import UnknownFace
from imgret.gallery.versions import version_store
from tests.api.conftest import API_KEY, png

KEYED = {"X-API-Key": API_KEY}


def _calibrate(client, threshold: float) -> None:
    """A calibration of the served version at ``threshold`` (written as calibrate writes it:
    what is measured here is the pool, not the calibration)."""
    resources = client.app.state.resources
    version = client.get("/health").json()["model_version"]
    with resources.sessions.begin() as session:
        row = version_store.get_version(version, session=session)
        version_store.add_calibration(
            row, session=session, query_set="cal", query_set_sha256="0" * 64,
            target_fpir=0.01, threshold=threshold, threshold_low=None, threshold_high=None,
            fpir=0.0, fnir=0.0, rerank=None, details={})
    resources.follow_active()


def _identify(client, image: bytes, headers=None):
    response = client.post("/identify", files={"image": ("q.png", image, "image/png")},
                           headers=headers or {})
    assert response.status_code == 200, response.text
    return response.json()


def _kept(client) -> int:
    with client.app.state.resources.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(UnknownFace)))


def test_unknowns_are_kept_only_where_the_collection_opts_in(client) -> None:
    _calibrate(client, 0.5)  # an empty gallery: every query is nobody
    off = _identify(client, png(1, 1))
    assert off["known"] is False and off["unknown_id"] is None and _kept(client) == 0

    patched = client.patch("/collections/default", json={"unknowns_days": 30})
    assert patched.status_code == 200, patched.text
    assert patched.json()["unknowns_days"] == 30
    first, again = _identify(client, png(1, 1)), _identify(client, png(1, 1))

    assert first["unknown_id"] is not None and again["unknown_id"] != first["unknown_id"]
    # The same face twice: the second joins the first's cluster.
    assert again["cluster_id"] == first["cluster_id"]
    clusters = client.get("/identities/unknowns").json()
    assert clusters["count"] == 1
    (cluster,) = clusters["data"]
    assert cluster["size"] == 2 and cluster["cohesion"] == pytest.approx(1.0, abs=1e-5)
    assert {m["id"] for m in cluster["members"]} == {first["unknown_id"], again["unknown_id"]}
    image = client.get(cluster["members"][0]["uri"])
    assert image.status_code == 200 and image.content == png(1, 1)
    assert image.headers["cache-control"] == "private, no-store"

    enrolled = client.post(f"/identities/unknowns/clusters/{cluster['id']}/enroll",
                           json={"label": "visitor"})

    assert enrolled.status_code == 200, enrolled.text
    body = enrolled.json()
    assert body["change"]["action"] == "enroll" and body["change"]["to_label"] == "visitor"
    assert len(set(body["item_ids"])) == 1  # the same bytes twice: one gallery item
    assert client.get("/identities").json()["data"] == [{"label": "visitor", "items": 1}]
    assert client.get("/identities/unknowns").json()["count"] == 0 and _kept(client) == 0
    assert client.get(cluster["members"][0]["uri"]).status_code == 404
    assert client.get(f"/gallery/{body['item_ids'][0]}/image").content == png(1, 1)
    # Enrolled: the same face is now someone.
    _calibrate(client, 0.5)
    assert _identify(client, png(1, 1))["label"] == "visitor"


def test_a_dismissed_cluster_and_expired_unknowns_leave_nothing(client) -> None:
    _calibrate(client, 0.5)
    client.patch("/collections/default", json={"unknowns_days": 1})
    kept = _identify(client, png(2, 1))
    media = client.app.state.resources.media
    assert any(True for _ in media.stored_keys())
    dismissed = client.post(f"/identities/unknowns/clusters/{kept['cluster_id']}/dismiss")
    assert dismissed.json() == {"removed": 1}
    assert _kept(client) == 0 and list(media.stored_keys()) == []
    assert client.post(f"/identities/unknowns/clusters/{kept['cluster_id']}/dismiss"
                       ).status_code == 404

    # Retention: an unknown older than the collection's days is gone when the next is kept.
    old = _identify(client, png(3, 1))
    with client.app.state.resources.sessions.begin() as session:
        row = session.get(UnknownFace, old["unknown_id"])
        row.created_at = row.created_at.replace(year=row.created_at.year - 1)
    _identify(client, png(4, 1))
    with client.app.state.resources.sessions() as session:
        ids = set(session.scalars(select(UnknownFace.id)))
    assert old["unknown_id"] not in ids and len(ids) == 1


def test_the_pool_is_for_writers_only_even_on_a_public_collection(make_local_client) -> None:
    with make_local_client(api_key=API_KEY) as client:
        _calibrate(client, 0.5)
        assert client.patch("/collections/default", json={"unknowns_days": 7},
                            headers=KEYED).status_code == 200
        kept = _identify(client, png(1, 2))
        assert kept["unknown_id"] is not None
        reader = client.post("/keys", json={"name": "viewer", "roles": {"default": "read"}},
                             headers=KEYED).json()["key"]
        uri = f"/identities/unknowns/{kept['unknown_id']}/image"
        assert client.get("/identities/unknowns").status_code == 401
        assert client.get(uri).status_code == 401
        assert client.get(uri, headers={"X-API-Key": reader}).status_code == 403
        assert client.get(uri, headers=KEYED).status_code == 200
        assert client.get("/identities/unknowns", headers=KEYED).json()["count"] == 1


@pytest.mark.parametrize("body", [{"unknowns_days": -1}, {"unknowns_days": 3651},
                                  {"unknowns_days": "7"}, {"unknowns_days": 1.5}, {}])
def test_bad_retention_settings_are_422(local_client, body) -> None:
    response = local_client.patch("/collections/default", json=body)
    assert response.status_code == 422, response.text
    assert local_client.get("/collections").json()["collections"][0]["unknowns_days"] == 0


def test_deleting_a_collection_removes_its_kept_unknowns_images(client) -> None:
    from imgret.gallery.media.files import sha256_hex
    from imgret.gallery.storage.tables import Collection, ModelVersion, utcnow

    assert client.post("/collections", json={"name": "shop"}).status_code == 201
    resources = client.app.state.resources
    image = png(6, 6)
    sha = sha256_hex(image)
    with resources.sessions.begin() as session:
        (path,) = resources.media.put_many([(image, sha)], session=session)
    with resources.engine.begin() as connection:  # a row of the shop's pool, as keep writes it
        shop = connection.execute(select(Collection.id).where(Collection.name == "shop")
                                  ).scalar_one()
        version = connection.execute(select(ModelVersion.id).where(
            ModelVersion.collection_id == shop)).scalar_one()
        connection.execute(UnknownFace.__table__.insert().values(
            collection_id=shop, sha256=sha, media_path=path, content_type="image/png",
            model_version_id=version, dim=16, vector=b"\0" * 64, score=None, cluster_id=None,
            created_at=utcnow()))
    assert sha in set(resources.media.stored_keys())

    assert client.delete("/collections/shop").status_code == 204

    assert sha not in set(resources.media.stored_keys())
    with resources.engine.connect() as connection:  # the rows went with the collection
        assert connection.execute(select(func.count()).select_from(UnknownFace.__table__)
                                  ).scalar_one() == 0
