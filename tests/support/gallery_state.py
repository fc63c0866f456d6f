"""What the database, a server's index and the data dir each say about the gallery.

Shared by the concurrency and crash-safety tests, which compare the three after running
real ``imgret serve`` processes: the live items in SQL (the truth), the ids a server's
in-memory index returns, the media files on disk and the saved index with its manifest.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import select

from imgret.errors import IndexStale
from imgret.gallery.media.files import MediaStore, sha256_hex
from imgret.gallery.search.faiss_index import read_index, stored_ids
from imgret.gallery.search.manifest import Manifest, ids_checksum, index_dir
from imgret.gallery.storage import change_log, item_store, query_set_store
from imgret.gallery.storage.db import make_engine, make_sessionmaker
from imgret.gallery.storage.tables import GalleryItem
from imgret.gallery.versions import version_store
from tests.support.images import class_image, image_bytes

# Writes and /evaluate carry this key: the servers under test are started with it, so the
# tests do not depend on whether a keyless loopback server accepts anonymous writes.
API_KEY = "imgret-test-key"
KEY_HEADERS = {"X-API-Key": API_KEY}
K_MAX = 1000  # the API's largest k: "every id in the index" for the galleries used here


def server_env(*, data_dir: Path, db_url: str, checkpoint: Path, device: str) -> dict[str, str]:
    """The ``IMGRET_*`` environment of a test server."""
    return {
        "IMGRET_DATA_DIR": str(data_dir),
        "IMGRET_DATABASE_URL": db_url,
        "IMGRET_MODEL": str(checkpoint),
        "IMGRET_DEVICE": device,
        "IMGRET_API_KEY": API_KEY,
    }


def png(label: int, index: int) -> bytes:
    """A distinct generated 32x32 PNG (distinct ``(label, index)`` give distinct bytes)."""
    return image_bytes(class_image(label, index))


def live_items(db_url: str) -> dict[int, str]:
    """``id -> sha256`` of every live (not deleted) gallery item, read from SQL."""
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            rows = session.execute(
                select(GalleryItem.id, GalleryItem.sha256).where(GalleryItem.deleted_at.is_(None))
            ).all()
    finally:
        engine.dispose()
    return {int(i): sha for i, sha in rows}


def index_ids(base: str, probe: bytes, *, timeout: float = 60) -> set[int]:
    """Every id a server's index returns: one search with the largest ``k``.

    Raises:
        AssertionError: the index is larger than ``K_MAX`` (this helper would miss ids).
    """
    size = httpx.get(f"{base}/health", timeout=timeout).json()["index_size"]
    assert size <= K_MAX, f"index of {size} vectors: too big to list with one search"
    response = httpx.post(f"{base}/search", files={"image": ("p.png", probe, "image/png")},
                          data={"k": str(K_MAX)}, timeout=timeout)
    assert response.status_code == 200, response.text
    return {hit["id"] for hit in response.json()["results"]}


def listed_ids(base: str, *, timeout: float = 60) -> set[int]:
    """Every id ``GET /gallery`` lists, page by page."""
    ids: set[int] = set()
    offset = 0
    while True:
        page = httpx.get(f"{base}/gallery", params={"offset": offset, "limit": 1000},
                         timeout=timeout)
        assert page.status_code == 200, page.text
        data = page.json()["data"]
        ids.update(item["id"] for item in data)
        if len(data) < 1000:
            return ids
        offset += len(data)


def media_file(data_dir: Path, sha256: str) -> Path:
    """Where the media store keeps the bytes with this hash (``media/ab/cd/<sha256>``)."""
    return MediaStore.in_data_dir(data_dir).path(sha256)


def temp_files(data_dir: Path) -> list[Path]:
    """Leftover temporary files (dot-names) under the media store and the index folders."""
    found = []
    for folder in (data_dir / "media", data_dir / "indexes"):
        if folder.is_dir():
            found.extend(p for p in folder.rglob(".*") if p.is_file())
    return sorted(found)


def manifest_problems(data_dir: Path, db_url: str, model_version: str) -> list[str]:
    """Why the saved index and its manifest do not describe the database (empty when they do).

    The same test a starting server applies before trusting a saved index, done
    independently: the file's checksum equals the manifest's, its live ids equal the
    manifest's count and id checksum, the manifest's change sequence is not ahead of the
    database, and replaying the change log after it gives exactly the database's live items.
    """
    folder = index_dir(data_dir, model_version)
    try:
        manifest = Manifest.read(folder)
        index = read_index(folder, manifest.index_sha256)
    except IndexStale as exc:
        return [f"saved index unusable: {exc}"]
    problems = []
    tombstones = np.asarray(manifest.tombstones, dtype=np.int64)
    live = np.setdiff1d(stored_ids(index), tombstones)
    if len(live) != manifest.count or ids_checksum(live) != manifest.ids_sha256:
        problems.append(f"index file holds {len(live)} live ids, manifest says {manifest.count}"
                        " (or another id set)")
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            db_seq = change_log.max_change_seq(session=session)
            changes = change_log.changes_after(manifest.change_seq, session=session,
                                               limit=10_000_000)
    finally:
        engine.dispose()
    if manifest.change_seq > db_seq:
        problems.append(f"manifest at change {manifest.change_seq}, database at {db_seq}")
    ids = set(live.tolist())
    for change in changes:
        if change.op == "delete":
            ids.discard(change.item_id)
        else:
            ids.add(change.item_id)
    truth = set(live_items(db_url))
    if ids != truth:
        problems.append(
            f"saved index + change log replay != database: missing {sorted(truth - ids)[:20]}, "
            f"extra {sorted(ids - truth)[:20]}"
        )
    return problems


def add_query_item(sessions, data: bytes, *, model_version: str, dim: int,
                   query_set: str = "q") -> None:
    """Store ``data`` as an item of a query set (a zero vector), referring to the same media
    key as a gallery item with those bytes: the bytes then outlive that item's delete."""
    key = sha256_hex(data)
    with sessions.begin() as session:
        version = version_store.get_model_version(session=session, version=model_version)
        target = query_set_store.get_or_create_query_set(query_set, session=session)
        item_store.insert_items(
            [item_store.NewRow(key, MediaStore.relative_path(key), "image/png", "x")],
            np.zeros((1, dim), np.float32), session=session, model_version=version,
            query_set=target,
        )
