"""Following what other processes commit: the change log and switches, caught up on a
PostgreSQL wake-up or every follower interval."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import anyio.to_thread

from imgret.gallery.storage import positions
from imgret.gallery.storage.notify import listen_for_changes
from imgret.gallery.storage.tables import DEFAULT_COLLECTION_ID
from imgret.service.resources.bundle import Resources

logger = logging.getLogger(__name__)

# A process that serves a collection writes its position at least this often; one not heard
# from for POSITIONS_LIVE_S is gone (imgret.service.identities.erase waits for the others).
POSITION_REFRESH_S = 30.0
POSITIONS_LIVE_S = 3 * POSITION_REFRESH_S


async def follow_changes(resources: Resources, interval_s: float | None = None) -> None:
    """Apply other processes' gallery writes to this process's index as they commit.

    API replicas share the database, the source of truth; each keeps its own in-memory
    index and replays the gallery change log, and serves the version the database says is
    active (a switch made by another process is followed the same way). On PostgreSQL a
    LISTEN (:mod:`imgret.gallery.storage.notify`, ``IMGRET_CHANGE_NOTIFY``) wakes this loop as
    soon as any process commits a write or a switch; every ``interval_s``
    (``IMGRET_FOLLOW_INTERVAL_S``) it looks anyway, the fallback for SQLite and for a listening
    connection that dropped.
    Errors are logged and retried at the next wake-up (a database restart must not stop the
    follower for good); ``resources.follower`` keeps the lag, which /health and /metrics
    report.
    """
    interval_s = resources.settings.follow_interval_s if interval_s is None else interval_s
    state = resources.follower
    default = resources.collection_id == DEFAULT_COLLECTION_ID
    if default:
        resources.metrics.track_follower(
            lambda: state.lag_seconds(), lambda: resources.searcher.change_seq
        )
        resources.metrics.publish_gauges()

    catch_up = catch_up_with(resources)
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()

    def notified(_table: str) -> None:  # on the listener's thread
        loop.call_soon_threadsafe(wake.set)

    # One listening connection per process: the other collections' followers poll (a
    # hundred open collections must not hold a hundred connections).
    listener = (
        listen_for_changes(resources.engine, notified)
        if resources.settings.change_notify and default else None
    )
    try:
        while True:
            await sleep_until_woken(wake, interval_s)
            # Cleared before catching up: a write committed during the catch-up wakes the
            # next round instead of being lost.
            wake.clear()
            await _catch_up_once(resources, catch_up)
            # With several workers, what the other workers' scrapes report of this one.
            resources.metrics.publish_gauges()
    finally:
        if listener is not None:
            await anyio.to_thread.run_sync(listener.stop)
        await anyio.to_thread.run_sync(forget_position, resources)


def catch_up_with(resources: Resources) -> Callable[[], int]:
    """One catch-up of ``resources`` with the database (run on a worker thread): a switch
    made by another process first (loads that version's model and index), then the served
    index's changes, even when the switch failed (a missing checkpoint): the failure is
    reported, and /health turns degraded if it lasts. Returns the change rows applied."""

    def catch_up() -> int:
        try:
            resources.follow_active()
        except Exception:
            resources.searcher.refresh_from_changes()
            raise
        applied = resources.searcher.refresh_from_changes()
        record_position(resources)
        return applied

    return catch_up


def record_position(resources: Resources, *, force: bool = False) -> None:
    """Tell the database how far this process's served index has applied the change log
    (:mod:`imgret.gallery.storage.positions`): when it moved, and every
    ``POSITION_REFRESH_S`` while it does not, so an erase knows which processes serve the
    collection and when each has dropped what it erased."""
    seq = resources.searcher.change_seq
    last = resources.follower.position
    if (not force and last is not None and last[0] == seq
            and time.monotonic() - last[1] < POSITION_REFRESH_S):
        return
    with resources.sessions.begin() as session:
        positions.record_position(seq, session=session)
    resources.follower.position = (seq, time.monotonic())


def forget_position(resources: Resources) -> None:
    """This process no longer serves the collection (shutdown); best effort."""
    try:
        with resources.sessions.begin() as session:
            positions.forget_process(session=session)
    except Exception:  # noqa: BLE001 - a stale row expires by itself
        logger.debug("could not remove this process's serving position", exc_info=True)


async def catch_up_once(resources: Resources) -> None:
    """:func:`catch_up_with` once, on a worker thread; a failure is counted and logged."""
    await _catch_up_once(resources, catch_up_with(resources))


async def sleep_until_woken(wake: asyncio.Event, timeout_s: float) -> None:
    """Return when ``wake`` is set or after ``timeout_s``, whichever comes first.

    A cancellation always propagates. ``asyncio.wait_for`` does not guarantee that on Python
    3.11: a cancellation that arrives in the same loop pass as the wake-up is swallowed, so
    the follower's loop never ended and the app's shutdown waited on it forever (a change
    notification at shutdown; seen as a hung test in CI).
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await wake.wait()


async def _catch_up_once(resources: Resources, catch_up: Callable[[], int]) -> None:
    state = resources.follower
    try:
        applied = await anyio.to_thread.run_sync(catch_up)
    except Exception as exc:  # noqa: BLE001 - keep following; the next wake-up retries
        state.failures += 1
        state.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        resources.metrics.follower_failures.inc()
        log = logger.exception if state.failures in (1, 10) else logger.debug
        log("could not apply gallery changes (%d in a row); retrying", state.failures)
        return
    state.last_ok_at, state.failures, state.last_error = time.time(), 0, None
    if applied:
        # Includes this process's own writes, which are already in the index (no-ops).
        logger.debug("replayed %d gallery change-log rows", applied)
