"""imgret.metrics.openset: thresholds, FPIR / FNIR, TAR@FAR and their intervals, against
scikit-learn's roc_curve on the same scores and against hand-made searches."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_curve

from imgret.metrics.openset import (
    OpenSetSearches,
    det_curve,
    fnir_at,
    fpir_at,
    open_set_report,
    paired_fnir_difference,
    rank1_dir_at,
    tar_at_far,
    threshold_at_fpir,
    threshold_at_rate,
    verification_report,
)


def _oracle_tpr_at_fpr(positive, negative, rate) -> float:
    y = np.r_[np.ones(len(positive)), np.zeros(len(negative))]
    fpr, tpr, _ = roc_curve(y, np.r_[positive, negative], drop_intermediate=False)
    return float(tpr[fpr <= rate].max())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rate", [0.3, 0.1, 0.01])
def test_tar_at_far_is_sklearns_best_tpr_within_the_far(seed, rate) -> None:
    rng = np.random.default_rng(seed)
    # Rounded scores: many ties, the case a threshold rule gets wrong first.
    genuine = np.round(rng.normal(1.0, 0.6, 300), 1)
    impostor = np.round(rng.normal(0.0, 0.6, 2000), 1)
    assert tar_at_far(genuine, impostor, rate) == pytest.approx(
        _oracle_tpr_at_fpr(genuine, impostor, rate))


@pytest.mark.parametrize("seed", range(4))
def test_fnir_at_fpir_is_one_minus_sklearns_tpr(seed) -> None:
    rng = np.random.default_rng(seed)
    n = 600
    mated = rng.random(n) < 0.5
    top = np.round(rng.normal(0.5, 0.3, n), 2)
    mate = np.where(mated, np.round(top - rng.exponential(0.05, n), 2), -np.inf)
    top = np.maximum(top, mate)
    searches = OpenSetSearches(top, mate, mated & (mate == top), mated, np.arange(n))
    for f in (0.2, 0.05, 0.01):
        t = threshold_at_fpir(searches, f)
        assert fpir_at(searches, t) <= f
        # The lowest such threshold: one step down alarms on more than f of the non-mated.
        below = searches.top_score[~mated][searches.top_score[~mated] < t].max()
        assert fpir_at(searches, below) > f
        finite = np.isfinite(mate[mated])
        oracle = _oracle_tpr_at_fpr(mate[mated][finite], top[~mated], f) * finite.mean()
        assert 1 - fnir_at(searches, t) == pytest.approx(oracle)


def test_searches_from_candidate_lists() -> None:
    searches = OpenSetSearches.from_candidates(
        ["a", "b", "x", "a"],
        [["a", "b"], ["a", "b"], ["b"], []],
        [[0.9, 0.4], [0.8, 0.7], [0.6], []],
        gallery_labels={"a", "b"})
    assert searches.mated.tolist() == [True, True, False, True]
    assert searches.top_score.tolist() == [0.9, 0.8, 0.6, -np.inf]
    assert searches.mate_score.tolist() == [0.9, 0.7, -np.inf, -np.inf]
    assert searches.top_is_mate.tolist() == [True, False, False, False]
    assert searches.group[0] == searches.group[3] != searches.group[1]
    # One non-mated search at 0.6: any threshold above it gives FPIR 0.
    assert fpir_at(searches, 0.61) == 0.0 and fpir_at(searches, 0.6) == 1.0
    assert fnir_at(searches, 0.75) == pytest.approx(2 / 3)  # b's mate at 0.7; the empty list
    assert rank1_dir_at(searches, 0.5) == pytest.approx(1 / 3)


def test_a_rate_the_non_mated_searches_cannot_resolve_is_none_with_the_reason() -> None:
    rng = np.random.default_rng(0)
    n = 80
    mated = np.arange(n) < 40
    top = rng.random(n)
    searches = OpenSetSearches(top, np.where(mated, top, -np.inf), mated, mated,
                               np.arange(n))
    assert threshold_at_rate(top[~mated], 0.01) is None
    report = open_set_report(searches, fpirs=(0.1, 0.01), resamples=50)
    resolved, unresolved = report["operating_points"]
    assert resolved["fnir"]["value"] is not None
    assert unresolved["fnir"] is None and "needs >= 100 non-mated searches, has 40" in \
        unresolved["note"]


def test_report_intervals_hold_the_value_and_repeat_for_a_seed() -> None:
    rng = np.random.default_rng(3)
    n = 1500
    labels = rng.integers(0, 300, n)
    mated = labels < 200
    top = rng.normal(0.4, 0.2, n) + 0.3 * mated
    searches = OpenSetSearches(top, np.where(mated, top - 0.01, -np.inf),
                               np.zeros(n, bool), mated, labels)
    report = open_set_report(searches, fpirs=(0.1, 0.01), resamples=200, seed=7)
    assert report == open_set_report(searches, fpirs=(0.1, 0.01), resamples=200, seed=7)
    for point in report["operating_points"]:
        for key in ("threshold", "fnir", "fpir_measured"):
            low, high = point[key]["ci95"]
            assert low <= point[key]["value"] <= high, (point["fpir"], key)
        assert point["fpir_measured"]["value"] <= point["fpir"]
    assert report["operating_points"][0]["fnir"]["value"] < \
        report["operating_points"][1]["fnir"]["value"]  # a stricter FPIR misses more


def test_grouped_resampling_widens_the_interval_of_correlated_searches() -> None:
    """Ten searches per identity that agree with each other carry the information of one:
    resampling identities must give a wider interval than pretending they are independent."""
    rng = np.random.default_rng(5)
    per, ids = 10, 120
    base = np.repeat(rng.normal(0.5, 0.2, ids), per)
    labels = np.repeat(np.arange(ids), per)
    mated = labels < 60
    top = base + rng.normal(0, 0.001, len(base))
    mate = np.where(mated, top, -np.inf)
    grouped = OpenSetSearches(top, mate, mated, mated, labels)
    independent = OpenSetSearches(top, mate, mated, mated, np.arange(len(top)))

    def width(s):
        (point,) = open_set_report(s, fpirs=(0.1,), resamples=300)["operating_points"]
        low, high = point["fnir"]["ci95"]
        return high - low

    assert width(grouped) > 2 * width(independent)


def test_det_curve_is_monotone_and_spans_the_operating_range() -> None:
    rng = np.random.default_rng(1)
    n = 5000
    mated = rng.random(n) < 0.5
    top = rng.normal(0, 1, n) + mated
    searches = OpenSetSearches(top, np.where(mated, top, -np.inf), mated, mated,
                               np.arange(n))
    det = det_curve(searches, points=50)
    assert len(det["fpir"]) <= 50
    assert np.all(np.diff(det["fpir"]) >= 0) and np.all(np.diff(det["fnir"]) <= 0)
    assert det["fpir"][0] == 0.0 and det["fnir"][0] == 1.0
    assert det["threshold"][0] == np.inf


def test_verification_report_matches_tar_at_far_with_intervals() -> None:
    rng = np.random.default_rng(2)
    genuine, impostor = rng.normal(1, 0.5, 400), rng.normal(0, 0.5, 4000)
    report = verification_report(genuine, impostor, genuine_group=np.arange(400) % 100,
                                 impostor_group=np.arange(4000) % 100, fars=(0.1, 0.001),
                                 resamples=100)
    first, last = report["points"]
    assert first["tar"]["value"] == pytest.approx(tar_at_far(genuine, impostor, 0.1))
    low, high = first["tar"]["ci95"]
    assert low <= first["tar"]["value"] <= high
    assert last["tar"]["value"] == pytest.approx(tar_at_far(genuine, impostor, 0.001))


@pytest.mark.parametrize("rate", [0, 1, -0.1, 1.5, float("nan")])
def test_rates_outside_the_open_interval_are_refused(rate) -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        threshold_at_rate(np.arange(10.0), rate)


def test_a_set_without_non_mated_searches_is_refused() -> None:
    searches = OpenSetSearches(np.ones(3), np.ones(3), np.ones(3, bool), np.ones(3, bool),
                               np.arange(3))
    with pytest.raises(ValueError, match="mated and non-mated"):
        open_set_report(searches)


def _searches(top, mate, labels) -> OpenSetSearches:
    mated = np.isfinite(mate)
    return OpenSetSearches(np.asarray(top, float), np.asarray(mate, float),
                           mated & (np.asarray(mate) == np.asarray(top)), mated,
                           np.asarray(labels))


def test_paired_fnir_difference_is_each_side_at_its_own_threshold() -> None:
    rng = np.random.default_rng(4)
    n = 400
    labels = rng.integers(0, 80, n)
    mated = labels < 40
    top = rng.normal(0.5, 0.15, n) + 0.3 * mated
    a = _searches(top, np.where(mated, top, -np.inf), labels)
    # B: the same non-mated scores shifted up (a higher threshold), mates unchanged.
    b_top = np.where(mated, top, top + 0.1)
    b = _searches(b_top, np.where(mated, top, -np.inf), labels)
    result = paired_fnir_difference(a, b, 0.1, resamples=300, seed=1)
    assert result["a"]["threshold"] == threshold_at_fpir(a, 0.1)
    assert result["b"]["threshold"] == threshold_at_fpir(b, 0.1) > result["a"]["threshold"]
    assert result["difference"] == pytest.approx(
        fnir_at(b, result["b"]["threshold"]) - fnir_at(a, result["a"]["threshold"]))
    low, high = result["ci95"]
    assert 0 < low <= result["difference"] <= high
    same = paired_fnir_difference(a, a, 0.1, resamples=100)
    assert same["difference"] == 0 and same["ci95"] == [0.0, 0.0]


def test_paired_fnir_difference_refuses_other_searches() -> None:
    a = _searches([0.9, 0.5, 0.4], [0.9, -np.inf, -np.inf], [0, 1, 2])
    other = _searches([0.9, 0.5, 0.4], [0.9, -np.inf, -np.inf], [0, 1, 1])
    with pytest.raises(ValueError, match="same searches"):
        paired_fnir_difference(a, other, 0.5)
    with pytest.raises(ValueError, match="needs >= 10 non-mated"):
        paired_fnir_difference(a, a, 0.1)
