"""Deletes are final and acknowledged adds are real, on SQLite and PostgreSQL.

Each test replays one interleaving that could break a guarantee, in the order that exposes it:
a late ``Searcher.add`` after a delete, a replica that had not polled yet, a dedup answer read
before a concurrent delete committed, a re-embedding of an item deleted meanwhile, image
bytes left on disk after a delete.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from imgret.gallery.ingest import NewItem, add_items
from imgret.gallery.media.files import sha256_hex
from imgret.gallery.media.gc import purge_media, sweep_media
from imgret.gallery.search import Searcher
from imgret.gallery.storage import change_log, item_store, vector_store
from imgret.gallery.versions import version_store
from tests.support.gallery_state import add_query_item
from tests.support.images import class_image, image_bytes
from tests.support.threads import run_in_threads


def _open(sessions, tmp_path, embedder) -> Searcher:
    return Searcher.open(sessions, tmp_path / "data", model_version=embedder.model_version,
                         dim=embedder.dim, save=False)


def _add(sessions, media, embedder, *images: bytes, label: str = "x"):
    return add_items([NewItem(data, label) for data in images], session_factory=sessions,
                     media=media, embedder=embedder)


def _delete(sessions, ids) -> list[item_store.DeletedItem]:
    with sessions.begin() as session:
        return item_store.delete_items(ids, session=session)


def _found(searcher: Searcher, vector: np.ndarray, item_id: int) -> bool:
    return item_id in {hit.id for hit in searcher.search(vector, 50)[0]}


def test_an_add_that_arrives_after_the_delete_does_not_revive_the_item(sessions, media,
                                                                      embedder, tmp_path):
    """POST /gallery commits, a DELETE of the new id commits and updates the index, and only
    then does the POST's own index update run (the order of the old race)."""
    searcher = _open(sessions, tmp_path, embedder)
    added = _add(sessions, media, embedder, image_bytes(class_image(1, 0)))
    (item_id,) = added.ids
    _delete(sessions, [item_id])
    searcher.remove([item_id])  # a no-op for the index: the id is not in it yet
    searcher.add(added.vector_ids, added.vectors, added.infos)  # the late add
    assert not _found(searcher, added.vectors[0], item_id)
    assert searcher.size == 0


def test_a_replay_that_fetched_vectors_before_the_delete_does_not_revive_it(
        sessions, media, embedder, tmp_path):
    searcher = _open(sessions, tmp_path, embedder)
    added = _add(sessions, media, embedder, image_bytes(class_image(2, 0)))
    (item_id,) = added.ids
    with sessions() as session:  # the follower read the add and its vector ...
        version = version_store.get_model_version(session=session, version=embedder.model_version)
        page = vector_store.fetch_vectors([item_id], session=session, model_version=version)
    _delete(sessions, [item_id])  # ... a delete committed and was applied ...
    searcher.remove([item_id])
    searcher.add(page.ids, page.vectors, page.infos)  # ... then the follower added it
    assert not _found(searcher, added.vectors[0], item_id)


def test_a_delete_made_by_another_process_holds_for_the_next_search(sessions, media,
                                                                   embedder, tmp_path):
    """Two Searchers on one database stand for two API processes: a delete committed through
    one is honoured by the other's very next search, with no polling in between."""
    added = _add(sessions, media, embedder, image_bytes(class_image(3, 0)),
                 image_bytes(class_image(3, 1)))
    here, there = _open(sessions, tmp_path, embedder), _open(sessions, tmp_path, embedder)
    victim, survivor = added.ids
    assert _found(there, added.vectors[0], victim)
    _delete(sessions, [victim])
    here.remove([victim])  # the process that took the DELETE
    assert not _found(there, added.vectors[0], victim)
    assert _found(there, added.vectors[1], survivor)
    # A late replay of the old add cannot bring it back either.
    there.add(added.vector_ids[:1], added.vectors[:1], added.infos[:1])
    assert not _found(there, added.vectors[0], victim)


def test_dedup_waits_for_a_concurrent_delete_instead_of_acknowledging_a_deleted_item(
        sessions, media, embedder):
    """The same bytes are uploaded while a delete of the live item holding them is in flight:
    the upload must not answer with the id being deleted."""
    data = image_bytes(class_image(4, 0))
    (old_id,) = _add(sessions, media, embedder, data).ids
    result: dict[str, object] = {}
    deleting = sessions.begin()
    session = deleting.__enter__()
    try:
        item_store.delete_items([old_id], session=session)  # holds the gallery write lock
        upload = threading.Thread(
            target=lambda: result.update(added=_add(sessions, media, embedder, data))
        )
        upload.start()
        time.sleep(0.5)  # the upload plans, embeds, then waits for the lock
        assert upload.is_alive(), "the upload did not wait for the delete's lock"
    finally:
        deleting.__exit__(None, None, None)  # commit the delete
    upload.join(30)
    added = result["added"]
    assert added.ids != [old_id] and added.created == [True]
    with sessions() as check:
        assert item_store.get_item(added.ids[0], session=check) is not None
    assert media.exists(sha256_hex(data))  # the new item's bytes stayed


def test_two_uploads_of_the_same_new_bytes_at_once_make_one_item(sessions, media, embedder):
    data = image_bytes(class_image(5, 0))
    # Without the unique-key retry: an IntegrityError (a 500) in all but one.
    results, errors = run_in_threads(
        lambda: _add(sessions, media, embedder, data, label="same"), 4, timeout_s=60)
    assert errors == []
    assert len({r.ids[0] for r in results}) == 1
    assert sorted(r.created[0] for r in results) == [False, False, False, True]
    assert all(r.existing[0].label == "same" for r in results if not r.created[0])


def test_re_embedding_skips_items_deleted_meanwhile(sessions, media, embedder):
    added = _add(sessions, media, embedder, image_bytes(class_image(6, 0)),
                 image_bytes(class_image(6, 1)))
    _delete(sessions, [added.ids[0]])
    with sessions.begin() as session:
        other = version_store.register_model_version(session=session, version="other-v2",
                                                     dim=embedder.dim)
        done = item_store.add_embeddings(list(added.ids), added.vectors, session=session,
                                         model_version=other)
    assert done == [added.ids[1]]
    with sessions() as session:
        ops = [(c.item_id, c.op) for c in change_log.changes_after(0, session=session)]
        other = version_store.get_model_version(session=session, version="other-v2")
        assert vector_store.fetch_vectors(added.ids, session=session,
                                          model_version=other).ids.tolist() == [added.ids[1]]
    assert (added.ids[0], "add") not in ops[3:]  # no add logged after the delete


def test_a_delete_removes_the_bytes_and_the_embeddings(sessions, media, embedder):
    data = image_bytes(class_image(7, 0))
    (item_id,) = _add(sessions, media, embedder, data).ids
    deleted = _delete(sessions, [item_id])
    assert media.exists(sha256_hex(data))  # committed; the bytes go in the second step
    assert purge_media([d.sha256 for d in deleted], session_factory=sessions, media=media) == 1
    assert not media.exists(sha256_hex(data))
    with sessions() as session:
        version = version_store.get_model_version(session=session, version=embedder.model_version)
        assert vector_store.count_vectors(session=session, model_version_id=version.id) == 0
        page = vector_store.fetch_vectors([item_id], session=session, model_version=version)
        assert len(page.ids) == 0


def test_bytes_still_referenced_by_a_query_item_are_kept(sessions, media, embedder):
    data = image_bytes(class_image(8, 0))
    (item_id,) = _add(sessions, media, embedder, data).ids
    add_query_item(sessions, data, model_version=embedder.model_version, dim=embedder.dim)
    deleted = _delete(sessions, [item_id])
    assert purge_media([d.sha256 for d in deleted], session_factory=sessions, media=media) == 0
    assert media.exists(sha256_hex(data))


def test_the_start_up_sweep_finishes_interrupted_deletes_and_uploads(sessions, media,
                                                                    embedder):
    kept, deleted, orphan = (image_bytes(class_image(9, i)) for i in range(3))
    ids = _add(sessions, media, embedder, kept, deleted).ids
    _delete(sessions, [ids[1]])  # a crash here: the bytes were never purged
    media.put(orphan)  # an upload whose rows never committed
    stale = media.path(sha256_hex(kept)).parent / ".tmp-999999999-x.partial"
    stale.write_bytes(b"half")  # a temporary file of a killed writer (no such pid)
    assert sweep_media(session_factory=sessions, media=media) == 2
    assert media.exists(sha256_hex(kept))
    assert not media.exists(sha256_hex(deleted)) and not media.exists(sha256_hex(orphan))
    assert not stale.exists()


def test_put_replaces_a_file_that_does_not_hold_its_bytes(media):
    data = image_bytes(class_image(1, 1))
    key = sha256_hex(data)
    media.put(data)
    path = media.path(key)
    path.write_bytes(bytes(len(data)))  # same size, wrong bytes (a torn write)
    media.put(data)
    assert path.read_bytes() == data
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    assert os.stat(path).st_size == len(data)
