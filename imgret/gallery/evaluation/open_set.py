"""Open-set evaluation through the serving path: "who is this, or nobody", measured on the
rankings that :func:`imgret.gallery.evaluation.retrieval.rank_queries` got from the Searcher (the
same index, filters and re-ranking as ``/search``).

A query is **mated** when the gallery it was ranked against holds its label (R > 0: under
the re-ID rule, a query whose identity's gallery items are all from its own camera has none
left and is non-mated), **non-mated** otherwise: an identity the gallery does not hold. The
figures are :mod:`imgret.metrics.openset`'s (NIST FRVT 1:N's FPIR and FNIR at a threshold,
rank-1 identification above it, the DET curve; IJB-C's TAR@FAR), each with a bootstrap
interval that resamples identities.

Decisions this module makes:

- **Candidates are the returned rankings**, at the evaluation's depth (the whole gallery for
  small evaluations, else max(R, k)). A mate ranked below the depth counts as not returned
  (a miss at every threshold), as FRVT's FNIR at rank R counts it; the top score, which
  decides FPIR, is always returned. Hits deleted while the evaluation ran are dropped.
- **TAR@FAR** scores pairs of a query and a returned candidate: genuine = same label,
  impostor = different label, over every query (mated or not). Pairs beyond the depth are
  not scored: with a full ranking that is every pair; with a truncated one the pairs left
  out are the low-scoring tails (impostor and genuine), so the rates are shares of the
  *scored* pairs (the FAR of the threshold over all pairs is below the target), and the
  section says which (``pairs``: "all" or "top-K").
- **The hardest queries** (``hardest``) are listed so that a threshold can be judged on
  the queries it decides first: the non-mated ones with the highest top scores (the first
  false alarms as ``T`` falls) and the mated ones with the lowest best-mate scores (the first
  misses as ``T`` rises), at most :data:`HARDEST` of each, with their ids, labels and scores.
  They are all a page needs to show the decision on them at any threshold.
- **Unknown labels** (``unknown_labels``) declare identities that must be unknown to the
  gallery: each must be a label of the query set and hold no item of the evaluated gallery,
  else the request is refused. They are never removed from the gallery: an evaluation that
  hid items would describe a gallery other than the one served, and a threshold calibrated
  on it would not describe served decisions. Declaring them asks for the section.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from imgret.metrics.openset import (
    DEFAULT_RATES,
    OpenSetSearches,
    open_set_report,
    paired_fnir_difference,
    verification_report,
)

# Queries of each kind listed in ``hardest`` (the section stays small on any query set).
HARDEST = 20

# The label of a hit deleted mid-evaluation (imgret.gallery.evaluation.retrieval gives it): no
# identity.
DELETED = "\x00deleted"


@dataclass(frozen=True)
class OpenSetRequest:
    """What an evaluation is asked about open-set decisions.

    Attributes:
        enabled: ``True``: the section is required (refused when the queries are not both
            mated and non-mated); ``False``: never; ``None``: added when they are both.
        fpirs: target FPIRs of the operating points (each in (0, 1)); also the FARs of
            TAR@FAR.
        unknown_labels: labels declared unknown (see the module docstring); any implies
            ``enabled``.
    """

    enabled: bool | None = None
    fpirs: tuple[float, ...] = DEFAULT_RATES
    unknown_labels: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        bad = [f for f in self.fpirs if not 0.0 < float(f) < 1.0]
        if bad or not self.fpirs:
            raise ValueError(f"fpirs must each lie in (0, 1), got {list(self.fpirs)}")

    @property
    def required(self) -> bool:
        return bool(self.enabled) or bool(self.unknown_labels)


def check_unknown_labels(unknown: Sequence[str], query_labels: Sequence[str],
                         label_count: Counter[str]) -> None:
    """Refuse declared unknowns that are not query labels or that the gallery holds.

    Raises:
        ValueError: naming each such label.
    """
    queried = set(query_labels)
    absent = sorted({label for label in unknown if label not in queried})
    if absent:
        raise ValueError(f"unknown_labels: {', '.join(map(repr, absent[:10]))} "
                         f"{'is not a label' if len(absent) == 1 else 'are not labels'} of "
                         "the query set")
    held = sorted({label for label in unknown if label_count.get(label, 0) > 0})
    if held:
        shown = ", ".join(f"{label!r} ({label_count[label]} items)" for label in held[:10])
        raise ValueError(f"unknown_labels: the gallery holds {shown}; an unknown identity "
                         "must have no gallery item (delete them, or leave the label out)")


def searches(query_labels: Sequence[str], hit_labels: Sequence[Sequence[str]],
             hit_scores: Sequence[Sequence[float]],
             num_relevant: np.ndarray) -> OpenSetSearches:
    """The per-search summary of ranked candidate lists; mated = the query's gallery holds
    relevant items (``num_relevant > 0``)."""
    labels, scores = [], []
    for row_labels, row_scores in zip(hit_labels, hit_scores, strict=True):
        keep = [i for i, label in enumerate(row_labels) if label != DELETED]
        labels.append([row_labels[i] for i in keep])
        scores.append([float(row_scores[i]) for i in keep])
    mated = np.asarray(num_relevant) > 0
    held = {label for label, m in zip(query_labels, mated.tolist(), strict=True) if m}
    base = OpenSetSearches.from_candidates(list(query_labels), labels, scores, held)
    # Per query, not per label: under the re-ID rule one identity may be mated for a query
    # from one camera and not for another.
    return OpenSetSearches(base.top_score, np.where(mated, base.mate_score, -np.inf),
                           base.top_is_mate & mated, mated, base.group)


def wanted(request: OpenSetRequest, found: OpenSetSearches) -> bool:
    """Whether the section goes into the report.

    Raises:
        ValueError: it is required but the queries lack one kind.
    """
    n_mated = int(found.mated.sum())
    n_non = len(found.mated) - n_mated
    if request.enabled is False and not request.unknown_labels:
        return False
    if n_mated and n_non:
        return True
    if request.required:
        raise ValueError(
            "open_set needs mated queries (their label is in the gallery) and non-mated ones "
            f"(identities the gallery does not hold); this query set has {n_mated} mated and "
            f"{n_non} non-mated")
    return False


def section(found: OpenSetSearches, query_labels: Sequence[str],
            hit_labels: Sequence[Sequence[str]], hit_scores: Sequence[Sequence[float]], *,
            request: OpenSetRequest, depth: int, gallery_size: int, bootstrap: int,
            seed: int, query_ids: Sequence[int] | None = None,
            decided: tuple[Sequence[Sequence[str]], Sequence[Sequence[float]]] | None = None,
            ) -> dict[str, Any]:
    """``report["open_set"]``: :func:`imgret.metrics.openset.open_set_report` at
    ``request.fpirs``, TAR@FAR from the returned candidates' scores, and the hardest
    queries (:func:`hardest`; ``query_ids``: the stored ids of the queries, if any).
    ``decided``: the candidate lists ``found`` was made from, when not the items (each
    query's identities and their scores)."""
    report = open_set_report(found, fpirs=request.fpirs, resamples=bootstrap, seed=seed)
    for point in report["operating_points"]:
        point.setdefault("note", None)
    report["det"] = _finite_det(report["det"])
    genuine, impostor, g_group, i_group = [], [], [], []
    for q, (label, row_labels, row_scores) in enumerate(
            zip(query_labels, hit_labels, hit_scores, strict=True)):
        for hit_label, score in zip(row_labels, row_scores, strict=True):
            if hit_label == DELETED:
                continue
            same = hit_label == label
            (genuine if same else impostor).append(float(score))
            (g_group if same else i_group).append(int(found.group[q]))
    verification: dict[str, Any] | None = None
    if genuine:
        verification = verification_report(
            np.asarray(genuine), np.asarray(impostor), genuine_group=np.asarray(g_group),
            impostor_group=np.asarray(i_group), fars=request.fpirs, resamples=bootstrap,
            seed=seed)
        for point in verification["points"]:
            point.setdefault("note", None)
    pairs = "all" if depth >= gallery_size else f"top-{depth}"
    report.update(
        depth=depth,
        pairs=pairs,
        unknown_labels=sorted(set(request.unknown_labels)),
        verification=verification,
        hardest=hardest(found, query_labels, *(decided or (hit_labels, hit_scores)),
                        query_ids),
        note=("mated: the query's label has gallery items; non-mated: it has none. A mate "
              f"below rank {depth} counts as not returned. TAR@FAR scores the query-candidate "
              f"pairs returned ({pairs})"
              + ("" if pairs == "all" else "; pairs beyond them are not scored, so FAR is a "
                                           "share of the scored pairs")),
    )
    return report


def hardest(found: OpenSetSearches, query_labels: Sequence[str],
            hit_labels: Sequence[Sequence[str]], hit_scores: Sequence[Sequence[float]],
            query_ids: Sequence[int] | None = None,
            limit: int = HARDEST) -> dict[str, list[dict[str, Any]]]:
    """The non-mated queries with the highest top scores and the mated ones with the lowest
    best-mate scores (a mate not returned first), at most ``limit`` of each.

    Each entry: ``{index, query_id, label, top_label, top_score, mate_score}``; a score is
    ``None`` when no such candidate was returned (``mate_score`` always, for a non-mated
    query). At a threshold ``T`` the decision on a query names ``top_label`` when
    ``top_score >= T``, else nobody; a mated query is a miss (FNIR) when ``mate_score < T``.
    """
    def entry(q: int) -> dict[str, Any]:
        kept = [(score, label) for label, score in zip(hit_labels[q], hit_scores[q],
                                                        strict=True) if label != DELETED]
        top_label = max(kept, key=lambda pair: pair[0])[1] if kept else None
        top, mate = float(found.top_score[q]), float(found.mate_score[q])
        return {"index": q, "query_id": int(query_ids[q]) if query_ids is not None else None,
                "label": str(query_labels[q]), "top_label": top_label,
                "top_score": top if np.isfinite(top) else None,
                "mate_score": mate if np.isfinite(mate) else None}

    mated = np.flatnonzero(found.mated)
    non = np.flatnonzero(~found.mated)
    # Stable sorts: ties keep query order, so the lists are reproducible.
    non = non[np.argsort(-found.top_score[non], kind="stable")][:limit]
    mated = mated[np.argsort(found.mate_score[mated], kind="stable")][:limit]
    return {"non_mated": [entry(int(q)) for q in non],
            "mated": [entry(int(q)) for q in mated]}


def _finite_det(det: dict[str, list[float]]) -> dict[str, list[float | None]]:
    """The DET curve with its infinite thresholds (above every score: nothing accepted;
    below every score of an empty list) as ``None``: JSON has no infinity."""
    return {**det, "threshold": [t if np.isfinite(t) else None for t in det["threshold"]]}


def fnir_comparison(a: OpenSetSearches, b: OpenSetSearches, fpir: float, *, bootstrap: int,
                    seed: int, min_effect: float) -> dict[str, Any]:
    """B's FNIR against A's on the same queries, each at its own threshold for ``fpir``
    (:func:`imgret.metrics.openset.paired_fnir_difference`), with a verdict on B: "worse"
    when the interval of B − A lies above 0 and B − A is at least ``min_effect`` (more
    misses), "better" when it lies below 0 by at least that, otherwise "no detectable
    difference"; "unresolved" when the interval cannot be computed.

    Raises:
        ValueError: not the same queries, a kind of query missing, or too few non-mated ones.
    """
    result = paired_fnir_difference(a, b, fpir, resamples=bootstrap, seed=seed)
    difference, interval = result["difference"], result["ci95"]
    if interval is None:
        verdict = "unresolved"
    elif interval[0] > 0 and difference >= min_effect:
        verdict = "worse"
    elif interval[1] < 0 and difference <= -min_effect:
        verdict = "better"
    else:
        verdict = "no detectable difference"
    return {**result, "metric": "fnir", "min_effect": min_effect, "verdict": verdict}


def fnir_gate(comparison: dict[str, Any]) -> tuple[bool, str]:
    """``require=fnir_not_worse`` on :func:`fnir_comparison` of the active version (A) and a
    candidate (B): allowed unless B's FNIR is worse, and not when the comparison cannot be
    resolved (a gate that cannot tell does not let a candidate through).

    Returns:
        ``(allowed, message)`` with both FNIRs, the difference and its interval.
    """
    interval = comparison["ci95"]
    shown = (f"[{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval is not None
             else "unresolved")
    message = (f"FNIR at FPIR {comparison['fpir']:g} {comparison['verdict']}: A "
               f"{comparison['a']['fnir']:.4f} (threshold {comparison['a']['threshold']:.6g}),"
               f" B {comparison['b']['fnir']:.4f} (threshold "
               f"{comparison['b']['threshold']:.6g}), B - A = "
               f"{comparison['difference']:+.4f}, 95% interval {shown} over "
               f"{comparison['num_paired']} queries")
    if comparison["verdict"] == "unresolved":
        return False, message + " (too few non-mated queries in too many resamples)"
    return comparison["verdict"] != "worse", message
