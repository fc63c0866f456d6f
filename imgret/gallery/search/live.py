"""The index being served: the CPU master with its GPU mirror, the catalog of live ids,
tombstones, and the memory of every deleted id.

Not thread-safe: the Searcher holds its reader/writer lock around every call (searches
share it; adds, removes and swaps own it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import faiss
import numpy as np

from imgret.gallery.search.build import BuiltIndex
from imgret.gallery.search.faiss_index import (
    GPU_LOCK,
    place_index,
    search_index,
    search_params,
    serialize_index,
    set_search_defaults,
)
from imgret.gallery.search.filters import Catalog, DeadIds, SearchFilter
from imgret.gallery.search.manifest import normalise_factory
from imgret.gallery.search.ranking import Hit, complete, search_allowed, to_hits
from imgret.gallery.search.threads import ExactFlat, faiss_threads, uses_blas_path
from imgret.gallery.storage.vector_store import ItemInfo

logger = logging.getLogger(__name__)

# FAISS GPU indexes return at most 2048 neighbours per query.
_GPU_MAX_K = 2048


@dataclass(frozen=True)
class Snapshot:
    """What a save writes, copied under the lock: the index file's bytes and the facts of
    its manifest."""

    data: np.ndarray
    live_ids: np.ndarray
    change_seq: int
    factory: str
    tombstones: list[int]


class LiveIndex:
    """The current index of a Searcher and what is live in it.

    Args:
        index: a CPU FAISS index whose ids are gallery ids.
        factory: the factory string it was built with.
        infos: id -> filter info of every live id in the index.
        change_seq: the change-log position the index reflects.
        tombstones: ids stored in the index but deleted (indexes without ``remove_ids``).
        use_gpu: ``None`` = mirror on the GPUs when FAISS sees some, ``False`` = CPU only.
        nprobe, ef_search: query-time knobs of IVF / HNSW indexes (``None`` = defaults).
    """

    def __init__(self, index: faiss.Index, *, factory: str, infos: dict[int, ItemInfo],
                 change_seq: int, tombstones: Sequence[int], use_gpu: bool | None,
                 nprobe: int | None, ef_search: int | None):
        self._use_gpu = use_gpu
        self._knobs = {"nprobe": nprobe, "ef_search": ef_search}
        # Never added again, across swaps.
        self._dead = DeadIds()
        self._install(index, factory, infos, change_seq, tombstones)

    def _install(self, index: faiss.Index, factory: str, infos: dict[int, ItemInfo],
                 change_seq: int, tombstones: Sequence[int]) -> None:
        if any(self._knobs.values()):
            set_search_defaults(index, **self._knobs)
        self.index = index
        self._exact = ExactFlat.of(index)  # small unfiltered batches: BLAS + FAISS heaps
        self.factory = normalise_factory(factory)
        self._gpu, self.device = place_index(index, use_gpu=self._use_gpu)
        self._gpu_stale: set[int] = set()  # removed ids the GPU mirror still holds
        self.catalog = Catalog(infos)
        self.tombstones = {int(t) for t in tombstones}
        self._can_remove: bool | None = None
        self.seq = int(change_seq)

    @property
    def d(self) -> int:
        """The vectors' dimension."""
        return int(self.index.d)

    @property
    def stored(self) -> int:
        """Vectors the index stores, tombstones included."""
        return int(self.index.ntotal)

    def swap(self, built: BuiltIndex) -> None:
        """Make a rebuilt index current, without the ids removed while it read SQL."""
        revived = [i for i in built.infos if i in self._dead]
        gone = set(revived)
        infos = {i: info for i, info in built.infos.items() if i not in gone}
        tombstones: list[int] = []
        if revived and _can_remove(built.index):
            built.index.remove_ids(np.asarray(revived, dtype=np.int64))
        else:
            tombstones = revived
        self._install(built.index, built.manifest.factory, infos, built.manifest.change_seq,
                      tombstones)

    # ------------------------------------------------------------------ updates

    def add(self, ids: np.ndarray, vectors: np.ndarray, infos: Sequence[ItemInfo]) -> int:
        """Add the items that are new and were never removed; returns how many."""
        keep, seen = [], set()
        for row, item_id in enumerate(ids.tolist()):
            if item_id in self.catalog or item_id in seen:
                continue
            if item_id in self._dead:
                continue  # deleted (ids are never reused): a late add must not revive it
            if item_id in self.tombstones:
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
        self.index.add_with_ids(new_vectors, new_ids)
        if self._gpu is not None:
            try:
                with GPU_LOCK:
                    self._gpu.add_with_ids(new_vectors, new_ids)
            except RuntimeError as exc:
                logger.warning("GPU mirror dropped (add failed: %s); searching on CPU", exc)
                self._gpu, self.device = None, "cpu"
        self.catalog.add(new_ids, [infos[row] for row in keep])
        return len(keep)

    def remove(self, wanted: set[int]) -> int:
        """Remember ``wanted`` (non-negative ids) as deleted for good, and remove the live
        ones: with ``remove_ids`` where the index has it, else as tombstones.

        Returns:
            How many live ids were removed.
        """
        self._dead.remember(wanted)
        present = sorted(i for i in wanted if i in self.catalog)
        if not present:
            return 0
        array = np.asarray(present, dtype=np.int64)
        if self._can_remove is not False:
            try:
                self.index.remove_ids(array)
                self._can_remove = True
            except RuntimeError:
                logger.info("%s has no remove_ids: deleted ids become tombstones",
                            type(self.index).__name__)
                self._can_remove = False
        if not self._can_remove:
            self.tombstones.update(present)
        if self._gpu is not None:
            try:
                with GPU_LOCK:
                    self._gpu.remove_ids(array)
            except RuntimeError:
                self._gpu_stale.update(present)
        self.catalog.remove(present)
        return len(present)

    def rebuild_reason(self, threshold: float) -> str | None:
        """Why the index should be rebuilt: deleted vectors it still stores (tombstones, or
        ids the GPU mirror kept) exceed ``threshold`` of it; ``None`` while they do not."""
        stale = max(len(self.tombstones), len(self._gpu_stale))
        if stale > threshold * max(self.index.ntotal, 1):
            return f"{stale} deleted vectors are still stored"
        return None

    # ------------------------------------------------------------------ search

    def search(self, queries: np.ndarray, k: int, flt: SearchFilter | None) -> list[list[Hit]]:
        """The top ``min(k, allowed)`` hits of each query among the live ids ``flt`` allows.

        Unfiltered searches go to the GPU mirror when there is one; filtered ones use the
        CPU master's id selector (see :mod:`imgret.gallery.search.ranking`).
        """
        mask, n_allowed = self.catalog.allowed(flt, has_tombstones=bool(self.tombstones))
        want = min(k, n_allowed)
        if want == 0:
            return [[] for _ in range(len(queries))]
        if mask is None and self._gpu is not None:
            # Over-fetch by the removed ids the mirror still holds; the live mask drops them.
            fetch = min(want + len(self._gpu_stale), _GPU_MAX_K, self._gpu.ntotal)
            with GPU_LOCK:  # concurrent readers would share FAISS's GPU scratch memory
                distances, labels = self._gpu.search(queries, max(fetch, 1))
            check = self.catalog.live
        elif mask is None:
            distances, labels = self._search_cpu(queries, want)
            check = None
        else:
            distances, labels = search_allowed(self.index, queries, want, mask, n_allowed)
            check = mask
        hits = to_hits(distances, labels, check, want)
        short = [row for row, row_hits in enumerate(hits) if len(row_hits) < want]
        if short:
            completed = complete(self.index, queries[short], want,
                                 mask if mask is not None else self.catalog.live)
            for row, row_hits in zip(short, completed, strict=True):
                hits[row] = row_hits
        return hits

    def neighbours(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Unfiltered top ``min(k, live)`` over the live ids as arrays (no :class:`Hit`
        objects: re-ranking reads thousands of these lists).

        Returns:
            ``(scores (n, w) float32, ids (n, w) int64)``, best first; ``-1`` ids (and
            ``-inf`` scores) pad rows that came back short.
        """
        want = min(k, len(self.catalog))
        if want == 0 or not len(queries):
            return (np.zeros((len(queries), 0), np.float32),
                    np.zeros((len(queries), 0), np.int64))
        if not self.tombstones and self._gpu is None:
            return self._search_cpu(queries, want)  # every stored id is live
        scores = np.full((len(queries), want), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), want), -1, dtype=np.int64)
        for row, hits in enumerate(self.search(queries, want, None)):
            ids[row, : len(hits)] = [hit.id for hit in hits]
            scores[row, : len(hits)] = [hit.score for hit in hits]
        return scores, ids

    def _search_cpu(self, queries: np.ndarray, want: int) -> tuple[np.ndarray, np.ndarray]:
        """Unfiltered CPU search: an exact Flat index below FAISS's BLAS threshold goes to a
        BLAS product and FAISS's heaps; every other search to FAISS on one OpenMP thread per
        query at most (see :mod:`imgret.gallery.search.threads`). The same ids and scores either
        way,
        ties and the last float bit aside."""
        if self._exact is not None and not uses_blas_path(len(queries), self.index.d):
            return self._exact.search(queries, want)
        params, _ = search_params(self.index, None, k=want)
        with faiss_threads(len(queries)):
            return search_index(self.index, queries, want, params)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """``(n, d)`` float32 stored vectors of live ``ids`` (``(n,) int64``), reconstructed
        from the CPU master (approximate for compressed indexes such as PQ)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return np.zeros((0, self.index.d), dtype=np.float32)
        return np.ascontiguousarray(self.index.reconstruct_batch(ids), dtype=np.float32)

    def snapshot(self) -> Snapshot:
        """An in-memory copy of the index and its manifest facts (a memcpy, for the lock)."""
        return Snapshot(
            data=serialize_index(self.index), live_ids=self.catalog.ids(),
            change_seq=self.seq, factory=self.factory, tombstones=sorted(self.tombstones),
        )


def _can_remove(index: faiss.Index) -> bool:
    """Whether ``remove_ids`` works on this index type (HNSW has none)."""
    try:
        index.remove_ids(np.zeros(0, dtype=np.int64))
    except RuntimeError:
        return False
    return True
