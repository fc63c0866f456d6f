"""Retrieval metrics: one exact, chunked implementation shared by training, `/evaluate` and the CLI.

Two pure functions produce the same report:

* :func:`retrieval_metrics` takes embeddings and labels, runs an exact (flat, inner-product)
  search in query chunks and hands the rank of every relevant gallery item to the same code
  that :func:`ranking_metrics` uses.
* :func:`ranking_metrics` takes rankings that were computed elsewhere (for example the top-K
  lists that the service gets back from FAISS) and computes the report from them.

Ranking convention (both functions):
    Scores are similarities, higher is better. Ties are broken by gallery index, lower index
    first: the order of a stable sort on descending score, which is also the order FAISS's flat
    search returns and hence what pytorch-metric-learning's ``AccuracyCalculator`` sees. A rank
    is 1-based: the best gallery item has rank 1.

Why no top-k search: ``mean_average_precision`` is defined over the *full* ranking, so the
rank of every relevant item is needed, however deep. For a query whose relevant items score
``v_1..v_R`` the rank of item ``j`` is ``1 + #{gallery items that beat v_j}``; that count is
all any metric needs, and it can be computed for a whole chunk of score rows with a handful of
vectorised passes (see :func:`_block_ranks_numpy`) instead of a sort or a top-k selection.

Implementations of that count, all exact and cross-checked by the tests:

* CPU: NumPy (:func:`_block_ranks_numpy`), or a numba-compiled kernel (:func:`_rank_kernel`)
  when numba is installed; numba is optional and about 1.5x faster overall when relevant
  items rank deep (``IMGRET_METRICS_NUMBA=0`` forces NumPy).
* ``device="cuda"``: torch (:func:`_block_ranks_torch`, ``torch.searchsorted``).

The score matrix is one float32 GEMM per chunk (torch/MKL on the CPU); thread counts are
whatever torch, NumPy and numba are configured with: nothing process-wide is changed here.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

__all__ = ["ranking_metrics", "retrieval_metrics"]

_SCALAR_METRICS = ("map_at_r", "r_precision", "precision_at_1", "mean_average_precision", "mrr")
_K_METRICS = ("recall_at_k", "map_at_k", "ndcg_at_k", "recall_fraction_at_k")

# Scores per post-processing block (rows x gallery): small enough that a block's mask and
# candidate arrays stay in cache, large enough to amortise the ~40 NumPy calls per block.
_BLOCK_SCORES = 1 << 20
# Default size of one chunk of the float32 score matrix (chunk_size x gallery); the CPU path
# keeps two (the next chunk's GEMM overlaps this chunk's post-processing).
_CHUNK_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def retrieval_metrics(
    query_emb: Any,
    query_labels: Any,
    gallery_emb: Any,
    gallery_labels: Any,
    *,
    k: int | Iterable[int] = (1, 5, 10),
    query_in_gallery: bool = False,
    query_cameras: Any = None,
    gallery_cameras: Any = None,
    chunk_size: int | None = None,
    device: str | torch.device = "cpu",
    bootstrap: int = 1000,
    seed: int = 0,
    per_query: bool = False,
) -> dict[str, Any]:
    """Exact retrieval metrics of a labelled query set against a labelled gallery.

    Every query is ranked against the whole gallery by inner product (exact search, no
    approximation) and the report of :func:`ranking_metrics` is computed from the rank of each
    of its relevant gallery items. Work is done in chunks of ``chunk_size`` queries, so memory
    is bounded by ``chunk_size x len(gallery)`` scores; the full query x gallery matrix is
    never held.

    Relevance: a gallery item is relevant to a query when it has the query's label. With
    ``query_in_gallery`` the query itself (gallery item ``i`` for query ``i``) is removed from
    its own ranking. With cameras (re-ID, the Market-1501 rule), gallery items with the same
    label *and* the same camera as the query are removed from its ranking entirely: they are
    neither relevant nor counted in any rank. ``R`` is the number of relevant items that remain;
    queries with ``R = 0`` are skipped and counted in ``num_skipped``.

    Args:
        query_emb: ``(n_queries, d)`` float array or tensor, L2-normalised (any float dtype; it
            is converted to float32). NumPy arrays and torch tensors (any device) are accepted.
        query_labels: ``(n_queries,)`` labels: ints or strings (any hashable numpy dtype).
        gallery_emb: ``(n_gallery, d)`` float array or tensor, same ``d``.
        gallery_labels: ``(n_gallery,)`` labels, same kind as ``query_labels``.
        k: cut-off(s) for the ``*_at_k`` metrics; an int or an iterable of ints, each in
            ``1..n_gallery`` (``1..n_gallery - 1`` with ``query_in_gallery``).
        query_in_gallery: query ``i`` is gallery item ``i`` (leave-one-out evaluation of a set
            against itself). Needs ``n_queries == n_gallery`` and equal labels (and cameras).
        query_cameras: ``(n_queries,)`` camera ids, or None. Give both camera arrays or neither.
        gallery_cameras: ``(n_gallery,)`` camera ids, or None.
        chunk_size: queries per chunk; default: as many as fit 256 MiB of float32 scores. The
            CPU path holds two chunks of scores (``2 * chunk_size * n_gallery * 4`` bytes) plus
            per-worker buffers of about 1M scores.
        device: ``"cpu"`` (NumPy/MKL path) or a torch CUDA device (``"cuda"``, ``"cuda:1"``).
        bootstrap: number of bootstrap resamples of the queries for ``ci95``; 0 disables it.
        seed: seed of the bootstrap, so that the same input gives the same interval.
        per_query: also return per-query values under ``"per_query"`` (see
            :func:`ranking_metrics`).

    Returns:
        The report described in :func:`ranking_metrics` (``num_truncated`` is always 0 here:
        the search is exhaustive).

    Raises:
        ValueError: empty inputs, length or dimension mismatches, non-finite embeddings,
            labels or cameras that are not 1-D, cameras for only one side, bad ``k``,
            ``chunk_size`` or ``bootstrap``, or no query with a relevant gallery item.
    """
    q_np, g_np, q_t, g_t, dev = _prepare_embeddings(query_emb, gallery_emb, device)
    n_q, n_g = (
        (len(q_np) if q_np is not None else len(q_t)),
        (len(g_np) if g_np is not None else len(g_t)),
    )
    plan = _RelevancePlan(
        query_labels, gallery_labels, query_cameras, gallery_cameras, n_q, n_g, query_in_gallery
    )
    ks = _validate_k(
        k,
        n_g - int(query_in_gallery),
        "the gallery size" + (" minus one (query_in_gallery)" if query_in_gallery else ""),
    )
    if chunk_size is None:
        chunk_size = max(1, min(n_q, _CHUNK_BYTES // (4 * n_g)))
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    _validate_bootstrap(bootstrap)
    evaluated = np.flatnonzero(plan.num_relevant > 0)
    if evaluated.size == 0:
        raise ValueError("no query has a relevant gallery item (R = 0 for every query)")

    r_eval = plan.num_relevant[evaluated]
    names = _value_names(ks)
    values = np.empty((len(evaluated), len(names)))
    first = np.empty(len(evaluated))

    def consume(lo: int, hi: int, ranks: np.ndarray, offsets: np.ndarray) -> None:
        # Called per block (from worker threads on the CPU path), on disjoint query ranges:
        # memory holds one block's ranks, never all of them.
        values[lo:hi], first[lo:hi] = _per_query_values(ranks, offsets, r_eval[lo:hi], ks)

    if dev.type == "cpu":
        kernel = _numba_kernel()
        if kernel is not None:
            _ranks_compiled(q_np, g_np, plan, evaluated, chunk_size, consume, kernel)
        else:
            _ranks_numpy(q_np, g_np, plan, evaluated, chunk_size, consume)
    else:
        _ranks_torch(q_t, g_t, plan, evaluated, chunk_size, consume)
    return _report(
        values,
        names,
        first,
        r_eval,
        evaluated,
        num_queries=n_q,
        ks=ks,
        bootstrap=bootstrap,
        seed=seed,
        per_query=per_query,
    )


def ranking_metrics(
    relevant_ranks: Any,
    num_relevant: Any,
    *,
    k: int | Iterable[int] = (1, 5, 10),
    depth: int | Any = None,
    bootstrap: int = 1000,
    seed: int = 0,
    per_query: bool = False,
) -> dict[str, Any]:
    """Retrieval metrics from precomputed rankings (for example FAISS top-K results).

    Each query is described by where its relevant gallery items sit in its ranking, plus its
    number of relevant items ``R`` (which a truncated ranking cannot show). Ties must already be
    broken in the rankings; :func:`retrieval_metrics` breaks them by gallery index.

    Definitions, with ``rel(i)`` = 1 when rank ``i`` holds a relevant item and
    ``P(i)`` = relevant items in the top ``i`` divided by ``i``:

    * ``map_at_r``: mean of ``(1/R) * sum_{i<=R} P(i) rel(i)`` (pytorch-metric-learning's
      MAP@R).
    * ``r_precision``: mean of (relevant in top R) / R.
    * ``precision_at_1``: fraction of queries whose rank-1 item is relevant.
    * ``recall_at_k[k]``: fraction of queries with a relevant item in the top k (the
      metric-learning convention, = CMC rank-k).
    * ``mean_average_precision``: mean of ``(1/R) * sum_i P(i) rel(i)`` over the full ranking
      (the re-ID mAP).
    * ``map_at_k[k]``: mean of ``(1/hits@k) * sum_{i<=k} P(i) rel(i)``, 0 for a query with no
      hit in its top k (the recommender convention).
    * ``ndcg_at_k[k]``: binary-relevance NDCG, ``sum_{i<=k} rel(i)/log2(i+1)`` over the same
      sum for an ideal ranking of ``min(R, k)`` relevant items.
    * ``recall_fraction_at_k[k]``: mean of (relevant in top k) / R (the IR convention).
    * ``mrr``: mean of 1 / (rank of the first relevant item), 0 where none is ranked.

    Truncated rankings: when a ranking only covers its top ``depth`` positions and lists fewer
    than ``R`` relevant items, the missing ones are ranked below ``depth`` at unknown places and
    contribute nothing: ``mean_average_precision`` is then computed over the available ranking
    (still divided by ``R``, i.e. a lower bound of the full-ranking value), and so are
    ``map_at_r`` and ``r_precision`` for queries with ``R > depth``. Such queries are counted in
    ``num_truncated``. The ``*_at_k`` metrics, ``precision_at_1`` and ``mrr`` are exact as long
    as every ``k <= depth`` (enforced). A query that lists all its ``R`` relevant items is exact
    whatever its depth.

    From a top-K search (FAISS ``D, I = index.search(x, K)``, ``I == -1`` past the end)::

        rel = (I >= 0) & (gallery_labels[I] == query_labels[:, None])
        report = ranking_metrics(rel, num_relevant, k=(1, 5, 10))

    where ``num_relevant[i]`` counts query ``i``'s label in the gallery. Items that must not be
    ranked at all (the query itself, or same-label same-camera items under the re-ID rule) are
    dropped from each row of ``I`` before building ``rel``, and left out of ``num_relevant``.

    Args:
        relevant_ranks: either a 2-D boolean array or tensor ``(n_queries, K)`` of ranked
            relevance (``[i, j]`` is True when the item at rank ``j + 1`` of query ``i`` is
            relevant; the ranking depth is ``K``), or a sequence of ``n_queries`` 1-D integer
            arrays holding the 1-based rank of each relevant item of that query (any order, no
            duplicates; a 2-D integer array counts as one row per query).
        num_relevant: ``(n_queries,)`` non-negative ints, ``R`` per query. Queries with
            ``R = 0`` are skipped and counted in ``num_skipped``.
        k: cut-off(s) for the ``*_at_k`` metrics, an int or an iterable of positive ints.
        depth: for the rank-list form only: None when every ranking is complete (each query
            lists exactly ``R`` ranks), else the number of ranked positions available, one int
            for all queries or ``(n_queries,)`` ints.
        bootstrap: number of bootstrap resamples over the evaluated queries for ``ci95``
            (percentile interval, 2.5% and 97.5%); 0 disables it and ``ci95`` is None.
        seed: seed of the bootstrap generator (NumPy PCG64), so the same input gives the same
            interval.
        per_query: add ``"per_query"``: lists over the evaluated queries of ``query_index``,
            ``num_relevant``, ``average_precision`` (full ranking), ``map_at_r`` and
            ``first_relevant_rank`` (None where no relevant item is ranked).

    Returns:
        A JSON-serialisable dict of plain Python values::

            {
              "map_at_r": float, "r_precision": float, "precision_at_1": float,
              "mean_average_precision": float, "mrr": float,
              "recall_at_k": {k: float, ...}, "map_at_k": {k: float, ...},
              "ndcg_at_k": {k: float, ...}, "recall_fraction_at_k": {k: float, ...},
              "num_queries": int,    # queries given, skipped ones included
              "num_skipped": int,    # queries with R = 0, left out of every mean
              "num_truncated": int,  # evaluated queries whose ranking misses relevant items
              "k": [int, ...],       # the sorted, de-duplicated cut-offs
              "ci95": {"map_at_r": [low, high], ..., "recall_at_k": {k: [low, high], ...},
                       ...} or None,
            }

        Dict keys of the ``*_at_k`` metrics are Python ints (``json.dumps`` writes them as
        strings). Every mean is over the ``num_queries - num_skipped`` evaluated queries.

    Raises:
        ValueError: malformed rankings (not 1-D/2-D, ranks < 1, duplicates, more ranks than
            ``R``, ranks beyond ``depth``, fewer ranks than ``R`` without ``depth``), a length
            mismatch with ``num_relevant``, a ``k`` beyond the ranking depth, bad ``bootstrap``,
            or no query with ``R > 0``.
    """
    num_relevant = _as_int_vector(num_relevant, "num_relevant")
    if np.any(num_relevant < 0):
        raise ValueError("num_relevant must be >= 0")
    n = len(num_relevant)
    if n == 0:
        raise ValueError("no queries: num_relevant is empty")
    _validate_bootstrap(bootstrap)

    if _is_bool_matrix(relevant_ranks):
        if depth is not None:
            raise ValueError("depth is implied by the relevance matrix's width; do not pass it")
        rel = _to_numpy(relevant_ranks)
        if rel.shape[0] != n:
            raise ValueError(
                f"relevance matrix has {rel.shape[0]} rows but num_relevant has {n} entries"
            )
        q, col = np.nonzero(rel)
        counts = np.bincount(q, minlength=n)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        ranks = (col + 1).astype(np.int64)
        depth_arr = np.full(n, rel.shape[1], np.int64)
    else:
        ranks, offsets = _rank_lists(relevant_ranks, n)
        counts = np.diff(offsets)
        if depth is None:
            depth_arr = None
        else:
            depth_arr = np.broadcast_to(_as_int_vector(np.atleast_1d(depth), "depth"), (n,))
            if np.any(depth_arr < 0):
                raise ValueError("depth must be >= 0")
            if depth_arr.size and ranks.size and np.any(ranks > np.repeat(depth_arr, counts)):
                raise ValueError("a rank is larger than its query's ranking depth")
    if np.any(counts > num_relevant):
        bad = int(np.flatnonzero(counts > num_relevant)[0])
        raise ValueError(
            f"query {bad} lists {int(counts[bad])} relevant items but num_relevant is "
            f"{int(num_relevant[bad])}"
        )
    if depth_arr is None and np.any(counts != num_relevant):
        bad = int(np.flatnonzero(counts != num_relevant)[0])
        raise ValueError(
            f"query {bad} lists {int(counts[bad])} relevant ranks but num_relevant is "
            f"{int(num_relevant[bad])}; pass depth= if the rankings are truncated"
        )

    evaluated = np.flatnonzero(num_relevant > 0)
    if evaluated.size == 0:
        raise ValueError("no query has a relevant item (num_relevant is 0 everywhere)")
    complete = counts == num_relevant
    if depth_arr is not None:
        # Only queries that miss relevant items constrain k: the others are exact at any k.
        limit = int(depth_arr[~complete].min()) if np.any(~complete) else None
        ks = _validate_k(k, limit, "the ranking depth")
    else:
        ks = _validate_k(k, None, "")
    # Keep only the evaluated queries (R > 0): they have the same CSR layout.
    sel_counts = counts[evaluated]
    sel_offsets = np.concatenate([[0], np.cumsum(sel_counts)])
    take = np.repeat(offsets[evaluated], sel_counts) + (
        np.arange(sel_offsets[-1]) - np.repeat(sel_offsets[:-1], sel_counts)
    )
    sel_ranks = ranks[take]
    # Rank lists may come in any order: sort within each query.
    order = np.lexsort((sel_ranks, np.repeat(np.arange(len(evaluated)), sel_counts)))
    sel_ranks = sel_ranks[order]
    values, first = _per_query_values(sel_ranks, sel_offsets, num_relevant[evaluated], ks)
    names = _value_names(ks)
    return _report(
        values,
        names,
        first,
        num_relevant[evaluated],
        evaluated,
        num_queries=n,
        ks=ks,
        bootstrap=bootstrap,
        seed=seed,
        per_query=per_query,
        num_truncated=int(np.count_nonzero(~complete[evaluated])),
    )


# ---------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _is_bool_matrix(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.bool and x.dim() == 2
    return isinstance(x, np.ndarray) and x.dtype == np.bool_ and x.ndim == 2


def _as_int_vector(x: Any, name: str) -> np.ndarray:
    arr = _to_numpy(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.mod(arr, 1) == 0):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _rank_lists(rank_lists: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(rank_lists, (np.ndarray, torch.Tensor)):
        arr = _to_numpy(rank_lists)
        # A 2-D integer array is one row of ranks per query (equal counts).
        if arr.ndim not in (1, 2) or (arr.ndim == 2 and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(
                "relevant_ranks must be a 2-D boolean relevance matrix or a sequence of 1-D "
                "rank arrays"
            )
        rank_lists = list(arr)
    if not isinstance(rank_lists, (Sequence, np.ndarray)) or isinstance(rank_lists, str):
        raise ValueError("relevant_ranks must be a boolean matrix or a sequence of rank arrays")
    if len(rank_lists) != n:
        raise ValueError(
            f"relevant_ranks has {len(rank_lists)} queries but num_relevant has {n} entries"
        )
    parts = []
    for i, r in enumerate(rank_lists):
        arr = np.atleast_1d(_to_numpy(r)) if np.ndim(_to_numpy(r)) == 0 else _to_numpy(r)
        if arr.ndim != 1:
            raise ValueError(f"relevant_ranks[{i}] must be 1-D, got shape {arr.shape}")
        arr = _as_int_vector(arr, f"relevant_ranks[{i}]") if arr.size else np.empty(0, np.int64)
        parts.append(arr)
    counts = np.array([len(p) for p in parts], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ranks = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if ranks.size:
        if ranks.min() < 1:
            raise ValueError("ranks are 1-based: every rank must be >= 1")
        q = np.repeat(np.arange(n), counts)
        order = np.lexsort((ranks, q))
        sr, sq = ranks[order], q[order]
        if np.any((sr[1:] == sr[:-1]) & (sq[1:] == sq[:-1])):
            raise ValueError("a query lists the same rank twice")
    return ranks, offsets


def _validate_k(k: Any, limit: int | None, what: str) -> list[int]:
    if isinstance(k, (int, np.integer)):
        values = [k]
    elif isinstance(k, Iterable) and not isinstance(k, (str, bytes)):
        values = list(k)
    else:
        raise ValueError(f"k must be a positive int or a list of them, got {k!r}")
    if not values:
        raise ValueError("k must be a positive int or a non-empty list of them")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"k values must be ints, got {v!r}")
        if v < 1:
            raise ValueError(f"k must be >= 1, got {int(v)}")
        if limit is not None and v > limit:
            raise ValueError(f"k={int(v)} is larger than {what} ({limit})")
        out.append(int(v))
    return sorted(set(out))


def _validate_bootstrap(bootstrap: Any) -> None:
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, (int, np.integer)):
        raise ValueError(f"bootstrap must be an int >= 0, got {bootstrap!r}")
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap}")


def _prepare_embeddings(query_emb: Any, gallery_emb: Any, device: Any):
    """Validate both embedding matrices; return float32 numpy (CPU) or tensors (device)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}") from exc
    mats = []
    for name, x in (("query_emb", query_emb), ("gallery_emb", gallery_emb)):
        if isinstance(x, torch.Tensor):
            if x.dim() != 2:
                raise ValueError(f"{name} must be 2-D (n, d), got shape {tuple(x.shape)}")
            if not (x.is_floating_point()):
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
        else:
            x = np.asarray(x)
            if x.ndim != 2:
                raise ValueError(f"{name} must be 2-D (n, d), got shape {x.shape}")
            if not np.issubdtype(x.dtype, np.floating):
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
        mats.append(x)
    if mats[0].shape[1] != mats[1].shape[1]:
        raise ValueError(
            f"dimension mismatch: query_emb has d={mats[0].shape[1]}, "
            f"gallery_emb has d={mats[1].shape[1]}"
        )
    out_np, out_t = [], []
    for name, x in zip(("query_emb", "gallery_emb"), mats, strict=True):
        if dev.type == "cpu":
            arr = np.ascontiguousarray(_to_numpy(x), dtype=np.float32)
            # Squared norms catch NaN/inf and magnitudes whose dot products would overflow.
            if not np.all(np.isfinite(np.einsum("ij,ij->i", arr, arr, dtype=np.float64))):
                raise ValueError(f"{name} contains NaN or infinite values")
            out_np.append(arr)
            out_t.append(None)
        else:
            t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
            t = t.to(device=dev, dtype=torch.float32).contiguous()
            if not bool(torch.isfinite((t.double() ** 2).sum(1)).all()):
                raise ValueError(f"{name} contains NaN or infinite values")
            out_np.append(None)
            out_t.append(t)
    return out_np[0], out_np[1], out_t[0], out_t[1], dev


def _encode_pair(q: Any, g: Any, n_q: int, n_g: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Map query and gallery values (ints, strings, ...) jointly to small ints."""
    qa, ga = _to_numpy(q), _to_numpy(g)
    for name, arr, n in ((f"query_{what}", qa, n_q), (f"gallery_{what}", ga, n_g)):
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        if len(arr) != n:
            raise ValueError(f"{name} has {len(arr)} entries but there are {n} embeddings")
    try:
        both = np.concatenate([qa, ga])
        _, inv = np.unique(both, return_inverse=True)
    except TypeError as exc:  # e.g. ints mixed with strings in an object array
        raise ValueError(f"{what} must be all of one comparable type: {exc}") from exc
    if both.dtype.kind == "f" and np.any(np.isnan(both)):
        raise ValueError(f"{what} contain NaN")
    inv = inv.reshape(-1).astype(np.int64)
    return inv[:n_q], inv[n_q:]


class _RelevancePlan:
    """Who is relevant to whom, and who is removed from whose ranking.

    Gallery items are grouped by label (and by label+camera) once; a chunk of queries then
    expands its groups with vectorised index arithmetic instead of a query x gallery mask.
    """

    def __init__(self, ql, gl, qc, gc, n_q, n_g, query_in_gallery):
        self.n_gallery = n_g
        self.loo = bool(query_in_gallery)
        self.q_lab, self.g_lab = _encode_pair(ql, gl, n_q, n_g, "labels")
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
            self.q_cam, self.g_cam = _encode_pair(qc, gc, n_q, n_g, "cameras")
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
        row, col = _expand(self.lab_start[labs], self.lab_count[labs], self.order)
        if self.cameras:
            cams = self.q_cam[queries]
            keep = self.g_cam[col] != cams[row]
            rm_row, rm_col = _expand(*self._lc_lookup(labs * self.n_cam + cams), self.lc_order)
        elif self.loo:
            keep = col != queries[row]
            rm_row = np.arange(len(queries))
            rm_col = queries.astype(np.int64)
        else:
            return row, col, np.empty(0, np.int64), np.empty(0, np.int64)
        return row[keep], col[keep], rm_row, rm_col


def _expand(starts: np.ndarray, lengths: np.ndarray, order: np.ndarray):
    """Concatenate ``order[s:s+l]`` for each (s, l); return (segment id, value) arrays."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    seg = np.repeat(np.arange(len(lengths)), lengths)
    out_off = np.cumsum(lengths) - lengths
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - out_off, lengths)
    return seg, order[pos].astype(np.int64)



def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor view of ``array`` without a copy; torch only reads it here, so the warning it
    gives for read-only arrays (e.g. vectors decoded from database bytes) does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)

# ---------------------------------------------------------------------------------------------
# exact ranks of relevant items: CPU (NumPy) path
# ---------------------------------------------------------------------------------------------


def _ranks_numpy(q, g, plan, evaluated, chunk_size, consume, pipeline=True):
    """Exact ranks of the relevant items of every evaluated query, handed to ``consume``.

    ``consume(lo, hi, ranks, offsets)`` receives the evaluated queries ``lo:hi`` (positions in
    ``evaluated``) with their relevant ranks in ascending order, CSR by ``offsets``; it is
    called from worker threads, on disjoint ranges.

    Per chunk: one float32 GEMM (torch/MKL, its own intra-op threads) into a reused buffer;
    then blocks of rows are post-processed by a thread pool (NumPy releases the GIL inside its
    loops). With ``pipeline`` the GEMM of the next chunk runs while the pool works on this
    one (two score buffers), which keeps both cores busy through the GEMM's serial parts.
    """
    n_g = len(g)
    chunk = min(chunk_size, len(evaluated))
    starts = list(range(0, len(evaluated), chunk))
    block = max(1, min(chunk, _BLOCK_SCORES // n_g, 64))
    workers = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
    g_t = _read_only_tensor(g)
    n_buf = 2 if pipeline and len(starts) > 1 else 1
    bufs = [np.empty((chunk, n_g), np.float32) for _ in range(n_buf)]
    local = threading.local()  # per-worker scratch, dropped with the pool's threads

    def gemm(i: int) -> None:
        qs = evaluated[starts[i] : starts[i] + chunk]
        out = torch.from_numpy(bufs[i % n_buf][: len(qs)])
        torch.mm(torch.from_numpy(q[qs]), g_t.T, out=out)

    def job(S: np.ndarray, lo: int, hi: int) -> None:
        sc = getattr(local, "scratch", None)
        if sc is None:
            sc = local.scratch = _Scratch(block, n_g)
        qs = evaluated[lo:hi]
        rel_row, rel_col, rm_row, rm_col = plan.pairs(qs)
        r = _block_ranks_numpy(S, rel_row, rel_col, rm_row, rm_col, sc)
        consume(lo, hi, *_sorted_csr(rel_row, r, len(qs), n_g))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        gemm(0)
        for i, c0 in enumerate(starts):
            b = min(chunk, len(evaluated) - c0)
            buf = bufs[i % n_buf]
            futures = [
                pool.submit(job, buf[s0 : min(b, s0 + block)], c0 + s0, c0 + min(b, s0 + block))
                for s0 in range(0, b, block)
            ]
            if i + 1 < len(starts):
                if n_buf == 1:
                    for f in futures:
                        f.result()
                gemm(i + 1)
            for f in futures:
                f.result()


def _sorted_csr(rel_row: np.ndarray, r: np.ndarray, b: int, n_g: int):
    """Ranks sorted within each row (the metrics need ranking order) and CSR offsets."""
    key = rel_row * (n_g + 1)
    ranks = np.sort(key + r) - key
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rel_row, minlength=b))])
    return ranks, offsets


def _ranks_compiled(q, g, plan, evaluated, chunk_size, consume, kernel):
    """Same contract as :func:`_ranks_numpy`, post-processing with the numba kernel.

    The kernel is parallel over the rows of a chunk (numba's threads), so it is called from
    this thread only; the GEMM of the next chunk runs beside it in a helper thread.
    """
    n_g = len(g)
    chunk = min(chunk_size, len(evaluated))
    starts = list(range(0, len(evaluated), chunk))
    g_t = _read_only_tensor(g)
    bufs = [np.empty((chunk, n_g), np.float32) for _ in range(min(2, len(starts)))]

    def gemm(i: int) -> None:
        qs = evaluated[starts[i] : starts[i] + chunk]
        torch.mm(torch.from_numpy(q[qs]), g_t.T, out=torch.from_numpy(bufs[i % 2][: len(qs)]))

    with ThreadPoolExecutor(max_workers=1) as helper:
        gemm(0)
        for i, lo in enumerate(starts):
            pending = helper.submit(gemm, i + 1) if i + 1 < len(starts) else None
            qs = evaluated[lo : lo + chunk]
            S = bufs[i % 2][: len(qs)]
            rel_row, rel_col, rm_row, rm_col = plan.pairs(qs)
            if rm_row.size:
                S.reshape(-1)[rm_row * n_g + rm_col] = -np.inf
            offsets = np.concatenate([[0], np.cumsum(np.bincount(rel_row, minlength=len(qs)))])
            ranks = np.empty(len(rel_col), np.int64)
            kernel(S, offsets, rel_col, ranks)
            consume(lo, lo + len(qs), *_sorted_csr(rel_row, ranks, len(qs), n_g))
            if pending is not None:
                pending.result()


_KERNEL_STATE: dict[str, Any] = {}


def _numba_kernel():
    """The compiled rank kernel if numba is installed, else None (the NumPy path is used).

    Optional accelerator: same results as :func:`_block_ranks_numpy` (tests compare them),
    about twice as fast when relevant items rank deep. Compiled on first use and cached on
    disk when the package directory is writable. ``IMGRET_METRICS_NUMBA=0`` turns it off.
    """
    if os.environ.get("IMGRET_METRICS_NUMBA", "1") == "0":
        return None
    if "kernel" not in _KERNEL_STATE:
        try:
            import numba  # noqa: F401
        except ImportError:
            _KERNEL_STATE["kernel"] = None
        else:
            _KERNEL_STATE["kernel"] = _compile_kernel()
    return _KERNEL_STATE["kernel"]


# numba.prange once numba is imported (see _compile_kernel); plain range otherwise.
_prange = range


def _rank_kernel(S, rel_off, rel_col, out):
    """Ranks of relevant items, row by row (see :func:`_numba_kernel`); ``out`` is filled.

    Plain Python over NumPy scalars, compiled by numba when it is installed; the plain
    version is far too slow for real use and only lets the tests check the algorithm.
    """
    # Per row, the algorithm of _block_ranks_numpy without compaction: cell of every
    # score by the same float32 map, histogram, then exact comparisons in the cells
    # that hold a relevant score.
    b, n = S.shape
    for r in _prange(b):
        lo = rel_off[r]
        n_rel = rel_off[r + 1] - lo
        row = S[r]
        umin = np.float32(np.inf)
        umax = np.float32(-np.inf)
        for j in range(n_rel):
            x = row[rel_col[lo + j]]
            umin = min(umin, x)
            umax = max(umax, x)
        n_cells = min(max(64, 8 * n_rel), max(64, n))
        span = np.float64(umax) - np.float64(umin)
        w64 = (n_cells - 2) / span if span > 0 else 1.0
        w = np.float32(min(w64, 2.0**22 / max(abs(np.float64(umin)), 1.0)))
        bias = np.float32(1.5) - umin * w
        top = np.float32(n_cells + 1)
        cells = np.empty(n, np.int32)
        for e in range(n):  # vectorised
            cells[e] = np.int32(max(min(row[e] * w + bias, top), np.float32(0.0)))
        # Relevant items grouped by cell (counting sort). Their cells are read from
        # `cells`, so an item and its own score always agree.
        tstart = np.zeros(n_cells + 3, np.int64)
        for j in range(n_rel):
            tstart[cells[rel_col[lo + j]] + 2] += 1
        for c in range(2, n_cells + 3):
            tstart[c] += tstart[c - 1]
        torder = np.empty(n_rel, np.int64)
        for j in range(n_rel):
            c = cells[rel_col[lo + j]] + 1
            torder[tstart[c]] = j
            tstart[c] += 1
        # Two interleaved histograms break the store-to-load chain of repeated cells.
        hist = np.zeros(n_cells + 2, np.int64)
        hist2 = np.zeros(n_cells + 2, np.int64)
        for e in range(n // 2):
            hist[cells[2 * e]] += 1
            hist2[cells[2 * e + 1]] += 1
        if n % 2:
            hist[cells[n - 1]] += 1
        flag = np.zeros(n_cells + 2, np.uint8)
        for c in range(n_cells + 2):
            hist[c] += hist2[c]
            flag[c] = c > 0 and tstart[c + 1] > tstart[c]
        beats = np.zeros(n_rel, np.int64)
        for e in range(n):
            c = cells[e]
            if flag[c]:
                s = row[e]
                for p in range(tstart[c], tstart[c + 1]):
                    t = torder[p]
                    col = rel_col[lo + t]
                    if s > row[col] or (s == row[col] and e < col):
                        beats[t] += 1
        acc = 0
        for c in range(n_cells + 1, -1, -1):  # hist[c] := items in strictly higher cells
            h = hist[c]
            hist[c] = acc
            acc += h
        for j in range(n_rel):
            out[lo + j] = 1 + hist[cells[rel_col[lo + j]]] + beats[j]


def _compile_kernel():
    import numba

    global _prange
    _prange = numba.prange  # resolved as a global when numba compiles _rank_kernel
    options = {"parallel": True, "nogil": True, "boundscheck": False}
    try:
        return numba.njit(cache=True, **options)(_rank_kernel)
    except RuntimeError:  # no writable cache location: compile without caching
        return numba.njit(**options)(_rank_kernel)


class _Scratch:
    """Per-worker buffer, reused across blocks so that no pass pays for fresh page faults."""

    def __init__(self, rows: int, n: int):
        self.m = np.empty((rows, n), np.bool_)
        self.f = np.empty((rows, n) if rows > 1 else (0, 0), np.float32)


def _block_ranks_numpy(S, rel_row, rel_col, rm_row, rm_col, sc):
    """Exact 1-based ranks of the relevant items of a block of score rows.

    ``S`` is ``(b, n)`` float32 (modified: removed items are set to -inf). ``rel_row`` /
    ``rel_col`` list the relevant items, row-major, every row having at least one.

    rank(j) = 1 + #{items with a higher score} + #{items with an equal score and a lower
    gallery index}. A binary search of every score among the relevant scores would cost
    O(n log R) scalar steps per row; instead:

    1. Candidates: only items scoring >= the row's lowest relevant score can beat a relevant
       item (one SIMD compare, then compaction).
    2. Cells: a per-row monotone map (float32 multiply, add, min, truncate: every step is
       monotone, and the relevant scores go through the *same* float32 operations) puts each
       candidate in a cell, so a candidate in a higher cell than a relevant score is higher
       than it, exactly. A histogram of the cells (one bincount) and its cumulative sum give
       "candidates in strictly higher cells" for every relevant score.
    3. Only candidates that share a cell with a relevant score (a few percent) are compared
       with it one by one, ties included.
    """
    b, n = S.shape
    flat = S.reshape(-1)
    if rm_row.size:
        flat[rm_row * n + rm_col] = -np.inf
    v = flat[rel_row * n + rel_col]
    seg = np.flatnonzero(np.r_[True, rel_row[1:] != rel_row[:-1]])
    umin = np.minimum.reduceat(v, seg)
    umax = np.maximum.reduceat(v, seg)

    # Only items scoring >= the lowest relevant score of their row can beat a relevant item:
    # one SIMD compare pass, then the scalar work is on these candidates only.
    mask = sc.m[:b]
    np.greater_equal(S, umin[:, None], out=mask)
    idx = np.flatnonzero(mask)

    # Cells per row. More cells mean fewer candidates sharing a cell with a relevant score
    # (those are compared one by one) but a longer histogram per row: balance the two, and
    # keep several cells per relevant score so that few cells hold more than one.
    r_max = int(np.diff(np.r_[seg, len(v)]).max())
    n_cells = max(64, 4 * r_max, int(2 * math.sqrt(len(idx) / b * r_max)))
    n_cells = min(n_cells, max(64, n), (1 << 21) // b - 2)
    width = n_cells + 2  # cell 0: below every relevant score; top cells: above every one
    span = np.maximum(umax.astype(np.float64) - umin, 1e-30)
    # Cap the slope so that |umin * w| < 2**22: the float32 map then stays accurate to < 1
    # cell, so every candidate lands in its own row's cells (a near-zero span only makes more
    # candidates share cells with relevant scores, which is slower, never wrong).
    limit = 2.0**22 / np.maximum(np.abs(umin.astype(np.float64)), 1.0)
    w = np.minimum((n_cells - 2) / span, limit).astype(np.float32)
    # Row r's cells are r*width .. r*width+width-1: folding the offset into the float map
    # makes the flat cell id a single truncation (exact while b*width < 2**21). A candidate's
    # F is >= base + ~1.5, so no lower clip is needed.
    base = np.arange(0, b * width, width, dtype=np.float64).astype(np.float32)
    bias = (base + np.float32(1.5)) - umin * w  # float32 arithmetic, as for the scores below
    top = base + np.float32(width - 1)
    # The same float32 operations either on the candidates alone or, when they are dense,
    # as SIMD passes over the whole block followed by one gather (cheaper than repeating the
    # per-row parameters for every candidate).
    if b == 1:  # large galleries: one row per block, scalar parameters
        F = flat[idx] * w[0]
        F += bias[0]
        np.minimum(F, top[0], out=F)
    elif 4 * len(idx) > b * n:
        F2 = sc.f[:b]
        np.multiply(S, w[:, None], out=F2)
        np.add(F2, bias[:, None], out=F2)
        np.minimum(F2, top[:, None], out=F2)
        F = F2.reshape(-1)[idx]
    else:
        per_row = np.diff(np.searchsorted(idx, np.arange(b + 1) * n))
        F = flat[idx] * np.repeat(w, per_row)
        F += np.repeat(bias, per_row)
        np.minimum(F, np.repeat(top, per_row), out=F)
    cell = F.astype(np.intp)  # truncation = floor: F >= 0
    # The relevant scores through the identical float32 operations.
    tc = np.minimum(v * w[rel_row] + bias[rel_row], top[rel_row]).astype(np.intp)

    hist = np.bincount(cell, minlength=b * width)
    # Candidates in strictly higher cells of the same row = row total - cumulative count.
    cum = np.cumsum(hist.reshape(b, width), axis=1).reshape(-1)
    above = cum[(rel_row + 1) * width - 1] - cum[tc]

    # Extract the candidates that share a cell with a relevant score (a few percent).
    tcount = np.bincount(tc, minlength=b * width)
    e = np.flatnonzero(np.take(tcount.astype(np.bool_), cell))
    e_cell = cell[e]
    e_idx = idx[e]
    e_val = flat[e_idx]
    # lut[cell] = the relevant item alone in that cell, or -1 when several share it.
    shared = tcount[tc] > 1
    lut = np.empty(b * width, np.int64)  # only cells holding a relevant score are read
    lut[tc] = np.where(shared, -1, np.arange(len(v)))
    t = lut[e_cell]

    # Cells with one relevant score: one comparison per extracted candidate.
    one = t >= 0
    t1, v1 = t[one], e_val[one]
    beats = v1 > v[t1]
    # Equal scores: the lower gallery index ranks first. Every relevant item ties with
    # itself, so only items with another tie need the index comparison.
    tie = v1 == v[t1]
    tied_twice = np.bincount(t1[tie], minlength=len(v)) > 1
    if tied_twice.any():
        sel = np.flatnonzero(tie & tied_twice[t1])
        beats[sel] = e_idx[one][sel] % n < rel_col[t1[sel]]
    in_cell = np.bincount(t1[beats], minlength=len(v))
    # Cells with several relevant scores: all (candidate, relevant item) pairs in the cell.
    many = np.flatnonzero(~one)
    if many.size:
        em = many[np.argsort(e_cell[many], kind="stable")]
        em_cell = e_cell[em]
        tm = np.flatnonzero(shared)
        start = np.searchsorted(em_cell, tc[tm], side="left")
        cnt = np.searchsorted(em_cell, tc[tm], side="right") - start
        pair_t = np.repeat(tm, cnt)
        pair_e = em[np.repeat(start - (np.cumsum(cnt) - cnt), cnt) + np.arange(cnt.sum())]
        pv, tv = e_val[pair_e], v[pair_t]
        pb = (pv > tv) | ((pv == tv) & (e_idx[pair_e] % n < rel_col[pair_t]))
        in_cell += np.bincount(pair_t[pb], minlength=len(v))
    return 1 + above + in_cell


# ---------------------------------------------------------------------------------------------
# exact ranks of relevant items: torch path (GPU; also runs on CPU)
# ---------------------------------------------------------------------------------------------


def _ranks_torch(q, g, plan, evaluated, chunk_size, consume):
    """Same contract as :func:`_ranks_numpy`, with torch ops on ``q.device``.

    Per chunk: scores by one GEMM; per row the relevant scores sorted; every score's position
    among them by ``torch.searchsorted`` (cheap on a GPU), histogrammed per row; exact ties
    with a relevant score are resolved by gallery index on the (few) tied items.
    """
    dev = q.device
    n_g = g.shape[0]
    for lo in range(0, len(evaluated), chunk_size):
        qs = evaluated[lo : lo + chunk_size]
        rel_row, rel_col, rm_row, rm_col = plan.pairs(qs)
        S = q[torch.from_numpy(qs).to(dev)] @ g.T
        r = _block_ranks_torch(S, rel_row, rel_col, rm_row, rm_col)
        consume(lo, lo + len(qs), *_sorted_csr(rel_row, r, len(qs), n_g))


def _block_ranks_torch(S, rel_row, rel_col, rm_row, rm_col) -> np.ndarray:
    """Exact ranks of the relevant items in score rows ``S`` (b, n), modified in place.

    Same contract as :func:`_block_ranks_numpy`; returns numpy int64 ranks in the order of
    ``rel_row`` / ``rel_col``.
    """
    dev = S.device
    b, n = S.shape
    rr = torch.from_numpy(rel_row).to(dev)
    rc = torch.from_numpy(rel_col).to(dev)
    if rm_row.size:
        S[torch.from_numpy(rm_row).to(dev), torch.from_numpy(rm_col).to(dev)] = -math.inf
    v = S[rr, rc]
    counts = torch.bincount(rr, minlength=b)
    r_max = int(counts.max())
    slot = torch.arange(len(rr), device=dev) - (torch.cumsum(counts, 0) - counts)[rr]
    T = torch.full((b, r_max), math.inf, device=dev, dtype=S.dtype)
    T[rr, slot] = v
    T, perm = torch.sort(T, dim=1)  # ascending; the +inf padding is never below a score
    where = torch.empty_like(perm)  # where each relevant item sits in its sorted row
    where.scatter_(1, perm, torch.arange(r_max, device=dev).expand(b, r_max))
    # lt[i] = relevant scores strictly below score i; a score beats relevant score v exactly
    # when lt reaches le(v) = relevant scores <= v, so "items above v" is a suffix count.
    lt = torch.searchsorted(T, S, out_int32=True)
    row_off = (torch.arange(b, device=dev) * (r_max + 1))[:, None]
    hist = torch.bincount((lt + row_off).reshape(-1), minlength=b * (r_max + 1))
    suffix = torch.flip(torch.cumsum(torch.flip(hist.reshape(b, r_max + 1), [1]), 1), [1])
    le = torch.searchsorted(T, T, right=True)
    above = suffix[rr, le[rr, where[rr, slot]]]
    # Ties: items whose score equals some relevant score; within a (row, score) group the
    # lower gallery index ranks first.
    tied = torch.searchsorted(T, S, right=True, out_int32=True) > lt
    tr, tcol = torch.nonzero(tied, as_tuple=True)  # row-major, columns ascending
    tval = S[tr, tcol]
    o = torch.argsort(tval, stable=True)
    o = o[torch.argsort(tr[o], stable=True)]  # by row, then score, then column
    tr, tcol, tval = tr[o], tcol[o], tval[o]
    new = torch.ones(len(tr), dtype=torch.bool, device=dev)
    new[1:] = (tr[1:] != tr[:-1]) | (tval[1:] != tval[:-1])
    gstart = torch.nonzero(new, as_tuple=True)[0]
    pos_in_group = torch.arange(len(tr), device=dev) - gstart[torch.cumsum(new.long(), 0) - 1]
    # Every relevant item is among the tied items (it equals itself): find it by (row, col).
    key_t = tr * n + tcol
    ko = torch.argsort(key_t)
    loc = ko[torch.searchsorted(key_t[ko], rr * n + rc)]
    return (1 + above + pos_in_group[loc]).cpu().numpy().astype(np.int64)


# ---------------------------------------------------------------------------------------------
# from ranks to the report
# ---------------------------------------------------------------------------------------------


def _value_names(ks: list[int]) -> list[str]:
    """Column names of :func:`_per_query_values`, in order."""
    names = list(_SCALAR_METRICS)
    for kk in ks:
        names += [f"{m}/{kk}" for m in _K_METRICS]
    return names


def _per_query_values(ranks, offsets, R, ks):
    """Per-query metric values, columns as :func:`_value_names`, and first relevant ranks.

    ``ranks`` holds each query's relevant ranks in ascending order, CSR by ``offsets``;
    ``R`` (> 0) the number of relevant items. Returns ``(values (n, m) float64, first (n,))``
    with ``first`` = inf where no relevant item is ranked.
    """
    n = len(R)
    counts = np.diff(offsets)
    qid = np.repeat(np.arange(n), counts)
    # Position of each relevant item among the query's relevant items: P(rank) = pos / rank.
    pos = np.arange(1, len(ranks) + 1) - np.repeat(offsets[:-1], counts)
    prec = pos / ranks
    Rf = R.astype(np.float64)
    first = np.full(n, np.inf)
    has = counts > 0
    first[has] = ranks[offsets[:-1][has]]
    out = np.empty((n, len(_SCALAR_METRICS) + len(_K_METRICS) * len(ks)))
    # Only ranks <= R matter for MAP@R and R-precision, only ranks <= max(k) for @k metrics:
    # filter once, so that the many per-k sums run on short arrays.
    in_r = ranks <= R[qid]
    q_r, p_r = qid[in_r], prec[in_r]
    out[:, 0] = np.bincount(q_r, p_r, minlength=n) / Rf  # map_at_r
    out[:, 1] = np.bincount(q_r, minlength=n) / Rf  # r_precision
    out[:, 2] = first == 1  # precision_at_1
    out[:, 3] = np.bincount(qid, prec, minlength=n) / Rf  # mean_average_precision
    out[:, 4] = np.where(has, 1.0 / first, 0.0)  # mrr
    top = ranks <= max(ks)
    q_k, r_k, p_k = qid[top], ranks[top], prec[top]
    gain = 1.0 / np.log2(r_k + 1.0)
    ideal = np.concatenate([[0.0], np.cumsum(1.0 / np.log2(np.arange(2, max(ks) + 2)))])
    col = len(_SCALAR_METRICS)
    for kk in ks:  # columns in _K_METRICS order
        in_k = r_k <= kk
        hits = np.bincount(q_k[in_k], minlength=n)
        out[:, col] = first <= kk  # recall_at_k
        ap_k = np.bincount(q_k[in_k], p_k[in_k], minlength=n)
        out[:, col + 1] = np.divide(ap_k, hits, out=np.zeros(n), where=hits > 0)  # map_at_k
        dcg = np.bincount(q_k[in_k], gain[in_k], minlength=n)
        out[:, col + 2] = dcg / ideal[np.minimum(R, kk)]  # ndcg_at_k
        out[:, col + 3] = hits / Rf  # recall_fraction_at_k
        col += len(_K_METRICS)
    return out, first


def _bootstrap_ci(values: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile 95% interval of the column means, resampling rows with replacement.

    Each resample is summarised by how often it draws every query (a bincount), so a batch of
    resamples is one small matrix product with the per-query values; batches stay ~8 MB.
    """
    n = len(values)
    rng = np.random.default_rng(seed)
    means = np.empty((n_boot, values.shape[1]))
    batch = max(1, min(n_boot, (1 << 20) // n))
    weights = np.empty((batch, n))
    for s in range(0, n_boot, batch):
        nb = min(batch, n_boot - s)
        draws = rng.integers(0, n, size=(nb, n))
        for j in range(nb):
            weights[j] = np.bincount(draws[j], minlength=n)
        means[s : s + nb] = (weights[:nb] @ values) / n
    lo, hi = np.percentile(means, [2.5, 97.5], axis=0)
    return lo, hi


def _report(
    values,
    names,
    first,
    R,
    query_index,
    *,
    num_queries,
    ks,
    bootstrap,
    seed,
    per_query,
    num_truncated=0,
):
    """Assemble the JSON-friendly report from per-query values (see :func:`ranking_metrics`)."""
    means = values.mean(axis=0)
    report: dict[str, Any] = {}
    for m in _SCALAR_METRICS:
        report[m] = float(means[names.index(m)])
    for m in _K_METRICS:
        report[m] = {kk: float(means[names.index(f"{m}/{kk}")]) for kk in ks}
    report["num_queries"] = int(num_queries)
    report["num_skipped"] = int(num_queries - len(R))
    report["num_truncated"] = int(num_truncated)
    report["k"] = list(ks)
    if bootstrap:
        lo, hi = _bootstrap_ci(values, int(bootstrap), int(seed))
        ci: dict[str, Any] = {}
        for m in _SCALAR_METRICS:
            i = names.index(m)
            ci[m] = [float(lo[i]), float(hi[i])]
        for m in _K_METRICS:
            ci[m] = {}
            for kk in ks:
                i = names.index(f"{m}/{kk}")
                ci[m][kk] = [float(lo[i]), float(hi[i])]
        report["ci95"] = ci
    else:
        report["ci95"] = None
    if per_query:
        report["per_query"] = {
            "query_index": [int(i) for i in query_index],
            "num_relevant": [int(r) for r in R],
            "average_precision": values[:, names.index("mean_average_precision")].tolist(),
            "map_at_r": values[:, names.index("map_at_r")].tolist(),
            "first_relevant_rank": [int(f) if np.isfinite(f) else None for f in first],
        }
    return report
