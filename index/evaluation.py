"""Evaluation through the serving path: rank a labelled query set with the Searcher (same index
and filters as /search) and score the rankings with ``imgret.metrics.ranking_metrics``.

Shared by ``POST /evaluate`` and ``imgret evaluate``.

Protocol details (the contract leaves them to us):

- R (relevant items of a query) = live gallery items of the searcher's model version with the
  query's label, counted from the searcher's own id -> label map, so the ranking and R
  describe the same gallery snapshot. Queries with R = 0 are skipped (``num_skipped``).
- Ranking depth: the whole gallery while queries x gallery <= ``FULL_RANKING_BUDGET``
  (every metric exact); beyond that max(max R, max k), bounded by the gallery size. MAP@R,
  R-Precision, P@1, Recall@K, mAP@k, NDCG@k are exact at that depth, and so is MRR for
  queries with a hit in it. ``mean_average_precision`` is over the full ranking: exact for
  every query whose R relevant items all fall in the top ``depth`` and a lower bound
  otherwise; those queries are counted in ``num_truncated``.
- Re-ID (``exclude_same_camera``): gallery items with the query's label *and* camera are
  removed from its ranking (an ``exclude_ids`` filter, so the index still returns ``depth``
  other items) and from its R: the Market-1501 rule.
- Queries are separate images, never gallery items (``query_in_gallery`` is false).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.errors import GalleryError, ImgretError
from imgret.images import DEFAULT_MAX_PIXELS, DecodeLimits, embed_encoded
from imgret.metrics import ranking_metrics
from imgret.stats import paired_bootstrap_ci
from index import store
from index.media import MediaStore
from index.search import Hit, Searcher, SearchFilter

logger = logging.getLogger(__name__)

DEFAULT_KS = (1, 5, 10)
# Queries searched per index call: bounds the hit lists held at once to chunk x depth.
_QUERY_CHUNK = 512
# ... and at most this many (query, rank) results per call: each call holds the index's
# shared lock, and a gallery write (which needs it exclusively) and every search queued
# behind that write wait for the call to end. ~10 ms of exact search on a CPU.
_RESULTS_PER_CALL = 65_536
# Query x gallery pairs up to which every query ranks the whole gallery (exact mAP).
FULL_RANKING_BUDGET = 2_000_000
# Neighbours listed for each of the worst queries.
WORST_NEIGHBOURS = 10
BOOTSTRAP = 1000
SEED = 0

_PAIRED_METRICS = ("map_at_r", "mean_average_precision", "precision_at_1", "mrr")


class EvaluationError(ImgretError, ValueError):
    """An evaluation request that cannot be answered (no relevant items, k over the gallery
    size, a model version whose query embeddings do not exist, ...)."""


@dataclass(frozen=True)
class QueryBatch:
    """A labelled query set, embedded.

    Attributes:
        vectors: ``(n, d)`` float32, L2-normalised, from the model being evaluated.
        labels: ``n`` labels (strings, as gallery labels are).
        cameras: ``n`` camera ids (re-ID), or ``None``.
        ids: ``n`` query-item ids of a named set (for reports), or ``None``.
        name: the query set's name, ``None`` for an upload.
    """

    vectors: np.ndarray
    labels: Sequence[str]
    cameras: Sequence[int | None] | None = None
    ids: Sequence[int] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        n = len(self.labels)
        if self.vectors.ndim != 2 or len(self.vectors) != n:
            raise EvaluationError(f"{len(self.vectors)} query vectors for {n} labels")
        if self.cameras is not None and len(self.cameras) != n:
            raise EvaluationError(f"{len(self.cameras)} cameras for {n} queries")


def embed_queries(
    images: Sequence[bytes], labels: Sequence[str], *, embedder: Embedder,
    cameras: Sequence[int | None] | None = None, limits: DecodeLimits | None = None,
) -> QueryBatch:
    """Decode and embed uploaded query images with the one Embedder.

    Through :func:`imgret.images.embed_encoded`: the request's decoded pixels are priced from
    the headers before anything is decoded, then one image is decoded at a time, so an upload
    of 2,000 small files that each declare 40 M pixels costs a 413, not gigabytes.

    Args:
        images: the encoded query images.
        labels: one per image.
        embedder: the served model.
        cameras: one per image, or ``None``.
        limits: the service's decoding limits (default: the built-in defaults).

    Raises:
        ImageTooLarge: an image, or the request, over its pixel limit (nothing decoded).
        ImageDecodeError: a bad image; the message starts with ``images[i]``.
    """
    vectors = embed_encoded(images, embedder=embedder, limits=limits or DecodeLimits())
    return QueryBatch(vectors, list(labels), cameras)


def load_query_batch(
    name: str, *, session: Session, model_version: str, embedder: Embedder | None = None,
    media: MediaStore | None = None, max_pixels: int = DEFAULT_MAX_PIXELS,
) -> QueryBatch:
    """A named query set (``imgret ingest --query-set NAME``) with its vectors for a version.

    Stored query embeddings of ``model_version`` are used. When there are none and
    ``embedder`` is that version's model, the stored query images are embedded now (nothing is
    written: evaluation is read-only).

    Raises:
        GalleryError: no such query set or model version.
        EvaluationError: no stored embeddings for the version and no model to make them.
    """
    version = store.get_model_version(session=session, version=model_version)
    try:
        items, vectors = store.load_query_set(name, session=session, model_version=version)
    except GalleryError:
        items, _ = store.load_query_set(name, session=session)  # unknown name raises here
        if embedder is None or media is None or embedder.model_version != version.version:
            raise EvaluationError(
                f"query set {name!r} has no embeddings for model version {version.version}; "
                f"ingest it with that model (imgret ingest PATH --query-set {name} --model ...)"
            ) from None
        logger.info("embedding %d stored queries of %r with %s", len(items), name,
                    version.version)
        # Stored images were checked at ingest: no request budget, but still one image decoded
        # at a time (memory bounded by one image, not by the set).
        vectors = embed_encoded(
            [media.read(item.media_path) for item in items], embedder=embedder,
            limits=DecodeLimits(image_pixels=max_pixels, request_pixels=2**62),
            names=[f"query item {item.id}" for item in items],
        )
    if not items:
        raise EvaluationError(f"query set {name!r} is empty")
    cameras = [item.camera for item in items]
    return QueryBatch(
        vectors=vectors,
        labels=[item.label for item in items],
        cameras=cameras if any(c is not None for c in cameras) else None,
        ids=[item.id for item in items],
        name=name,
    )


def evaluate_query_set(
    searcher: Searcher, name: str, *, session_factory: sessionmaker[Session],
    embedder: Embedder | None = None, media: MediaStore | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False, worst: int = 0,
) -> Evaluation:
    """A named query set, with the vectors of ``searcher``'s model version, ranked through
    ``searcher``: the one code path of ``POST /evaluate {"query_set": ...}`` and
    ``imgret evaluate``. Arguments as :func:`load_query_batch` and :func:`evaluate`."""
    with session_factory() as session:
        queries = load_query_batch(
            name, session=session, model_version=searcher.model_version, embedder=embedder,
            media=media, max_pixels=max_pixels,
        )
    return evaluate(searcher, queries, k=k, exclude_same_camera=exclude_same_camera,
                    worst=worst)


@dataclass(frozen=True)
class Evaluation:
    """The report of :func:`evaluate` and the per-query values behind it.

    Attributes:
        report: JSON-ready metrics (see :func:`evaluate`).
        per_query: ``ranking_metrics``'s per-query lists (used to pair two model versions).
    """

    report: dict[str, Any]
    per_query: dict[str, list]


def evaluate(
    searcher: Searcher, queries: QueryBatch, *, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False, worst: int = 0, bootstrap: int = BOOTSTRAP,
    seed: int = SEED,
) -> Evaluation:
    """Rank every query through ``searcher`` and compute the metric report.

    Args:
        searcher: the served index (or another model version's).
        queries: the embedded, labelled queries (same model version as ``searcher``).
        k: cut-offs of the ``*_at_k`` metrics, each ``1..gallery size``; default 1, 5, 10
            (those not over the gallery size).
        exclude_same_camera: the re-ID rule (needs query cameras).
        worst: also list the ``worst`` queries by AP@R with their top neighbours.
        bootstrap, seed: the ``ci95`` bootstrap (seeded: same input, same interval).

    Returns:
        In ``report``: ``imgret.metrics.ranking_metrics``'s report plus ``protocol``,
        ``model_version``,
        ``index_factory``, ``query_set``, ``gallery_size``, ``depth`` and (with ``worst``)
        ``worst``: a list of ``{index, label, camera, query_id, average_precision_at_r,
        first_relevant_rank, neighbours: [{id, label, score, relevant}]}``.

    Raises:
        EvaluationError: an empty gallery, k over the gallery size, cameras missing for the
            re-ID rule, or no query with a relevant gallery item.
    """
    rankings = rank_queries(searcher, queries, k=k, exclude_same_camera=exclude_same_camera)
    try:
        report = ranking_metrics(
            rankings.relevance, rankings.num_relevant, k=rankings.ks, bootstrap=bootstrap,
            seed=seed, per_query=True,
        )
    except ValueError as exc:
        raise EvaluationError(str(exc)) from None
    per_query = report.pop("per_query")
    report.update(
        protocol=rankings.protocol,
        model_version=searcher.model_version,
        index_factory=searcher.factory,
        query_set=queries.name,
        gallery_size=rankings.gallery_size,
        depth=rankings.depth,
    )
    if worst > 0:
        report["worst"] = _worst(per_query, rankings, queries, worst)
    return Evaluation(report, per_query)


@dataclass(frozen=True)
class Rankings:
    """Top-``depth`` results of every query, and what is relevant in them.

    Attributes:
        hits: per query, its hits best first (at most ``depth``).
        relevance: ``(n, depth)`` bool, ``[i, j]``: rank ``j + 1`` of query ``i`` is relevant.
        num_relevant: ``(n,)`` int64, R per query.
        labels: per query, the labels of its hits.
    """

    hits: list[list[Hit]]
    relevance: np.ndarray
    num_relevant: np.ndarray
    labels: list[list[str]]
    ks: list[int]
    depth: int
    gallery_size: int
    protocol: str


def rank_queries(
    searcher: Searcher, queries: QueryBatch, *, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False,
) -> Rankings:
    """Search every query at the evaluation depth (see the module docstring).

    The gallery of the evaluation is the index's live ids when it starts: items added while
    it runs are left out of the rankings, items deleted while it runs count in R but can no
    longer be ranked (they lower the numbers slightly instead of making them inconsistent).
    """
    ids = searcher.ids()
    gallery_size = len(ids)
    if gallery_size == 0:
        raise EvaluationError("the gallery is empty: add items (POST /gallery) first")
    if k is None:
        k = [v for v in DEFAULT_KS if v <= gallery_size]
    ks = sorted({int(v) for v in k})
    if not ks or ks[0] < 1 or ks[-1] > gallery_size:
        raise EvaluationError(
            f"k must be between 1 and the gallery size ({gallery_size}), got {list(k)}"
        )
    if exclude_same_camera and queries.cameras is None:
        raise EvaluationError("exclude_same_camera needs a camera for every query")

    label_count: Counter[str] = Counter()
    same_camera: dict[tuple[str, int | None], list[int]] = defaultdict(list)
    for item_id in ids.tolist():
        info = searcher.info(item_id)
        if info is None:
            continue  # deleted since ids() was read
        label_count[info.label] += 1
        if exclude_same_camera:
            same_camera[(info.label, info.camera)].append(item_id)

    n = len(queries.labels)
    num_relevant = np.array([label_count[label] for label in queries.labels], dtype=np.int64)
    filters: list[SearchFilter | None] = [None] * n
    if exclude_same_camera:
        excluded: dict[tuple[str, int | None], SearchFilter] = {}
        for i, (label, camera) in enumerate(zip(queries.labels, queries.cameras, strict=True)):
            group = (label, camera)
            if group not in excluded:
                excluded[group] = SearchFilter(exclude_ids=frozenset(same_camera.get(group, ())))
            filters[i] = excluded[group]
            num_relevant[i] -= len(excluded[group].exclude_ids)
    depth = int(min(gallery_size, max(int(num_relevant.max()), ks[-1])))
    if n * gallery_size <= FULL_RANKING_BUDGET:
        # Small enough to rank the whole gallery: mean_average_precision is then exact.
        depth = gallery_size

    hits: list[list[Hit]] = []
    rows_per_call = max(1, min(_QUERY_CHUNK, _RESULTS_PER_CALL // max(depth, 1)))
    for start in range(0, n, rows_per_call):
        stop = min(n, start + rows_per_call)
        rows = searcher.search(queries.vectors[start:stop], depth, filters[start:stop])
        # R was counted on the snapshot ``ids``: an item added since (the gallery stays
        # writable during an evaluation) is not part of this evaluation's gallery. Keeping it
        # would let a ranking list more relevant items than R.
        hits.extend(_within(ids, row) for row in rows)
    relevance = np.zeros((n, depth), dtype=bool)
    hit_labels: list[list[str]] = []
    for i, row in enumerate(hits):
        labels = [_label(searcher, hit.id) for hit in row]
        hit_labels.append(labels)
        relevance[i, : len(row)] = [label == queries.labels[i] for label in labels]
    protocol = (
        "re-id: same-label same-camera gallery items removed from each query's ranking "
        "(Market-1501 rule)"
        if exclude_same_camera
        else "closed-set retrieval: relevant = gallery items with the query's label"
    )
    protocol += f"; ranked through the served index ({searcher.factory}), depth {depth}"
    return Rankings(hits, relevance, num_relevant, hit_labels, ks, depth, gallery_size, protocol)


def _within(sorted_ids: np.ndarray, row: list[Hit]) -> list[Hit]:
    """The hits whose id is in ``sorted_ids`` (one vectorised look-up per ranking)."""
    if not row:
        return row
    found = np.fromiter((hit.id for hit in row), np.int64, len(row))
    position = np.minimum(np.searchsorted(sorted_ids, found), len(sorted_ids) - 1)
    keep = sorted_ids[position] == found
    return row if keep.all() else [hit for hit, ok in zip(row, keep.tolist(), strict=True) if ok]


def compare_versions(
    a: Evaluation, b: Evaluation, *, bootstrap: int = BOOTSTRAP, seed: int = SEED,
) -> dict[str, Any]:
    """B − A on the same queries, with a paired bootstrap 95% interval per metric
    (:func:`imgret.stats.paired_bootstrap_ci`).

    Both must come from :func:`evaluate` on the same query set: per-query values are paired
    by query index (queries evaluated in only one of them are dropped). Resampling the same
    queries for both sides removes the between-query variance that unpaired intervals carry.

    Returns:
        ``{metric: {"a", "b", "difference", "ci95": [low, high], "num_paired"}}`` for MAP@R,
        mAP, P@1 and MRR, and ``"b_better"``: the metrics whose interval lies above 0.
    """
    table_a, table_b = _per_query_table(a.per_query), _per_query_table(b.per_query)
    common = sorted(set(table_a) & set(table_b))
    if not common:
        raise EvaluationError("the two versions have no evaluated query in common")
    va = {m: np.array([table_a[q][m] for q in common]) for m in _PAIRED_METRICS}
    vb = {m: np.array([table_b[q][m] for q in common]) for m in _PAIRED_METRICS}
    low, high = paired_bootstrap_ci(np.column_stack(list(va.values())),
                                    np.column_stack(list(vb.values())), bootstrap, seed)
    out: dict[str, Any] = {}
    for j, metric in enumerate(_PAIRED_METRICS):
        out[metric] = {
            "a": float(va[metric].mean()), "b": float(vb[metric].mean()),
            "difference": float((vb[metric] - va[metric]).mean()),
            "ci95": [float(low[j]), float(high[j])], "num_paired": len(common),
        }
    out["b_better"] = [m for m in _PAIRED_METRICS if out[m]["ci95"][0] > 0]
    out["a_better"] = [m for m in _PAIRED_METRICS if out[m]["ci95"][1] < 0]
    return out


def _per_query_table(per_query: dict[str, list]) -> dict[int, dict[str, float]]:
    table = {}
    for i, query in enumerate(per_query["query_index"]):
        first = per_query["first_relevant_rank"][i]
        table[query] = {
            "map_at_r": per_query["map_at_r"][i],
            "mean_average_precision": per_query["average_precision"][i],
            "precision_at_1": float(first == 1),
            "mrr": 1.0 / first if first else 0.0,
        }
    return table


def _worst(per_query: dict[str, list], rankings: Rankings, queries: QueryBatch,
           n: int) -> list[dict[str, Any]]:
    order = sorted(
        range(len(per_query["query_index"])),
        # Lowest AP@R first; among equals the one whose first hit is deepest (or missing).
        key=lambda j: (per_query["map_at_r"][j],
                       -(per_query["first_relevant_rank"][j] or rankings.depth + 1)),
    )
    out = []
    for j in order[:n]:
        q = per_query["query_index"][j]
        row = rankings.hits[q][:WORST_NEIGHBOURS]
        out.append(
            {
                "index": q,
                "label": queries.labels[q],
                "camera": queries.cameras[q] if queries.cameras is not None else None,
                "query_id": queries.ids[q] if queries.ids is not None else None,
                "average_precision_at_r": per_query["map_at_r"][j],
                "first_relevant_rank": per_query["first_relevant_rank"][j],
                "neighbours": [
                    {"id": hit.id, "label": label, "score": hit.score,
                     "relevant": label == queries.labels[q]}
                    for hit, label in zip(row, rankings.labels[q], strict=False)
                ],
            }
        )
    return out


def _label(searcher: Searcher, item_id: int) -> str:
    info = searcher.info(item_id)
    # An id deleted mid-evaluation counts as not relevant (it is no longer in the gallery).
    return info.label if info is not None else "\x00deleted"


def format_report(report: dict[str, Any]) -> list[str]:
    """Human-readable lines of a report (``imgret evaluate`` prints them): a markdown table of
    every metric with its 95% interval, preceded by the protocol and model version."""
    ci = report.get("ci95") or {}

    def interval(name: str, k: int | None = None) -> str:
        bounds = ci.get(name)
        if bounds is not None and k is not None:
            bounds = bounds.get(k, bounds.get(str(k)))
        return f"[{bounds[0]:.4f}, {bounds[1]:.4f}]" if bounds else ""

    lines = [
        f"query set: {report.get('query_set') or '(upload)'}; model version: "
        f"{report['model_version']}; gallery: {report['gallery_size']} items",
        f"protocol: {report['protocol']}",
        f"queries: {report['num_queries']} ({report['num_skipped']} skipped with R = 0, "
        f"{report['num_truncated']} with relevant items below depth {report['depth']})",
        "",
        "| metric | value | 95% CI |",
        "|---|---:|---|",
    ]
    for name in ("map_at_r", "r_precision", "precision_at_1", "mean_average_precision", "mrr"):
        lines.append(f"| {name} | {report[name]:.4f} | {interval(name)} |")
    for name in ("recall_at_k", "map_at_k", "ndcg_at_k", "recall_fraction_at_k"):
        for k, value in sorted((int(k), v) for k, v in report[name].items()):
            lines.append(f"| {name}@{k} | {value:.4f} | {interval(name, k)} |")
    return lines
