"""Open-set decisions: "this identity, or nobody", measured as face and re-ID evaluations do.

A lookup against a gallery answers a label only when its best score reaches a threshold
``T``; below it the answer is *unknown*. Two kinds of search measure such a rule (NIST FRVT
1:N, "Face Recognition Vendor Test Part 2: Identification", NISTIR 8271):

* a **mated** search is for an identity the gallery holds; it fails when no candidate of
  that identity scores ``>= T`` among the returned candidates:
  ``FNIR(T) = #{mated: best mate score < T} / #mated``;
* a **non-mated** search is for an identity the gallery does not hold; it is a false alarm
  when any candidate scores ``>= T``: ``FPIR(T) = #{non-mated: top score >= T} / #non-mated``.

``T`` is chosen for a target FPIR from the non-mated searches (:func:`threshold_at_fpir`);
FNIR is then read at it. The rank-1 identification rate above threshold (``DIR(1, T)``)
counts mated searches whose top candidate is a mate and scores ``>= T``: what a decision
that names the top label gets right. The DET curve is FNIR against FPIR over every ``T``.

1:1 verification (IJB-C's protocol) scores pairs instead of searches: the true accept rate
at a false accept rate, ``TAR@FAR``, from the scores of same-label (genuine) and
different-label (impostor) pairs; :func:`tar_at_far` equals the largest true-positive rate
of scikit-learn's ``roc_curve`` whose false-positive rate is ``<= FAR`` (the oracle test).

A target rate ``f`` needs at least ``1 / f`` non-mated searches (impostor pairs) to be
resolved: with fewer, no threshold can show a rate between 0 and ``f``, and the figure is
reported as ``None`` rather than a number that only says the set was small.

Intervals: a percentile bootstrap over searches, resampling whole identities when a
``group`` (the query's label) repeats, since searches of one identity are not independent;
each resample re-derives the threshold, so the interval of FNIR at a target FPIR includes
the uncertainty of the threshold itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Target rates reported by default (FRVT's operating points).
DEFAULT_RATES = (0.1, 0.01, 0.001)
_TAILS_95 = [2.5, 97.5]
# The DET curve is reported at most at this many points (log-spaced in FPIR).
DET_POINTS = 200


@dataclass(frozen=True)
class OpenSetSearches:
    """The per-search summary that every open-set figure is computed from.

    Attributes:
        top_score: ``(n,)`` best score of any returned candidate (``-inf``: none returned).
        mate_score: ``(n,)`` best score of a returned candidate with the search's identity
            (``-inf``: none, and always for a non-mated search).
        top_is_mate: ``(n,)`` the top candidate has the search's identity.
        mated: ``(n,)`` the gallery holds the search's identity.
        group: ``(n,)`` int identity of each search, for the clustered bootstrap.
    """

    top_score: np.ndarray
    mate_score: np.ndarray
    top_is_mate: np.ndarray
    mated: np.ndarray
    group: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.mated)
        for name in ("top_score", "mate_score", "top_is_mate", "group"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, not {n}")
        if not np.all(self.mated[self.top_is_mate]):
            raise ValueError("a non-mated search cannot have a mate on top")
        if np.isnan(self.top_score).any() or np.isnan(self.mate_score).any():
            raise ValueError("scores must not be NaN")

    @classmethod
    def from_candidates(cls, query_labels: Sequence, candidate_labels: Sequence[Sequence],
                        candidate_scores: Sequence[Sequence[float]],
                        gallery_labels: set) -> OpenSetSearches:
        """From ranked candidate lists (best first), as a search returns them.

        Args:
            query_labels: each search's identity.
            candidate_labels, candidate_scores: per search, the returned candidates' labels
                and scores, best first (the lists may be empty).
            gallery_labels: every label the gallery holds (decides mated / non-mated).
        """
        n = len(query_labels)
        if len(candidate_labels) != n or len(candidate_scores) != n:
            raise ValueError("one candidate list per query is needed")
        top = np.full(n, -np.inf)
        mate = np.full(n, -np.inf)
        top_is_mate = np.zeros(n, bool)
        mated = np.array([label in gallery_labels for label in query_labels], dtype=bool)
        for i, (label, labels, scores) in enumerate(
                zip(query_labels, candidate_labels, candidate_scores, strict=True)):
            if len(labels) != len(scores):
                raise ValueError(f"query {i}: {len(labels)} labels but {len(scores)} scores")
            if len(scores):
                top[i] = max(scores)
                top_is_mate[i] = labels[int(np.argmax(scores))] == label
            mates = [s for lab, s in zip(labels, scores, strict=True) if lab == label]
            if mates:
                mate[i] = max(mates)
        _, group = np.unique(np.asarray([str(q) for q in query_labels], dtype=object),
                             return_inverse=True)
        return cls(top, mate, top_is_mate, mated, group.astype(np.int64))


def _check_rate(rate: float, what: str) -> float:
    rate = float(rate)
    if not 0.0 < rate < 1.0:
        raise ValueError(f"{what} must lie in (0, 1), got {rate}")
    return rate


def threshold_at_rate(negative_scores: np.ndarray, rate: float,
                      weights: np.ndarray | None = None) -> float | None:
    """The lowest threshold whose false-alarm share among ``negative_scores`` is ``<= rate``
    (a score ``>= T`` alarms); ``None`` when fewer than ``1 / rate`` negatives (weighted)
    cannot resolve the rate.

    At most ``floor(rate * n)`` negatives may alarm, so ``T`` lies just above the next one:
    ``nextafter`` of the (allowed + 1)-th highest score, which also keeps ties below it.
    """
    rate = _check_rate(rate, "the target rate")
    scores = np.asarray(negative_scores, dtype=np.float64)
    w = np.ones(len(scores)) if weights is None else np.asarray(weights, dtype=np.float64)
    total = w.sum()
    if total * rate < 1.0:
        return None
    order = np.argsort(-scores, kind="stable")
    cum = np.cumsum(w[order])
    allowed = np.floor(rate * total + 1e-9)
    k = int(np.searchsorted(cum, allowed, side="right"))
    return float(np.nextafter(scores[order][k], np.inf))


def threshold_at_fpir(searches: OpenSetSearches, fpir: float) -> float | None:
    """The threshold that holds FPIR at or below ``fpir`` on these non-mated searches."""
    return threshold_at_rate(searches.top_score[~searches.mated], fpir)


def fpir_at(searches: OpenSetSearches, threshold: float) -> float:
    non = searches.top_score[~searches.mated]
    if not len(non):
        raise ValueError("FPIR needs non-mated searches")
    return float(np.mean(non >= threshold))


def fnir_at(searches: OpenSetSearches, threshold: float) -> float:
    mate = searches.mate_score[searches.mated]
    if not len(mate):
        raise ValueError("FNIR needs mated searches")
    return float(np.mean(mate < threshold))


def rank1_dir_at(searches: OpenSetSearches, threshold: float) -> float:
    """Mated searches whose top candidate is a mate scoring ``>= threshold``."""
    m = searches.mated
    if not m.any():
        raise ValueError("identification needs mated searches")
    return float(np.mean(searches.top_is_mate[m] & (searches.top_score[m] >= threshold)))


def det_curve(searches: OpenSetSearches,
              points: int = DET_POINTS) -> dict[str, list[float]]:
    """FNIR against FPIR over every threshold (a non-mated top score), thinned to at most
    ``points`` entries spread evenly in log FPIR, the DET plot's axis."""
    non = np.sort(searches.top_score[~searches.mated])[::-1]
    mate = np.sort(searches.mate_score[searches.mated])
    if not len(non) or not len(mate):
        raise ValueError("a DET curve needs mated and non-mated searches")
    finite = non[np.isfinite(non)]
    thresholds = np.unique(np.concatenate([finite, [np.inf]]))[::-1]
    fpir = np.searchsorted(-non, -thresholds, side="right") / len(non)
    fnir = np.searchsorted(mate, thresholds, side="left") / len(mate)
    if len(thresholds) > points:
        targets = np.geomspace(max(fpir[fpir > 0].min(), 1e-9), 1.0, points - 1)
        keep = np.unique(np.concatenate([[0], np.searchsorted(fpir, targets, side="left")
                                         .clip(0, len(fpir) - 1)]))
        thresholds, fpir, fnir = thresholds[keep], fpir[keep], fnir[keep]
    return {"threshold": [float(t) for t in thresholds], "fpir": fpir.tolist(),
            "fnir": fnir.tolist()}


def tar_at_far(genuine: np.ndarray, impostor: np.ndarray, far: float) -> float | None:
    """True accept rate at a false accept rate, from same-label and different-label pair
    scores; ``None`` when fewer than ``1 / far`` impostor pairs."""
    genuine = np.asarray(genuine, dtype=np.float64)
    if not len(genuine):
        raise ValueError("TAR needs same-label pairs")
    threshold = threshold_at_rate(np.asarray(impostor, dtype=np.float64), far)
    return None if threshold is None else float(np.mean(genuine >= threshold))


def _cluster_weights(group: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """``(resamples, n)`` draw counts per search, resampling whole groups with replacement."""
    _, inverse = np.unique(group, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_groups, size=(resamples, n_groups))
    if not resamples:
        return np.zeros((0, len(group)))
    counts = np.stack([np.bincount(d, minlength=n_groups) for d in draws])
    return counts[:, inverse].astype(np.float64)


def _interval(values: list[float | None]) -> list[float] | None:
    kept = np.array([v for v in values if v is not None], dtype=np.float64)
    if not len(values):
        return None  # no resamples asked for
    # A resample that cannot resolve the rate says the interval cannot be trusted either.
    if len(kept) < 0.95 * len(values):
        return None
    low, high = np.percentile(kept, _TAILS_95)
    return [float(low), float(high)]


def _weighted_share_below(sorted_scores: np.ndarray, cum_weights: np.ndarray,
                          threshold: float) -> float:
    i = int(np.searchsorted(sorted_scores, threshold, side="left"))
    return float(cum_weights[i - 1] / cum_weights[-1]) if i else 0.0


def open_set_report(searches: OpenSetSearches, *, fpirs: Sequence[float] = DEFAULT_RATES,
                    resamples: int = 1000, seed: int = 0) -> dict:
    """Every open-set figure of the searches, each with its bootstrap 95% interval (``None``
    with ``resamples=0``).

    Returns:
        ``{"mated": n, "non_mated": n, "operating_points": [{"fpir": f, "threshold", "fnir",
        "rank1_identification", "fpir_measured", each {"value", "ci95"}}], "det": {...}}``;
        an operating point that the non-mated searches cannot resolve has ``None`` values
        and says so in ``"note"``.
    """
    mated = searches.mated
    n_mated, n_non = int(mated.sum()), int((~mated).sum())
    if not n_mated or not n_non:
        raise ValueError("an open-set evaluation needs mated and non-mated searches "
                         f"(got {n_mated} mated, {n_non} non-mated)")
    if resamples < 0:
        raise ValueError("resamples must be >= 0 (0: no intervals)")
    weights = _cluster_weights(searches.group, resamples, seed)
    non_scores = searches.top_score[~mated]
    mate_order = np.argsort(searches.mate_score[mated], kind="stable")
    mate_sorted = searches.mate_score[mated][mate_order]
    top_ok = searches.top_is_mate[mated]
    points = []
    for f in fpirs:
        f = _check_rate(f, "a target FPIR")
        threshold = threshold_at_fpir(searches, f)
        if threshold is None:
            points.append({"fpir": f, "threshold": None, "fnir": None,
                           "rank1_identification": None, "fpir_measured": None,
                           "note": f"needs >= {int(np.ceil(1 / f))} non-mated searches, "
                                   f"has {n_non}"})
            continue
        boot: dict[str, list[float | None]] = {"threshold": [], "fnir": [],
                                               "rank1_identification": [], "fpir_measured": []}
        for w in weights:
            w_non, w_mate = w[~mated], w[mated]
            if not w_mate.sum() or not w_non.sum():
                for key in boot:
                    boot[key].append(None)
                continue
            t = threshold_at_rate(non_scores, f, w_non)
            boot["threshold"].append(t)
            if t is None:
                for key in ("fnir", "rank1_identification", "fpir_measured"):
                    boot[key].append(None)
                continue
            cum = np.cumsum(w_mate[mate_order])
            boot["fnir"].append(_weighted_share_below(mate_sorted, cum, t))
            hit = top_ok & (searches.top_score[mated] >= t)
            boot["rank1_identification"].append(float(w_mate[hit].sum() / w_mate.sum()))
            boot["fpir_measured"].append(float(w_non[non_scores >= t].sum() / w_non.sum()))
        values = {"threshold": threshold, "fnir": fnir_at(searches, threshold),
                  "rank1_identification": rank1_dir_at(searches, threshold),
                  "fpir_measured": fpir_at(searches, threshold)}
        points.append({"fpir": f, **{key: {"value": value, "ci95": _interval(boot[key])}
                                     for key, value in values.items()}})
    return {"mated": n_mated, "non_mated": n_non, "resamples": resamples,
            "operating_points": points, "det": det_curve(searches)}


def verification_report(genuine: np.ndarray, impostor: np.ndarray, *,
                        genuine_group: np.ndarray, impostor_group: np.ndarray,
                        fars: Sequence[float] = DEFAULT_RATES, resamples: int = 1000,
                        seed: int = 0) -> dict:
    """TAR at each FAR from pair scores, with a bootstrap interval over the queries the pairs
    come from (``*_group``: the query, or the query's identity, of each pair; a group's pairs
    move together).

    The impostor scores are sorted once: a resample only re-weighs them, and only the top of
    the sorted list can hold a threshold (at most a ``max(fars)`` share of the weight lies
    above it), so each resample sums the weights of that top part alone (the whole list when
    a heavy resample needs more). Same numbers as :func:`threshold_at_rate` per resample.
    """
    genuine = np.asarray(genuine, dtype=np.float64)
    impostor = np.asarray(impostor, dtype=np.float64)
    fars = [_check_rate(far, "a target FAR") for far in fars]
    groups = np.concatenate([genuine_group, impostor_group])
    _, inverse = np.unique(groups, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    g_idx, i_idx = inverse[: len(genuine)], inverse[len(genuine):]
    rng = np.random.default_rng(seed)
    counts = [np.bincount(rng.integers(0, n_groups, n_groups), minlength=n_groups)
              for _ in range(resamples)]
    order = np.argsort(-impostor, kind="stable")
    sorted_impostor, sorted_group = impostor[order], i_idx[order]
    # The top share of the sorted impostors that a threshold lies in for every resample but
    # a rare heavy one (twice the largest FAR, plus slack for small sets).
    head = min(len(impostor), int(np.ceil(2 * max(fars, default=0) * len(impostor))) + 64)
    boot: dict[float, list[float | None]] = {far: [] for far in fars}
    for c in counts:
        wg = c[g_idx].astype(np.float64)
        total = float(c[i_idx].sum()) if len(i_idx) else 0.0
        cum = np.cumsum(c[sorted_group[:head]], dtype=np.float64)
        for far in fars:
            t = None
            if total and total * far >= 1.0 and wg.sum():
                allowed = np.floor(far * total + 1e-9)
                if not len(cum) or cum[-1] <= allowed:
                    cum = np.cumsum(c[sorted_group], dtype=np.float64)
                k = int(np.searchsorted(cum, allowed, side="right"))
                t = float(np.nextafter(sorted_impostor[k], np.inf))
            boot[far].append(None if t is None else float(wg[genuine >= t].sum() / wg.sum()))
    out = []
    for far in fars:
        value = tar_at_far(genuine, impostor, far)
        if value is None:
            out.append({"far": far, "tar": None,
                        "note": f"needs >= {int(np.ceil(1 / far))} different-label pairs, "
                                f"has {len(impostor)}"})
            continue
        out.append({"far": far, "tar": {"value": value, "ci95": _interval(boot[far])}})
    return {"genuine_pairs": len(genuine), "impostor_pairs": len(impostor), "points": out}


def paired_fnir_difference(a: OpenSetSearches, b: OpenSetSearches, fpir: float, *,
                           resamples: int = 1000, seed: int = 0) -> dict:
    """FNIR of ``b`` minus FNIR of ``a`` on the same searches, each at its own threshold for
    the target ``fpir``, with a paired bootstrap 95% interval.

    Every resample draws identities once for both sides (``a.group``) and re-derives both
    thresholds from the resampled non-mated searches, so the interval carries the uncertainty
    of each threshold as well as that of the misses, while the between-identity variance
    that both sides share cancels.

    Returns:
        ``{"fpir", "a": {"threshold", "fnir"}, "b": {...}, "difference", "ci95",
        "num_paired", "mated", "non_mated"}`` (``ci95`` ``None`` when too many resamples
        cannot resolve the rate).

    Raises:
        ValueError: searches that are not the same ones (count, mated flags, groups), a set
            without mated or non-mated searches, or too few non-mated searches for ``fpir``.
    """
    fpir = _check_rate(fpir, "the target FPIR")
    if (len(a.mated) != len(b.mated) or not np.array_equal(a.mated, b.mated)
            or not np.array_equal(a.group, b.group)):
        raise ValueError("a paired comparison needs the same searches on both sides")
    mated = a.mated
    n_mated, n_non = int(mated.sum()), int((~mated).sum())
    if not n_mated or not n_non:
        raise ValueError("an open-set comparison needs mated and non-mated searches "
                         f"(got {n_mated} mated, {n_non} non-mated)")
    thresholds = [threshold_at_fpir(s, fpir) for s in (a, b)]
    if thresholds[0] is None or thresholds[1] is None:
        raise ValueError(f"FPIR {fpir:g} needs >= {int(np.ceil(1 / fpir))} non-mated "
                         f"searches, has {n_non}")
    fnirs = [fnir_at(s, t) for s, t in zip((a, b), thresholds, strict=True)]
    boot: list[float | None] = []
    for w in _cluster_weights(a.group, resamples, seed):
        w_non, w_mate = w[~mated], w[mated]
        if not w_mate.sum():
            boot.append(None)
            continue
        rates = []
        for s in (a, b):
            t = threshold_at_rate(s.top_score[~mated], fpir, w_non) if w_non.sum() else None
            if t is None:
                break
            rates.append(float(w_mate[s.mate_score[mated] < t].sum() / w_mate.sum()))
        boot.append(rates[1] - rates[0] if len(rates) == 2 else None)
    return {"fpir": fpir,
            "a": {"threshold": thresholds[0], "fnir": fnirs[0]},
            "b": {"threshold": thresholds[1], "fnir": fnirs[1]},
            "difference": fnirs[1] - fnirs[0], "ci95": _interval(boot),
            "num_paired": len(mated), "mated": n_mated, "non_mated": n_non}
