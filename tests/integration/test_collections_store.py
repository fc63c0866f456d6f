"""Collections in the database, on both backends: every store read and write of one
collection's session sees only its rows, a shared image is one file that survives a delete
elsewhere, and deleting a collection removes everything it owned and nothing else."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import func, select, text

from imgret.gallery.media.files import MediaStore, sha256_hex
from imgret.gallery.storage import change_log, item_store, query_set_store, vector_store
from imgret.gallery.storage.db import make_sessionmaker
from imgret.gallery.storage.scope import ALL_COLLECTIONS
from imgret.gallery.storage.tables import (
    Collection,
    Embedding,
    GalleryChange,
    GalleryItem,
    ModelCheckpoint,
    ModelVersion,
    QueryItem,
)
from imgret.gallery.tenancy import collections
from imgret.gallery.versions import intake, version_store


def _unit(n: int, seed: int) -> np.ndarray:
    vectors = np.random.default_rng(seed).normal(size=(n, 16)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _add(sessions, media: MediaStore, blobs: list[bytes], labels: list[str],
         query_set: str | None = None) -> list[int]:
    rows = []
    for blob, label in zip(blobs, labels, strict=True):
        rows.append(item_store.NewRow(sha256_hex(blob), media.put(blob), "image/png", label))
    with sessions.begin() as session:
        version = version_store.active_model_version(session=session)
        qs = query_set_store.get_or_create_query_set(query_set,
                                                     session=session) if query_set else None
        return item_store.insert_items(rows, _unit(len(rows), len(blobs)), session=session,
                                       model_version=version, query_set=qs)


@pytest.fixture
def two(sessions, tmp_path, tiny_checkpoint):
    """``default`` serving the tiny model, and ``shop`` bound to the same checkpoint."""
    intake.register_checkpoint(tiny_checkpoint, session_factory=sessions, data_dir=tmp_path)
    info = collections.create("shop", session_factory=sessions)
    shop = make_sessionmaker(sessions.kw["bind"], info.id)
    return sessions, shop


def test_each_session_reads_and_writes_only_its_collection(two, tmp_path) -> None:
    default, shop = two
    media = MediaStore(tmp_path / "media")
    same = b"\x89PNG same bytes in both"
    ours = _add(default, media, [same, b"\x89PNG only default"], ["a", "b"])
    theirs = _add(shop, media, [same], ["z"])
    _add(shop, media, [b"\x89PNG a query"], ["z"], query_set="q")
    with default() as session, shop() as other:
        # One checkpoint, two bound versions: each collection serves its own row.
        mine, yours = (version_store.active_model_version(session=s) for s in (session, other))
        assert mine.version == yours.version and mine.id != yours.id
        assert [i.id for i in item_store.list_items(session=session)[0]] == ours
        assert [i.id for i in item_store.list_items(session=other)[0]] == theirs
        assert item_store.count_live_items(session=session) == 2
        assert item_store.get_item(theirs[0], session=session) is None  # session.get is filtered
        assert set(item_store.get_items(ours + theirs, session=other)) == set(theirs)
        assert item_store.find_items([sha256_hex(same)], session=session) == \
            {sha256_hex(same): ours[0]}
        assert {c.item_id for c in change_log.changes_after(0, session=other)} == set(theirs)
        assert [r.version for r in version_store.list_model_versions(session=other)] == \
            [yours.version]
        assert query_set_store.query_set_sizes(session=session) == []
        with pytest.raises(Exception, match="unknown query set"):
            query_set_store.load_query_set("q", session=session)
        # The vectors an index is built from are the collection's own.
        pages = list(vector_store.iter_vector_pages(session=other, model_version=yours))
        assert [int(i) for p in pages for i in p.ids] == theirs
    # A delete through the wrong collection's session touches nothing.
    with default.begin() as session:
        assert item_store.delete_items(theirs, session=session) == []
        deleted = item_store.delete_items([ours[0]], session=session)
    # The shared image is still used by ``shop``: its bytes stay.
    with default() as session:
        assert item_store.unreferenced_media([deleted[0].sha256], session=session) == set()
        assert item_store.referenced_media(session=session) >= {sha256_hex(same)}
    with default.kw["bind"].connect() as connection:
        gone, _ = change_log.deletes_after(0, connection=connection, collection_id=1)
        assert gone == [ours[0]]
        assert change_log.deletes_after(0, connection=connection, collection_id=2)[0] == []


def test_deleting_a_collection_removes_all_it_owned_and_nothing_else(two, tmp_path) -> None:
    default, shop = two
    media = MediaStore(tmp_path / "media")
    same, own = b"\x89PNG shared", b"\x89PNG only the shop's"
    kept = _add(default, media, [same], ["a"])
    _add(shop, media, [same, own], ["x", "y"])
    _add(shop, media, [b"\x89PNG shop query"], ["x"], query_set="q")
    assert collections.delete("shop", session_factory=default, media=media,
                              data_dir=tmp_path) == 2
    every = make_sessionmaker(default.kw["bind"], None)
    with every() as session:
        assert session.scalars(select(Collection.name)).all() == ["default"]
        counts = {table.__name__: session.scalar(select(func.count()).select_from(table))
                  for table in (GalleryItem, Embedding, GalleryChange, ModelVersion,
                                ModelCheckpoint, QueryItem)}
    assert counts == {"GalleryItem": 1, "Embedding": 1, "GalleryChange": 1, "ModelVersion": 1,
                      "ModelCheckpoint": 1, "QueryItem": 0}
    assert media.exists(sha256_hex(same)) and not media.exists(sha256_hex(own))
    with default() as session:
        assert [i.id for i in item_store.list_items(session=session)[0]] == kept
    with pytest.raises(collections.CollectionNotFound):
        collections.delete("shop", session_factory=default, media=media, data_dir=tmp_path)
    # The name is free again, under a new id (index files are named by id).
    assert collections.create("shop", session_factory=default).id > 2


@pytest.mark.parametrize("name", ["", "Shop", "a" * 65, "-x", "a/b", "a b", "é", "default",
                                  "all", "x\x00"])
def test_bad_names_are_refused_and_create_nothing(two, name: str) -> None:
    default, _ = two
    with pytest.raises(ValueError):
        collections.create(name, session_factory=default)
    with pytest.raises(collections.CollectionExists):
        collections.create("shop", session_factory=default)
    assert [c.name for c in collections.describe(session_factory=default)] == ["default", "shop"]


def test_a_session_over_every_collection_sees_all_and_cannot_add(two, tmp_path) -> None:
    default, shop = two
    media = MediaStore(tmp_path / "media")
    _add(default, media, [b"\x89PNG 1"], ["a"])
    _add(shop, media, [b"\x89PNG 2"], ["b"])
    every = make_sessionmaker(default.kw["bind"], None)
    with every() as session:
        assert session.scalar(select(func.count()).select_from(GalleryItem)) == 2
        assert session.scalar(
            select(func.count()).select_from(GalleryItem)
            .execution_options(**{ALL_COLLECTIONS: True})) == 2
    with default() as session:
        assert session.scalar(select(func.count()).select_from(GalleryItem)) == 1
        # Raw SQL is not filtered: it is the explicit way out, used by migrations and backups.
        assert session.scalar(text("SELECT count(*) FROM gallery_items")) == 2
    with pytest.raises(ValueError, match="every collection"), every.begin() as session:
        query_set_store.get_or_create_query_set("q", session=session)
