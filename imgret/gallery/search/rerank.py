"""Re-ranking of a search: k-reciprocal re-ranking (Zhong et al., CVPR 2017) and average query
expansion, each computed from one query's top candidates and their own neighbourhoods in the
index, so memory is bounded by the number of candidates and never by the gallery.

Two layers:

- pure functions over small arrays: :func:`k_reciprocal_distances` (Zhong et al.'s
  algorithm on a set ``U`` = the query plus its candidates, given each member's nearest
  neighbours over the whole gallery) and :func:`expand_query` (AQE / alpha-QE);
- :func:`rerank_search`, which fetches those arrays from the live index (the Searcher calls it
  under its read lock) and turns the distances into ranked hits.

**k-reciprocal** (``KReciprocal``; defaults are the paper's k1 = 20, k2 = 6, lambda = 0.3).
For a query q with top-``candidates`` list C (N items), U = {q} ∪ C. Distances are squared
Euclidean distances of the unit vectors (``2 - 2 * cosine``), each row divided by its maximum
over the whole gallery (as torchreid's ``re_ranking`` normalises the full matrix). Every
member's top-(k1 + 1) list over {q} ∪ gallery is exact: the query's is its own search, a
candidate's comes from one more index search (batched over all candidates of a request) with q
inserted at its distance, and each row maximum from a search with the negated vector. Then,
inside U, exactly as the full-matrix algorithm: the k1-reciprocal sets, their expansion by the
(k1/2)-reciprocal sets that overlap them by more than 2/3, Gaussian-kernel weights, local query
expansion over the k2 nearest neighbours, the Jaccard distance and
``final = (1 - lambda) * jaccard + lambda * distance``.

What "the same as the full-matrix algorithm" means:

- N >= gallery size (U is the whole set): identical. Ranks agree exactly and distances to
  float64 rounding (checked against a straightforward full-matrix implementation of Zhong et
  al., ``tests/unit/gallery/test_rerank.py``), ties aside.
- N < gallery size: reciprocal sets, expansion sets and the k2 expansion are the exact sets
  intersected with U (every rank used is a rank over the whole gallery; neighbours outside U
  are left out, and the k2 average is over those in U). A gallery item outside U is taken to
  share no k-reciprocal neighbour with the query (Jaccard distance 1), so it ranks after every
  candidate, in its original order: re-ranking permutes the top N and leaves the rest as they
  were. The full matrix can also lift an item from below N; that is what a bound of N costs.
- Each query is re-ranked on its own (U holds one query). torchreid's batch version puts all
  queries of an evaluation into one graph, so a query's result there depends on the other
  queries; run it one query at a time to compare.

**Query expansion** (``QueryExpansion``, average QE of Chum et al. 2007 with alpha = 0;
alpha-QE of Radenović et al. 2018 otherwise): the new query is
``normalise(q + sum_i w_i * c_i)`` over the top ``top_m`` candidates c_i, with
``w_i = max(cos(q, c_i), 0) ** alpha``, and it is searched again. Exact (no bound involved).

Filters. The neighbourhood graph is the query's gallery: the live items minus the filter's
``exclude_ids`` (the query itself in a search by id, same-camera matches in a re-ID evaluation:
items that are not part of this query's gallery). Label, camera and metadata conditions only
restrict what is returned: a filtered answer is the re-ranked candidates that match, then the
other matching items in their original order.

Memory per query: an (N + 1)^2 float64 distance matrix and as many weights (N = 100: 160 KiB
in all), plus an (N, k1 + 1) neighbour list; per request, the vectors and lists of the distinct
candidates of its queries. Cost: one more batched search of the candidates (their
neighbourhoods) and one of the negated vectors (their row maxima), each of ``N`` rows per
query at most; ``benchmarks/rerank_bench.py`` measures it.

Cost: the time is the index searches, about 1 ms per candidate at 100k vectors (the grid of
``benchmarks/rerank_bench.py --grid`` is in docs/rerank.md): k1 only sizes a heap and k only
the first list, and the (N + 1)^2 work inside U matters only from N ~ 1,000 (two (N+1)^3
products). :func:`index_searches` counts
those searches; the service prices a request's re-ranking with it (``imgret.service.limits``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from imgret.gallery.search.filters import SearchFilter
from imgret.gallery.search.ranking import Hit

if TYPE_CHECKING:
    from imgret.gallery.search.live import LiveIndex

K_RECIPROCAL = "k_reciprocal"
QUERY_EXPANSION = "query_expansion"
METHODS = (K_RECIPROCAL, QUERY_EXPANSION)

# Bounds of the parameters (the API refuses values outside them with 422).
CANDIDATES_MAX = 1000
K1_MAX = 100
TOP_M_MAX = 100
ALPHA_MAX = 10.0


@dataclass(frozen=True)
class KReciprocal:
    """k-reciprocal re-ranking (Zhong et al. 2017) of the top ``candidates`` of each query.

    Attributes:
        k1: size of the k-reciprocal neighbourhoods (paper: 20).
        k2: neighbours averaged by the local query expansion (paper: 6; 1 = none).
        lambda_value: weight of the original distance in the final one (paper: 0.3).
        candidates: N, the candidates re-ranked per query (memory and cost grow with N^2 and
            N; items below rank N keep their order, after the candidates).
    """

    k1: int = 20
    k2: int = 6
    lambda_value: float = 0.3
    candidates: int = 100

    method = K_RECIPROCAL

    def __post_init__(self) -> None:
        _check_int("k1", self.k1, 1, K1_MAX)
        _check_int("k2", self.k2, 1, K1_MAX + 1)
        _check_int("candidates", self.candidates, 1, CANDIDATES_MAX)
        if not (isinstance(self.lambda_value, (int, float)) and 0.0 <= self.lambda_value <= 1.0):
            raise ValueError(f"lambda must be between 0 and 1, got {self.lambda_value!r}")

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the method and its parameters (reports name what produced them)."""
        return {"method": self.method, **asdict(self)}


@dataclass(frozen=True)
class QueryExpansion:
    """Average query expansion: search again with the query averaged with its top ``top_m``.

    Attributes:
        top_m: neighbours averaged into the query.
        alpha: weight exponent of each neighbour's cosine similarity (0: plain average,
            AQE; 3 is alpha-QE's usual value).
    """

    top_m: int = 5
    alpha: float = 0.0

    method = QUERY_EXPANSION

    def __post_init__(self) -> None:
        _check_int("top_m", self.top_m, 1, TOP_M_MAX)
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= ALPHA_MAX):
            raise ValueError(f"alpha must be between 0 and {ALPHA_MAX}, got {self.alpha!r}")

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the method and its parameters."""
        return {"method": self.method, **asdict(self)}


Rerank = KReciprocal | QueryExpansion


def rerank_options(method: str | Rerank | None, **params: Any) -> Rerank | None:
    """The re-ranking named ``method`` with ``params`` (the others at their defaults).

    Args:
        method: ``"k_reciprocal"``, ``"query_expansion"``, an options object (returned as
            is, no params allowed), or ``None`` (no re-ranking, no params allowed).
        params: ``k1``, ``k2``, ``lambda_value``, ``candidates`` (k-reciprocal) or ``top_m``,
            ``alpha`` (query expansion); ``None`` values mean the default.

    Raises:
        ValueError: an unknown method, a parameter of another method, or one out of range.
    """
    given = {name: value for name, value in params.items() if value is not None}
    if method is None or isinstance(method, (KReciprocal, QueryExpansion)):
        if given:
            raise ValueError(f"{', '.join(sorted(given))}: re-ranking parameters need "
                             f"rerank={' or '.join(METHODS)}")
        return method
    kinds = {K_RECIPROCAL: KReciprocal, QUERY_EXPANSION: QueryExpansion}
    if method not in kinds:
        raise ValueError(f"unknown rerank method {method!r}; valid: {', '.join(METHODS)}")
    kind = kinds[method]
    wrong = sorted(set(given) - set(kind.__dataclass_fields__))
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: not a parameter of {method} (it takes "
                         f"{', '.join(kind.__dataclass_fields__)})")
    return kind(**given)


def index_searches(option: Rerank | None) -> int:
    """The index searches (query rows) one query's re-ranking costs beyond the plain search:
    its cost unit (see the module docstring: about 0.5 ms each at 100k exact vectors).

    k-reciprocal: the candidates' neighbourhoods and farthest items (2 N), the query's own
    farthest item and its longer first list (2). Query expansion: the first search and the
    expanded query's (2). No re-ranking: 0.
    """
    if option is None:
        return 0
    if isinstance(option, KReciprocal):
        return 2 * option.candidates + 2
    return 2


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
        low <= value <= high
    ):
        raise ValueError(f"{name} must be an integer between {low} and {high}, got {value!r}")


# --------------------------------------------------------------------------- pure functions


def k_reciprocal_distances(
    dist: np.ndarray, ranks: np.ndarray, row_max: np.ndarray, *, k1: int, k2: int,
    lambda_value: float,
) -> np.ndarray:
    """Zhong et al.'s final distances from the query (member 0) to the other members of U.

    The algorithm of the full-matrix version (torchreid's ``re_ranking``), restricted to U:
    where U is the whole set, the two agree.

    Args:
        dist: ``(n, n)`` squared Euclidean distances within U (member 0 is the query).
        ranks: ``(n, K)`` int, ``K >= min(k1 + 1, n)``: each member's nearest neighbours over
            the whole set, nearest first (itself first), as indexes into U, or ``-1`` for a
            neighbour outside U (it still takes its rank).
        row_max: ``(n,)`` each member's largest distance over the whole set (the
            normalisation of its row).
        k1, k2, lambda_value: see :class:`KReciprocal`.

    Returns:
        ``(n - 1,)`` float64 final distances of members ``1..n-1``, each in [0, 1].
    """
    n = len(dist)
    norm = np.asarray(dist, dtype=np.float64) / np.maximum(
        np.asarray(row_max, dtype=np.float64), np.finfo(np.float64).tiny)[:, None]
    forward = _neighbour_mask(ranks, k1 + 1, n)
    half = _neighbour_mask(ranks, int(np.around(k1 / 2.0)) + 1, n)
    reciprocal = forward & forward.T            # [x, y]: y in R(x, k1)
    half_reciprocal = half & half.T             # [c, z]: z in R(c, k1 / 2)
    half_size = half_reciprocal.sum(axis=1)
    # overlap[x, c] = |R(c, k1/2) ∩ R(x, k1)|; c expands x when it is in R(x, k1) and more
    # than 2/3 of its own set lies in R(x, k1).
    # (counts of at most n: exact in float64, and BLAS multiplies floats)
    overlap = reciprocal.astype(np.float64) @ half_reciprocal.T.astype(np.float64)
    expands = reciprocal & (overlap > 2.0 / 3 * half_size[None, :])
    expanded = reciprocal | ((expands.astype(np.float64) @ half_reciprocal.astype(np.float64))
                             > 0)
    weights = np.where(expanded, np.exp(-norm), 0.0)
    v = weights / np.maximum(weights.sum(axis=1, keepdims=True), np.finfo(np.float64).tiny)
    if k2 != 1:
        qe = _neighbour_mask(ranks, k2, n).astype(np.float64)
        v = (qe / np.maximum(qe.sum(axis=1, keepdims=True), 1.0)) @ v
    overlap_min = np.minimum(v[0][None, :], v[1:]).sum(axis=1)
    jaccard = 1.0 - overlap_min / (2.0 - overlap_min)
    return jaccard * (1.0 - lambda_value) + norm[0, 1:] * lambda_value


def _neighbour_mask(ranks: np.ndarray, depth: int, n: int) -> np.ndarray:
    """``(n, n)`` bool: ``[x, y]`` when y is among x's first ``depth`` neighbours (in U)."""
    top = np.asarray(ranks)[:, :depth]
    rows = np.broadcast_to(np.arange(len(top))[:, None], top.shape)
    inside = top >= 0
    mask = np.zeros((len(top), n), dtype=bool)
    mask[rows[inside], top[inside]] = True
    return mask


def expand_query(query: np.ndarray, neighbours: np.ndarray, scores: np.ndarray, *,
                 alpha: float = 0.0) -> np.ndarray:
    """The expanded query of AQE / alpha-QE, L2-normalised.

    Args:
        query: ``(d,)`` unit vector.
        neighbours: ``(m, d)`` its top-m neighbours' vectors.
        scores: ``(m,)`` their cosine similarities to the query.
        alpha: weights ``max(score, 0) ** alpha`` (0: each neighbour weighs as the query).

    Returns:
        ``(d,)`` float32.
    """
    weights = np.maximum(np.asarray(scores, dtype=np.float64), 0.0) ** alpha
    expanded = np.asarray(query, dtype=np.float64) + weights @ np.asarray(neighbours, np.float64)
    norm = np.linalg.norm(expanded)
    return (expanded / norm if norm > 0 else np.asarray(query, np.float64)).astype(np.float32)


# --------------------------------------------------------------------------- from the index


def rerank_search(live: LiveIndex, queries: np.ndarray, k: int,
                  filters: Sequence[SearchFilter | None], options: Rerank) -> list[list[Hit]]:
    """Search ``queries`` (one filter each) and re-rank with ``options``; the caller holds
    the Searcher's read lock, so every search and vector read sees one state of the index.

    Returns:
        Per query ``min(k, matching items)`` hits, best first; ``score`` is 1 - the final
        distance (k-reciprocal) or the cosine similarity to the expanded query.
    """
    if isinstance(options, QueryExpansion):
        return _query_expansion(live, queries, k, filters, options)
    return _k_reciprocal(live, queries, k, filters, options)


def _graph_filter(flt: SearchFilter | None) -> SearchFilter | None:
    """The query's gallery for its neighbourhood graph: live items minus ``exclude_ids``."""
    if flt is None or not flt.exclude_ids:
        return None
    return SearchFilter(exclude_ids=flt.exclude_ids)


def _grouped_search(live: LiveIndex, queries: np.ndarray, depth: int,
                    filters: Sequence[SearchFilter | None]) -> list[list[Hit]]:
    """``live.search`` of each query with its own filter (equal filters in one call)."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, flt in enumerate(filters):
        groups[flt.key() if flt is not None else None].append(row)
    out: list[list[Hit]] = [[] for _ in range(len(queries))]
    for rows in groups.values():
        hits = live.search(queries[rows], depth, filters[rows[0]])
        for row, row_hits in zip(rows, hits, strict=True):
            out[row] = row_hits
    return out


def _query_expansion(live: LiveIndex, queries: np.ndarray, k: int,
                     filters: Sequence[SearchFilter | None],
                     options: QueryExpansion) -> list[list[Hit]]:
    graphs = [_graph_filter(flt) for flt in filters]
    top = _grouped_search(live, queries, options.top_m, graphs)
    ids = sorted({hit.id for row in top for hit in row})
    vectors = live.vectors(np.asarray(ids, dtype=np.int64))
    expanded = np.empty_like(queries)
    for row, hits in enumerate(top):
        if not hits:
            expanded[row] = queries[row]
            continue
        at = np.searchsorted(ids, [hit.id for hit in hits])
        expanded[row] = expand_query(queries[row], vectors[at],
                                     np.array([hit.score for hit in hits]), alpha=options.alpha)
    return _grouped_search(live, expanded, k, filters)


def _k_reciprocal(live: LiveIndex, queries: np.ndarray, k: int,
                  filters: Sequence[SearchFilter | None],
                  options: KReciprocal) -> list[list[Hit]]:
    n_queries = len(queries)
    graphs = [_graph_filter(flt) for flt in filters]
    selects = [flt is not None and flt.selects for flt in filters]
    n_cand = options.candidates
    # The query's own list over its gallery: the candidates, then (unfiltered queries) the
    # rest of the answer in its original order.
    first = _grouped_search(live, queries, max(k, n_cand), graphs)
    candidates = [row[:n_cand] for row in first]

    # One search for the neighbourhoods of every distinct candidate, one for the row maxima
    # (the farthest item: the top hit of the negated vector). Lists are fetched long enough
    # to drop a query's excluded ids and still hold k1 + 1 entries.
    ids = np.array(sorted({hit.id for row in candidates for hit in row}), dtype=np.int64)
    vectors = live.vectors(ids)
    extra = max((len(g.exclude_ids) for g in graphs if g is not None), default=0)
    nb_scores, nb_ids = live.neighbours(vectors, options.k1 + 1 + extra)
    far_scores, far_ids = live.neighbours(-np.concatenate([vectors, queries]), 1 + extra)

    out: list[list[Hit]] = []
    for row in range(n_queries):
        excluded = graphs[row].exclude_ids if graphs[row] is not None else frozenset()
        cand = candidates[row]
        if not cand:
            out.append([])
            continue
        cand_ids = np.fromiter((hit.id for hit in cand), np.int64, len(cand))
        at = np.searchsorted(ids, cand_ids)
        rows = np.append(at, len(ids) + row)  # the candidates', then the query's farthest
        local = _local_problem(queries[row], cand_ids, vectors[at], nb_ids[at], nb_scores[at],
                               far_ids[rows], far_scores[rows], excluded, options.k1 + 1)
        final = k_reciprocal_distances(*local, k1=options.k1, k2=options.k2,
                                       lambda_value=options.lambda_value)
        order = np.argsort(final, kind="stable")
        ranked = [Hit(cand[i].id, float(1.0 - final[i])) for i in order.tolist()]
        # Outside U: Jaccard distance 1, so score = lambda * (1 - d / max): after every
        # candidate, in the original order.
        q_max = local[2][0]
        lam = options.lambda_value
        if selects[row]:
            mask, _ = live.catalog.allowed(filters[row], has_tombstones=False)
            ranked = [hit for hit in ranked if mask[hit.id]]
            in_u = set(cand_ids.tolist())
            tail = [hit for hit in live.search(queries[row : row + 1], k + n_cand,
                                               filters[row])[0] if hit.id not in in_u]
        else:
            tail = first[row][n_cand:]
        ranked += [Hit(hit.id, lam * (1.0 - _sq(hit.score) / q_max)) for hit in tail]
        out.append(ranked[:k])
    return out


def _sq(score: float) -> float:
    """Squared Euclidean distance of two unit vectors from their inner product."""
    return max(0.0, 2.0 - 2.0 * score)


def _local_problem(
    query: np.ndarray, cand_ids: np.ndarray, cand_vectors: np.ndarray,
    nb_ids: np.ndarray, nb_scores: np.ndarray, far_ids: np.ndarray, far_scores: np.ndarray,
    excluded: frozenset[int], depth: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dist, ranks, row_max)`` of :func:`k_reciprocal_distances` for U = {q} ∪ cand.

    Args:
        query: ``(d,)``; cand_ids ``(m,)`` and cand_vectors ``(m, d)``: its candidates, best
            first.
        nb_ids, nb_scores: ``(m, W)`` each candidate's nearest gallery items (``-1`` pads).
        far_ids, far_scores: ``(m + 1, F)`` the top hits of each candidate's negated vector,
            then of the query's (``-score`` is the smallest inner product).
        excluded: ids outside the query's gallery.
        depth: k1 + 1, the list length the algorithm reads.
    """
    m = len(cand_ids)
    n = m + 1
    members = np.concatenate([query[None, :], cand_vectors]).astype(np.float64)
    dist = np.maximum(0.0, 2.0 - 2.0 * (members @ members.T))
    np.fill_diagonal(dist, 0.0)
    gone = np.fromiter(excluded, np.int64, len(excluded))

    # Each candidate's list over {q} ∪ gallery: itself first (distance 0, whatever an
    # approximate index says), its other live neighbours in order with q inserted after those
    # at least as similar as q, as indexes into U (-1: outside U, still holding its rank).
    valid = (nb_ids >= 0) & (nb_ids != cand_ids[:, None]) & ~np.isin(nb_ids, gone)
    order = np.argsort(~valid, axis=1, kind="stable")  # valid entries first, in order
    valid = np.take_along_axis(valid, order, axis=1)
    listed = np.take_along_axis(nb_ids, order, axis=1)
    scores = np.take_along_axis(nb_scores, order, axis=1)
    by_id = np.argsort(cand_ids)
    where = np.minimum(np.searchsorted(cand_ids[by_id], listed), m - 1)
    inside = valid & (cand_ids[by_id][where] == listed)
    local = np.where(inside, by_id[where] + 1, -1)
    q_scores = members[1:] @ members[0]
    before_q = (valid & (scores >= q_scores[:, None])).sum(axis=1)
    width = listed.shape[1]
    lists = np.full((m, width + 2), -1, dtype=np.int64)
    lists[:, 0] = np.arange(1, n)
    column = 1 + np.arange(width)[None, :] + (np.arange(width)[None, :] >= before_q[:, None])
    lists[np.arange(m)[:, None], column] = local
    lists[np.arange(m), 1 + before_q] = 0
    ranks = np.full((n, depth), -1, dtype=np.int64)
    ranks[0, : min(n, depth)] = np.arange(min(n, depth))  # the query: itself, its candidates
    ranks[1:, : min(depth, width + 2)] = lists[:, :depth]

    # Row maxima: the farthest live, non-excluded gallery item, and U's own row.
    usable = (far_ids >= 0) & ~np.isin(far_ids, gone)
    first = np.argmax(usable, axis=1)
    farthest = np.where(usable.any(axis=1),
                        np.maximum(0.0, 2.0 + 2.0 * far_scores[np.arange(n), first]), 0.0)
    farthest = np.roll(farthest, 1)  # the query's row is the last one fetched
    row_max = np.maximum(farthest, dist.max(axis=1))
    return dist, ranks, np.where(row_max > 0, row_max, 1.0)


def rerank_summary(options: Rerank | None) -> str:
    """A phrase for a report's protocol line."""
    if options is None:
        return "no re-ranking"
    params = ", ".join(f"{k}={v}" for k, v in options.describe().items() if k != "method")
    return f"re-ranked by {options.method} ({params})"


__all__ = [
    "CANDIDATES_MAX", "K1_MAX", "METHODS", "TOP_M_MAX", "KReciprocal", "QueryExpansion",
    "Rerank", "expand_query", "index_searches", "k_reciprocal_distances", "rerank_options",
    "rerank_search", "rerank_summary",
]
