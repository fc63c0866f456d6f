"""The Searcher: one model version's gallery index, searched from many threads while it
follows gallery writes.

It composes the parts of :mod:`imgret.gallery.search` and holds the locks that make them safe
together. Deletes are final, in every process, at once:

- an id that was removed once is remembered (ids are never reused) and never added again, so
  an ``add`` that arrives late (an upload whose DELETE committed before its index update, a
  replay that fetched vectors before the delete) cannot bring it back;
- before every search, a Searcher with a database reads the deletes committed since it last
  looked (one indexed query, :func:`imgret.gallery.storage.change_log.deletes_after`) and applies
  them, so a DELETE acknowledged by any process is honoured by every search that starts after it.
  Adds made by other processes arrive with the follower (``refresh_from_changes``), within its
  interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import GalleryError
from imgret.gallery.search.changes import ChangeLog
from imgret.gallery.search.faiss_index import DEFAULT_FACTORY
from imgret.gallery.search.filters import SearchFilter, group_queries
from imgret.gallery.search.identities import (
    TEMPLATE,
    TEMPLATE_ITEMS_MAX,
    Identity,
    IdentityGroup,
    group_hits,
)
from imgret.gallery.search.lifecycle import (
    BackgroundRebuild,
    build_or_fallback,
    open_searcher,
    write_snapshot,
)
from imgret.gallery.search.live import LiveIndex
from imgret.gallery.search.lock import ReadWriteLock
from imgret.gallery.search.manifest import collection_root, index_dir, normalise_factory
from imgret.gallery.search.milvus_index import MilvusIndex, milvus_uri, open_milvus
from imgret.gallery.search.ranking import Hit
from imgret.gallery.search.rerank import Rerank, rerank_options, rerank_search
from imgret.gallery.storage.scope import collection_of_factory
from imgret.gallery.storage.vector_store import ItemInfo
from imgret.settings import Settings

logger = logging.getLogger(__name__)


class Searcher:
    """Search a gallery index; safe to call from many threads.

    Searches take a shared lock; ``add``/``remove``/rebuild swaps take an exclusive one.
    Build one with :meth:`open` (load or rebuild from SQL) or directly from an index.

    Args:
        index: a CPU FAISS index whose ids are gallery ids (see ``faiss_index.create_index``).
        model_version: the model version of its vectors.
        factory: the factory string it was built with.
        infos: id -> filter info of every live id in the index.
        change_seq: the change-log position the index reflects.
        tombstones: ids stored in the index but deleted (indexes without ``remove_ids``).
        session_factory: the gallery database (needed for refresh and rebuilds).
        data_dir: where :meth:`save` writes; ``None`` disables saving.
        use_gpu: ``None`` = GPUs when FAISS sees some, ``False`` = CPU only.
        rebuild_threshold: rebuild from SQL (in the background) once deleted-but-stored
            vectors exceed this fraction of the index.
        requested_factory: the factory asked for, when ``factory`` is a fallback (an empty
            gallery cannot train IVF: it starts exact and rebuilds later).
        nprobe: IVF lists visited per query (default nlist/16, at least 8): recall vs speed.
        ef_search: HNSW beam width (default 64): recall vs speed.
    """

    def __init__(
        self, index: faiss.Index | None = None, *, model_version: str, factory: str = "",
        infos: Mapping[int, ItemInfo] | None = None, change_seq: int = 0,
        tombstones: Sequence[int] = (), session_factory: sessionmaker[Session] | None = None,
        data_dir: str | Path | None = None, use_gpu: bool | None = None,
        rebuild_threshold: float = 0.1, requested_factory: str | None = None,
        nprobe: int | None = None, ef_search: int | None = None,
        live: MilvusIndex | None = None,
    ):
        self.model_version = model_version
        self.rebuild_threshold = rebuild_threshold
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._lock = ReadWriteLock()
        self._save_lock = threading.Lock()
        self._live: LiveIndex | MilvusIndex
        if live is not None:  # another engine holds the vectors (nothing saved beside SQL)
            self._live = live
            self.requested_factory = live.factory
        else:
            if index is None:
                raise ValueError("a Searcher needs a FAISS index or a live index")
            self.requested_factory = normalise_factory(requested_factory or factory)
            self._live = LiveIndex(index, factory=factory, infos=dict(infos or {}),
                                   change_seq=change_seq, tombstones=tombstones,
                                   use_gpu=use_gpu, nprobe=nprobe, ef_search=ef_search)
        self.dim = int(self._live.d)
        self._changes = (ChangeLog(session_factory, model_version, self._live.seq)
                         if session_factory is not None else None)
        self._rebuilds = BackgroundRebuild(self.rebuild, model_version)

    @classmethod
    def from_settings(
        cls, session_factory: sessionmaker[Session], settings: Settings,
        model_version: str | None = None, **kwargs: Any,
    ) -> Searcher:
        """:meth:`open` with the index settings in force (``IMGRET_DATA_DIR``,
        ``IMGRET_INDEX_FACTORY``, ``IMGRET_INDEX_NPROBE``, ``IMGRET_INDEX_EF_SEARCH``), so the
        service, ``/evaluate`` and the CLI search the same way. The index files are the
        sessions' collection's (:func:`imgret.gallery.search.manifest.collection_root`)."""
        collection = collection_of_factory(session_factory)
        if settings.index_backend == "milvus":
            return cls.open_milvus(session_factory, settings, model_version, **kwargs)
        root = collection_root(settings.data_dir, collection)
        return cls.open(
            session_factory, root, settings.index_factory, model_version,
            nprobe=settings.index_nprobe, ef_search=settings.index_ef_search, **kwargs,
        )

    @classmethod
    def open(
        cls, session_factory: sessionmaker[Session], data_dir: str | Path,
        factory: str = DEFAULT_FACTORY, model_version: str | None = None, *,
        use_gpu: bool | None = None, progress: bool = False, save: bool = True,
        rebuild_threshold: float = 0.1, dim: int | None = None,
        config: Mapping[str, Any] | None = None, nprobe: int | None = None,
        ef_search: int | None = None,
    ) -> Searcher:
        """Load the saved index of a model version, or rebuild it from SQL.

        The saved index is used when its manifest names the same model version, factory and
        dimension, its file checksum holds, and, after replaying the change log from the
        manifest's position, its ids equal the database's. Otherwise it is rebuilt from the
        stored embeddings (the reason is logged) and saved.

        ``model_version`` must be registered (ingest and ``add_items`` do it), unless
        ``dim`` is given: then an unknown version is registered (the first one becomes
        active), so a service can start on an empty database with its model
        (``dim=embedder.dim, config=embedder.spec.to_dict()``). A version with no items gives
        an empty index. A factory that needs training falls back to exact ``Flat`` while the
        gallery is too small to train it (logged); the next open or rebuild tries again.

        Args:
            session_factory: sessions on the gallery database (schema at head).
            data_dir: holds ``indexes/<model_version>/``.
            factory: FAISS factory string (``IMGRET_INDEX_FACTORY``).
            model_version: default the active one.
            use_gpu: ``None`` = automatic.
            progress: tqdm bar while building.
            save: write the index and manifest after a rebuild.
            rebuild_threshold: see the class.
            dim: register ``model_version`` with this dimension if it is unknown.
            config: its model config, stored when registering.
            nprobe, ef_search: query-time knobs of IVF / HNSW indexes (see the class).

        Raises:
            GalleryError: no such (or no active) model version and no ``dim``.
            InvalidIndexFactory: a factory string that is refused.
        """
        return open_searcher(
            cls, session_factory, data_dir, factory, model_version, progress=progress,
            save=save, dim=dim, config=config, use_gpu=use_gpu,
            rebuild_threshold=rebuild_threshold, nprobe=nprobe, ef_search=ef_search,
        )

    @classmethod
    def open_milvus(
        cls, session_factory: sessionmaker[Session], settings: Settings,
        model_version: str | None = None, *, dim: int | None = None,
        config: Mapping[str, Any] | None = None, rebuild: bool = False,
        rebuild_threshold: float = 0.1, **_: Any,
    ) -> Searcher:
        """The Searcher of a model version on Milvus (``IMGRET_INDEX_BACKEND=milvus``):
        its collection reconciled with SQL, then caught up with the change log
        (:func:`imgret.gallery.search.milvus_index.open_milvus`). FAISS's options (GPU,
        saving, progress) do not apply."""
        token = settings.milvus_token.get_secret_value() if settings.milvus_token else None
        live, version = open_milvus(
            session_factory, uri=milvus_uri(settings), token=token,
            collection=collection_of_factory(session_factory), model_version=model_version,
            dim=dim, config=dict(config) if config is not None else None, rebuild=rebuild)
        searcher = cls(model_version=version, session_factory=session_factory, live=live,
                       change_seq=live.seq, rebuild_threshold=rebuild_threshold)
        searcher.refresh_from_changes()
        return searcher

    # ------------------------------------------------------------------ properties

    @property
    def size(self) -> int:
        """Searchable (live) vectors."""
        return len(self._live.catalog)

    @property
    def change_seq(self) -> int:
        """The change-log position this index reflects."""
        return self._live.seq

    @property
    def factory(self) -> str:
        """The factory string of the index being served."""
        return self._live.factory

    @property
    def device(self) -> str:
        """Where unfiltered searches run: ``"cpu"`` or the GPU mirror's description."""
        return self._live.device

    def ids(self) -> np.ndarray:
        """The live ids, sorted ``(n,) int64``."""
        with self._lock.read():
            return np.sort(self._live.catalog.ids())

    def info(self, item_id: int) -> ItemInfo | None:
        """Label, camera and metadata of a live id (``None`` when absent)."""
        return self._live.catalog.infos.get(int(item_id))

    @property
    def stats(self) -> dict[str, Any]:
        """Numbers for /health and logs."""
        live = self._live
        return {
            "model_version": self.model_version, "factory": live.factory, "size": self.size,
            "stored": live.stored, "tombstones": len(live.tombstones),
            "change_seq": live.seq, "device": live.device,
        }

    # ------------------------------------------------------------------ search

    def search(
        self, vectors: np.ndarray, k: int,
        filters: SearchFilter | Sequence[SearchFilter | None] | None = None,
        rerank: Rerank | str | Sequence[Rerank | None] | None = None,
    ) -> list[list[Hit]]:
        """The k best gallery items for each query vector.

        Filtered searches return ``min(k, number of matching items)`` hits, never silently
        fewer (see :mod:`imgret.gallery.search.ranking`).

        Args:
            vectors: ``(n, d)`` float32 queries, L2-normalised (``Embedder.embed`` output);
                a ``(d,)`` vector is one query.
            k: results per query (≥ 1).
            filters: one filter for all queries, one per query, or ``None``.
            rerank: re-rank the results (:mod:`imgret.gallery.search.rerank`): ``None`` (plain
                search), ``"k_reciprocal"`` / ``"query_expansion"`` (default parameters),
                a :class:`~imgret.gallery.search.rerank.KReciprocal` /
                :class:`~imgret.gallery.search.rerank.QueryExpansion`, or one of these per query.

        Returns:
            ``n`` lists of :class:`Hit`, best first; each has ``min(k, matching items)``
            hits. With re-ranking, ``score`` is 1 − the re-ranked distance (k-reciprocal) or
            the similarity to the expanded query (query expansion).

        Raises:
            ValueError: wrong shape or dimension, ``k < 1``, a filter or rerank list of
                another length than the queries, or an unknown rerank method.
            DatabaseError: the deletes committed by other processes cannot be read (the
                database is unreachable): no answer is better than one with a deleted item.
        """
        queries = self._queries(vectors)
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        reranks = _per_query_rerank(rerank, len(queries))
        if self._changes is not None:
            self.sync_deletes()
        results: list[list[Hit]] = [[] for _ in range(len(queries))]
        plain = [row for row, option in enumerate(reranks) if option is None]
        per_query = (list(filters) if filters is not None and not isinstance(filters, SearchFilter)
                     else [filters] * len(queries))
        if len(per_query) != len(queries):
            raise ValueError(f"{len(per_query)} filters for {len(queries)} queries")
        with self._lock.read():
            if plain:
                for flt, rows in group_queries([per_query[r] for r in plain], len(plain)):
                    hits = self._live.search(queries[[plain[r] for r in rows]], k, flt)
                    for row, row_hits in zip(rows, hits, strict=True):
                        results[plain[row]] = row_hits
            for option, rows in _rerank_groups(reranks):
                hits = rerank_search(self._live, queries[rows], k,
                                     [per_query[r] for r in rows], option)
                for row, row_hits in zip(rows, hits, strict=True):
                    results[row] = row_hits
        return results

    def identities(self, query: np.ndarray, hits: Sequence[Hit], group: IdentityGroup,
                   flt: SearchFilter | None = None, *,
                   templates: dict[str, np.ndarray | None] | None = None) -> list[Identity]:
        """One query's ``hits`` (best first, from :meth:`search` with ``group``'s fetch size)
        grouped into its top identities (:mod:`imgret.gallery.search.identities`).

        For the ``template`` aggregation each proposed identity is scored against the mean
        of its live items that ``flt`` allows (at most ``TEMPLATE_ITEMS_MAX``), read from this
        index under the same lock, so a template never mixes in a deleted item.
        ``templates``: a cache of unit templates by label, for a caller that groups many
        queries (an evaluation); used and filled only where ``flt`` leaves a label whole.
        """
        query = self._queries(query)[0]
        with self._lock.read():
            catalog = self._live.catalog

            def label_of(item_id: int) -> str | None:
                info = catalog.infos.get(item_id)
                return None if info is None else info.label

            scores = None
            if group.aggregation == TEMPLATE:
                scores = {}
                mask, _ = catalog.allowed(flt, has_tombstones=False)
                for label in dict.fromkeys(filter(None, map(label_of, (h.id for h in hits)))):
                    template = self._template(catalog, label, mask, templates)
                    if template is not None:
                        scores[label] = float(query @ template)
            return group_hits(hits, label_of, k=group.k, per_identity=group.per_identity,
                              aggregation=group.aggregation, templates=scores)

    def _template(self, catalog, label: str, mask: np.ndarray | None,
                  cache: dict[str, np.ndarray | None] | None) -> np.ndarray | None:
        """The unit mean of ``label``'s live items that ``mask`` allows (``None``: none, or
        they cancel out); the caller holds the read lock."""
        every = np.fromiter(catalog.ids_of(label), np.int64)
        ids = every
        if mask is not None:
            ids = every[(every < len(mask)) & mask[np.clip(every, 0, len(mask) - 1)]]
        whole = len(ids) == len(every)
        if whole and cache is not None and label in cache:
            return cache[label]
        template = None
        if len(ids):
            mean = self._live.vectors(np.sort(ids)[:TEMPLATE_ITEMS_MAX]).astype(
                np.float64).mean(axis=0)
            norm = float(np.linalg.norm(mean))
            template = mean / norm if norm > 0 else None
        if whole and cache is not None:
            cache[label] = template
        return template

    def _queries(self, vectors: np.ndarray) -> np.ndarray:
        array = np.asarray(vectors, dtype=np.float32)
        if array.ndim == 1:
            array = array[None, :]
        if array.ndim != 2 or array.shape[1] != self.dim:
            raise ValueError(
                f"expected (n, {self.dim}) float32 vectors for model version "
                f"{self.model_version}, got shape {tuple(np.shape(vectors))}"
            )
        return np.ascontiguousarray(array)

    # ------------------------------------------------------------------ updates

    def add(self, ids: Sequence[int] | np.ndarray, vectors: np.ndarray,
            infos: Sequence[ItemInfo] | None = None) -> int:
        """Make items searchable at once (call after their rows are committed).

        Ids already in the index are skipped, so replaying a change is harmless; ids removed
        before are never added again.

        Args:
            ids: ``(n,)`` gallery ids.
            vectors: ``(n, d)`` float32, L2-normalised.
            infos: ``n`` label/camera/metadata records for filters (default: empty label).

        Returns:
            How many were added.
        """
        ids = np.asarray(ids, dtype=np.int64).ravel()
        vectors = self._queries(vectors) if len(ids) else np.zeros((0, self.dim), np.float32)
        if len(vectors) != len(ids):
            raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
        infos = list(infos) if infos is not None else [ItemInfo("")] * len(ids)
        if len(infos) != len(ids):
            raise ValueError(f"{len(ids)} ids for {len(infos)} infos")
        with self._lock.write():
            return self._live.add(ids, vectors, infos)

    def remove(self, ids: Sequence[int] | np.ndarray) -> int:
        """Make items unsearchable at once, and for good (call after the delete is committed).

        Every id given is remembered as deleted, present or not: an ``add`` of it that
        arrives later (it was in flight when the delete committed) is ignored.

        Uses FAISS ``remove_ids`` where the index supports it; otherwise the ids become
        tombstones, filtered out of every search, and once they exceed
        ``rebuild_threshold`` of the index a rebuild from SQL starts in the background.

        Returns:
            How many live ids were removed (unknown ids are ignored).
        """
        wanted = {int(i) for i in np.asarray(ids, dtype=np.int64).ravel() if i >= 0}
        with self._lock.write():
            removed = self._live.remove(wanted)
            reason = self._live.rebuild_reason(self.rebuild_threshold) if removed else None
        if reason is not None:
            if self._changes is None:
                logger.warning("%s; no database to rebuild from, they stay filtered", reason)
            else:
                self._rebuilds.start(reason)
        return removed

    def sync_deletes(self) -> int:
        """Apply the deletes that any process committed since the last call (one query).

        Called before every search, so a delete acknowledged anywhere holds for every search
        that starts after the acknowledgement.

        Returns:
            How many ids the deletes named.

        Raises:
            DatabaseError: the database cannot be read.
        """
        if self._changes is None:
            return 0
        return self._changes.sync_deletes(self.remove)

    def refresh_from_changes(self, *, page_size: int = 10_000) -> int:
        """Apply gallery changes committed after :attr:`change_seq` (replica polling).

        Adds fetch the stored embeddings of this model version (items without one are
        skipped); deletes remove. Applying a change twice is harmless.

        Returns:
            The number of change rows read.
        """
        if self._changes is None:
            raise GalleryError("this Searcher has no database to follow (session_factory)")
        with self._changes.replay_lock:
            return self._replay_changes(page_size)

    def _replay_changes(self, page_size: int = 10_000) -> int:
        """The body of :meth:`refresh_from_changes`; the caller holds the replay lock."""
        total = 0
        while True:
            page = self._changes.read_page(self._live.seq, self._live.catalog, page_size)
            if page is None:
                return total
            self.remove(page.deletes)
            if page.adds is not None and len(page.adds.ids):
                self.add(page.adds.ids, page.adds.vectors, page.adds.infos)
            with self._lock.write():
                self._live.seq = max(self._live.seq, page.last_seq)
            total += page.rows
            if page.rows < page_size:
                return total

    # ------------------------------------------------------------------ persistence

    @property
    def can_save(self) -> bool:
        """Whether :meth:`save` has a data directory to write to."""
        return self._data_dir is not None

    def save(self) -> Path:
        """Write the index and its manifest to ``<data_dir>/indexes/<model_version>/``.

        The deletes any process committed before the save are applied first, so a saved
        file never holds a vector SQL had already deleted.

        Only an in-memory copy is made under the (shared) lock; hashing and the disk write
        happen after it is released, so a writer waiting for the lock waits for a memcpy, not
        for the disk. Saves are serialised, so an older copy never overwrites a newer one.
        """
        if self._data_dir is None:
            raise GalleryError("this Searcher has no data_dir to save to")
        folder = index_dir(self._data_dir, self.model_version)
        self.sync_deletes()
        with self._save_lock:
            with self._lock.read():
                snapshot = self._live.snapshot()
            if snapshot is None:
                return folder  # the vectors live in another engine
            write_snapshot(snapshot, folder, model_version=self.model_version, dim=self.dim)
        logger.info("saved the %s index (%d vectors) to %s", self.model_version,
                    len(snapshot.live_ids), folder)
        return folder

    def rebuild(self) -> None:
        """Rebuild from SQL while searches go on, swap it in, then replay newer changes."""
        if self._changes is None:
            raise GalleryError("this Searcher has no database to rebuild from")
        if isinstance(self._live, MilvusIndex):
            raise GalleryError("a Milvus index is rebuilt with `imgret index build --rebuild`")
        built = build_or_fallback(self._changes.session_factory, self.requested_factory,
                                  self.model_version, False)
        # No refresh may run between the swap and the catch-up: it would move the sequence
        # past changes the new index has not seen.
        with self._changes.replay_lock:
            with self._lock.write():
                self._live.swap(built)  # ids removed while it read SQL stay removed
            self._replay_changes()
        if self._data_dir is not None:
            self.save()

    def wait_for_rebuild(self, timeout: float | None = None) -> None:
        """Block until a background rebuild (if any) has finished."""
        self._rebuilds.wait(timeout)


def _per_query_rerank(rerank: Rerank | str | Sequence[Rerank | None] | None,
                      n: int) -> list[Rerank | None]:
    """One re-ranking option (or ``None``) per query."""
    if rerank is None or isinstance(rerank, str):
        return [rerank_options(rerank)] * n
    if not isinstance(rerank, Sequence):
        return [rerank] * n
    options = [rerank_options(option) for option in rerank]
    if len(options) != n:
        raise ValueError(f"{len(options)} rerank options for {n} queries")
    return options


def _rerank_groups(options: list[Rerank | None]) -> list[tuple[Rerank, list[int]]]:
    """The rows of each distinct re-ranking option (rows without one left out)."""
    groups: dict[Rerank, list[int]] = {}
    for row, option in enumerate(options):
        if option is not None:
            groups.setdefault(option, []).append(row)
    return list(groups.items())
