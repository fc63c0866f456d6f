"""The collections one process serves.

The default collection is loaded at start-up (:func:`imgret.service.resources.load_resources`)
and its routes are today's (``/search``, ``/gallery``, ...). Every other collection is served
under ``/collections/{name}/...`` by the same routers: the request's resources are the
collection's, opened on its first request (model, index, batcher, a follower that polls its
change log) and kept open.

Every request to a named collection looks its name up in SQL first (one indexed read), so a
collection deleted by any process answers 404 in every process from then on, and one created
again under the same name is opened afresh (ids are never reused). The same checkpoint bound
to several collections is one model in memory.
"""

from __future__ import annotations

import asyncio
import logging

import anyio.to_thread

from imgret.embedder import Embedder
from imgret.index import collections
from imgret.index.collections import CollectionNotFound
from imgret.index.models import DEFAULT_COLLECTION
from imgret.process import in_own_thread
from imgret.service.resources import Resources, follow_changes, load_collection
from imgret.service.tasks import cancel_and_wait

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
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._opening = asyncio.Lock()

    def names(self) -> list[str]:
        """The collections open here besides ``default``."""
        return sorted(self._open)

    async def resources(self, name: str) -> Resources:
        """The resources of collection ``name``, opened if needed.

        Raises:
            CollectionNotFound: no such collection (any open resources of that name are
                closed: another process deleted it).
        """
        if name == DEFAULT_COLLECTION:
            return self.default
        collection_id = await anyio.to_thread.run_sync(self._lookup, name)
        opened = self._open.get(name)
        if opened is not None and opened.collection_id == collection_id:
            return opened
        if opened is not None:  # deleted, or deleted and created again
            await self.close(name)
        if collection_id is None:
            raise CollectionNotFound(f"no collection named {name!r}")
        async with self._opening:
            opened = self._open.get(name)
            if opened is None:
                opened = await anyio.to_thread.run_sync(
                    in_own_thread, load_collection, self.default, collection_id, name,
                    self._shared_model)
                await opened.batcher.start()
                self._open[name] = opened
                self._followers[name] = asyncio.create_task(
                    follow_changes(opened), name=f"follow-collection-{name}")
                logger.info("opened collection %s (%d vectors of %s)", name,
                            opened.searcher.size, opened.serving.version)
        return opened

    def _lookup(self, name: str) -> int | None:
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
        follower = self._followers.pop(name, None)
        if follower is not None:
            await cancel_and_wait(follower)
        if opened is not None:
            await opened.batcher.stop()
            if opened.jobs is not None:
                await anyio.to_thread.run_sync(opened.jobs.stop)

    async def close_all(self) -> None:
        for name in list(self._open):
            await self.close(name)
