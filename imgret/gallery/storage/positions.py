"""How far each serving process has applied a collection's change log
(:class:`~imgret.gallery.storage.tables.ServingPosition`): written by every process's
follower, read by an erase to know when every serving process has dropped what it erased.

Functions take ``session`` keyword-only and never commit (the caller frames the
transaction); rows are written with Core statements that name their collection.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from imgret.gallery.storage.scope import collection_of
from imgret.gallery.storage.tables import ServingPosition, utcnow

_PROCESS: tuple[int, str] | None = None


def process_name() -> str:
    """This process's name in the table: host, pid and a random part (a pid is reused
    after a restart; a forked worker gets its own)."""
    global _PROCESS
    if _PROCESS is None or _PROCESS[0] != os.getpid():
        name = f"{socket.gethostname()[:80]}:{os.getpid()}:{secrets.token_hex(4)}"
        _PROCESS = (os.getpid(), name)
    return _PROCESS[1]


@dataclass(frozen=True)
class Position:
    process: str
    change_seq: int
    seen_at: datetime


def record_position(change_seq: int, *, session: Session,
                    process: str | None = None) -> None:
    """This process has applied the collection's change log up to ``change_seq``."""
    process = process or process_name()
    collection_id = collection_of(session)
    now = utcnow()
    table = ServingPosition.__table__
    updated = session.execute(
        update(table).where(table.c.process == process,
                            table.c.collection_id == collection_id)
        .values(change_seq=int(change_seq), seen_at=now))
    if updated.rowcount == 0:
        session.execute(table.insert().values(process=process, collection_id=collection_id,
                                              change_seq=int(change_seq), seen_at=now))


def live_positions(*, session: Session, within_s: float) -> list[Position]:
    """The positions of the processes heard from in the last ``within_s`` seconds; older
    rows (processes gone) are removed."""
    table = ServingPosition.__table__
    collection_id = collection_of(session)
    cutoff = utcnow() - timedelta(seconds=within_s)
    session.execute(delete(table).where(table.c.collection_id == collection_id,
                                        table.c.seen_at < cutoff))
    rows = session.execute(select(table.c.process, table.c.change_seq, table.c.seen_at)
                           .where(table.c.collection_id == collection_id)
                           .order_by(table.c.process))
    return [Position(str(p), int(s), at) for p, s, at in rows]


def forget_process(*, session: Session, process: str | None = None) -> None:
    """This process stops serving the collection (shutdown, or the collection closed)."""
    table = ServingPosition.__table__
    session.execute(delete(table).where(table.c.process == (process or process_name()),
                                        table.c.collection_id == collection_of(session)))
