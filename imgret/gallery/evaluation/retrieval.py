"""Evaluation through the serving path: rank a labelled query set with the Searcher (same index
and filters as /search) and score the rankings with ``imgret.metrics.ranking_metrics``.

Shared by ``POST /evaluate`` and ``imgret evaluate``.

Protocol details the architecture leaves open:

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
- Open-set decisions (``report["open_set"]``, :mod:`imgret.gallery.evaluation.open_set`): when the
  queries are both mated (their label has gallery items) and non-mated (it has none), or
  when asked, FPIR / FNIR at target FPIRs with their thresholds, rank-1 identification, the
  DET curve and TAR@FAR, from the same rankings. Non-mated queries have R = 0, so the
  closed-set metrics skip them as before. FPIR, FNIR, rank-1 identification and the DET
  curve are decided on the **identity score** (``report["open_set"]["score"]``): each
  ranked label scored by its template over the items the query may see
  (:mod:`imgret.gallery.search.identities`; measured better than the best item in
  docs/identities.md), as ``/identify`` decides; a re-ranked evaluation decides on the
  re-ranked item scores (``best``). TAR@FAR scores query-item pairs.
- Re-ranking (``rerank``, :mod:`imgret.gallery.search.rerank`): the rankings come from the
  Searcher's re-ranked search, everything else is unchanged. Under the re-ID rule the same-camera
  matches are outside the query's gallery, so they take no part in its neighbourhood graph (stricter
  than torchreid, which re-ranks with them and drops them afterwards). A re-ranked evaluation
  describes a search option, not the model, so callers do not record it as the version's last
  evaluation; ``report["rerank"]`` names the method and its parameters (``null``: plain).

Per-label breakdown (``report["per_label"]``), over the evaluated queries only (R = 0 ones are
skipped, as everywhere): one entry per query label with ``count`` (its evaluated queries),
``map_at_r`` (the mean of their per-query AP@R), ``precision_at_1`` (the fraction whose first
hit has the label) and ``confusions``. Confusions: the top-R hits of each query of the label
(R = that query's num_relevant, capped at the ranking depth and at the hits returned) whose
label differs from the query's, counted per hit label over all the label's queries; the 5
most frequent, ties by label. A hit deleted while the evaluation ran has no label and is not
counted. Entries are sorted worst first: lowest ``map_at_r``, ties by label.

Comparing two versions and the activation gate: :mod:`imgret.gallery.evaluation.comparison`.
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
from imgret.gallery.evaluation import open_set as open_set_evaluation
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.search import Hit, Searcher, SearchFilter
from imgret.gallery.search.identities import BEST, DECISION_SCORE, TEMPLATE, IdentityGroup
from imgret.gallery.search.rerank import Rerank, rerank_options, rerank_summary
from imgret.gallery.storage import item_store, query_set_store
from imgret.gallery.storage.tables import QueryItem
from imgret.gallery.versions import version_store
from imgret.images import DEFAULT_MAX_PIXELS, DecodeLimits, embed_encoded
from imgret.metrics import ranking_metrics
from imgret.metrics.openset import OpenSetSearches

logger = logging.getLogger(__name__)


OpenSetRequest = open_set_evaluation.OpenSetRequest


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


# Confusions listed per label in ``per_label``.
CONFUSIONS_PER_LABEL = 5



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
    media: MediaBackend | None = None, max_pixels: int = DEFAULT_MAX_PIXELS,
) -> QueryBatch:
    """A named query set (``imgret ingest --query-set NAME``) with its vectors for a version.

    Stored query embeddings of ``model_version`` are used. When there are none and
    ``embedder`` is that version's model, the stored query images are embedded now (nothing is
    written: evaluation is read-only).

    Raises:
        GalleryError: no such query set or model version.
        EvaluationError: no stored embeddings for the version and no model to make them.
    """
    version = version_store.get_model_version(session=session, version=model_version)
    try:
        items, vectors = query_set_store.load_query_set(name, session=session,
                                                        model_version=version)
    except GalleryError:
        items, _ = query_set_store.load_query_set(name, session=session)  # unknown name raises here
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
            _read_stored(media, items), embedder=embedder,
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


def _read_stored(media: MediaBackend, items: Sequence[QueryItem]) -> list[bytes]:
    blobs: list[bytes] = []
    for item, data in zip(items, media.read_many([item.media_path for item in items]),
                          strict=True):
        if data is None:
            # The store lost bytes a row still refers to (files removed by hand, a backend
            # switched without moving the images): the set cannot be evaluated as it is.
            raise EvaluationError(
                f"the stored image of query item {item.id} is missing from the "
                f"{media.backend} media store (IMGRET_MEDIA_BACKEND); ingest the query set "
                "again"
            )
        blobs.append(data)
    return blobs


def evaluate_query_set(
    searcher: Searcher, name: str, *, session_factory: sessionmaker[Session],
    embedder: Embedder | None = None, media: MediaBackend | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False, worst: int = 0, rerank: Rerank | str | None = None,
    open_set: OpenSetRequest | None = None,
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
                    worst=worst, rerank=rerank, session_factory=session_factory,
                    open_set=open_set)


@dataclass(frozen=True)
class Evaluation:
    """The report of :func:`evaluate` and the per-query values behind it.

    Attributes:
        report: JSON-ready metrics (see :func:`evaluate`).
        per_query: ``ranking_metrics``'s per-query lists (used to pair two model versions).
        searches: every query's open-set summary (top score, best mate score), in query
            order, whether or not the report has an ``open_set`` section (used to pair two
            versions' FNIR and to calibrate a threshold).
    """

    report: dict[str, Any]
    per_query: dict[str, list]
    searches: OpenSetSearches | None = None


def evaluate(
    searcher: Searcher, queries: QueryBatch, *, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False, worst: int = 0, bootstrap: int = BOOTSTRAP,
    seed: int = SEED, rerank: Rerank | str | None = None,
    session_factory: sessionmaker[Session] | None = None,
    open_set: OpenSetRequest | None = None,
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
        rerank: re-rank every query's results (``Searcher.search``'s ``rerank``).
        session_factory: the gallery database, asked only when ``searcher`` holds no vector,
            to say whether the gallery is empty or the version is not embedded yet.
        open_set: the open-set section's options (default: added when the queries are both
            mated and non-mated, at FPIRs 0.1, 0.01, 0.001; see
            :mod:`imgret.gallery.evaluation.open_set`).

    Returns:
        In ``report``: ``imgret.metrics.ranking_metrics``'s report plus ``protocol``,
        ``model_version``, ``index_factory``, ``query_set``, ``gallery_size``, ``depth``,
        ``rerank`` (the method and its parameters, ``None`` for a plain search),
        ``per_label`` (see the module docstring: ``[{label, count, map_at_r,
        precision_at_1, confusions: [{label, count}]}]``, worst first) and (with
        ``worst``) ``worst``: a list of ``{index, label, camera, query_id,
        average_precision_at_r, first_relevant_rank, neighbours: [{id, label, score,
        relevant}]}``; ``open_set`` (:func:`imgret.gallery.evaluation.open_set.section`) when the
        queries are mated and non-mated or it is asked for.

    Raises:
        EvaluationError: an empty gallery, k over the gallery size, cameras missing for the
            re-ID rule, no query with a relevant gallery item, or an open-set request the
            queries cannot answer (declared unknown labels that are not query labels or
            that the gallery holds; ``open_set`` required without both kinds of query).
    """
    try:
        option = rerank_options(rerank)
    except ValueError as exc:
        raise EvaluationError(str(exc)) from None
    request = open_set or OpenSetRequest()
    rankings = rank_queries(searcher, queries, k=k, exclude_same_camera=exclude_same_camera,
                            rerank=option, session_factory=session_factory,
                            unknown_labels=request.unknown_labels)
    scores = [[hit.score for hit in row] for row in rankings.hits]
    decided_on = BEST if option is not None else DECISION_SCORE
    decided = None
    if decided_on == TEMPLATE:
        decided = identity_candidates(searcher, queries, rankings)
        found = open_set_evaluation.searches(queries.labels, *decided, rankings.num_relevant)
    else:
        found = open_set_evaluation.searches(queries.labels, rankings.labels, scores,
                                             rankings.num_relevant)
    try:
        with_open_set = open_set_evaluation.wanted(request, found)
    except ValueError as exc:
        raise EvaluationError(str(exc)) from None
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
        rerank=option.describe() if option is not None else None,
    )
    report["per_label"] = _per_label(per_query, rankings, queries)
    if worst > 0:
        report["worst"] = _worst(per_query, rankings, queries, worst)
    report["open_set"] = None
    if with_open_set:
        report["open_set"] = open_set_evaluation.section(
            found, queries.labels, rankings.labels, scores, request=request,
            depth=rankings.depth, gallery_size=rankings.gallery_size, bootstrap=bootstrap,
            seed=seed, query_ids=queries.ids, decided=decided)
        report["open_set"]["score"] = decided_on
    return Evaluation(report, per_query, found)


def identity_candidates(searcher: Searcher, queries: QueryBatch, rankings: Rankings
                        ) -> tuple[list[list[str]], list[list[float]]]:
    """Per query, the labels among its ranked items scored by their templates (over the
    items its filter lets it see), best first: what an open-set decision is made on."""
    cache: dict[str, np.ndarray | None] = {}
    labels: list[list[str]] = []
    scores: list[list[float]] = []
    filters = rankings.filters or [None] * len(rankings.hits)
    for vector, row, flt in zip(queries.vectors, rankings.hits, filters, strict=True):
        group = IdentityGroup(max(1, len(row)), 1, TEMPLATE)
        found = searcher.identities(vector, row, group, flt, templates=cache)
        labels.append([identity.label for identity in found])
        scores.append([identity.score for identity in found])
    return labels, scores


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
    filters: list[SearchFilter | None] | None = None


def rank_queries(
    searcher: Searcher, queries: QueryBatch, *, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False, rerank: Rerank | None = None,
    session_factory: sessionmaker[Session] | None = None, unknown_labels: Sequence[str] = (),
) -> Rankings:
    """Search every query at the evaluation depth (see the module docstring).

    ``unknown_labels`` are checked against the query labels and the gallery before anything
    is searched (:func:`imgret.gallery.evaluation.open_set.check_unknown_labels`).

    The gallery of the evaluation is the index's live ids when it starts: items added while
    it runs are left out of the rankings, items deleted while it runs count in R but can no
    longer be ranked (they lower the numbers slightly instead of making them inconsistent).
    """
    ids = searcher.ids()
    gallery_size = len(ids)
    if gallery_size == 0:
        raise EvaluationError(_nothing_to_rank(searcher.model_version, session_factory))
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
    if unknown_labels:
        try:
            open_set_evaluation.check_unknown_labels(unknown_labels, queries.labels,
                                                     label_count)
        except ValueError as exc:
            raise EvaluationError(str(exc)) from None

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
        rows = searcher.search(queries.vectors[start:stop], depth, filters[start:stop],
                               rerank=rerank)
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
    if rerank is not None:
        protocol += f"; {rerank_summary(rerank)}"
    return Rankings(hits, relevance, num_relevant, hit_labels, ks, depth, gallery_size, protocol,
                    filters)


def _nothing_to_rank(version: str, session_factory: sessionmaker[Session] | None) -> str:
    """Why an index holds no vector: an empty gallery, or a version not embedded yet (its
    index is empty while the gallery is not); without a database, both are named."""
    embed = (f"embed it first (POST /models/{version}/embed or `imgret models embed "
             f"{version}`)")
    if session_factory is None:
        return (f"model version {version} has no vectors to rank against: the gallery is "
                f"empty (add items with POST /gallery), or the version is not embedded; "
                f"{embed}")
    with session_factory() as session:
        _, live = item_store.list_items(session=session, limit=1)
    if live == 0:
        return "the gallery is empty: add items (POST /gallery) first"
    return (f"model version {version} has no vectors of the {live} gallery items: {embed}")


def _within(sorted_ids: np.ndarray, row: list[Hit]) -> list[Hit]:
    """The hits whose id is in ``sorted_ids`` (one vectorised look-up per ranking)."""
    if not row:
        return row
    found = np.fromiter((hit.id for hit in row), np.int64, len(row))
    position = np.minimum(np.searchsorted(sorted_ids, found), len(sorted_ids) - 1)
    keep = sorted_ids[position] == found
    return row if keep.all() else [hit for hit, ok in zip(row, keep.tolist(), strict=True) if ok]


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


def _per_label(per_query: dict[str, list], rankings: Rankings,
               queries: QueryBatch) -> list[dict[str, Any]]:
    """``report["per_label"]`` (see the module docstring): per-label sums by ``bincount``;
    the only per-hit work is a look-up of each wrong-label hit in the top R."""
    index = np.asarray(per_query["query_index"], dtype=np.int64)
    n = len(index)
    if n == 0:
        return []
    names, code = np.unique(np.asarray(queries.labels, dtype=object)[index],
                            return_inverse=True)
    code = code.reshape(-1)
    size = len(names)
    count = np.bincount(code, minlength=size)
    map_sum = np.bincount(code, np.asarray(per_query["map_at_r"], dtype=np.float64), size)
    first_hit = np.fromiter((f == 1 for f in per_query["first_relevant_rank"]), bool, n)
    p1_sum = np.bincount(code, first_hit, size)

    # Top R of each query, capped at the hits it got (at most the depth).
    returned = np.fromiter((len(rankings.hits[q]) for q in index.tolist()), np.int64, n)
    top = np.minimum(np.asarray(per_query["num_relevant"], dtype=np.int64), returned)
    pairs: Counter[tuple[int, str]] = Counter()
    width = int(top.max())
    if width > 0:
        wrong = ~rankings.relevance[index, :width] & (np.arange(width) < top[:, None])
        rows, ranks = np.nonzero(wrong)
        hit_labels = [rankings.labels[q][r]
                      for q, r in zip(index[rows].tolist(), ranks.tolist(), strict=True)]
        pairs.update(zip(code[rows].tolist(), hit_labels, strict=True))
    confused: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for (c, label), times in pairs.items():
        if label != _DELETED:
            confused[c].append((label, times))

    entries = []
    for c in range(size):
        top_confusions = sorted(confused[c], key=lambda pair: (-pair[1], pair[0]))
        entries.append({
            "label": str(names[c]),
            "count": int(count[c]),
            "map_at_r": float(map_sum[c] / count[c]),
            "precision_at_1": float(p1_sum[c] / count[c]),
            "confusions": [{"label": label, "count": times}
                           for label, times in top_confusions[:CONFUSIONS_PER_LABEL]],
        })
    entries.sort(key=lambda entry: (entry["map_at_r"], entry["label"]))
    return entries


# The label of an id deleted mid-evaluation: not relevant, and no confusion.
_DELETED = open_set_evaluation.DELETED


def _label(searcher: Searcher, item_id: int) -> str:
    info = searcher.info(item_id)
    # An id deleted mid-evaluation counts as not relevant (it is no longer in the gallery).
    return info.label if info is not None else _DELETED
