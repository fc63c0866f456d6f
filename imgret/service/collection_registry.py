"""The collections one process serves.

The default collection is loaded at start-up
(:func:`imgret.service.resources.startup.load_resources`) and its routes are today's (``/search``,
``/gallery``, ...). Every other collection is served under ``/collections/{name}/...`` by the same
routers: the request's resources are the collection's, opened on its first request (model, index,
batcher), and kept up to date by one shared follower (:meth:`CollectionRegistry.follow`).

Memory is planned per collection: an open collection holds its index (``size x dim x 4``
bytes of vectors, reported by ``GET /collections/{name}``); at most
``IMGRET_MAX_OPEN_COLLECTIONS`` stay open (the least recently used is closed to open
another), and one unused for ``IMGRET_COLLECTION_IDLE_S`` is closed. A closed collection's
next request opens it again: its saved index file is loaded (or rebuilt from SQL), and the
change log brings it up to date.

Every request to a named collection looks its name up in SQL first (one indexed read), so a
collection deleted by any process answers 404 in every process from then on, and one created
again under the same name is opened afresh (ids are never reused). The same checkpoint bound
to several collections is one model in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import anyio.to_thread

from imgret.embedder import Embedder
from imgret.gallery.storage.tables import DEFAULT_COLLECTION
from imgret.gallery.tenancy import collections
from imgret.gallery.tenancy.collections import CollectionNotFound
from imgret.gallery.versions import version_store
from imgret.process import in_own_thread
from imgret.service.resources.bundle import Resources
from imgret.service.resources.follower import catch_up_once
from imgret.service.resources.startup import load_collection
from imgret.service.version_cache import index_bytes

logger = logging.getLogger(__name__)


class CollectionRegistry:
    """The open collections of this process, by name.

    Args:
        default: the default collection's resources (also the source of the shared engine,
            media store, settings and metrics).
    """

    def __init__(self, default: Resources):
        self.default = default
        self._open: dict[str, Resources] = {}
        self._used: dict[str, float] = {}  # name -> time.monotonic() of its last request
        self._held: dict[str, int] = {}  # name -> requests holding it now
        self._deleting: set[str] = set()  # being deleted by this process: never reopened
        self._opening = asyncio.Lock()
        settings = default.settings
        self.max_open = settings.max_open_collections
        self.idle_s = settings.collection_idle_s

    async def resources(self, name: str) -> Resources:
        """The resources of collection ``name``, opened if needed.

        Raises:
            CollectionNotFound: no such collection (any open resources of that name are
                closed: another process deleted it).
        """
        if name == DEFAULT_COLLECTION:
            return self.default
        if name in self._deleting:
            raise CollectionNotFound(f"no collection named {name!r}")
        collection_id = await anyio.to_thread.run_sync(self.lookup, name)
        opened = self._open.get(name)
        if opened is not None and opened.collection_id == collection_id:
            self._used[name] = time.monotonic()
            return opened
        if opened is not None:  # deleted, or deleted and created again
            await self.close(name)
        if collection_id is None:
            raise CollectionNotFound(f"no collection named {name!r}")
        async with self._opening:
            opened = self._open.get(name)
            if opened is None:
                await self._make_room()
                opened = await anyio.to_thread.run_sync(
                    in_own_thread, load_collection, self.default, collection_id, name,
                    self._shared_model)
                await opened.batcher.start()
                self._open[name] = opened
                logger.info("opened collection %s (%d vectors of %s)", name,
                            opened.searcher.size, opened.serving.version)
            self._used[name] = time.monotonic()
        return opened

    def memory(self, name: str) -> dict | None:
        """What collection ``name`` holds in this process: ``None`` if it is not open."""
        opened = self.default if name == DEFAULT_COLLECTION else self._open.get(name)
        if opened is None:
            return None
        searcher = opened.searcher
        used = self._used.get(name)
        return {"vectors": searcher.size, "bytes": index_bytes(searcher),
                "idle_s": None if used is None else round(time.monotonic() - used, 3)}

    async def close_idle(self) -> list[str]:
        """Close the collections unused for ``idle_s``; returns their names."""
        now = time.monotonic()
        idle = [n for n, r in self._open.items()
                if now - self._used.get(n, now) >= self.idle_s and self._idle(n, r)]
        for name in idle:
            await self.close(name)
            logger.info("closed collection %s: unused for %.0f s", name, self.idle_s)
        return idle

    async def reap(self) -> None:
        """Close idle collections until cancelled (checks every tenth of ``idle_s``)."""
        while True:
            await asyncio.sleep(max(0.05, self.idle_s / 10))
            await self.close_idle()

    @contextlib.contextmanager
    def holding(self, name: str) -> Iterator[None]:
        """Mark collection ``name`` in use by a request while the block runs."""
        self._held[name] = self._held.get(name, 0) + 1
        try:
            yield
        finally:
            self._held[name] -= 1
            if not self._held[name]:
                del self._held[name]

    def _idle(self, name: str, resources: Resources) -> bool:
        return not self._held.get(name) and not resources.search_busy()

    async def _make_room(self) -> None:
        """Close the least recently used collections until one more fits, skipping those a
        request holds or whose searches are queued or running (closing one would fail them);
        when every open one is busy the bound is exceeded for a moment rather than a request
        failed."""
        while len(self._open) >= self.max_open:
            idle = [n for n, r in self._open.items() if self._idle(n, r)]
            if not idle:
                logger.warning("every open collection is busy: %d open, bound %d",
                               len(self._open), self.max_open)
                return
            await self.close(min(idle, key=lambda n: self._used.get(n, 0.0)))

    @contextlib.asynccontextmanager
    async def deleting(self, name: str) -> AsyncIterator[None]:
        """While collection ``name`` is being deleted here: no request opens it again, and
        one that held it hears that it is gone (:meth:`is_gone`), not that the server stops."""
        self._deleting.add(name)
        try:
            await self.close(name)
            yield
        finally:
            self._deleting.discard(name)

    def is_gone(self, name: str) -> bool:
        """Whether collection ``name`` is being deleted here or no longer exists in SQL."""
        return name in self._deleting or self.lookup(name) is None

    def lookup(self, name: str) -> int | None:
        """The id of collection ``name`` in SQL now, ``None`` if there is none."""
        with self.default.sessions() as session:
            row = collections.find(name, session=session)
            return None if row is None else row.id

    def _shared_model(self, version: str) -> Embedder | None:
        for resources in (self.default, *self._open.values()):
            embedder = resources.embedders.get(version)
            if embedder is not None:
                return embedder
        return None

    async def close(self, name: str) -> None:
        """Close collection ``name`` here (its follower, batcher and jobs); a no-op if it is
        not open. The next request opens it again from SQL."""
        opened = self._open.pop(name, None)
        self._used.pop(name, None)
        if opened is not None:
            await opened.batcher.stop()
            if opened.jobs is not None:
                await anyio.to_thread.run_sync(opened.jobs.stop)

    async def follow(self, interval_s: float | None = None) -> None:
        """Keep every open collection up to date with what other processes commit, until
        cancelled: one poll for all of them every ``interval_s`` (the follower interval) asks
        which collections have new change-log rows and what each serves (version and
        calibration), and only those that changed catch up. A hundred open collections cost
        two small queries a second, not two hundred."""
        interval_s = interval_s or self.default.settings.follow_interval_s
        sessions = self.default.sessions
        seq = await anyio.to_thread.run_sync(self._newest_seq)
        while True:
            await asyncio.sleep(interval_s)
            if not self._open:
                continue
            try:
                changed, newest, served = await anyio.to_thread.run_sync(
                    self._poll, sessions, seq)
            except Exception:  # noqa: BLE001 - retried at the next interval
                logger.exception("could not poll the collections' changes")
                continue
            for opened in list(self._open.values()):
                version = opened.serving.version
                calibration = opened.serving.calibration
                state = (version, calibration.id if calibration is not None else None)
                if (opened.collection_id in changed
                        or served.get(opened.collection_id, state) != state):
                    await catch_up_once(opened)
            seq = newest

    def _newest_seq(self) -> int:
        with self.default.sessions() as session:
            return version_store.newest_change_seq(session=session)

    @staticmethod
    def _poll(sessions, seq: int) -> tuple[dict[int, int], int, dict]:
        with sessions() as session:
            changed, newest = version_store.collections_changed_after(seq, session=session)
            return changed, newest, version_store.served_states(session=session)

    async def close_all(self) -> None:
        for name in list(self._open):
            await self.close(name)
