"""What other processes committed to the gallery, read for a Searcher: the deletes to catch
up on before each search, and pages of the change log to replay (replicas follow it; a load
or rebuild catches up with it)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Container
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import DatabaseError
from imgret.gallery.storage import change_log, vector_store
from imgret.gallery.storage.scope import collection_of_factory
from imgret.gallery.storage.vector_store import VectorPage
from imgret.gallery.versions import version_store


@dataclass(frozen=True)
class ChangePage:
    """One page of the change log, reduced to the last word on each item.

    Attributes:
        deletes: ids whose last change is a delete.
        adds: stored embeddings of the added ids not yet in the index (``None``: none);
            items without an embedding of the model version are left out.
        last_seq: the sequence number of the page's last change.
        rows: change rows read.
    """

    deletes: list[int]
    adds: VectorPage | None
    last_seq: int
    rows: int


class ChangeLog:
    """Reads a gallery database's change log for the Searcher of one model version.

    Args:
        session_factory: sessions on the gallery database.
        model_version: whose embeddings added items bring.
        deletes_seq: the position of the last deletes catch-up (the index's change_seq).
    """

    def __init__(self, session_factory: sessionmaker[Session], model_version: str,
                 deletes_seq: int):
        self.session_factory = session_factory
        self.model_version = model_version
        # One replay at a time; a rebuild holds it from its swap through its catch-up.
        self.replay_lock = threading.Lock()
        self._deletes_lock = threading.Lock()
        self._deletes_seq = deletes_seq
        self._collection_id = collection_of_factory(session_factory)

    def sync_deletes(self, remove: Callable[[list[int]], object]) -> int:
        """Pass the ids that any process deleted since the last call to ``remove`` (one
        indexed query); the position moves on once ``remove`` has returned.

        Returns:
            How many ids the deletes named.

        Raises:
            DatabaseError: the database cannot be read.
        """
        with self._deletes_lock:
            try:
                with self.session_factory.kw["bind"].connect() as connection:
                    deleted, seq = change_log.deletes_after(
                        self._deletes_seq, connection=connection,
                        collection_id=self._collection_id)
            except SQLAlchemyError as exc:
                raise DatabaseError(
                    f"cannot read the gallery's deletes from the database: "
                    f"{type(exc).__name__}"
                ) from None
            if deleted:
                remove(deleted)
            self._deletes_seq = max(self._deletes_seq, seq)
            return len(deleted)

    def read_page(self, after_seq: int, indexed: Container[int],
                  page_size: int) -> ChangePage | None:
        """The changes after ``after_seq`` (at most ``page_size``); ``None`` when there are
        none. Adds of ids already ``indexed`` need no vectors and are left out."""
        with self.session_factory() as session:
            changes = change_log.changes_after(after_seq, session=session, limit=page_size)
            if not changes:
                return None
            last_op: dict[int, str] = {}
            for change in changes:
                last_op[change.item_id] = change.op  # the last word on each item
            adds = [i for i, op in last_op.items() if op == "add" and i not in indexed]
            deletes = [i for i, op in last_op.items() if op == "delete"]
            vectors = None
            if adds:
                version = version_store.get_model_version(session=session,
                                                          version=self.model_version)
                vectors = vector_store.fetch_vectors(adds, session=session, model_version=version)
        return ChangePage(deletes, vectors, changes[-1].seq, len(changes))
