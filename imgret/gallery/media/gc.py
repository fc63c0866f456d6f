"""Removing image bytes that no row refers to any more: after a delete, and at start-up.

A delete must remove the bytes (face and person galleries), crash-safely:

1. the delete transaction marks the row deleted and drops its embeddings, and commits;
2. a second transaction takes the gallery write lock, finds the hashes that no live gallery
   item and no query item refers to any more, and unlinks their files before releasing it.

Writers store media files only while holding the same lock, so step 2 can never remove bytes
that a new row is about to point to (the same image uploaded again at that moment). A crash
between 1 and 2 leaves unreferenced files behind; so does a crash of an upload after its file
was written and before its rows committed. :func:`sweep_media` removes both kinds at
start-up of every API process, together with temporary files of writes that were killed.

With the database backend (``imgret.gallery.media.blobs``) step 2 deletes the ``media_blobs`` rows
in its own transaction, the one that found them unreferenced: when it commits, the bytes are gone
for every process. An upload's blobs commit or roll back with its rows, so only a crash
between 1 and 2 leaves something for the sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sqlalchemy.orm import Session, sessionmaker

from imgret.gallery.media.files import MediaBackend
from imgret.gallery.storage import item_store

logger = logging.getLogger(__name__)


def purge_media(
    sha256s: Iterable[str], *, session_factory: sessionmaker[Session], media: MediaBackend
) -> int:
    """Remove the stored bytes of these hashes if no row refers to them any more.

    Returns:
        How many images were removed.
    """
    wanted = set(sha256s)
    if not wanted:
        return 0
    with session_factory.begin() as session:
        item_store.lock_gallery_writes(session=session)
        gone = item_store.unreferenced_media(wanted, session=session)
        return media.remove(gone, session=session)


def sweep_media(*, session_factory: sessionmaker[Session], media: MediaBackend) -> int:
    """Remove every stored image no row refers to, and temporary files of killed writes;
    clear the personal data that deleted rows still hold
    (:func:`imgret.gallery.storage.item_store.clear_deleted_items`:
    rows deleted before deletes cleared it, or restored from an older backup).

    Images that rows refer to but the store lacks are only counted and logged as an error:
    nothing here can bring them back, and the usual cause is a changed
    ``IMGRET_MEDIA_BACKEND`` on a gallery filled under the other one (its images then answer
    404), which the operator must hear about at start-up rather than from users.

    Returns:
        How many images were removed.
    """
    with session_factory.begin() as session:
        cleared = item_store.clear_deleted_items(connection=session)
    if cleared:
        logger.info("cleared the personal data (label, camera, metadata, source, hash) of %d "
                    "deleted gallery items, deleted before deletes cleared it", cleared)
    removed, referenced, stored = remove_unreferenced(session_factory=session_factory,
                                                      media=media)
    if removed:
        logger.info("removed %d stored images that no gallery or query item refers to", removed)
    missing = len(referenced - stored)
    if missing:
        logger.error(
            "%d of the %d images that gallery or query items refer to are not in the %s media "
            "store (IMGRET_MEDIA_BACKEND=%s): they answer 404. If the gallery was filled with "
            "the other backend, set IMGRET_MEDIA_BACKEND back to it, or stop the servers and "
            "move the images with `imgret media migrate --to %s`", missing, len(referenced),
            media.backend, media.backend, media.backend)
    return removed


def remove_unreferenced(
    *, session_factory: sessionmaker[Session], media: MediaBackend
) -> tuple[int, set[str], set[str]]:
    """Remove the temporary files of killed writes and every stored image no row refers to.

    The store is listed without the lock (it may be large); the database is asked, and the
    images removed, under it.

    Returns:
        How many images were removed, the keys rows refer to, and the keys that were stored.
    """
    media.sweep_temporaries()
    stored = set(media.stored_keys())
    with session_factory.begin() as session:
        item_store.lock_gallery_writes(session=session)
        referenced = item_store.referenced_media(session=session)
        removed = media.remove(stored - referenced, session=session) if stored else 0
    return removed, referenced, stored
