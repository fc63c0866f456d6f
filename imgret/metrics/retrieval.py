"""The two entry points of :mod:`imgret.metrics`: :func:`retrieval_metrics` (embeddings and
labels in, exact search) and :func:`ranking_metrics` (rankings computed elsewhere in). Both
validate their input, reduce it to the ranks of each query's relevant items and hand those to
the same definitions (:mod:`imgret.metrics.definitions`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from imgret.metrics.definitions import build_report, per_query_values, value_names
from imgret.metrics.inputs import (
    as_int_vector,
    is_bool_matrix,
    prepare_embeddings,
    rank_lists,
    to_numpy,
    validate_bootstrap,
    validate_k,
)
from imgret.metrics.ranks import default_chunk_size, exact_ranks
from imgret.metrics.relevance import RelevancePlan


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
        chunk_size: queries per chunk; default: as many as fit 256 MiB of float32 scores. One
            chunk of scores is held in host memory (``chunk_size * n_gallery * 4`` bytes),
            plus ``n_gallery`` candidate ids per rank-counting task (at most 16).
        device: where the query x gallery product runs: ``"cpu"`` or a torch CUDA device
            (``"cuda"``, ``"cuda:1"``). The ranks are counted on the CPU either way.
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
    q, g = prepare_embeddings(query_emb, gallery_emb, device)
    n_q, n_g = q.shape[0], g.shape[0]
    plan = RelevancePlan(
        query_labels, gallery_labels, query_cameras, gallery_cameras, n_q, n_g, query_in_gallery
    )
    ks = validate_k(
        k,
        n_g - int(query_in_gallery),
        "the gallery size" + (" minus one (query_in_gallery)" if query_in_gallery else ""),
    )
    if chunk_size is None:
        chunk_size = default_chunk_size(n_q, n_g)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    validate_bootstrap(bootstrap)
    evaluated = np.flatnonzero(plan.num_relevant > 0)
    if evaluated.size == 0:
        raise ValueError("no query has a relevant gallery item (R = 0 for every query)")

    r_eval = plan.num_relevant[evaluated]
    values = np.empty((len(evaluated), len(value_names(ks))))
    first = np.empty(len(evaluated))

    def consume(lo: int, hi: int, ranks: np.ndarray, offsets: np.ndarray) -> None:
        values[lo:hi], first[lo:hi] = per_query_values(ranks, offsets, r_eval[lo:hi], ks)

    exact_ranks(q, g, plan, evaluated, chunk_size, consume)
    return build_report(
        values,
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
    num_relevant = as_int_vector(num_relevant, "num_relevant")
    if np.any(num_relevant < 0):
        raise ValueError("num_relevant must be >= 0")
    n = len(num_relevant)
    if n == 0:
        raise ValueError("no queries: num_relevant is empty")
    validate_bootstrap(bootstrap)

    if is_bool_matrix(relevant_ranks):
        if depth is not None:
            raise ValueError("depth is implied by the relevance matrix's width; do not pass it")
        rel = to_numpy(relevant_ranks)
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
        ranks, offsets = rank_lists(relevant_ranks, n)
        counts = np.diff(offsets)
        if depth is None:
            depth_arr = None
        else:
            depth_arr = np.broadcast_to(as_int_vector(np.atleast_1d(depth), "depth"), (n,))
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
        ks = validate_k(k, limit, "the ranking depth")
    else:
        ks = validate_k(k, None, "")
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
    values, first = per_query_values(sel_ranks, sel_offsets, num_relevant[evaluated], ks)
    return build_report(
        values,
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
