"""Grouping hits into identities, and every identity's score from a full score matrix."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.gallery.search.identities import (
    IdentityGroup,
    check_aggregation,
    group_hits,
    score_matrix_identities,
)
from imgret.gallery.search.ranking import Hit

LABELS = {1: "a", 2: "b", 3: "a", 4: "c", 5: "b", 6: "a"}
HITS = [Hit(1, 0.9), Hit(2, 0.85), Hit(3, 0.5), Hit(4, 0.45), Hit(5, 0.8), Hit(6, 0.1)]


def test_best_ranks_identities_by_their_best_item_and_lists_their_items() -> None:
    groups = group_hits(HITS, LABELS.get, k=2, per_identity=2, aggregation="best")
    assert [(g.label, g.score) for g in groups] == [("a", 0.9), ("b", 0.85)]
    assert [h.id for h in groups[0].hits] == [1, 3]


def test_mean_top_n_can_reorder_identities() -> None:
    groups = group_hits(HITS, LABELS.get, k=3, per_identity=3, aggregation="mean_top2")
    assert [g.label for g in groups] == ["b", "a", "c"]
    assert groups[0].score == pytest.approx((0.85 + 0.8) / 2)
    # An identity with fewer items than n is scored on what it has.
    assert groups[2].score == pytest.approx(0.45)


def test_deleted_items_are_dropped_and_templates_decide_the_template_order() -> None:
    label_of = {**LABELS, 1: None}.get
    groups = group_hits(HITS, label_of, k=3, per_identity=1, aggregation="template",
                        templates={"a": 0.2, "b": 0.7, "c": 0.95})
    assert [g.label for g in groups] == ["c", "b", "a"]
    assert groups[2].hits == (Hit(3, 0.5),)
    with pytest.raises(ValueError, match="templates"):
        group_hits(HITS, LABELS.get, k=1, per_identity=1, aggregation="template")


@pytest.mark.parametrize("name", ["median", "mean_top0", "mean_top100", "", "best "])
def test_unknown_aggregations_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="aggregation"):
        check_aggregation(name)
    with pytest.raises(ValueError):
        IdentityGroup(3, 1, name)


def test_fetch_size_grows_with_what_is_listed_within_the_cap() -> None:
    assert IdentityGroup(2, 1).fetch_size(1000) == 100
    assert IdentityGroup(50, 3).fetch_size(1000) == 600
    assert IdentityGroup(500, 20).fetch_size(1000) == 1000


def test_score_matrix_matches_grouping_and_honours_the_visibility_mask() -> None:
    rng = np.random.default_rng(0)
    gallery = rng.normal(size=(9, 4))
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries = gallery[[0, 4]] + 0.1
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    labels = np.array(list("aaabbbccc"))
    scores = queries @ gallery.T
    valid = np.ones_like(scores, bool)
    valid[0, 0] = False  # query 0 may not see item 0 (its own camera)
    names, best = score_matrix_identities(scores, labels, "best", valid=valid)
    assert list(names) == ["a", "b", "c"]
    assert best[0, 0] == pytest.approx(scores[0, 1:3].max())
    assert best[1, 1] == pytest.approx(scores[1, 3:6].max())
    _, template = score_matrix_identities(scores, labels, "template", vectors=gallery,
                                          queries=queries, valid=valid)
    mean = gallery[1:3].mean(axis=0)
    assert template[0, 0] == pytest.approx(queries[0] @ mean / np.linalg.norm(mean))
    hits = [Hit(i, float(s)) for i, s in sorted(enumerate(scores[1]), key=lambda x: -x[1])]
    grouped = group_hits(hits, lambda i: str(labels[i]), k=3, per_identity=3,
                         aggregation="mean_top2")
    _, mean2 = score_matrix_identities(scores, labels, "mean_top2")
    for identity in grouped:
        assert identity.score == pytest.approx(mean2[1, "abc".index(identity.label)])
