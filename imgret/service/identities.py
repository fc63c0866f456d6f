"""Identities as the service changes them: merge two labels, move items to another label,
undo either, with every change in the audit log (:mod:`imgret.gallery.storage.identity_store`).

Each change commits in SQL first (the relabelled items' deletes and adds, and the audit
entry, in one transaction under the gallery write lock), then this process's index drops the
old ids and replays the adds; other processes drop the old ids before their next search and
take the adds with their change-log follower, as for any delete and add.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.orm import Session
from starlette.requests import Request

from imgret.errors import GalleryError
from imgret.gallery.media.gc import purge_media
from imgret.gallery.search.manifest import collection_root, index_dir
from imgret.gallery.storage import change_log, identity_store, positions
from imgret.gallery.storage.identity_store import ERASE, ERASED, MERGE, MOVE, UNDO, Move
from imgret.gallery.storage.item_store import lock_gallery_writes
from imgret.gallery.storage.tables import LabelChange, utcnow
from imgret.service.request_rules import InvalidRequest, NotFound
from imgret.service.resources.bundle import Resources
from imgret.service.resources.follower import POSITIONS_LIVE_S, record_position

logger = logging.getLogger(__name__)

# How long an erase waits for every serving process to confirm (at least five follower
# intervals), and how often it looks.
ERASE_CONFIRM_S = 10.0
CONFIRM_POLL_S = 0.05


class NotUndoable(GalleryError):
    """An audit entry that cannot be undone (already undone, or an erase): 409."""


def actor_of(request: Request) -> str:
    """Who made a change, for the audit log: the stored key's id (its name is for admins:
    ``GET /keys``), the environment's key, or ``local`` (no keys in use: writes come from
    this machine)."""
    caller = request.scope.get("state", {}).get("caller")
    if caller is not None and caller.key is not None:
        return f"key {caller.key.id}"
    if caller is not None and caller.bootstrap:
        return "IMGRET_API_KEY"
    return "local"


def labels(*, session: Session, offset: int, limit: int,
           label: str | None) -> tuple[list[tuple[str, int]], int]:
    """A page of ``(label, live items)`` in label order, and how many labels match."""
    return identity_store.label_counts(session=session, offset=offset, limit=limit,
                                       label=label)


def changes(*, session: Session, offset: int, limit: int) -> tuple[list[LabelChange], int]:
    """A page of the audit log, newest first, and its length."""
    return identity_store.list_changes(session=session, offset=offset, limit=limit)


def change(change_id: int, *, session: Session) -> LabelChange:
    """One audit entry.

    Raises:
        NotFound: none with that id in this collection.
    """
    entry = identity_store.get_change(change_id, session=session)
    if entry is None:
        raise NotFound(f"no identity change {change_id}")
    return entry


def merge(resources: Resources, source: str, target: str, actor: str) -> LabelChange:
    """Every live item of ``source`` becomes ``target``'s.

    Raises:
        NotFound: ``source`` has no live item.
        InvalidRequest: ``source`` and ``target`` are the same label.
    """
    if source == target:
        raise InvalidRequest("source and target are the same label: nothing to merge")
    with resources.sessions.begin() as session:
        lock_gallery_writes(session=session)
        ids = identity_store.live_ids_of(source, session=session)
        if not ids:
            raise NotFound(f"no live item has the label {source!r}")
        moves = identity_store.relabel_items(ids, target, session=session)
        entry = identity_store.record_change(MERGE, session=session, actor=actor, moves=moves,
                                             from_label=source, to_label=target)
        session.expunge(entry)
    _follow(resources, moves)
    return entry


def move(resources: Resources, item_ids: list[int], label: str, actor: str) -> LabelChange:
    """The live items ``item_ids`` get ``label`` (a new label splits them off).

    Raises:
        NotFound: one of the ids is not a live item of this collection (nothing changes).
    """
    with resources.sessions.begin() as session:
        lock_gallery_writes(session=session)
        live = set(identity_store.live_among(item_ids, session=session))
        missing = sorted(set(item_ids) - live)
        if missing:
            raise NotFound(f"no gallery item {missing[0]}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        moves = identity_store.relabel_items(item_ids, label, session=session)
        entry = identity_store.record_change(MOVE, session=session, actor=actor, moves=moves,
                                             to_label=label)
        session.expunge(entry)
    _follow(resources, moves)
    return entry


def undo(resources: Resources, change_id: int, actor: str) -> LabelChange:
    """Undo an audit entry: its items (by their new ids, where still live and still under
    the label it gave them) go back to their old labels; recorded as an ``undo`` entry.

    Raises:
        NotFound: no such entry in this collection.
        NotUndoable: it was undone already, or it is an erase.
    """
    with resources.sessions.begin() as session:
        lock_gallery_writes(session=session)
        entry = identity_store.get_change(change_id, session=session)
        if entry is None:
            raise NotFound(f"no identity change {change_id}")
        if entry.undone_by is not None:
            raise NotUndoable(f"identity change {change_id} was undone by {entry.undone_by}")
        if entry.action not in (MERGE, MOVE, UNDO):
            raise NotUndoable(f"an {entry.action} cannot be undone")
        back: dict[str, list[int]] = defaultdict(list)
        for _, new_id, old_label in entry.moves:
            back[old_label].append(int(new_id))
        moves: list[Move] = []
        for old_label, ids in back.items():
            still = identity_store.live_among(ids, session=session, label=entry.to_label)
            moves.extend(identity_store.relabel_items(still, old_label, session=session))
        undone = identity_store.record_change(UNDO, session=session, actor=actor, moves=moves,
                                              from_label=entry.to_label, undo_of=entry.id)
        session.expunge(undone)
    _follow(resources, moves)
    return undone


@dataclass(frozen=True)
class Erased:
    """What an erase removed, and which serving processes confirmed it (for the receipt)."""

    label: str
    change: LabelChange
    rows: identity_store.ErasedRows
    media_removed: int
    committed_at: datetime
    confirmed: list[tuple[str, datetime]]
    unconfirmed: list[str]


def erase(resources: Resources, label: str, actor: str) -> Erased:
    """Remove every item, vector, image and query-set item of ``label`` in this collection,
    and its name from the audit log; then wait (a bounded while) until every process that
    serves the collection has applied the deletes.

    Order: one transaction removes the rows (:func:`identity_store.erase_label`) and logs an
    ``erase`` entry; this process's index drops the ids and is saved (a saved index file
    holds no erased vector), and the saved indexes of the collection's other versions are
    removed (caches, rebuilt from SQL when opened); the image bytes no other row uses are
    removed; then the
    positions of the serving processes (:mod:`imgret.gallery.storage.positions`) are read
    until each has passed the erase's deletes, or ``ERASE_CONFIRM_S`` (at least five
    follower intervals) runs out: a process that has not confirmed by then is named in
    ``unconfirmed`` (it still leaves the items out of every search it starts: the deletes
    are applied before each search).

    Raises:
        NotFound: nothing has the label (no live item, no query item).
    """
    with resources.sessions.begin() as session:
        rows = identity_store.erase_label(label, session=session)
        if not rows.item_ids and not rows.query_item_ids:
            raise NotFound(f"nothing has the label {label!r}")
        erase_seq = change_log.max_change_seq(session=session) if rows.item_ids else 0
        entry = identity_store.record_change(
            ERASE, session=session, actor=actor, from_label=ERASED,
            moves=[Move(i, None, ERASED) for i in rows.item_ids])
        session.expunge(entry)
    committed_at = utcnow()
    searcher = resources.searcher
    searcher.remove(rows.item_ids)
    if searcher.can_save:
        searcher.save()
    if rows.item_ids:
        _drop_other_saved_indexes(resources, searcher.model_version)
    removed = purge_media([*rows.item_hashes, *rows.query_hashes],
                          session_factory=resources.sessions, media=resources.media)
    resources.metrics.gallery_writes.labels("delete").inc(len(rows.item_ids))
    confirmed, unconfirmed = _confirmations(resources, erase_seq)
    return Erased(label, entry, rows, removed, committed_at, confirmed, unconfirmed)


def _drop_other_saved_indexes(resources: Resources, served: str) -> None:
    """Remove the saved index files of the collection's other model versions: they may hold
    erased vectors, and are caches (a version opened later rebuilds its index from SQL,
    where the vectors are gone). The served version's file was just saved without them."""
    root = collection_root(resources.settings.data_dir, resources.collection_id) / "indexes"
    keep = index_dir(collection_root(resources.settings.data_dir, resources.collection_id),
                     served).name
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if folder.is_dir() and folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("erase: removed the saved index %s (rebuilt from SQL when opened)",
                        folder.name)


def _confirmations(resources: Resources, erase_seq: int
                   ) -> tuple[list[tuple[str, datetime]], list[str]]:
    """Wait until every live serving process's position reaches ``erase_seq`` (or the
    deadline): ``(confirmed with when, unconfirmed)``."""
    with contextlib.suppress(Exception):
        resources.searcher.refresh_from_changes()
    record_position(resources, force=True)
    deadline = time.monotonic() + max(ERASE_CONFIRM_S, 5 * resources.settings.follow_interval_s)
    while True:
        with resources.sessions.begin() as session:
            live = positions.live_positions(session=session, within_s=POSITIONS_LIVE_S)
        done = [(p.process, aware(p.seen_at)) for p in live if p.change_seq >= erase_seq]
        waiting = [p.process for p in live if p.change_seq < erase_seq]
        if not waiting or time.monotonic() >= deadline:
            return done, waiting
        time.sleep(CONFIRM_POLL_S)


def aware(moment: datetime) -> datetime:
    """A stored time with its zone: SQLite hands timestamps back without it, and every
    stored time is UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _follow(resources: Resources, moves: list[Move]) -> None:
    """This process's index after a committed relabel: the old ids out at once, the new ones
    in from the change log (the follower retries if this fails)."""
    if not moves:
        return
    searcher = resources.searcher
    searcher.remove([m.old_id for m in moves])
    try:
        searcher.refresh_from_changes()
    except Exception:  # noqa: BLE001 - committed: the follower makes the new ids searchable
        logger.exception("index update after a committed relabel failed; the follower retries")
