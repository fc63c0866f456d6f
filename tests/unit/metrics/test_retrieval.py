"""imgret.metrics.retrieval_metrics and ranking_metrics: hand-computed cases, agreement with
pytorch-metric-learning's AccuracyCalculator and with a brute-force full sort."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from imgret.metrics import ranking_metrics, retrieval_metrics
from tests.unit.metrics.cases import brute_force, clustered, flat_report, integer_embeddings, scored

# ---------------------------------------------------------------------------------------------
# hand-computed cases
# ---------------------------------------------------------------------------------------------


def test_single_query_every_metric_by_hand():
    # Ranking: A B A B B A -> relevant (A) at ranks 1, 3, 6; R = 3.
    q, g = scored([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
    rep = retrieval_metrics(q, ["A"], g, list("ABABBA"), k=(1, 5), bootstrap=0)
    assert rep["map_at_r"] == pytest.approx((1 + 2 / 3) / 3)
    assert rep["r_precision"] == pytest.approx(2 / 3)
    assert rep["precision_at_1"] == 1.0
    assert rep["mean_average_precision"] == pytest.approx((1 + 2 / 3 + 3 / 6) / 3)
    assert rep["mrr"] == 1.0
    assert rep["recall_at_k"] == {1: 1.0, 5: 1.0}
    assert rep["map_at_k"] == {1: 1.0, 5: pytest.approx((1 + 2 / 3) / 2)}
    idcg5 = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    assert rep["ndcg_at_k"][1] == 1.0
    assert rep["ndcg_at_k"][5] == pytest.approx((1 + 1 / math.log2(4)) / idcg5)
    assert rep["recall_fraction_at_k"] == {1: pytest.approx(1 / 3), 5: pytest.approx(2 / 3)}
    assert (rep["num_queries"], rep["num_skipped"], rep["num_truncated"]) == (1, 0, 0)
    assert rep["k"] == [1, 5]
    assert rep["ci95"] is None


def test_first_relevant_deep_and_means_over_queries():
    # Query 0: B B A A -> ranks 3, 4 (R=2). Query 1: label B -> ranks 1, 2.
    q, g = scored([[0.9, 0.8, 0.7, 0.6], [0.9, 0.8, 0.7, 0.6]])
    rep = retrieval_metrics(q, [0, 1], g, [1, 1, 0, 0], k=(1, 2, 3), bootstrap=0)
    q0 = {"map_at_r": 0.0, "ap": (1 / 3 + 2 / 4) / 2, "mrr": 1 / 3}
    assert rep["map_at_r"] == pytest.approx((q0["map_at_r"] + 1) / 2)
    assert rep["r_precision"] == pytest.approx((0 + 1) / 2)
    assert rep["precision_at_1"] == pytest.approx(0.5)
    assert rep["mean_average_precision"] == pytest.approx((q0["ap"] + 1) / 2)
    assert rep["mrr"] == pytest.approx((q0["mrr"] + 1) / 2)
    assert rep["recall_at_k"] == {1: 0.5, 2: 0.5, 3: 1.0}
    # map@3 of query 0: one hit at rank 3 -> P(3) = 1/3.
    assert rep["map_at_k"][3] == pytest.approx((1 / 3 + 1) / 2)
    assert rep["ndcg_at_k"][3] == pytest.approx(
        ((1 / math.log2(4)) / (1 + 1 / math.log2(3)) + 1) / 2
    )
    assert rep["recall_fraction_at_k"][2] == pytest.approx((0 + 1) / 2)


@pytest.mark.parametrize(
    ("scores", "labels", "expected_rank"),
    [
        ([0.5, 0.5, 0.5], ["B", "A", "B"], 2),  # tie: lower gallery index first
        ([0.5, 0.5], ["A", "B"], 1),
        ([0.5, 0.5], ["B", "A"], 2),
        ([0.3, 0.5, 0.5, 0.5], ["B", "B", "B", "A"], 3),
        ([0.7, 0.5, 0.5, 0.5], ["B", "A", "B", "B"], 2),
    ],
)
def test_ties_are_broken_by_gallery_index(scores, labels, expected_rank):
    q, g = scored([scores])
    rep = retrieval_metrics(q, ["A"], g, labels, k=1, bootstrap=0)
    assert rep["mrr"] == pytest.approx(1 / expected_rank)
    assert rep["precision_at_1"] == float(expected_rank == 1)


def test_queries_without_relevant_items_are_skipped():
    q, g = scored([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]])
    rep = retrieval_metrics(q, ["x", "y", "zzz"], g, ["x", "y"], k=1, bootstrap=0)
    assert rep["num_queries"] == 3
    assert rep["num_skipped"] == 1
    assert rep["precision_at_1"] == 1.0
    assert rep["mean_average_precision"] == 1.0


def test_all_queries_skipped_raises():
    q, g = scored([[0.9, 0.1]])
    with pytest.raises(ValueError, match="no query has a relevant"):
        retrieval_metrics(q, ["z"], g, ["x", "y"], k=1)


def test_leave_one_out_by_hand():
    # Points on a circle at 0, 20, 45 and 80 degrees; labels A A B B.
    ang = np.deg2rad([0.0, 20.0, 45.0, 80.0])
    x = np.stack([np.cos(ang), np.sin(ang)], 1).astype(np.float32)
    labels = ["A", "A", "B", "B"]
    rep = retrieval_metrics(x, labels, x, labels, k=(1, 3), query_in_gallery=True, bootstrap=0)
    # Item 2 (45 deg): neighbours 20 (A), 80 (B), 0 (A) -> its one relevant item at rank 2.
    assert rep["precision_at_1"] == pytest.approx(3 / 4)
    assert rep["map_at_r"] == pytest.approx(3 / 4)
    assert rep["r_precision"] == pytest.approx(3 / 4)
    assert rep["mean_average_precision"] == pytest.approx((1 + 1 + 0.5 + 1) / 4)
    assert rep["mrr"] == pytest.approx(0.875)
    assert rep["recall_at_k"] == {1: 0.75, 3: 1.0}
    # Without leave-one-out every query finds itself first.
    rep2 = retrieval_metrics(x, labels, x, labels, k=1, bootstrap=0)
    assert rep2["precision_at_1"] == 1.0


def test_leave_one_out_k_limit_is_gallery_minus_one():
    x, y = clustered(5, classes=2)
    retrieval_metrics(x, y, x, y, k=4, query_in_gallery=True, bootstrap=0)
    with pytest.raises(ValueError, match="larger than"):
        retrieval_metrics(x, y, x, y, k=5, query_in_gallery=True)


def test_camera_rule_removes_same_label_same_camera():
    # Query: label A, camera 1. Gallery (best first): A/c1 (removed), B/c2, A/c2, A/c1
    # (removed), B/c1 -> ranking B A B: the one relevant item at rank 2.
    q, g = scored([[0.9, 0.8, 0.7, 0.6, 0.5]])
    labels, cams = ["A", "B", "A", "A", "B"], [1, 2, 2, 1, 1]
    rep = retrieval_metrics(
        q, ["A"], g, labels, k=(1, 2), query_cameras=[1], gallery_cameras=cams, bootstrap=0
    )
    assert rep["precision_at_1"] == 0.0
    assert rep["map_at_r"] == 0.0
    assert rep["mean_average_precision"] == pytest.approx(0.5)
    assert rep["mrr"] == pytest.approx(0.5)
    assert rep["recall_at_k"] == {1: 0.0, 2: 1.0}
    # Without cameras the same-camera A items count: ranks 1, 3, 4 of 5.
    plain = retrieval_metrics(q, ["A"], g, labels, k=1, bootstrap=0)
    assert plain["mean_average_precision"] == pytest.approx((1 + 2 / 3 + 3 / 4) / 3)


def test_camera_rule_all_same_camera_means_skipped():
    q, g = scored([[0.9, 0.8], [0.1, 0.2]])
    rep = retrieval_metrics(
        q, [0, 1], g, [0, 1], k=1, query_cameras=[3, 4], gallery_cameras=[3, 5], bootstrap=0
    )
    assert rep["num_skipped"] == 1  # query 0's only match shares its camera
    assert rep["precision_at_1"] == 1.0  # query 1: its match (camera 5) scores highest


def test_string_and_int_labels_give_the_same_report():
    x, y = clustered(60, classes=4, seed=3)
    names = np.array(["cat", "dog", "emu", "fox"])[y]
    a = retrieval_metrics(x, y, x, y, query_in_gallery=True, bootstrap=50)
    b = retrieval_metrics(x, names, x, list(names), query_in_gallery=True, bootstrap=50)
    assert a == b


def test_torch_tensor_inputs():
    x, y = clustered(50, classes=3, seed=4)
    a = retrieval_metrics(x, y, x, y, bootstrap=0)
    b = retrieval_metrics(torch.from_numpy(x), torch.from_numpy(y), x, y, bootstrap=0)
    c = retrieval_metrics(x.astype(np.float64), y, x, y, bootstrap=0)
    assert a == b == c


def test_report_is_json_serialisable_with_int_k_keys():
    x, y = clustered(40, classes=3)
    rep = retrieval_metrics(x, y, x, y, k=[10, 1, 5, 5], per_query=True, bootstrap=20)
    assert list(rep["recall_at_k"]) == [1, 5, 10]
    assert all(type(k) is int for k in rep["ndcg_at_k"])
    assert isinstance(rep["map_at_r"], float)
    back = json.loads(json.dumps(rep))
    assert back["recall_at_k"]["5"] == rep["recall_at_k"][5]
    assert back["ci95"]["map_at_k"]["10"] == rep["ci95"]["map_at_k"][10]


def test_per_query_values():
    q, g = scored([[0.9, 0.8, 0.7], [0.1, 0.2, 0.3], [0.5, 0.5, 0.5]])
    rep = retrieval_metrics(q, [1, 0, 7], g, [0, 1, 0], k=1, per_query=True, bootstrap=0)
    pq = rep["per_query"]
    assert pq["query_index"] == [0, 1]
    assert pq["num_relevant"] == [1, 2]
    assert pq["first_relevant_rank"] == [2, 1]
    assert pq["average_precision"] == pytest.approx([0.5, (1 + 2 / 3) / 2])
    assert np.mean(pq["average_precision"]) == pytest.approx(rep["mean_average_precision"])


# ---------------------------------------------------------------------------------------------
# ranking_metrics (precomputed rankings)
# ---------------------------------------------------------------------------------------------


def test_ranking_metrics_rank_lists_match_retrieval_metrics():
    q, g = scored([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    labels = list("ABABBA")
    a = retrieval_metrics(q, ["A", "B"], g, labels, k=(1, 3), bootstrap=100, seed=3)
    # Query 1 ranks the gallery backwards: A B B A B A -> B at ranks 2, 3, 5.
    b = ranking_metrics([[6, 3, 1], [5, 2, 3]], [3, 3], k=(1, 3), bootstrap=100, seed=3)
    assert a == b


def test_ranking_metrics_relevance_matrix_and_truncation():
    rel = np.array(
        [
            [True, False, True, False],  # R = 2: complete
            [False, True, False, False],  # R = 3: two relevant items beyond the depth
            [False, False, False, False],  # R = 0: skipped
        ]
    )
    rep = ranking_metrics(rel, [2, 3, 0], k=(1, 4), bootstrap=0)
    assert rep["num_skipped"] == 1
    assert rep["num_truncated"] == 1
    # Query 1: only rank 2 known; AP over what is available, still divided by R = 3.
    assert rep["mean_average_precision"] == pytest.approx(((1 + 2 / 3) / 2 + (1 / 2) / 3) / 2)
    assert rep["map_at_r"] == pytest.approx((1 / 2 + (1 / 2) / 3) / 2)
    assert rep["recall_at_k"] == {1: 0.5, 4: 1.0}
    assert rep["mrr"] == pytest.approx((1 + 0.5) / 2)
    with pytest.raises(ValueError, match="depth"):
        ranking_metrics(rel, [2, 3, 0], k=5)
    # A complete ranking does not limit k.
    ranking_metrics(rel[:1], [2], k=50, bootstrap=0)
    t = ranking_metrics(torch.from_numpy(rel), [2, 3, 0], k=(1, 4), bootstrap=0)
    assert t == rep


def test_ranking_metrics_accepts_a_2d_integer_array_of_ranks():
    a = ranking_metrics(np.array([[3, 1], [2, 4]]), [2, 2], k=2, bootstrap=0)
    b = ranking_metrics([[1, 3], [2, 4]], [2, 2], k=2, bootstrap=0)
    assert a == b


def test_ranking_metrics_rank_lists_with_depth():
    rep = ranking_metrics([[1, 4], [2]], [2, 5], depth=10, k=10, bootstrap=0)
    assert rep["num_truncated"] == 1
    assert rep["mean_average_precision"] == pytest.approx(((1 + 2 / 4) / 2 + 0.5 / 5) / 2)
    rep2 = ranking_metrics([[1, 4], [2]], [2, 5], depth=[4, 10], k=4, bootstrap=0)
    assert rep2["recall_fraction_at_k"][4] == pytest.approx((1 + 1 / 5) / 2)


# ---------------------------------------------------------------------------------------------
# agreement with pytorch-metric-learning and with a brute force
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("query_in_reference", [True, False])
def test_agrees_with_accuracy_calculator(query_in_reference):
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    calc = AccuracyCalculator(
        include=("mean_average_precision_at_r", "r_precision", "precision_at_1"),
        k="max_bin_count",
        device=torch.device("cpu"),
    )
    x, y = clustered(900, d=32, classes=12, noise=1.6, seed=11)
    if query_in_reference:
        q, ql, g, gl = x, y, x, y
    else:
        q, ql, g, gl = x[:300], y[:300], x[300:], y[300:]
    ref = calc.get_accuracy(
        torch.from_numpy(q),
        torch.from_numpy(ql),
        torch.from_numpy(g),
        torch.from_numpy(gl),
        ref_includes_query=query_in_reference,
    )
    ours = retrieval_metrics(q, ql, g, gl, query_in_gallery=query_in_reference, bootstrap=0)
    assert ours["map_at_r"] == pytest.approx(ref["mean_average_precision_at_r"], abs=1e-6)
    assert ours["r_precision"] == pytest.approx(ref["r_precision"], abs=1e-6)
    assert ours["precision_at_1"] == pytest.approx(ref["precision_at_1"], abs=1e-6)


@pytest.mark.parametrize(
    ("case", "loo", "cameras"),
    [
        ("separate", False, False),
        ("leave_one_out", True, False),
        ("reid", False, True),
        ("reid_loo", True, True),
    ],
)
def test_agrees_with_brute_force_full_sort(case, loo, cameras):
    ks = (1, 3, 10)
    x, y = integer_embeddings(260, seed=len(case))
    rng = np.random.default_rng(5)
    if loo:
        q, ql, g, gl = x, y, x, y
    else:
        q, ql, g, gl = x[:90], y[:90], x[90:], y[90:]
    qc = gc = None
    if cameras:
        cam = rng.integers(0, 3, len(x))
        qc, gc = (cam, cam) if loo else (cam[:90], cam[90:])
    ref, skipped = brute_force(q, ql, g, gl, ks, loo=loo, qc=qc, gc=gc)
    rep = retrieval_metrics(
        q,
        ql,
        g,
        gl,
        k=ks,
        query_in_gallery=loo,
        query_cameras=qc,
        gallery_cameras=gc,
        bootstrap=0,
    )
    assert rep["num_skipped"] == skipped
    got = flat_report(rep)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_matches_cpu():
    x, y = clustered(500, classes=9, noise=2.0, seed=8)
    a = retrieval_metrics(x, y, x, y, query_in_gallery=True, bootstrap=100)
    b = retrieval_metrics(x, y, x, y, query_in_gallery=True, bootstrap=100, device="cuda")
    for key in ("map_at_r", "r_precision", "precision_at_1", "mean_average_precision", "mrr"):
        assert b[key] == pytest.approx(a[key], abs=1e-6)


def test_chunk_size_does_not_change_anything():
    x, y = clustered(400, classes=7, noise=2.0, seed=2)
    cam = np.random.default_rng(2).integers(0, 4, 400)
    kwargs = {"k": (1, 5, 20), "query_cameras": cam, "gallery_cameras": cam, "bootstrap": 200}
    a = retrieval_metrics(x, y, x, y, chunk_size=7, **kwargs)
    b = retrieval_metrics(x, y, x, y, chunk_size=1000, **kwargs)
    c = retrieval_metrics(x, y, x, y, chunk_size=1, **kwargs)
    assert a == b == c
