"""imgret.gallery.evaluation.retrieval: the per-label breakdown (with confusions) on hand-made
galleries ranked by
a real FAISS Searcher, and the verdicts and activation gate of a version comparison."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.cli.reports import format_report
from imgret.gallery.evaluation.comparison import (
    BETTER,
    MIN_EFFECT,
    NO_DIFFERENCE,
    VERDICTS,
    WORSE,
    compare_versions,
    gate,
    verdict,
)
from imgret.gallery.evaluation.retrieval import Evaluation, QueryBatch, evaluate
from imgret.gallery.search import Searcher
from imgret.gallery.search.faiss_index import check_factory, create_index
from imgret.gallery.storage.vector_store import ItemInfo

DIM = 8


def _unit(*parts: tuple[int, float]) -> np.ndarray:
    """A unit vector from ``(axis, weight)`` parts."""
    v = np.zeros(DIM, dtype=np.float64)
    for axis, weight in parts:
        v[axis] += weight
    return (v / np.linalg.norm(v)).astype(np.float32)


def _searcher(items: list[tuple[str, np.ndarray]]) -> Searcher:
    """An exact (Flat) inner-product Searcher over ``(label, vector)`` items, ids 1..n."""
    index = create_index(check_factory("Flat", DIM), DIM)
    ids = np.arange(1, len(items) + 1, dtype=np.int64)
    index.add_with_ids(np.stack([v for _, v in items]), ids)
    infos = {int(i): ItemInfo(label) for i, (label, _) in zip(ids, items, strict=True)}
    return Searcher(index, model_version="m", factory="Flat", infos=infos, use_gpu=False)


def _queries(pairs: list[tuple[str, np.ndarray]]) -> QueryBatch:
    return QueryBatch(np.stack([v for _, v in pairs]), [label for label, _ in pairs])


def _small_case() -> Evaluation:
    # Labels a, b (two items each) and c (one item), on separate axes.
    gallery = _searcher([
        ("a", _unit((0, 1.0))), ("a", _unit((0, 1.0), (3, 0.1))),
        ("b", _unit((1, 1.0))), ("b", _unit((1, 1.0), (3, 0.1))),
        ("c", _unit((2, 1.0))),
    ])
    queries = _queries([
        ("a", _unit((0, 1.0))),               # both a's first: AP@R 1
        ("a", _unit((0, 0.6), (1, 0.8))),     # both b's first: AP@R 0, 2 b-confusions
        ("b", _unit((1, 1.0))),               # AP@R 1
        ("c", _unit((2, 0.8), (0, 0.6))),     # c first: AP@R 1 (R = 1)
        ("c", _unit((2, 0.6), (0, 0.8))),     # an a first: AP@R 0, 1 a-confusion
        ("d", _unit((4, 1.0))),               # no d in the gallery: skipped
    ])
    return evaluate(gallery, queries, k=[1], bootstrap=0)


def test_per_label_means_confusions_and_worst_first_order() -> None:
    report = _small_case().report

    assert report["num_queries"] == 6 and report["num_skipped"] == 1
    assert report["per_label"] == [
        {"label": "a", "count": 2, "map_at_r": 0.5, "precision_at_1": 0.5,
         "confusions": [{"label": "b", "count": 2}]},
        # a tie with a on MAP@R: by label
        {"label": "c", "count": 2, "map_at_r": 0.5, "precision_at_1": 0.5,
         "confusions": [{"label": "a", "count": 1}]},
        {"label": "b", "count": 1, "map_at_r": 1.0, "precision_at_1": 1.0, "confusions": []},
    ]


def test_per_label_agrees_with_the_overall_metrics() -> None:
    report = _small_case().report
    per_label = report["per_label"]
    total = sum(entry["count"] for entry in per_label)
    assert total == report["num_queries"] - report["num_skipped"]
    assert sum(e["count"] * e["map_at_r"] for e in per_label) / total == pytest.approx(
        report["map_at_r"])
    assert sum(e["count"] * e["precision_at_1"] for e in per_label) / total == pytest.approx(
        report["precision_at_1"])


def test_confusions_count_only_the_top_r_most_frequent_first_at_most_five() -> None:
    # Ten wrong-label items close to the query (l1 x3, l2 x2, l3 x2, l4, l5, l6), then the
    # twelve items of the query's label: the top R = 12 holds all ten wrong ones and two
    # relevant ones; one more wrong item (l7) ranks below R and is not a confusion.
    wrong = ["l1", "l1", "l1", "l2", "l2", "l3", "l3", "l4", "l5", "l6"]
    gallery = [(label, _unit((1, 0.99 - 0.01 * i), (2, 0.1))) for i, label in enumerate(wrong)]
    gallery += [("q", _unit((1, 0.5 - 0.04 * i), (0, 1.0))) for i in range(12)]
    gallery += [("l7", _unit((1, 0.01), (5, 1.0)))]
    queries = _queries([("q", _unit((1, 1.0)))])

    report = evaluate(_searcher(gallery), queries, k=[1], bootstrap=0).report

    (entry,) = report["per_label"]
    assert entry["count"] == 1 and entry["precision_at_1"] == 0.0
    assert entry["map_at_r"] == pytest.approx((1 / 11 + 2 / 12) / 12)
    assert entry["confusions"] == [
        {"label": "l1", "count": 3}, {"label": "l2", "count": 2}, {"label": "l3", "count": 2},
        {"label": "l4", "count": 1}, {"label": "l5", "count": 1},
    ]


def test_format_report_prints_the_worst_labels_with_their_top_confusion() -> None:
    lines = format_report(_small_case().report)
    table = lines[lines.index("| label | queries | MAP@R | P@1 | top confusion |"):]
    assert table[2] == "| a | 2 | 0.5000 | 0.5000 | b (2 hits) |"
    assert table[4] == "| b | 1 | 1.0000 | 1.0000 | - |"


# --------------------------------------------------------------------------- verdicts, gate


def _evaluation(map_at_r: list[float], first: list[int | None]) -> Evaluation:
    """Per-query values as :func:`evaluate` keeps them (for pairing two versions)."""
    n = len(map_at_r)
    per_query = {"query_index": list(range(n)), "num_relevant": [3] * n,
                 "average_precision": list(map_at_r), "map_at_r": list(map_at_r),
                 "first_relevant_rank": list(first)}
    return Evaluation({}, per_query)


RNG = np.random.default_rng(0)
BASE = RNG.uniform(0.2, 0.6, 60).tolist()


def test_verdict_of_an_interval() -> None:
    assert verdict(0.01, 0.2, 0.1) == BETTER
    assert verdict(-0.2, -0.01, -0.1) == WORSE
    assert verdict(-0.1, 0.1, 0.0) == NO_DIFFERENCE
    assert verdict(0.0, 0.0, 0.0) == NO_DIFFERENCE
    assert verdict(0.0, 0.3, 0.1) == NO_DIFFERENCE  # touching 0 is not above it
    # An interval that excludes 0 around a difference too small to matter: no difference.
    assert verdict(-1e-4, -1e-6, -4e-5) == NO_DIFFERENCE
    assert verdict(1e-6, 1e-4, 4e-5) == NO_DIFFERENCE
    assert verdict(MIN_EFFECT / 2, 3 * MIN_EFFECT, MIN_EFFECT) == BETTER
    assert verdict(0.1, 0.2, 0.15, min_effect=0.2) == NO_DIFFERENCE


def test_float_level_changes_to_the_same_model_are_no_difference() -> None:
    """What the same model saved again does: a few queries' values move by ~1e-5, all the
    same way. The paired interval then excludes 0; the verdict must not call that worse."""
    changed = list(BASE)
    for i in range(0, 60, 6):
        changed[i] -= 3e-5
    comparison = compare_versions(_evaluation(BASE, [1, 2] * 30),
                                  _evaluation(changed, [1, 2] * 30))

    assert comparison["map_at_r"]["ci95"][1] < 0  # the interval alone would say "worse"
    assert comparison["map_at_r"]["min_effect"] == MIN_EFFECT
    assert comparison["verdict"]["map_at_r"] == NO_DIFFERENCE
    assert gate(comparison, "not_worse")[0]
    allowed, message = gate(comparison, "better")
    assert not allowed and "B - A >= 0.001" in message
    # With a smaller minimum effect the same interval is a verdict.
    strict = compare_versions(_evaluation(BASE, [1, 2] * 30), _evaluation(changed, [1, 2] * 30),
                              min_effect=1e-6)
    assert strict["verdict"]["map_at_r"] == WORSE
    assert not gate(strict, "not_worse")[0]
    assert set(VERDICTS) == {BETTER, WORSE, NO_DIFFERENCE}


def test_identical_versions_have_no_detectable_difference() -> None:
    a = _evaluation(BASE, [1, 2] * 30)
    comparison = compare_versions(a, _evaluation(BASE, [1, 2] * 30))

    assert comparison["map_at_r"]["ci95"] == [0.0, 0.0]
    assert comparison["verdict"] == {m: NO_DIFFERENCE for m in comparison["verdict"]}
    assert set(comparison["verdict"]) == {"map_at_r", "mean_average_precision",
                                          "precision_at_1", "mrr"}
    assert comparison["b_better"] == [] and comparison["a_better"] == []
    assert gate(comparison, "not_worse")[0] is True
    allowed, why = gate(comparison, "better")
    assert not allowed and "map_at_r no detectable difference" in why and "[+0.0000" in why


def test_better_and_worse_verdicts_and_the_gate() -> None:
    a = _evaluation(BASE, [2] * 60)
    better = compare_versions(a, _evaluation([v + 0.2 for v in BASE], [1] * 60))
    assert better["verdict"] == {m: BETTER for m in better["verdict"]}
    assert better["map_at_r"]["verdict"] == BETTER
    assert better["b_better"] == list(better["verdict"])
    allowed, why = gate(better, "better")
    assert allowed and why.startswith("map_at_r better: B - A = +0.2000")
    assert gate(better, "not_worse")[0]

    # MAP@R up but the first hit worse: refused by both requirements, naming the metrics.
    mixed = compare_versions(a, _evaluation([v + 0.2 for v in BASE], [3] * 60))
    assert mixed["verdict"]["map_at_r"] == BETTER
    assert mixed["verdict"]["mrr"] == WORSE
    assert mixed["a_better"] == ["mrr"]
    for require in ("better", "not_worse"):
        allowed, why = gate(mixed, require)
        assert not allowed and why.startswith("mrr worse: B - A = -0.1667")

    worse = compare_versions(a, _evaluation([v - 0.1 for v in BASE], [2] * 60))
    assert worse["verdict"]["map_at_r"] == WORSE
    allowed, why = gate(worse, "not_worse")
    assert not allowed and "map_at_r worse" in why and "interval [-0.1000" in why


def test_noisy_differences_around_zero_are_not_detectable() -> None:
    noise = RNG.normal(0, 0.05, 60)
    noise -= noise.mean()
    comparison = compare_versions(_evaluation(BASE, [1] * 60),
                                  _evaluation((np.array(BASE) + noise).tolist(), [1] * 60))
    low, high = comparison["map_at_r"]["ci95"]
    assert low < 0 < high
    assert comparison["verdict"]["map_at_r"] == NO_DIFFERENCE
    assert gate(comparison, "not_worse")[0] and not gate(comparison, "better")[0]


def test_gate_reads_the_evaluate_response_shape_and_checks_require() -> None:
    comparison = compare_versions(_evaluation(BASE, [2] * 60),
                                  _evaluation([v + 0.2 for v in BASE], [1] * 60))
    body = {"a": {}, "b": {},
            "difference": {m: v for m, v in comparison.items()
                           if isinstance(v, dict) and "ci95" in v},
            "verdict": comparison["verdict"]}
    assert gate(body, "better") == gate(comparison, "better")
    with pytest.raises(ValueError, match="require"):
        gate(comparison, "maybe")
