"""Hits, and the ladder that gives a filtered search ``min(k, allowed ids)`` hits on any index.

1. The allowed ids become a FAISS id selector (a bitmap over gallery ids) where the index
   type takes search parameters;
2. otherwise the search over-fetches in proportion to the selectivity and post-filters;
3. a row that still comes back short is retried exhaustively (every IVF list, a 4x HNSW
   beam);
4. as a last resort, it is ranked exactly over the allowed vectors reconstructed from the
   index.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from imgret.gallery.search.faiss_index import search_index, search_params
from imgret.gallery.search.threads import faiss_threads

# Exact re-ranking reconstructs allowed vectors in blocks of this many.
_EXACT_BLOCK = 65_536


@dataclass(frozen=True, slots=True)
class Hit:
    """One search result: a gallery id and its inner-product score (higher is better)."""

    id: int
    score: float


def search_allowed(index: faiss.Index, queries: np.ndarray, want: int, mask: np.ndarray,
                   n_allowed: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1 and 2: the top ``want`` allowed ids per query (``-1`` where none was found).

    Args:
        index: the CPU index.
        queries: ``(n, d)`` float32.
        want: hits wanted per query, at most ``n_allowed``.
        mask: boolean mask indexed by id: the allowed ids.
        n_allowed: how many ids ``mask`` allows.

    Returns:
        FAISS's ``(distances, labels)``, each ``(n, want)`` or wider.
    """
    selector = _selector(mask)  # a local: FAISS holds only a raw pointer to it
    params, supported = search_params(index, selector, k=want)
    if supported:
        with faiss_threads(len(queries)):
            return search_index(index, queries, want, params)
    # No selector support (PQ, refine): over-fetch in proportion to the selectivity.
    ntotal = index.ntotal
    fetch = min(ntotal, want * max(2, 2 * ntotal // max(n_allowed, 1)))
    while True:
        with faiss_threads(len(queries)):
            distances, labels = index.search(queries, fetch)
        inside = (labels >= 0) & mask[np.clip(labels, 0, len(mask) - 1)]
        if fetch >= ntotal or inside.sum(axis=1).min() >= want:
            return distances, np.where(inside, labels, -1)
        fetch = min(ntotal, fetch * 4)


def to_hits(distances: np.ndarray, labels: np.ndarray, check: np.ndarray | None,
            want: int) -> list[list[Hit]]:
    """The first ``want`` results of each row whose id ``check`` allows (``None``: any found
    id), best first."""
    # A non-finite score comes from a vector written before non-finite ones were refused:
    # it ranks nowhere and JSON cannot carry it, so it is never a hit.
    ok = (labels >= 0) & np.isfinite(distances)
    if check is not None:
        ok &= (labels < len(check)) & check[np.clip(labels, 0, len(check) - 1)]
    out = []
    for row_d, row_l, row_ok in zip(distances, labels, ok, strict=True):
        keep = np.flatnonzero(row_ok)[:want]
        out.append([Hit(i, d) for i, d in zip(row_l[keep].tolist(), row_d[keep].tolist(),
                                               strict=True)])
    return out


def complete(index: faiss.Index, queries: np.ndarray, want: int,
             mask: np.ndarray) -> list[list[Hit]]:
    """Steps 3 and 4, for rows that came back short: retry exhaustively, then rank exactly."""
    selector = _selector(mask)
    params, supported = search_params(index, selector, k=want, exhaustive=True)
    if supported and params is not None:
        with faiss_threads(len(queries)):
            distances, labels = search_index(index, queries, want, params)
        hits = to_hits(distances, labels, mask, want)
        if all(len(row) >= want for row in hits):
            return hits
    return exact_top(index, queries, want, np.flatnonzero(mask))


def exact_top(index: faiss.Index, queries: np.ndarray, want: int,
              ids: np.ndarray) -> list[list[Hit]]:
    """Exact inner-product top-``want`` over ``ids``, from vectors stored in the index."""
    best_scores = np.full((len(queries), 0), -np.inf, dtype=np.float32)
    best_ids = np.zeros((len(queries), 0), dtype=np.int64)
    for start in range(0, len(ids), _EXACT_BLOCK):
        block = ids[start : start + _EXACT_BLOCK].astype(np.int64)
        vectors = index.reconstruct_batch(block)
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


def _selector(mask: np.ndarray) -> faiss.IDSelectorBitmap:
    """A FAISS selector over the ids ``mask`` allows.

    FAISS reads the bitmap through a raw pointer, so the selector holds it as an attribute,
    and the caller holds the selector while FAISS searches with it.
    """
    bitmap = np.packbits(mask, bitorder="little")  # FAISS's IDSelectorBitmap bit order
    selector = faiss.IDSelectorBitmap(len(bitmap), faiss.swig_ptr(bitmap))
    selector.bitmap_array = bitmap
    return selector
