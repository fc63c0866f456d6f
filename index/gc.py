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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sqlalchemy.orm import Session, sessionmaker

from imgret.files import remove_stale_temps
from index import store
from index.media import MediaStore

logger = logging.getLogger(__name__)


def purge_media(
    sha256s: Iterable[str], *, session_factory: sessionmaker[Session], media: MediaStore
) -> int:
    """Remove the files of these hashes if no row refers to them any more.

    Returns:
        How many files were removed.
    """
    wanted = set(sha256s)
    if not wanted:
        return 0
    with session_factory.begin() as session:
        store.lock_gallery_writes(session=session)
        gone = store.unreferenced_media(wanted, session=session)
        return media.remove(gone)


def sweep_media(*, session_factory: sessionmaker[Session], media: MediaStore) -> int:
    """Remove every stored file no row refers to, and temporary files of killed writes.

    The store is listed without the lock (it may be large); the database is asked, and the
    files removed, under it.

    Returns:
        How many image files were removed.
    """
    remove_stale_temps(media.root)
    candidates = set(media.stored_keys())
    if not candidates:
        return 0
    with session_factory.begin() as session:
        store.lock_gallery_writes(session=session)
        unreferenced = candidates - store.referenced_media(session=session)
        removed = media.remove(unreferenced)
    if removed:
        logger.info("removed %d image files that no gallery or query item refers to", removed)
    return removed
