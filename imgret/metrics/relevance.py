"""Relevance for :func:`imgret.metrics.retrieval_metrics`: the gallery items relevant to each
query (same label) and those removed from its ranking (the query itself under leave-one-out;
same label and same camera under the re-ID rule).
"""

from __future__ import annotations

import functools

import numpy as np

from imgret.metrics.inputs import encode_pair
from imgret.metrics.jit import compile_loop


class RelevancePlan:
    """Who is relevant to whom, and who is removed from whose ranking; ``num_relevant[i]`` is
    query ``i``'s ``R``. Raises ``ValueError`` for malformed labels or cameras.

    Gallery items are grouped by label (and by label+camera) once; a chunk of queries then
    expands its groups with vectorised index arithmetic instead of a query x gallery mask.
    """

    def __init__(self, ql, gl, qc, gc, n_q, n_g, query_in_gallery):
        self.n_gallery = n_g
        self.loo = bool(query_in_gallery)
        self.q_lab, self.g_lab = encode_pair(ql, gl, n_q, n_g, "labels")
        if (qc is None) != (gc is None):
            raise ValueError("give cameras for both queries and gallery, or for neither")
        self.cameras = qc is not None
        if self.loo:
            if n_q != n_g:
                raise ValueError(
                    f"query_in_gallery needs as many queries as gallery items ({n_q} != {n_g})"
                )
            if not np.array_equal(self.q_lab, self.g_lab):
                raise ValueError("query_in_gallery: query i must have gallery item i's label")
        n_lab = int(max(self.q_lab.max(), self.g_lab.max())) + 1
        self.order = np.argsort(self.g_lab, kind="stable")  # grouped by label, index ascending
        counts = np.bincount(self.g_lab, minlength=n_lab)
        self.lab_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.lab_count = counts
        num_rel = counts[self.q_lab].copy()
        if self.cameras:
            self.q_cam, self.g_cam = encode_pair(qc, gc, n_q, n_g, "cameras")
            if self.loo and not np.array_equal(self.q_cam, self.g_cam):
                raise ValueError("query_in_gallery: query i must have gallery item i's camera")
            n_cam = int(max(self.q_cam.max(), self.g_cam.max())) + 1
            self.n_cam = n_cam
            # (label, camera) groups, keyed sparsely: labels x cameras can be large.
            key = self.g_lab * n_cam + self.g_cam
            self.lc_order = np.argsort(key, kind="stable")
            self.lc_keys, lc_counts = np.unique(key, return_counts=True)
            self.lc_start = np.concatenate([[0], np.cumsum(lc_counts)[:-1]])
            self.lc_count = lc_counts
            num_rel -= self._lc_lookup(self.q_lab * n_cam + self.q_cam)[1]
        elif self.loo:
            num_rel -= 1
        self.num_relevant = num_rel

    def _lc_lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, count) of the (label, camera) group of each key; count 0 when absent."""
        pos = np.minimum(np.searchsorted(self.lc_keys, keys), len(self.lc_keys) - 1)
        found = self.lc_keys[pos] == keys
        return self.lc_start[pos], np.where(found, self.lc_count[pos], 0)

    def pairs(self, queries: np.ndarray):
        """Relevant and removed (row, gallery col) pairs for a chunk of query indices.

        Rows are local (0..len(queries)-1); relevant pairs are row-major with ascending
        gallery index, so each row's relevant items are one contiguous segment.
        """
        labs = self.q_lab[queries]
        none = np.full(len(queries), -1, np.int64)
        starts, lengths = self.lab_start[labs], self.lab_count[labs]
        if self.cameras:
            cams = self.q_cam[queries]
            row, col = _expand(starts, lengths, self.order, none, self.g_cam, cams)
            rm_row, rm_col = _expand(
                *self._lc_lookup(labs * self.n_cam + cams), self.lc_order, none, _NO_KEY, none
            )
            return row, col, rm_row, rm_col
        if self.loo:
            own = queries.astype(np.int64)
            row, col = _expand(starts, lengths, self.order, own, _NO_KEY, none)
            return row, col, np.arange(len(queries)), own
        row, col = _expand(starts, lengths, self.order, none, _NO_KEY, none)
        return row, col, np.empty(0, np.int64), np.empty(0, np.int64)


_NO_KEY = np.zeros(1, np.int64)


def _expand(starts, lengths, order, drop, g_key, q_key):
    """Concatenate ``order[s:s+l]`` for each segment ``(s, l)`` as (segment id, value) int64
    arrays, leaving out value ``drop[i]`` and the values ``v`` with ``g_key[v] == q_key[i]``
    from segment ``i`` (-1: leave none out; ``q_key[i] == -1`` never matches)."""
    return compiled_expand()(
        np.asarray(starts, np.int64),
        np.asarray(lengths, np.int64),
        np.asarray(order, np.int64),
        drop,
        np.asarray(g_key, np.int64),
        np.asarray(q_key, np.int64),
    )


def expand_segments(starts, lengths, order, drop, g_key, q_key):
    """:func:`_expand`'s loop (plain Python; :func:`compiled_expand` compiles it)."""
    total = 0
    for i in range(len(starts)):
        total += lengths[i]
    row = np.empty(total, np.int64)
    col = np.empty(total, np.int64)
    m = 0
    for i in range(len(starts)):
        d = drop[i]
        key = q_key[i]
        for p in range(starts[i], starts[i] + lengths[i]):
            v = order[p]
            row[m] = i
            col[m] = v
            m += (v != d) & ((key < 0) or (g_key[v] != key))
    return row[:m], col[:m]


@functools.cache
def compiled_expand():
    """:func:`expand_segments` compiled by numba."""
    return compile_loop(expand_segments, parallel=False)
