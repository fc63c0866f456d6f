"""Search filters, and the catalog of live ids that turns a filter into an allowed-id mask."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from imgret.gallery.storage.vector_store import ItemInfo


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


def group_queries(
    filters: SearchFilter | Sequence[SearchFilter | None] | None, n: int
) -> list[tuple[SearchFilter | None, list[int]]]:
    """The rows of ``n`` queries grouped by equal filters, each group with its filter.

    Args:
        filters: one filter for all queries, one per query, or ``None``.
        n: the number of queries.

    Raises:
        ValueError: a filter list of another length than the queries.
    """
    if filters is None or isinstance(filters, SearchFilter):
        per_query: Sequence[SearchFilter | None] = [filters] * n
    else:
        per_query = list(filters)
        if len(per_query) != n:
            raise ValueError(f"{len(per_query)} filters for {n} queries")
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, flt in enumerate(per_query):
        groups[flt.key() if flt is not None else None].append(row)
    return [(per_query[rows[0]], rows) for rows in groups.values()]


class Catalog:
    """The live ids of an index and what filters select on.

    Holds id -> :class:`ItemInfo`, the ids of each label and of each camera, and ``live``, a
    boolean mask indexed by id (FAISS's id-selector bitmap is packed from such masks). Not
    thread-safe: the Searcher's lock guards it.
    """

    def __init__(self, infos: dict[int, ItemInfo]):
        self.infos = infos
        self._by_label: dict[str, set[int]] = defaultdict(set)
        self._by_camera: dict[int | None, set[int]] = defaultdict(set)
        ids = self.ids()
        self.live = np.zeros(int(ids.max()) + 1 if len(ids) else 1024, dtype=bool)
        self.live[ids] = True
        for item_id, info in infos.items():
            self._by_label[info.label].add(item_id)
            self._by_camera[info.camera].add(item_id)

    def __len__(self) -> int:
        return len(self.infos)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self.infos

    def ids(self) -> np.ndarray:
        """The live ids, unordered ``(n,) int64``."""
        return np.fromiter(self.infos, np.int64, len(self.infos))

    def ids_of(self, label: str) -> frozenset[int]:
        """The live ids with ``label``."""
        return frozenset(self._by_label.get(label, ()))

    def add(self, ids: np.ndarray, infos: Sequence[ItemInfo]) -> None:
        """Add new ids (``(n,) int64``, none of them live) with their infos."""
        self.live = grown(self.live, int(ids.max()) + 1)
        for item_id, info in zip(ids.tolist(), infos, strict=True):
            self.infos[item_id] = info
            self._by_label[info.label].add(item_id)
            self._by_camera[info.camera].add(item_id)
        self.live[ids] = True

    def remove(self, ids: Sequence[int]) -> None:
        """Remove live ids."""
        for item_id in ids:
            info = self.infos.pop(item_id)
            self._by_label[info.label].discard(item_id)
            self._by_camera[info.camera].discard(item_id)
        self.live[np.asarray(ids, dtype=np.int64)] = False

    def allowed(self, flt: SearchFilter | None, *,
                has_tombstones: bool) -> tuple[np.ndarray | None, int]:
        """The mask of ids a search may return, and how many there are.

        Args:
            flt: the filter, or ``None``.
            has_tombstones: the index still stores deleted ids.

        Returns:
            ``(mask, count)``; the mask is ``None`` when every stored id is live and allowed
            (no filter, no tombstones): the search needs no selector at all.
        """
        if flt is None or (not flt.selects and not flt.exclude_ids):
            if not has_tombstones:
                # The GPU mirror may still hold removed ids: its results are checked
                # against the live mask, so it can keep serving unfiltered searches.
                return None, len(self.infos)
            return self.live, len(self.infos)
        if flt.selects:
            candidates: set[int] | None = None
            if flt.label is not None:
                candidates = set(self._by_label.get(flt.label, ()))
            if flt.camera is not None:
                cams = self._by_camera.get(flt.camera, set())
                candidates = cams.copy() if candidates is None else candidates & cams
            if flt.metadata:
                wanted = dict(flt.metadata)
                pool = candidates if candidates is not None else self.infos.keys()
                candidates = {
                    i for i in pool
                    if all(self.infos[i].metadata.get(key) == value
                           for key, value in wanted.items())
                }
            candidates = (candidates or set()) - flt.exclude_ids
            mask = np.zeros(len(self.live), dtype=bool)
            if candidates:
                mask[np.fromiter(candidates, np.int64, len(candidates))] = True
            return mask, len(candidates)
        mask = self.live.copy()
        excluded = np.fromiter(flt.exclude_ids, np.int64, len(flt.exclude_ids))
        excluded = excluded[(excluded >= 0) & (excluded < len(mask))]
        mask[excluded] = False
        return mask, int(np.count_nonzero(mask))


class DeadIds:
    """Every id ever removed from an index (ids are never reused): an add that arrives after
    the delete (an upload racing it, a stale replay) must not bring one back."""

    def __init__(self) -> None:
        self._mask = np.zeros(1024, dtype=bool)

    def remember(self, ids: set[int]) -> None:
        if ids:
            self._mask = grown(self._mask, max(ids) + 1)
            self._mask[np.fromiter(ids, np.int64, len(ids))] = True

    def __contains__(self, item_id: int) -> bool:
        return item_id < len(self._mask) and bool(self._mask[item_id])


def grown(mask: np.ndarray, capacity: int) -> np.ndarray:
    """``mask`` itself when it holds ``capacity`` ids, else a copy at least twice as long."""
    if capacity <= len(mask):
        return mask
    bigger = np.zeros(max(capacity, 2 * len(mask)), dtype=bool)
    bigger[: len(mask)] = mask
    return bigger
