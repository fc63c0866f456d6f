"""The Searcher: a thread-safe FAISS index over the gallery, with filters and live updates.

One Searcher serves one model version. It loads the saved index (or rebuilds it from SQL when
the manifest disagrees with the database), keeps an id -> (label, camera, metadata) map for
filters, and follows gallery writes either directly (``add``/``remove`` after a commit in this
process) or by polling the change log (``refresh_from_changes``, for replicas).

Deletes are final, in every process, at once:

- an id that was removed once is remembered (ids are never reused) and never added again, so
  an ``add`` that arrives late (an upload whose DELETE committed before its index update, a
  replay that fetched vectors before the delete) cannot bring it back;
- before every search, a Searcher with a database reads the deletes committed since it last
  looked (one indexed query, :func:`index.store.deletes_after`) and applies them, so a DELETE
  acknowledged by any process is honoured by every search that starts after it. Adds made by
  other processes arrive with the follower (``refresh_from_changes``), within its interval.

Filtered searches return ``min(k, number of matching items)`` hits, never silently fewer:
the filter becomes a FAISS id selector (a bitmap over gallery ids) where the index type
supports one, otherwise the search over-fetches and post-filters; a row that still comes
back short is retried exhaustively and, as a last resort, ranked exactly over the matching
vectors reconstructed from the index.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import DatabaseError, GalleryError, IndexStale
from imgret.settings import Settings
from index import store
from index.faiss_index import (
    DEFAULT_FACTORY,
    BuiltIndex,
    TooFewVectors,
    build_from_sql,
    check_factory,
    place_index,
    read_index,
    search_index,
    search_params,
    serialize_index,
    set_search_defaults,
    stored_ids,
    write_index_bytes,
)
from index.manifest import Manifest, ids_checksum, index_dir, normalise_factory, now_iso
from index.store import ItemInfo

logger = logging.getLogger(__name__)

# FAISS GPU indexes return at most 2048 neighbours per query.
_GPU_MAX_K = 2048
# Exact re-ranking reconstructs matching vectors in blocks of this many.
_EXACT_BLOCK = 65_536


@dataclass(frozen=True, slots=True)
class Hit:
    """One search result: a gallery id and its inner-product score (higher is better)."""

    id: int
    score: float


@dataclass(frozen=True)
class SearchFilter:
    """Restrict a search to matching gallery items (all given conditions must hold).

    Attributes:
        label: only items with this label.
        camera: only items from this camera.
        metadata: only items whose metadata has these key/value pairs (JSON equality).
        exclude_ids: never return these ids (e.g. the query itself, for leave-one-out
            evaluation).
    """

    label: str | None = None
    camera: int | None = None
    metadata: Mapping[str, Any] | None = None
    exclude_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude_ids", frozenset(int(i) for i in self.exclude_ids))

    @property
    def selects(self) -> bool:
        """Whether a label / camera / metadata condition is set (not only exclusions)."""
        return self.label is not None or self.camera is not None or bool(self.metadata)

    def key(self) -> tuple:
        """A hashable key: queries with equal filters are searched as one batch."""
        meta = json.dumps(dict(self.metadata or {}), sort_keys=True, default=str)
        return (self.label, self.camera, meta, self.exclude_ids)


class ReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers (no starvation)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


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
        self, index: faiss.Index, *, model_version: str, factory: str,
        infos: Mapping[int, ItemInfo] | None = None, change_seq: int = 0,
        tombstones: Sequence[int] = (), session_factory: sessionmaker[Session] | None = None,
        data_dir: str | Path | None = None, use_gpu: bool | None = None,
        rebuild_threshold: float = 0.1, requested_factory: str | None = None,
        nprobe: int | None = None, ef_search: int | None = None,
    ):
        self.model_version = model_version
        self._knobs = {"nprobe": nprobe, "ef_search": ef_search}
        self.factory = normalise_factory(factory)
        self.requested_factory = normalise_factory(requested_factory or factory)
        self.dim = int(index.d)
        self.rebuild_threshold = rebuild_threshold
        self._session_factory = session_factory
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._use_gpu = use_gpu
        self._lock = ReadWriteLock()
        self._refresh_lock = threading.Lock()
        self._deletes_lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._rebuild_lock = threading.Lock()
        self._rebuild_thread: threading.Thread | None = None
        # Every id ever removed from this Searcher (ids are never reused): never added again.
        self._dead = np.zeros(1024, dtype=bool)
        self._install(index, dict(infos or {}), change_seq, tombstones)
        self._deletes_seq = self._seq

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_settings(
        cls, session_factory: sessionmaker[Session], settings: Settings,
        model_version: str | None = None, **kwargs: Any,
    ) -> Searcher:
        """:meth:`open` with the index settings in force (``IMGRET_DATA_DIR``,
        ``IMGRET_INDEX_FACTORY``, ``IMGRET_INDEX_NPROBE``, ``IMGRET_INDEX_EF_SEARCH``), so the
        service, ``/evaluate`` and the CLI search the same way."""
        return cls.open(
            session_factory, settings.data_dir, settings.index_factory, model_version,
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
        an empty index. A factory that needs training falls back to exact ``Flat`` while the gallery
        is too small to train it (logged); the next open or rebuild tries again.

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
        with session_factory.begin() as session:
            try:
                version = store.get_model_version(session=session, version=model_version)
            except GalleryError:
                if model_version is None or dim is None:
                    raise
                version = store.register_model_version(
                    session=session, version=model_version, dim=dim, config=config
                )
        check_factory(factory, version.dim)  # refuse a bad string before any work
        folder = index_dir(data_dir, version.version)
        common = dict(session_factory=session_factory, data_dir=data_dir, use_gpu=use_gpu,
                      rebuild_threshold=rebuild_threshold, requested_factory=factory,
                      nprobe=nprobe, ef_search=ef_search)
        try:
            searcher = cls._load(folder, version, factory, common)
        except IndexStale as exc:
            logger.warning("rebuilding the %s index from SQL: %s", version.version, exc)
            built = _build_or_fallback(session_factory, factory, version.version, progress)
            searcher = cls(
                built.index, model_version=version.version, factory=built.manifest.factory,
                infos=built.infos, change_seq=built.manifest.change_seq, **common,
            )
            searcher.refresh_from_changes()
            if save:
                searcher.save()
        return searcher

    @classmethod
    def _load(cls, folder: Path, version, factory: str, common: dict) -> Searcher:
        session_factory = common["session_factory"]
        manifest = Manifest.read(folder)
        reasons = manifest.mismatches(model_version=version.version, factory=factory,
                                      dim=version.dim)
        if reasons:
            raise IndexStale("manifest differs: " + "; ".join(reasons))
        with session_factory() as session:
            db_seq = store.max_change_seq(session=session)
        if manifest.change_seq > db_seq:
            raise IndexStale(
                f"the manifest is at change {manifest.change_seq} but the database only at "
                f"{db_seq} (a different or restored database)"
            )
        index = read_index(folder, manifest.index_sha256)
        tombstones = set(manifest.tombstones)
        live = np.setdiff1d(stored_ids(index), np.fromiter(tombstones, np.int64))
        if len(live) != manifest.count or ids_checksum(live) != manifest.ids_sha256:
            raise IndexStale("the index file's ids differ from its manifest")
        db_infos = _load_infos(session_factory, version)
        infos = {int(i): db_infos.get(int(i), ItemInfo("")) for i in live}
        set_search_defaults(index)
        searcher = cls(index, model_version=version.version, factory=manifest.factory,
                       infos=infos, change_seq=manifest.change_seq,
                       tombstones=sorted(tombstones), **common)
        replayed = searcher.refresh_from_changes()
        mine, theirs = searcher.ids(), np.fromiter(db_infos, np.int64, len(db_infos))
        if ids_checksum(mine) != ids_checksum(theirs):
            missing = len(np.setdiff1d(theirs, mine))
            extra = len(np.setdiff1d(mine, theirs))
            raise IndexStale(
                f"after replaying {replayed} changes the index holds {len(mine)} ids and the "
                f"database {len(theirs)} ({missing} missing, {extra} extra)"
            )
        logger.info(
            "loaded the %s index (%s, %d vectors, %d changes replayed)",
            version.version, manifest.factory, searcher.size, replayed,
        )
        return searcher

    def _install(self, index: faiss.Index, infos: dict[int, ItemInfo], change_seq: int,
                 tombstones: Sequence[int]) -> None:
        """Make ``index`` current (caller holds the write lock, or is the constructor)."""
        if any(self._knobs.values()):
            set_search_defaults(index, **self._knobs)
        self._index = index
        self._gpu, self.device = place_index(index, use_gpu=self._use_gpu)
        self._gpu_stale: set[int] = set()
        self._infos = infos
        self._tombstones = {int(t) for t in tombstones}
        self._can_remove: bool | None = None
        self._seq = int(change_seq)
        self._by_label: dict[str, set[int]] = defaultdict(set)
        self._by_camera: dict[int | None, set[int]] = defaultdict(set)
        ids = np.fromiter(infos, dtype=np.int64, count=len(infos))
        self._live = np.zeros(int(ids.max()) + 1 if len(ids) else 1024, dtype=bool)
        self._live[ids] = True
        for item_id, info in infos.items():
            self._by_label[info.label].add(item_id)
            self._by_camera[info.camera].add(item_id)

    # ------------------------------------------------------------------ properties

    @property
    def size(self) -> int:
        """Searchable (live) vectors."""
        return len(self._infos)

    @property
    def change_seq(self) -> int:
        """The change-log position this index reflects."""
        return self._seq

    def ids(self) -> np.ndarray:
        """The live ids, sorted ``(n,) int64``."""
        with self._lock.read():
            return np.sort(np.fromiter(self._infos, np.int64, len(self._infos)))

    def info(self, item_id: int) -> ItemInfo | None:
        """Label, camera and metadata of a live id (``None`` when absent)."""
        return self._infos.get(int(item_id))

    # ------------------------------------------------------------------ search

    def search(
        self, vectors: np.ndarray, k: int,
        filters: SearchFilter | Sequence[SearchFilter | None] | None = None,
    ) -> list[list[Hit]]:
        """The k best gallery items for each query vector.

        Args:
            vectors: ``(n, d)`` float32 queries, L2-normalised (``Embedder.embed`` output);
                a ``(d,)`` vector is one query.
            k: results per query (≥ 1).
            filters: one filter for all queries, one per query, or ``None``.

        Returns:
            ``n`` lists of :class:`Hit`, best first; each has ``min(k, matching items)``
            hits.

        Raises:
            ValueError: wrong shape or dimension, ``k < 1``, or a filter list of another
                length than the queries.
            DatabaseError: the deletes committed by other processes cannot be read (the
                database is unreachable): no answer is better than one with a deleted item.
        """
        queries = self._queries(vectors)
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if self._session_factory is not None:
            self.sync_deletes()
        n = len(queries)
        if filters is None or isinstance(filters, SearchFilter):
            per_query: Sequence[SearchFilter | None] = [filters] * n
        else:
            per_query = list(filters)
            if len(per_query) != n:
                raise ValueError(f"{len(per_query)} filters for {n} queries")
        groups: dict[Any, list[int]] = defaultdict(list)
        for row, flt in enumerate(per_query):
            groups[flt.key() if flt is not None else None].append(row)
        results: list[list[Hit]] = [[] for _ in range(n)]
        with self._lock.read():
            for rows in groups.values():
                hits = self._search_group(queries[rows], k, per_query[rows[0]])
                for row, row_hits in zip(rows, hits, strict=True):
                    results[row] = row_hits
        return results

    def _search_group(self, queries: np.ndarray, k: int,
                      flt: SearchFilter | None) -> list[list[Hit]]:
        mask, n_allowed = self._allowed(flt)
        want = min(k, n_allowed)
        if want == 0:
            return [[] for _ in range(len(queries))]
        if mask is None and self._gpu is not None:
            distances, labels = self._search_gpu(queries, want)
            check = self._live
        elif mask is None:
            params, _ = search_params(self._index, None, k=want)
            distances, labels = search_index(self._index, queries, want, params)
            check = None
        else:
            distances, labels = self._search_selected(queries, want, mask, n_allowed)
            check = mask
        hits = self._hits(distances, labels, check, want)
        short = [row for row, row_hits in enumerate(hits) if len(row_hits) < want]
        if short:
            completed = self._complete(queries[short], want, mask if mask is not None
                                       else self._live)
            for row, row_hits in zip(short, completed, strict=True):
                hits[row] = row_hits
        return hits

    def _allowed(self, flt: SearchFilter | None) -> tuple[np.ndarray | None, int]:
        """The allowed-id mask (``None`` = every stored id is live and allowed) and count."""
        if flt is None or (not flt.selects and not flt.exclude_ids):
            if not self._tombstones:
                # The GPU mirror may still hold removed ids: its results are checked
                # against the live mask, so it can keep serving unfiltered searches.
                return None, len(self._infos)
            return self._live, len(self._infos)
        if flt.selects:
            candidates: set[int] | None = None
            if flt.label is not None:
                candidates = set(self._by_label.get(flt.label, ()))
            if flt.camera is not None:
                cams = self._by_camera.get(flt.camera, set())
                candidates = cams.copy() if candidates is None else candidates & cams
            if flt.metadata:
                wanted = dict(flt.metadata)
                pool = candidates if candidates is not None else self._infos.keys()
                candidates = {
                    i for i in pool
                    if all(self._infos[i].metadata.get(key) == value
                           for key, value in wanted.items())
                }
            candidates = (candidates or set()) - flt.exclude_ids
            mask = np.zeros(len(self._live), dtype=bool)
            if candidates:
                mask[np.fromiter(candidates, np.int64, len(candidates))] = True
            return mask, len(candidates)
        mask = self._live.copy()
        excluded = np.fromiter(flt.exclude_ids, np.int64, len(flt.exclude_ids))
        excluded = excluded[(excluded >= 0) & (excluded < len(mask))]
        mask[excluded] = False
        return mask, int(np.count_nonzero(mask))

    def _search_selected(self, queries: np.ndarray, want: int, mask: np.ndarray,
                         n_allowed: int) -> tuple[np.ndarray, np.ndarray]:
        bitmap = np.packbits(mask, bitorder="little")  # FAISS's IDSelectorBitmap bit order
        selector = faiss.IDSelectorBitmap(len(bitmap), faiss.swig_ptr(bitmap))
        params, supported = search_params(self._index, selector, k=want)
        if supported:
            return search_index(self._index, queries, want, params)
        # No selector support (PQ, refine): over-fetch in proportion to the selectivity.
        ntotal = self._index.ntotal
        fetch = min(ntotal, want * max(2, 2 * ntotal // max(n_allowed, 1)))
        while True:
            distances, labels = self._index.search(queries, fetch)
            inside = (labels >= 0) & mask[np.clip(labels, 0, len(mask) - 1)]
            if fetch >= ntotal or inside.sum(axis=1).min() >= want:
                return distances, np.where(inside, labels, -1)
            fetch = min(ntotal, fetch * 4)

    def _search_gpu(self, queries: np.ndarray, want: int) -> tuple[np.ndarray, np.ndarray]:
        fetch = min(want + len(self._gpu_stale), _GPU_MAX_K, self._gpu.ntotal)
        return self._gpu.search(queries, max(fetch, 1))

    def _hits(self, distances: np.ndarray, labels: np.ndarray, check: np.ndarray | None,
              want: int) -> list[list[Hit]]:
        ok = labels >= 0
        if check is not None:
            ok &= (labels < len(check)) & check[np.clip(labels, 0, len(check) - 1)]
        out = []
        for row_d, row_l, row_ok in zip(distances, labels, ok, strict=True):
            keep = np.flatnonzero(row_ok)[:want]
            out.append([Hit(i, d) for i, d in zip(row_l[keep].tolist(), row_d[keep].tolist(),
                                                   strict=True)])
        return out

    def _complete(self, queries: np.ndarray, want: int, mask: np.ndarray) -> list[list[Hit]]:
        """Rows that came back short: retry exhaustively, then rank exactly."""
        bitmap = np.packbits(mask, bitorder="little")
        selector = faiss.IDSelectorBitmap(len(bitmap), faiss.swig_ptr(bitmap))
        params, supported = search_params(self._index, selector, k=want, exhaustive=True)
        if supported and params is not None:
            distances, labels = search_index(self._index, queries, want, params)
            hits = self._hits(distances, labels, mask, want)
            if all(len(row) >= want for row in hits):
                return hits
        return self._exact(queries, want, np.flatnonzero(mask))

    def _exact(self, queries: np.ndarray, want: int, ids: np.ndarray) -> list[list[Hit]]:
        """Exact inner-product top-``want`` over ``ids``, from vectors stored in the index."""
        best_scores = np.full((len(queries), 0), -np.inf, dtype=np.float32)
        best_ids = np.zeros((len(queries), 0), dtype=np.int64)
        for start in range(0, len(ids), _EXACT_BLOCK):
            block = ids[start : start + _EXACT_BLOCK].astype(np.int64)
            vectors = self._index.reconstruct_batch(block)
            scores = np.concatenate([best_scores, queries @ vectors.T], axis=1)
            cand = np.concatenate([best_ids, np.broadcast_to(block, (len(queries), len(block)))],
                                  axis=1)
            top = min(want, scores.shape[1])
            part = np.argpartition(-scores, top - 1, axis=1)[:, :top]
            best_scores = np.take_along_axis(scores, part, axis=1)
            best_ids = np.take_along_axis(cand, part, axis=1)
        order = np.argsort(-best_scores, axis=1, kind="stable")
        best_scores = np.take_along_axis(best_scores, order, axis=1)
        best_ids = np.take_along_axis(best_ids, order, axis=1)
        return [[Hit(i, s) for i, s in zip(row_i, row_s, strict=True)]
                for row_i, row_s in zip(best_ids.tolist(), best_scores.tolist(), strict=True)]

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

        Ids already in the index are skipped, so replaying a change is harmless.

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
            keep, seen = [], set()
            for row, item_id in enumerate(ids.tolist()):
                if item_id in self._infos or item_id in seen:
                    continue
                if item_id < len(self._dead) and self._dead[item_id]:
                    continue  # deleted (ids are never reused): a late add must not revive it
                if item_id in self._tombstones:
                    # Still stored (no remove_ids): adding again would duplicate it. Ids are
                    # never reused, so this only means a stale replay; the rebuild fixes it.
                    logger.warning("id %d was deleted and is still stored; not re-added", item_id)
                    continue
                if item_id < 0:
                    raise ValueError(f"gallery ids are non-negative, got {item_id}")
                seen.add(item_id)
                keep.append(row)
            if not keep:
                return 0
            new_ids, new_vectors = ids[keep], vectors[keep]
            self._index.add_with_ids(new_vectors, new_ids)
            if self._gpu is not None:
                try:
                    self._gpu.add_with_ids(new_vectors, new_ids)
                except RuntimeError as exc:
                    logger.warning("GPU mirror dropped (add failed: %s); searching on CPU", exc)
                    self._gpu, self.device = None, "cpu"
            self._grow(int(new_ids.max()) + 1)
            for row in keep:
                item_id, info = int(ids[row]), infos[row]
                self._infos[item_id] = info
                self._by_label[info.label].add(item_id)
                self._by_camera[info.camera].add(item_id)
            self._live[new_ids] = True
            return len(keep)

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
            if wanted:
                self._dead = _grown(self._dead, max(wanted) + 1)
                self._dead[np.fromiter(wanted, np.int64, len(wanted))] = True
            present = sorted(i for i in wanted if i in self._infos)
            if not present:
                return 0
            array = np.asarray(present, dtype=np.int64)
            if self._can_remove is not False:
                try:
                    self._index.remove_ids(array)
                    self._can_remove = True
                except RuntimeError:
                    logger.info("%s has no remove_ids: deleted ids become tombstones",
                                type(self._index).__name__)
                    self._can_remove = False
            if not self._can_remove:
                self._tombstones.update(present)
            if self._gpu is not None:
                try:
                    self._gpu.remove_ids(array)
                except RuntimeError:
                    self._gpu_stale.update(present)
            for item_id in present:
                info = self._infos.pop(item_id)
                self._by_label[info.label].discard(item_id)
                self._by_camera[info.camera].discard(item_id)
            self._live[array] = False
            stale = max(len(self._tombstones), len(self._gpu_stale))
            needs_rebuild = stale > self.rebuild_threshold * max(self._index.ntotal, 1)
        if needs_rebuild:
            self._schedule_rebuild(f"{stale} deleted vectors are still stored")
        return len(present)

    def _grow(self, capacity: int) -> None:
        self._live = _grown(self._live, capacity)

    # ------------------------------------------------------------------ replicas

    def sync_deletes(self) -> int:
        """Apply the deletes that any process committed since the last call (one query).

        Called before every search, so a delete acknowledged anywhere holds for every search
        that starts after the acknowledgement.

        Returns:
            How many ids the deletes named.

        Raises:
            DatabaseError: the database cannot be read.
        """
        if self._session_factory is None:
            return 0
        with self._deletes_lock:
            try:
                with self._session_factory.kw["bind"].connect() as connection:
                    deleted, seq = store.deletes_after(self._deletes_seq,
                                                       connection=connection)
            except SQLAlchemyError as exc:
                raise DatabaseError(
                    f"cannot read the gallery's deletes from the database: "
                    f"{type(exc).__name__}"
                ) from None
            if deleted:
                self.remove(deleted)
            self._deletes_seq = max(self._deletes_seq, seq)
            return len(deleted)

    def refresh_from_changes(self, *, page_size: int = 10_000) -> int:
        """Apply gallery changes committed after :attr:`change_seq` (replica polling).

        Adds fetch the stored embeddings of this model version (items without one are
        skipped); deletes remove. Applying a change twice is harmless.

        Returns:
            The number of change rows read.
        """
        if self._session_factory is None:
            raise GalleryError("this Searcher has no database to follow (session_factory)")
        with self._refresh_lock:
            return self._replay_changes(page_size)

    def _replay_changes(self, page_size: int = 10_000) -> int:
        """The body of :meth:`refresh_from_changes`; the caller holds ``_refresh_lock``."""
        total = 0
        while True:
            with self._session_factory() as session:
                changes = store.changes_after(self._seq, session=session, limit=page_size)
                if not changes:
                    return total
                last_op: dict[int, str] = {}
                for change in changes:
                    last_op[change.item_id] = change.op  # the last word on each item
                adds = [i for i, op in last_op.items() if op == "add" and i not in self._infos]
                deletes = [i for i, op in last_op.items() if op == "delete"]
                page = None
                if adds:
                    version = store.get_model_version(session=session,
                                                      version=self.model_version)
                    page = store.fetch_vectors(adds, session=session, model_version=version)
            self.remove(deletes)
            if page is not None and len(page.ids):
                self.add(page.ids, page.vectors, page.infos)
            with self._lock.write():
                self._seq = max(self._seq, changes[-1].seq)
            total += len(changes)
            if len(changes) < page_size:
                return total

    # ------------------------------------------------------------------ persistence

    def save(self) -> Path:
        """Write the index and its manifest to ``<data_dir>/indexes/<model_version>/``.

        Only an in-memory copy is made under the (shared) lock; hashing and the disk write
        happen after it is released, so a writer waiting for the lock waits for a memcpy, not
        for the disk. Saves are serialised, so an older copy never overwrites a newer one.
        """
        if self._data_dir is None:
            raise GalleryError("this Searcher has no data_dir to save to")
        folder = index_dir(self._data_dir, self.model_version)
        with self._save_lock:
            with self._lock.read():
                data = serialize_index(self._index)
                live = np.fromiter(self._infos, np.int64, len(self._infos))
                seq, factory = self._seq, self.factory
                tombstones = sorted(self._tombstones)
            _, digest = write_index_bytes(data, folder)
            manifest = Manifest(
                model_version=self.model_version, factory=factory, dim=self.dim,
                count=len(live), change_seq=seq, ids_sha256=ids_checksum(live),
                index_sha256=digest, tombstones=tombstones,
                faiss_version=faiss.__version__, created_at=now_iso(),
            )
            manifest.write(folder)
        logger.info("saved the %s index (%d vectors) to %s", self.model_version, len(live),
                    folder)
        return folder

    def rebuild(self) -> None:
        """Rebuild from SQL while searches go on, swap it in, then replay newer changes."""
        if self._session_factory is None:
            raise GalleryError("this Searcher has no database to rebuild from")
        built = _build_or_fallback(self._session_factory, self.requested_factory,
                                   self.model_version, False)
        # No refresh may run between the swap and the catch-up: it would move the sequence
        # past changes the new index has not seen.
        with self._refresh_lock:
            with self._lock.write():
                self.factory = built.manifest.factory
                # Ids removed while the build was reading SQL must not come back with it.
                revived = [i for i in built.infos if i < len(self._dead) and self._dead[i]]
                gone = set(revived)
                infos = {i: info for i, info in built.infos.items() if i not in gone}
                tombstones: list[int] = []
                if revived and _can_remove(built.index):
                    built.index.remove_ids(np.asarray(revived, dtype=np.int64))
                else:
                    tombstones = revived
                self._install(built.index, infos, built.manifest.change_seq, tombstones)
            self._replay_changes()
        if self._data_dir is not None:
            self.save()

    def _schedule_rebuild(self, reason: str) -> None:
        if self._session_factory is None:
            logger.warning("%s; no database to rebuild from, they stay filtered", reason)
            return
        with self._rebuild_lock:  # two removes at once must not start two rebuilds
            if self._rebuild_thread is not None and self._rebuild_thread.is_alive():
                return
            logger.info("%s: rebuilding the %s index in the background", reason,
                        self.model_version)
            self._rebuild_thread = threading.Thread(
                target=self._rebuild_logged, name="imgret-index-rebuild", daemon=True
            )
            self._rebuild_thread.start()

    def _rebuild_logged(self) -> None:
        try:
            self.rebuild()
        except Exception:  # a background thread has nobody to raise to
            logger.exception("background rebuild of the %s index failed", self.model_version)

    def wait_for_rebuild(self, timeout: float | None = None) -> None:
        """Block until a background rebuild (if any) has finished."""
        thread = self._rebuild_thread
        if thread is not None:
            thread.join(timeout)

    @property
    def stats(self) -> dict[str, Any]:
        """Numbers for /health and logs."""
        return {
            "model_version": self.model_version, "factory": self.factory, "size": self.size,
            "stored": int(self._index.ntotal), "tombstones": len(self._tombstones),
            "change_seq": self._seq, "device": self.device,
        }


def _grown(mask: np.ndarray, capacity: int) -> np.ndarray:
    """``mask`` itself when it holds ``capacity`` ids, else a copy at least twice as long."""
    if capacity <= len(mask):
        return mask
    grown = np.zeros(max(capacity, 2 * len(mask)), dtype=bool)
    grown[: len(mask)] = mask
    return grown


def _can_remove(index: faiss.Index) -> bool:
    """Whether ``remove_ids`` works on this index type (HNSW has none)."""
    try:
        index.remove_ids(np.zeros(0, dtype=np.int64))
    except RuntimeError:
        return False
    return True


def _load_infos(session_factory: sessionmaker[Session], version) -> dict[int, ItemInfo]:
    infos: dict[int, ItemInfo] = {}
    with session_factory() as session:
        for page in store.iter_vector_pages(session=session, model_version=version,
                                            page_size=50_000, with_vectors=False):
            infos.update(zip(page.ids.tolist(), page.infos, strict=True))
    return infos


def _build_or_fallback(session_factory: sessionmaker[Session], factory: str, version: str,
                       progress: bool) -> BuiltIndex:
    try:
        return build_from_sql(session_factory, factory, model_version=version,
                              progress=progress)
    except TooFewVectors as exc:
        logger.warning("%s; serving exact search (Flat) until the gallery is large enough",
                       exc)
        return build_from_sql(session_factory, DEFAULT_FACTORY, model_version=version,
                              progress=progress)
