"""Re-ranking (imgret.gallery.search.rerank) against straightforward full-matrix references: Zhong
et al.'s k-reciprocal re-ranking as torchreid's ``re_ranking`` computes it, and average query
expansion by brute force."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.gallery.search import SearchFilter
from imgret.gallery.search.rerank import (
    KReciprocal,
    QueryExpansion,
    expand_query,
    k_reciprocal_distances,
    rerank_options,
)
from tests.unit.gallery.test_index_searcher import make_searcher
from tests.unit.gallery.vectors import clustered_vectors


def reference_re_ranking(q_g_dist: np.ndarray, q_q_dist: np.ndarray, g_g_dist: np.ndarray,
                         k1: int = 20, k2: int = 6, lambda_value: float = 0.3) -> np.ndarray:
    """Zhong et al.'s re_ranking (the code torchreid ships), in float64: the whole
    (Q + G)^2 matrix. Inputs are Euclidean distances; returns the (Q, G) final distances."""
    original_dist = np.concatenate(
        [np.concatenate([q_q_dist, q_g_dist], axis=1),
         np.concatenate([q_g_dist.T, g_g_dist], axis=1)], axis=0)
    original_dist = np.power(original_dist, 2).astype(np.float64)
    original_dist = np.transpose(1.0 * original_dist / np.max(original_dist, axis=0))
    V = np.zeros_like(original_dist)
    initial_rank = np.argsort(original_dist).astype(np.int32)
    query_num = q_g_dist.shape[0]
    gallery_num = q_g_dist.shape[0] + q_g_dist.shape[1]
    all_num = gallery_num
    for i in range(all_num):
        forward_k_neigh_index = initial_rank[i, :k1 + 1]
        backward_k_neigh_index = initial_rank[forward_k_neigh_index, :k1 + 1]
        fi = np.where(backward_k_neigh_index == i)[0]
        k_reciprocal_index = forward_k_neigh_index[fi]
        k_reciprocal_expansion_index = k_reciprocal_index
        for j in range(len(k_reciprocal_index)):
            candidate = k_reciprocal_index[j]
            half = int(np.around(k1 / 2.0)) + 1
            candidate_forward_k_neigh_index = initial_rank[candidate, :half]
            candidate_backward_k_neigh_index = initial_rank[candidate_forward_k_neigh_index, :half]
            fi_candidate = np.where(candidate_backward_k_neigh_index == candidate)[0]
            candidate_k_reciprocal_index = candidate_forward_k_neigh_index[fi_candidate]
            if len(np.intersect1d(candidate_k_reciprocal_index, k_reciprocal_index)) > \
                    2.0 / 3 * len(candidate_k_reciprocal_index):
                k_reciprocal_expansion_index = np.append(k_reciprocal_expansion_index,
                                                         candidate_k_reciprocal_index)
        k_reciprocal_expansion_index = np.unique(k_reciprocal_expansion_index)
        weight = np.exp(-original_dist[i, k_reciprocal_expansion_index])
        V[i, k_reciprocal_expansion_index] = 1.0 * weight / np.sum(weight)
    original_dist = original_dist[:query_num, ]
    if k2 != 1:
        V_qe = np.zeros_like(V)
        for i in range(all_num):
            V_qe[i, :] = np.mean(V[initial_rank[i, :k2], :], axis=0)
        V = V_qe
    invIndex = [np.where(V[:, i] != 0)[0] for i in range(gallery_num)]
    jaccard_dist = np.zeros_like(original_dist)
    for i in range(query_num):
        temp_min = np.zeros(shape=[1, gallery_num])
        indNonZero = np.where(V[i, :] != 0)[0]
        indImages = [invIndex[ind] for ind in indNonZero]
        for j in range(len(indNonZero)):
            temp_min[0, indImages[j]] = temp_min[0, indImages[j]] + np.minimum(
                V[i, indNonZero[j]], V[indImages[j], indNonZero[j]])
        jaccard_dist[i] = 1 - temp_min / (2.0 - temp_min)
    final_dist = jaccard_dist * (1 - lambda_value) + original_dist * lambda_value
    return final_dist[:query_num, query_num:]


def euclidean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distances of unit vectors, from their inner products (float64)."""
    return np.sqrt(np.maximum(0.0, 2.0 - 2.0 * (a.astype(np.float64) @ b.T.astype(np.float64))))


def reference_one_query(query: np.ndarray, gallery: np.ndarray, **params) -> np.ndarray:
    """The full-matrix reference with one query (U = {q} ∪ gallery)."""
    q = query[None, :]
    return reference_re_ranking(euclidean(q, gallery), euclidean(q, q),
                                euclidean(gallery, gallery), **params)[0]


@pytest.fixture(scope="module")
def gallery() -> np.ndarray:
    return clustered_vectors(150, dim=16, clusters=6, seed=3)


@pytest.fixture(scope="module")
def queries() -> np.ndarray:
    return clustered_vectors(12, dim=16, clusters=6, seed=4)


PARAMS = [dict(k1=20, k2=6, lambda_value=0.3), dict(k1=8, k2=3, lambda_value=0.5),
          dict(k1=5, k2=1, lambda_value=0.0), dict(k1=20, k2=6, lambda_value=1.0)]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: "-".join(map(str, p.values())))
def test_pure_function_equals_full_matrix_reference(gallery, queries, params):
    """With U = the whole set, ``k_reciprocal_distances`` is the full-matrix algorithm."""
    for query in queries:
        members = np.concatenate([query[None, :], gallery])
        dist = euclidean(members, members) ** 2
        ranks = np.argsort(dist, axis=1)
        got = k_reciprocal_distances(dist, ranks, dist.max(axis=1), **params)
        np.testing.assert_allclose(got, reference_one_query(query, gallery, **params),
                                   rtol=0, atol=1e-9)


@pytest.mark.parametrize("params", PARAMS[:2], ids=["paper", "small"])
def test_searcher_equals_reference_when_candidates_cover_the_gallery(gallery, queries, params):
    """Bounded re-ranking through the index (candidates' neighbourhoods fetched by search,
    row maxima by searching the negated vectors) = the full matrix, when N >= gallery."""
    ids = np.arange(1, len(gallery) + 1, dtype=np.int64) * 7
    searcher = make_searcher("Flat", gallery, ids)
    option = KReciprocal(candidates=len(gallery), **params)
    results = searcher.search(queries, len(gallery), rerank=option)
    for query, row in zip(queries, results, strict=True):
        want = reference_one_query(query, gallery, **params)
        order = np.argsort(want, kind="stable")
        assert [hit.id for hit in row] == ids[order].tolist()
        np.testing.assert_allclose([1.0 - hit.score for hit in row], want[order],
                                   rtol=0, atol=1e-6)


def test_fewer_candidates_permute_only_the_top_n(gallery, queries):
    """N < gallery: the top N are re-ordered among themselves; the rest keep their plain
    order after them, with scores below every candidate's."""
    searcher = make_searcher("Flat", gallery)
    plain = searcher.search(queries, 60)
    reranked = searcher.search(queries, 60, rerank=KReciprocal(candidates=25))
    for p_row, r_row in zip(plain, reranked, strict=True):
        assert {h.id for h in r_row[:25]} == {h.id for h in p_row[:25]}
        assert [h.id for h in r_row[25:]] == [h.id for h in p_row[25:]]
        scores = [h.score for h in r_row]
        assert scores == sorted(scores, reverse=True)


def test_exclusions_leave_the_graph_and_the_answer(gallery, queries):
    """``exclude_ids`` remove items from the query's gallery: the same as the reference run on
    the gallery without them."""
    ids = np.arange(1, len(gallery) + 1, dtype=np.int64)
    searcher = make_searcher("Flat", gallery, ids)
    excluded = frozenset(range(1, 150, 4))
    keep = np.array([i not in excluded for i in ids.tolist()])
    option = KReciprocal(candidates=len(gallery))
    results = searcher.search(queries, len(gallery), SearchFilter(exclude_ids=excluded),
                              rerank=option)
    for query, row in zip(queries, results, strict=True):
        want = reference_one_query(query, gallery[keep])
        order = np.argsort(want, kind="stable")
        assert [hit.id for hit in row] == ids[keep][order].tolist()


def test_label_filter_restricts_the_answer_not_the_graph(gallery, queries):
    """A label filter keeps the graph over the whole gallery and returns the matching items in
    the order of the unfiltered re-ranking, then the other matching items."""
    searcher = make_searcher("Flat", gallery, labels=3)
    option = KReciprocal(candidates=40)
    everything = searcher.search(queries, len(gallery), rerank=option)
    flt = SearchFilter(label="l1")
    filtered = searcher.search(queries, 30, flt, rerank=option)
    for all_row, row in zip(everything, filtered, strict=True):
        want = [h.id for h in all_row if searcher.info(h.id).label == "l1"][:30]
        assert [h.id for h in row] == want
        assert len(row) == min(30, sum(searcher.info(i).label == "l1" for i in searcher.ids()))


def reference_query_expansion(queries, gallery, top_m, alpha, k):
    sims = queries @ gallery.T
    out = []
    for q, row in zip(queries, sims, strict=True):
        top = np.argsort(-row, kind="stable")[:top_m]
        expanded = q + (np.maximum(row[top], 0) ** alpha) @ gallery[top]
        expanded /= np.linalg.norm(expanded)
        scores = gallery @ expanded
        order = np.argsort(-scores, kind="stable")[:k]
        out.append((order, scores[order]))
    return out


@pytest.mark.parametrize(("top_m", "alpha"), [(5, 0.0), (10, 3.0), (1, 0.0)])
def test_query_expansion_equals_brute_force(gallery, queries, top_m, alpha):
    ids = np.arange(1, len(gallery) + 1, dtype=np.int64)
    searcher = make_searcher("Flat", gallery, ids)
    results = searcher.search(queries, 40, rerank=QueryExpansion(top_m=top_m, alpha=alpha))
    for (order, scores), row in zip(
        reference_query_expansion(queries.astype(np.float64), gallery.astype(np.float64),
                                  top_m, alpha, 40), results, strict=True):
        assert [h.id for h in row] == ids[order].tolist()
        np.testing.assert_allclose([h.score for h in row], scores, rtol=0, atol=1e-6)


def test_expand_query_is_unit_and_plain_average_at_alpha_zero():
    q = np.array([1.0, 0.0], np.float32)
    n = np.array([[0.0, 1.0], [0.6, 0.8]], np.float32)
    got = expand_query(q, n, np.array([0.0, 0.6]))
    want = (q + n.sum(axis=0)) / np.linalg.norm(q + n.sum(axis=0))
    np.testing.assert_allclose(got, want, atol=1e-7)


@pytest.mark.parametrize("factory", ["IVF8,Flat", "HNSW16", "PQ4x4"])
def test_other_index_types_rerank_and_keep_k(vectors, factory):
    searcher = make_searcher(factory, vectors)
    queries = clustered_vectors(5, seed=9)
    for option in ("k_reciprocal", "query_expansion"):
        rows = searcher.search(queries, 15, rerank=option)
        assert all(len(row) == 15 and len({h.id for h in row}) == 15 for row in rows)


def test_mixed_options_per_query(gallery, queries):
    searcher = make_searcher("Flat", gallery)
    plain = searcher.search(queries[:2], 10)
    mixed = searcher.search(queries[:2], 10, rerank=[None, KReciprocal()])
    alone = searcher.search(queries[1:2], 10, rerank="k_reciprocal")[0]
    for got, want in ((mixed[0], plain[0]), (mixed[1], alone)):
        assert [h.id for h in got] == [h.id for h in want]
        np.testing.assert_allclose([h.score for h in got], [h.score for h in want], atol=1e-6)


def test_deleted_items_never_come_back(gallery, queries):
    searcher = make_searcher("Flat", gallery)
    gone = [h.id for h in searcher.search(queries[:1], 10)[0]]
    searcher.remove(gone)
    for option in ("k_reciprocal", "query_expansion"):
        rows = searcher.search(queries, 50, rerank=option)
        assert not {h.id for row in rows for h in row} & set(gone)


@pytest.mark.parametrize(("method", "params", "message"), [
    ("bogus", {}, "unknown rerank method 'bogus'"),
    ("k_reciprocal", {"k1": 0}, "k1 must be an integer between 1 and 100"),
    ("k_reciprocal", {"lambda_value": 1.5}, "lambda must be between 0 and 1"),
    ("k_reciprocal", {"candidates": 5000}, "candidates must be an integer between 1 and 1000"),
    ("k_reciprocal", {"top_m": 3}, "top_m: not a parameter of k_reciprocal"),
    ("query_expansion", {"alpha": -1.0}, "alpha must be between 0 and 10"),
    (None, {"k1": 3}, "k1: re-ranking parameters need rerank="),
])
def test_bad_options_are_refused_with_a_message(method, params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        rerank_options(method, **params)


def test_memory_is_bounded_by_candidates_not_gallery(vectors, monkeypatch):
    """The per-query problem is (N + 1)^2 whatever the gallery: the pure function is only
    ever called with N + 1 members."""
    import imgret.gallery.search.rerank as module
    sizes = []
    real = module.k_reciprocal_distances

    def spy(dist, *args, **kwargs):
        sizes.append(dist.shape)
        return real(dist, *args, **kwargs)

    monkeypatch.setattr(module, "k_reciprocal_distances", spy)
    make_searcher("Flat", vectors).search(vectors[:3], 200, rerank=KReciprocal(candidates=30))
    assert sizes == [(31, 31)] * 3
