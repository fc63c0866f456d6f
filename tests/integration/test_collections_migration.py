"""Migration 0007 on a populated gallery, both ways, on both databases.

A gallery filled by today's code (items with vectors, deletes, a query set, a second version,
a calibration) plus a second collection is downgraded to 0006, the single-gallery schema:
the default gallery's rows all stay, the other collection's go, and no foreign key points
nowhere. Upgraded again, that single-gallery database becomes ``default`` with every item
still found by search (each live item's own vector finds it first) and nothing else
changed."""

from __future__ import annotations

import numpy as np
from sqlalchemy import inspect, text

from imgret.gallery.media.files import MediaStore, sha256_hex
from imgret.gallery.search import Searcher
from imgret.gallery.storage import item_store, query_set_store, vector_store
from imgret.gallery.storage.db import downgrade, make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.tables import Base
from imgret.gallery.tenancy import collections
from imgret.gallery.versions import intake, version_store

COUNTED = ("gallery_items", "embeddings", "gallery_changes", "model_versions",
           "model_activations", "query_sets", "query_items", "query_embeddings",
           "model_checkpoints")


def _counts(engine) -> dict[str, int]:
    with engine.connect() as connection:
        return {t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()
                for t in COUNTED}


def _fill(sessions, media: MediaStore, n: int, label: str, seed: int,
          query_set: str | None = None) -> list[int]:
    rows, vectors = [], np.random.default_rng(seed).normal(size=(n, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for i in range(n):
        blob = f"{label}-{i}".encode()
        rows.append(item_store.NewRow(sha256_hex(blob), media.put(blob), "image/png",
                                      f"{label}{i % 5}"))
    with sessions.begin() as session:
        version = version_store.active_model_version(session=session)
        qs = query_set_store.get_or_create_query_set(query_set,
                                                     session=session) if query_set else None
        return item_store.insert_items(rows, vectors, session=session, model_version=version,
                                       query_set=qs)


def test_a_populated_gallery_goes_down_to_one_gallery_and_up_into_default(
    db_url: str, tmp_path, tiny_checkpoint
) -> None:
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    default = make_sessionmaker(engine)
    media = MediaStore(tmp_path / "media")
    intake.register_checkpoint(tiny_checkpoint, session_factory=default, data_dir=tmp_path)
    ids = _fill(default, media, 60, "a", 0)
    _fill(default, media, 8, "q", 1, query_set="queries")
    with default.begin() as session:
        item_store.delete_items(ids[:5], session=session)
    live = ids[5:]
    shop = make_sessionmaker(engine, collections.create("shop", session_factory=default).id)
    newest = max(_fill(shop, media, 30, "s", 2))
    _fill(shop, media, 4, "sq", 4, query_set="shop-queries")
    with_shop = _counts(engine)
    engine.dispose()

    # Down: one gallery, the default one's rows exactly.
    downgrade(db_url, "0006")
    engine = make_engine(db_url)
    single = _counts(engine)
    assert with_shop["gallery_items"] == 90 and with_shop["model_versions"] == 2
    assert single == {"gallery_items": 60, "embeddings": 55,
                      "gallery_changes": 65, "model_versions": 1, "model_activations": 1,
                      "query_sets": 1, "query_items": 8, "query_embeddings": 8,
                      "model_checkpoints": 1}
    with engine.connect() as connection:
        assert "collection_id" not in {
            c["name"] for c in inspect(connection).get_columns("gallery_items")}
        if engine.dialect.name == "sqlite":
            assert connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall() == []
    engine.dispose()

    # Up: the single gallery becomes ``default``, every row kept, every live item found.
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    assert _counts(engine) == single
    default = make_sessionmaker(engine)
    assert [c.name for c in collections.describe(session_factory=default)] == ["default"]
    with default() as session:
        assert [i.id for i in item_store.list_items(session=session, limit=100)[0]] == live
        version = version_store.active_model_version(session=session)
        page = vector_store.fetch_vectors(live, session=session, model_version=version)
        items, _ = query_set_store.load_query_set("queries", session=session, model_version=version)
        assert len(items) == 8
    searcher = Searcher.open(default, tmp_path / "indexes", "Flat", version.version)
    hits = searcher.search(page.vectors, k=1)
    assert [h[0].id for h in hits] == [int(i) for i in page.ids] == live
    # Writes work in the migrated gallery, and ids are never reused (the shop's top ids were
    # deleted by the downgrade).
    assert min(_fill(default, media, 3, "new", 3)) > newest
    if engine.dialect.name == "sqlite":
        with engine.connect() as connection:
            tables = dict(connection.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'table'").all())
        declared = [t.name for t in Base.metadata.sorted_tables
                    if t.dialect_options["sqlite"].get("autoincrement")]
        assert [t for t in declared if "AUTOINCREMENT" not in tables[t]] == []
    assert collections.create("shop", session_factory=default).items == 0
    engine.dispose()


def test_query_vectors_made_across_collections_are_removed_and_the_rest_kept(
    db_url: str, tmp_path, tiny_checkpoint
) -> None:
    """Migration 0009: a vector of one collection's query item under another collection's
    version (what re-embedding jobs used to make) goes; a collection's own stay."""
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    default = make_sessionmaker(engine)
    media = MediaStore(tmp_path / "media")
    intake.register_checkpoint(tiny_checkpoint, session_factory=default, data_dir=tmp_path)
    shop = make_sessionmaker(engine, collections.create("shop", session_factory=default).id)
    _fill(default, media, 4, "own", 2, query_set="faces")
    _fill(shop, media, 3, "theirs", 3, query_set="cams")
    downgrade(db_url, "0008")
    with engine.begin() as connection:
        shop_version = connection.execute(text(
            "SELECT mv.id FROM model_versions mv JOIN collections c ON c.id = mv.collection_id"
            " WHERE c.name = 'shop'")).scalar_one()
        connection.execute(text(
            "INSERT INTO query_embeddings (model_version_id, query_item_id, dim, vector,"
            " created_at) SELECT :v, qe.query_item_id, qe.dim, qe.vector, qe.created_at"
            " FROM query_embeddings qe JOIN query_items qi ON qi.id = qe.query_item_id"
            " JOIN query_sets qs ON qs.id = qi.query_set_id WHERE qs.name = 'faces'"),
            {"v": shop_version})
    assert _counts(engine)["query_embeddings"] == 4 + 3 + 4
    upgrade_to_head(db_url)
    with engine.connect() as connection:
        kept = connection.execute(text(
            "SELECT qs.name, count(*) FROM query_embeddings qe"
            " JOIN query_items qi ON qi.id = qe.query_item_id"
            " JOIN query_sets qs ON qs.id = qi.query_set_id"
            " JOIN model_versions mv ON mv.id = qe.model_version_id"
            " WHERE mv.collection_id = qs.collection_id GROUP BY qs.name")).all()
    assert _counts(engine)["query_embeddings"] == 4 + 3
    assert dict(kept) == {"faces": 4, "cams": 3}
    engine.dispose()
