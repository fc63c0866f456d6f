"""Identities instead of items: a ranked list of gallery hits grouped by label.

A person (or a product, a character) is one label with several gallery items. A search that
asks for identities (``group_by=label``) wants the top ``k`` labels, each with one score and
its best items, not ``k`` items that may all be the same person.

How an identity's score is made from its items is the *aggregation*:

- ``best``: its best item's score (the nearest neighbour, as per-item search ranks);
- ``mean_top<n>``: the mean of its ``n`` best items' scores (fewer if it has fewer);
- ``template``: the query against the identity's template, the L2-normalised mean of all its
  items' vectors (one vector per identity, as face-recognition enrolment builds).

Which one serves is :data:`DEFAULT_AGGREGATION`, chosen by measurement on a multi-shot
re-identification protocol (``benchmarks/identity_bench.py``; docs/identities.md has the
table): the aggregation with the best rank-1 identification (CMC) whose FNIR at FPIR 0.01 is
not worse. ``/identify`` and calibration decide on the same identity-level score: for
``best`` that is the top item's score, so a per-item search and its identity grouping
always agree on who the top is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from imgret.gallery.search.ranking import Hit

BEST, TEMPLATE = "best", "template"
_MEAN_TOP = re.compile(r"mean_top([1-9][0-9]?)")
# Measured: benchmarks/identity_bench.py (docs/identities.md): the template ranks the right
# identity first more often and turns fewer known people away at the same false-accept rate.
DEFAULT_AGGREGATION = TEMPLATE
# The score open-set decisions (calibration, /identify, a search's decision) are made on.
DECISION_SCORE = TEMPLATE


def check_aggregation(name: str) -> str:
    """``name`` if it is an aggregation (``best``, ``mean_top<n>`` for n in 1..99,
    ``template``); else :class:`ValueError` naming them."""
    if name in (BEST, TEMPLATE) or _MEAN_TOP.fullmatch(name):
        return name
    raise ValueError(f"unknown aggregation {name!r}: use best, mean_top<n> (n = 1..99) "
                     "or template")


@dataclass(frozen=True, slots=True)
class Identity:
    """One label of a grouped search: its score and its best items, best first."""

    label: str
    score: float
    hits: tuple[Hit, ...]


# A grouped search ranks the identities of its best items: at least this many, and four
# items per identity listed, so an identity whose items all rank below the first
# ``fetch_size`` is not proposed (the template then re-scores every proposed identity over
# all its items).
FETCH_MIN = 100
FETCH_PER_LISTED = 4
# A template averages at most this many of an identity's items (the lowest ids: the first
# enrolled), so one huge label cannot make a search slow.
TEMPLATE_ITEMS_MAX = 1000


@dataclass(frozen=True, slots=True)
class IdentityGroup:
    """What a grouped search asks for: ``k`` identities, each with its ``per_identity`` best
    items, scored by ``aggregation``."""

    k: int
    per_identity: int = 3
    aggregation: str = DEFAULT_AGGREGATION

    def __post_init__(self) -> None:
        if self.k < 1 or self.per_identity < 1:
            raise ValueError("k and per_identity must be >= 1")
        check_aggregation(self.aggregation)

    def fetch_size(self, cap: int) -> int:
        """Items the search fetches to find the identities (at most ``cap``)."""
        return min(cap, max(FETCH_MIN, FETCH_PER_LISTED * self.k * self.per_identity))


def identity_score(scores: Sequence[float] | np.ndarray, aggregation: str) -> float:
    """The score of one identity from its items' scores, best first (not ``template``)."""
    if aggregation == BEST:
        return float(scores[0])
    match = _MEAN_TOP.fullmatch(aggregation)
    if match is None:
        raise ValueError(f"{aggregation!r} is not an item-score aggregation")
    return float(np.mean(np.asarray(scores[: int(match.group(1))], dtype=np.float64)))


def group_hits(hits: Sequence[Hit], label_of: Callable[[int], str | None], *, k: int,
               per_identity: int, aggregation: str = DEFAULT_AGGREGATION,
               templates: Mapping[str, float] | None = None) -> list[Identity]:
    """The top ``k`` identities among ``hits`` (one query's, best first).

    Args:
        hits: the query's item hits, best first.
        label_of: an item's label (``None``: deleted since; the hit is dropped).
        k: identities wanted.
        per_identity: items listed under each identity (its best ones).
        aggregation: see the module docstring; ``template`` needs ``templates``.
        templates: ``template`` only: the query's score against each label's template.

    Returns:
        At most ``k`` identities, best score first (ties: the one whose best item ranks
        first). An identity is scored from the items among ``hits`` (for ``template``: from
        its template); a caller that wants every identity's ``mean_top<n>`` exact fetches at
        least ``n`` items beyond the ``k``-th identity's.
    """
    if k < 1 or per_identity < 1:
        raise ValueError("k and per_identity must be >= 1")
    check_aggregation(aggregation)
    if aggregation == TEMPLATE and templates is None:
        raise ValueError("the template aggregation needs the templates' scores")
    members: dict[str, list[Hit]] = {}
    for hit in hits:
        label = label_of(hit.id)
        if label is not None:
            members.setdefault(label, []).append(hit)
    scored: list[tuple[float, int, str]] = []
    for first, (label, items) in enumerate(members.items()):
        if aggregation == TEMPLATE:
            assert templates is not None
            if label not in templates:
                continue
            score = float(templates[label])
        else:
            score = identity_score([h.score for h in items], aggregation)
        scored.append((score, first, label))
    scored.sort(key=lambda row: (-row[0], row[1]))
    return [Identity(label, score, tuple(members[label][:per_identity]))
            for score, _, label in scored[:k]]


def score_matrix_identities(scores: np.ndarray, gallery_labels: np.ndarray,
                            aggregation: str, *, vectors: np.ndarray | None = None,
                            queries: np.ndarray | None = None,
                            valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every identity's score for every query, from a full query x gallery score matrix
    (what an evaluation of the aggregations needs; the service groups ranked hits instead).

    Args:
        scores: ``(q, g)`` query-item scores.
        gallery_labels: ``(g,)`` the items' labels.
        aggregation: see the module docstring.
        vectors, queries: ``template`` only: ``(g, d)`` item and ``(q, d)`` query vectors.
        valid: ``(q, g)`` bool, items each query may see (Market-1501 leaves out the
            query's own camera); ``None``: all.

    Returns:
        ``(labels (L,), identity_scores (q, L))``; ``-inf`` where a query sees no item of
        the identity.
    """
    check_aggregation(aggregation)
    labels, code = np.unique(gallery_labels, return_inverse=True)
    n_queries = scores.shape[0]
    out = np.full((n_queries, len(labels)), -np.inf)
    mask = np.ones(scores.shape, bool) if valid is None else valid
    for j in range(len(labels)):
        columns = np.flatnonzero(code == j)
        seen = mask[:, columns]
        if aggregation == TEMPLATE:
            if vectors is None or queries is None:
                raise ValueError("the template aggregation needs vectors and queries")
            for i in range(n_queries):
                use = columns[seen[i]]
                if len(use):
                    template = vectors[use].mean(axis=0)
                    norm = np.linalg.norm(template)
                    out[i, j] = float(queries[i] @ template / norm) if norm > 0 else -np.inf
            continue
        block = np.where(seen, scores[:, columns], -np.inf)
        block = -np.sort(-block, axis=1)  # best first
        for i in range(n_queries):
            row = block[i][np.isfinite(block[i])]
            if len(row):
                out[i, j] = identity_score(row, aggregation)
    return labels, out
