"""Wake-ups from PostgreSQL: LISTEN on the channel that every committed gallery write and
model switch notifies (triggers of migration 0003), so a replica catches up at once instead
of at its next poll.

A notification only says "something changed, look": what changed is read from the change log
as before, so a lost or coalesced notification costs latency, never correctness (the poll
stays as the fallback). SQLite has no notifications: :func:`listen_for_changes` returns
``None`` there and its replicas keep polling.

The listening connection only ever reads, so a database host that vanished (power loss, a
dropped NAT entry) would leave it waiting forever without ever learning the peer is gone, and
the replica would fall back to slow polling unnoticed. It therefore asks libpq for TCP
keepalives (:data:`KEEPALIVE`): an idle connection is probed after 30 s, every 10 s, and
given up after 3 unanswered probes, so a dead peer is noticed within about a minute and the
thread reconnects.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable

from sqlalchemy.engine import Engine

logger = logging.getLogger(__name__)

CHANNEL = "imgret_changes"  # the channel migration 0003's triggers notify
# libpq connection parameters of the listening connection (see the module docstring).
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
             "keepalives_count": 3}


class ChangeListener:
    """A daemon thread holding one autocommit connection that LISTENs on :data:`CHANNEL` and
    calls ``on_change`` for each notification (from that thread: keep it short and
    thread-safe).

    The connection is its own, outside the engine's pool: it blocks waiting and must never be
    handed to a request. When it drops (a database restart), the thread reconnects every
    ``retry_s`` and calls ``on_change`` once after each (re)connection, since notifications
    sent while it was away are lost.

    Args:
        engine: the gallery database (PostgreSQL).
        on_change: called on every notification, with the table that changed.
        retry_s: pause before reconnecting.
    """

    def __init__(self, engine: Engine, on_change: Callable[[str], None], *,
                 retry_s: float = 1.0):
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False
        )
        self.on_change = on_change
        self.retry_s = retry_s
        self.listening = threading.Event()  # set while a LISTEN connection is open
        self._connection = None  # the open LISTEN connection (for socket_options)
        self._stop = threading.Event()
        # A channel of this listener's own: stop() notifies it, so a server shuts down as
        # soon as it is asked, not when the next wait for notifications times out.
        self._wake_channel = f"imgret_stop_{uuid.uuid4().hex}"
        self._thread = threading.Thread(target=self._run, name="imgret-listen", daemon=True)

    def start(self) -> ChangeListener:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self.listening.is_set():
            self._wake()
        self._thread.join(timeout)

    def _wake(self) -> None:
        """Notify this listener's own channel, ending its wait (best effort: without it the
        wait still ends at its timeout)."""
        import psycopg

        try:
            with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=2,
                                 application_name="imgret-listen-stop") as connection:
                connection.execute(f"NOTIFY {self._wake_channel}")
        except Exception:  # noqa: BLE001 - the timeout below still ends the wait
            logger.debug("could not wake the LISTEN thread; it stops at its next timeout")

    def _run(self) -> None:
        import psycopg  # the PostgreSQL driver: only a PostgreSQL gallery gets here

        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True,
                                     application_name="imgret-listen",
                                     **KEEPALIVE) as connection:
                    connection.execute(f"LISTEN {CHANNEL}")
                    connection.execute(f"LISTEN {self._wake_channel}")
                    self._connection = connection
                    self.listening.set()
                    if failures:
                        logger.info("listening for gallery changes again")
                    failures = 0
                    self.on_change("reconnected")  # whatever was missed while away
                    while not self._stop.is_set():
                        # A timeout in case stop()'s wake-up is lost; a notification
                        # returns at once.
                        for notify in connection.notifies(timeout=0.5):
                            if notify.channel == self._wake_channel:
                                break
                            self.on_change(notify.payload)
            except Exception as exc:  # noqa: BLE001 - reconnect; the poll covers the gap
                self._connection = None
                self.listening.clear()
                failures += 1
                log = logger.warning if failures in (1, 10) else logger.debug
                log("LISTEN %s failed (%d in a row: %s); polling until it reconnects",
                    CHANNEL, failures, type(exc).__name__)
                self._stop.wait(self.retry_s)
        self._connection = None
        self.listening.clear()

    def socket_options(self) -> dict[str, int] | None:
        """The keepalive options of the open LISTEN connection's TCP socket, as the kernel
        holds them (``SO_KEEPALIVE``, ``TCP_KEEPIDLE``, ``TCP_KEEPINTVL``, ``TCP_KEEPCNT``);
        ``None`` while no connection is open or it is not a TCP socket (a Unix socket)."""
        import socket

        connection = self._connection
        if connection is None:
            return None
        try:
            sock = socket.socket(fileno=os.dup(connection.fileno()))
        except OSError:
            return None
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            return {
                "keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                "keepalives_idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "keepalives_interval": sock.getsockopt(socket.IPPROTO_TCP,
                                                       socket.TCP_KEEPINTVL),
                "keepalives_count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            }


def listen_for_changes(engine: Engine,
                       on_change: Callable[[str], None]) -> ChangeListener | None:
    """A started :class:`ChangeListener` on a PostgreSQL gallery; ``None`` on any other
    database (nothing to listen to: poll)."""
    if engine.dialect.name != "postgresql":
        return None
    return ChangeListener(engine, on_change).start()
