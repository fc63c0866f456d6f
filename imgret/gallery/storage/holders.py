"""Who holds a gallery: every serving process holds a shared lock on its database for as long
as it serves, and maintenance that needs the servers stopped (``imgret media migrate``) takes
the same lock exclusively, so it is refused while any server runs and a server does not start
while it runs.

The lock belongs to the database (what both sides change), not to one machine:

- **PostgreSQL**: a session-level advisory lock (:data:`SERVING_LOCK_KEY`), shared by servers
  (``pg_try_advisory_lock_shared``), exclusive for maintenance (``pg_try_advisory_lock``), each
  held by a connection of its own (outside the engine's pool, TCP keepalive on, like the
  LISTEN connection). A process that dies lets go of it; so does one whose lock connection
  dropped (a database restart): that server serves on without it until it restarts, a gap
  no migration can see, so migrations belong to planned stops of every server.
- **SQLite**: ``flock`` on ``<database file>.serving-lock`` beside the database file, shared
  or exclusive likewise; the kernel lets go of it when the process dies. Every process of a
  SQLite gallery runs on the machine that holds its file; ``flock`` does not reach across
  network file systems, where SQLite itself is unsafe anyway.

No table and no heartbeat: a lock the database or the kernel releases with its holder cannot
go stale.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import make_url

from imgret.errors import GalleryError
from imgret.gallery.storage.notify import KEEPALIVE

logger = logging.getLogger(__name__)

# Any constant other than the gallery write lock's (imgret.gallery.storage.item_store): "serv".
SERVING_LOCK_KEY = 0x73657276
LOCK_SUFFIX = ".serving-lock"


class GalleryInUse(GalleryError):
    """The gallery is held by the other side: a server (for maintenance) or maintenance (for a
    server)."""


class GalleryLock:
    """A held lock on a gallery database; :meth:`release` lets go of it (idempotent)."""

    def __init__(self, release: Callable[[], None], description: str):
        self._release: Callable[[], None] | None = release
        self.description = description

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            with contextlib.suppress(Exception):
                release()

    def __enter__(self) -> GalleryLock:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def hold_for_serving(db_url: str) -> GalleryLock:
    """The shared lock a serving process holds for its lifetime.

    Raises:
        GalleryInUse: maintenance holds the gallery (a media migration is running).
    """
    lock = _acquire(db_url, exclusive=False)
    if lock is None:
        raise GalleryInUse(
            "a media migration (imgret media migrate) holds this gallery's database; start "
            "the server when it has finished"
        )
    return lock


def hold_for_maintenance(db_url: str, what: str) -> GalleryLock:
    """The exclusive lock of a command that needs every server stopped.

    Args:
        db_url: the gallery database.
        what: the command, for the message (``"imgret media migrate"``).

    Raises:
        GalleryInUse: a server (or other maintenance) holds the gallery; nothing was done.
    """
    lock = _acquire(db_url, exclusive=True)
    if lock is None:
        raise GalleryInUse(
            f"{what} needs every server of this gallery stopped, but a server (or another "
            "maintenance command) is using its database; stop every imgret server on it and "
            "run the command again"
        )
    return lock


def _acquire(db_url: str, *, exclusive: bool) -> GalleryLock | None:
    url = make_url(db_url)
    if url.get_backend_name() == "postgresql":
        return _acquire_postgres(url.set(drivername="postgresql").render_as_string(
            hide_password=False), exclusive=exclusive)
    database = url.database
    if not database or database == ":memory:":
        return GalleryLock(lambda: None, "a private in-memory database")
    return _acquire_file(Path(database).absolute(), exclusive=exclusive)


def _acquire_postgres(conninfo: str, *, exclusive: bool) -> GalleryLock | None:
    import psycopg

    connection = psycopg.connect(conninfo, autocommit=True, application_name=(
        "imgret-maintenance" if exclusive else "imgret-serving"), **KEEPALIVE)
    function = "pg_try_advisory_lock" if exclusive else "pg_try_advisory_lock_shared"
    try:
        row = connection.execute(f"SELECT {function}(%s)", (SERVING_LOCK_KEY,)).fetchone()
    except BaseException:
        connection.close()
        raise
    if not (row and row[0]):
        connection.close()
        return None

    def release() -> None:
        # Unlocked before the close: a closed connection's backend drops its locks only when
        # it exits, a moment later, so the next command would still find the gallery held.
        try:
            connection.execute("SELECT pg_advisory_unlock_all()")
        except psycopg.Error:
            pass  # a broken connection: its backend ends, and the lock with it
        finally:
            connection.close()

    return GalleryLock(release, "a PostgreSQL advisory lock")


def _acquire_file(database: Path, *, exclusive: bool) -> GalleryLock | None:
    import fcntl

    path = database.with_name(database.name + LOCK_SUFFIX)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # where the database will be created
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise GalleryError(f"cannot open the lock file {path} beside the database "
                           f"({exc.strerror}); the folder must be writable") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return GalleryLock(lambda: os.close(fd), f"flock on {path}")
