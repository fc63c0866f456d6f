"""The query pipeline of /search: decode, embed and search a batch of uploaded images and
stored items' vectors; re-ranking is finished off the model thread, on a bounded pool."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from imgret.embedder import Embedder
from imgret.errors import ImageDecodeError
from imgret.gallery.evaluation.calibration import Calibration, Decision, decide, no_decision_reason
from imgret.gallery.search import Hit, Searcher, SearchFilter
from imgret.gallery.search.identities import FETCH_MIN, TEMPLATE, Identity, IdentityGroup
from imgret.gallery.search.rerank import Rerank, index_searches
from imgret.gallery.search.threads import limit_pthreads_blas, yielding_to
from imgret.images import (
    DEFAULT_BATCH_PIXELS,
    DecodeGate,
    DecodeLimits,
    PixelBudget,
    preprocess_encoded,
    probe_image,
)
from imgret.service.batching import BatchStages, Deferred, DynamicBatcher
from imgret.service.followups import FollowUp, FollowUpPool
from imgret.service.limits import REQUEST_RERANK_SEARCHES_MAX
from imgret.service.telemetry import ServiceMetrics
from imgret.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    """The served model version: its model, its index and its decision threshold, always
    used together.

    A switch (``POST /models/{v}/activate``, or the follower seeing another process's switch)
    replaces the whole object, and each batch reads it once, so no query is ever embedded by
    one version and searched in another's index, and no decision applies one version's
    threshold to another's scores. A new calibration of the served version replaces it too
    (same model and index, the new threshold).

    Attributes:
        calibration: the version's newest calibration (``None``: it serves no decisions).
    """

    version: str
    embedder: Embedder
    searcher: Searcher
    calibration: Calibration | None = None


@dataclass(frozen=True)
class Answer:
    """The hits of one query (best first) and the :class:`Serving` that produced them (its
    version goes into the response; its searcher resolves the hits' labels)."""

    hits: list[Hit]
    serving: Serving
    identities: list[Identity] | None = None
    vector: np.ndarray | None = None  # the query's embedding (plain searches)
    # The best FETCH_MIN items or more (plain searches): whose labels a decision proposes.
    candidates: list[Hit] | None = None


def top_candidate(answer: Answer) -> tuple[str, float] | None:
    """``(label, score)`` of the answer's best hit still in its index (a hit deleted while
    the query was in flight is skipped, as the response skips it), or ``None``."""
    for hit in answer.hits:
        info = answer.serving.searcher.info(hit.id)
        if info is not None:
            return info.label, hit.score
    return None


def decision_top(answer: Answer, flt: SearchFilter | None = None) -> tuple[str, float] | None:
    """``(label, score)`` a decision on ``answer`` is made on, on the score its version's
    calibration measured: the top identity by template over the answer's items (``template``,
    docs/identities.md), or its best item (``best``: older calibrations, re-ranked answers).
    Reads the index (templates): call it off the event loop."""
    calibration = answer.serving.calibration
    if calibration is None or calibration.score != TEMPLATE or answer.vector is None:
        return top_candidate(answer)
    found = answer.serving.searcher.identities(
        answer.vector, answer.candidates or answer.hits, IdentityGroup(1, 1, TEMPLATE), flt)
    return (found[0].label, found[0].score) if found else None


def decision(answer: Answer, top: tuple[str, float] | None,
             rerank: Rerank | None) -> tuple[Decision | None, str | None]:
    """The decision on an answer whose best returned hit is ``top``, under the calibration
    of the version that produced it (threshold and scores of one version, whatever switch
    happened since), or ``(None, why not)`` (:mod:`imgret.gallery.evaluation.calibration`)."""
    serving = answer.serving
    reason = no_decision_reason(serving.version, serving.calibration, rerank)
    if reason is not None or serving.calibration is None:
        return None, reason
    return decide(serving.calibration, top), None


@dataclass(frozen=True)
class ImageQuery:
    """One uploaded query image and what to search for.

    Attributes:
        data: the encoded image bytes, not yet decoded (decoding runs in the batch thread).
        k: neighbours wanted.
        filters: restrict the candidates (label, camera, metadata), or ``None``.
        rerank: re-rank the results (:mod:`imgret.gallery.search.rerank`), or ``None``.
        group: group the ``k`` hits into identities (``k`` is then the group's fetch size),
            or ``None``.
    """

    data: bytes
    k: int
    filters: SearchFilter | None = None
    rerank: Rerank | None = None
    group: IdentityGroup | None = None


@dataclass(frozen=True)
class ItemQuery:
    """One search with a stored gallery item's vector (``/search`` with ``id``): queued and
    batched like an image, so it counts against the same queue and limits.

    Attributes:
        item_id: the gallery item (for messages; ``filters`` already leave it out).
        vector_of: the item's stored vector for a :class:`Serving`'s version, read on the
            batcher's decode thread (raises the HTTP error that answers the request: no such
            item, no vector of that version yet).
        k, filters, rerank, group: as :class:`ImageQuery`'s.
    """

    item_id: int
    vector_of: Callable[[Serving], np.ndarray]
    k: int
    filters: SearchFilter | None = None
    rerank: Rerank | None = None
    group: IdentityGroup | None = None


Query = ImageQuery | ItemQuery


def rerank_cost(query: Query) -> int:
    """What a query reserves on the re-ranking pool: its re-ranking's index searches."""
    return index_searches(query.rerank)


def rerank_answer(serving: Serving, vector: np.ndarray, query: Query,
                  busy: Callable[[], bool] = lambda: False) -> Answer:
    """Re-rank one query (on the re-ranking pool): the same version's index as its batch. Its
    searches pause between their products while ``busy()`` (search batches in progress):
    re-ranking is background work beside plain searches (:func:`yielding_to`)."""
    with yielding_to(busy):
        hits = serving.searcher.search(vector[None, :], query.k, query.filters,
                                       rerank=query.rerank)[0]
    return Answer(hits, serving)


@dataclass
class PreparedBatch:
    """A batch after its first stage (:meth:`SearchPipeline.prepare_batch`): decoded, waiting
    for the model.

    Attributes:
        serving: the :class:`Serving` read once for this batch; its model embeds the inputs
            and its index searches them, whatever switch happens meanwhile.
        budget: the batch's decoded-pixel allowance (shared by every chunk of the batch).
        queries: every query given to the batch so far, in order.
        results: per query: ``None`` (decoded, waiting for the model), the exception that
            failed it, or ``Deferred`` (no room in this batch's budget).
        inputs: the ``(1, 3, S, S)`` model inputs of the images' ``None`` slots, in order.
        rows: the positions in ``queries`` of ``inputs``.
        stored: position -> the ``(d,)`` stored vector of an :class:`ItemQuery`.
        full: the budget turned a query away: the batch takes no more.
    """

    serving: Serving
    budget: PixelBudget
    queries: list[Query] = field(default_factory=list)
    results: list[Answer | BaseException | None] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    stored: dict[int, np.ndarray] = field(default_factory=dict)
    full: bool = False
    closed: bool = False


class SearchPipeline(BatchStages[Query, PreparedBatch, Answer]):
    """The dynamic batcher's stages (:class:`~imgret.service.batching.BatchStages`): many queries,
    one forward pass.

    Each query is decoded on its own and turned into the model's input at once
    (:func:`imgret.images.preprocess_encoded`), so a batch holds one full-size image at a time
    plus small ``(3, S, S)`` inputs, whatever its size. A query that fails in any way while
    being decoded fails only its own request (a 4xx ``ImageDecodeError``; an unexpected error
    is logged with its traceback and reported as one): the other users of the batch get their
    results. The good ones are embedded together through the one
    :class:`~imgret.embedder.Embedder` and searched in one index call (the Searcher groups
    equal filters itself).

    Two stages, so that the batcher can overlap them
    (:class:`~imgret.service.batching.DynamicBatcher`
    runs :meth:`prepare_batch` on its decode thread and :meth:`finish_batch` on its model
    thread: the next batch is decoded while this one is in the model): :meth:`prepare_batch`
    reads the served version and decodes (it may be called again with ``into`` to add
    queries that arrived meanwhile, unless the process switched versions since),
    :meth:`finish_batch` embeds and searches. ``pipeline(queries)`` runs both at once.

    An :class:`ItemQuery` (search by a stored item) has no image: its vector is read in stage 1
    for the batch's version and joins the batch's index search. A re-ranked query is embedded
    and then handed back as a :class:`~imgret.service.followups.FollowUp` (:func:`rerank_answer`):
    the
    batcher re-ranks it on its re-ranking pool, never on the model thread, whose time per
    batch thus stays that of a plain search (what re-ranking costs: ``imgret.service.limits``).

    The batch has a decoded-pixel budget, charged from each image's header before it is
    decoded: once it is spent, the remaining queries are handed back as
    :class:`~imgret.service.batching.Deferred` and start the next batch, so one request of huge
    images delays the others by at most one budget's worth of decoding. The first query of a
    batch is always taken (it may be as large as the per-image limit allows).

    Args:
        serving: returns the served :class:`Serving` (read when a batch begins and when
            queries are added to it), or a fixed one.
        max_pixels: decompression-bomb limit per image (``IMGRET_MAX_IMAGE_PIXELS``).
        metrics: where decode, embed and search times go.
        batch_max_pixels: the batch's decoded-pixel budget (``IMGRET_BATCH_MAX_PIXELS``).
        gate: the process's decode gate (``DecodeLimits.gate``); ``None``: not gated.
    """

    def __init__(
        self, serving: Serving | Callable[[], Serving], *, max_pixels: int,
        metrics: ServiceMetrics, batch_max_pixels: int = DEFAULT_BATCH_PIXELS,
        gate: DecodeGate | None = None,
    ):
        self.serving: Callable[[], Serving] = (
            (lambda: serving) if isinstance(serving, Serving) else serving
        )
        self._running = 0  # batches prepared or in the model (a background job yields)
        self._running_lock = threading.Lock()
        self.max_pixels = max_pixels
        self.metrics = metrics
        self.batch_max_pixels = batch_max_pixels
        self.gate = gate

    @property
    def running(self) -> int:
        """Batches in progress: being decoded, waiting for the model, or in it."""
        return self._running

    def _batches_in_progress(self) -> bool:
        return self._running > 0

    def __call__(self, queries: Sequence[Query]
                 ) -> list[Answer | FollowUp[Answer] | BaseException]:
        """Run a batch (both stages, in this thread).

        Returns:
            Per query, in order: its :class:`Answer` (hits best first, at most ``k``), a
            :class:`~imgret.service.followups.FollowUp` whose ``finish()`` returns it (a re-ranked
            query), the exception that failed it (``ImageDecodeError`` for a bad upload), or
            ``Deferred`` (no room left in this batch's budget).
        """
        return self.finish_batch(self.prepare_batch(queries))

    def prepare_batch(self, queries: Sequence[Query],
                      into: PreparedBatch | None = None) -> PreparedBatch:
        """Stage 1: decode ``queries`` into a new batch, or add them to ``into`` (same served
        version, same budget). Every batch this returns must reach :meth:`finish_batch` or
        :meth:`discard_batch`.

        A batch answers with the version it was started with. If the process switched since
        (``serving`` names another version now), ``queries`` are not added: they are handed
        back as :class:`~imgret.service.batching.Deferred` and start the next batch, with the new
        version. A request that arrives after a switch was acknowledged is thus never
        answered by the old model, even when the batch it would join began before the switch
        (tests/integration/test_model_switch.py).
        """
        if into is None:
            into = PreparedBatch(self.serving(), PixelBudget(
                self.batch_max_pixels, setting="IMGRET_BATCH_MAX_PIXELS", scope="batch"))
            with self._running_lock:
                self._running += 1
        elif self.serving().version != into.serving.version:
            into.full = True
            for query in queries:
                into.queries.append(query)
                into.results.append(Deferred())
            return into
        batch = into
        embedder = batch.serving.embedder
        with self.metrics.timed(self.metrics.decode_seconds):
            for query in queries:
                position = len(batch.queries)
                batch.queries.append(query)
                batch.results.append(None)
                if isinstance(query, ItemQuery):
                    try:
                        batch.stored[position] = query.vector_of(batch.serving)
                    except Exception as exc:  # noqa: BLE001 - its own request's answer
                        batch.results[position] = exc
                    continue
                try:
                    prepared = self.prepare(query, batch.budget, embedder)
                except ImageDecodeError as exc:
                    batch.results[position] = exc
                    continue
                except Exception as exc:  # noqa: BLE001 - one upload must not fail the batch
                    logger.exception("query %d of a batch failed while decoding", position)
                    batch.results[position] = ImageDecodeError(
                        f"cannot decode the image ({type(exc).__name__})"
                    )
                    continue
                if prepared is None:
                    batch.results[position] = Deferred()
                    batch.full = True
                else:
                    batch.inputs.append(prepared)
                    batch.rows.append(position)
        return batch

    def finish_batch(self, batch: PreparedBatch
                     ) -> list[Answer | FollowUp[Answer] | BaseException]:
        """Stage 2: embed the decoded queries in one forward pass and search the plain ones in
        one index call (per-query filters, the largest ``k``, then each list cut to its own
        ``k``). A re-ranked query gets a :class:`~imgret.service.followups.FollowUp` instead: the
        batcher finishes it on the re-ranking pool, so this (model) thread never re-ranks.

        Returns:
            Per query of the batch, in order (see :meth:`__call__`).
        """
        try:
            serving = batch.serving
            vectors: dict[int, np.ndarray] = dict(batch.stored)
            if batch.rows:
                inputs = batch.inputs[0] if len(batch.inputs) == 1 else torch.cat(batch.inputs)
                batch.inputs = []
                with self.metrics.timed(self.metrics.embed_seconds):
                    embedded = serving.embedder.embed_tensors(inputs)
                del inputs
                vectors.update(zip(batch.rows, embedded, strict=True))
            plain = [p for p in sorted(vectors) if batch.queries[p].rerank is None]
            if plain:
                queries = [batch.queries[p] for p in plain]
                # At least FETCH_MIN: a decision proposes the identities among them (the
                # cost of a flat search hardly depends on k; the hits are cut below).
                k = max(FETCH_MIN, *(query.k for query in queries))
                with self.metrics.timed(self.metrics.search_seconds):
                    hits = serving.searcher.search(np.stack([vectors[p] for p in plain]), k,
                                                   [q.filters for q in queries])
                for position, query, row in zip(plain, queries, hits, strict=True):
                    row_hits = row[: query.k]
                    identities = None if query.group is None else serving.searcher.identities(
                        vectors[position], row_hits, query.group, query.filters)
                    batch.results[position] = Answer(row_hits, serving, identities,
                                                     vectors[position], row)
            for position in sorted(set(vectors) - set(plain)):
                batch.results[position] = FollowUp(functools.partial(
                    rerank_answer, serving, vectors[position], batch.queries[position],
                    self._batches_in_progress))
            return [Answer([], serving) if result is None else result
                    for result in batch.results]
        finally:
            self.discard_batch(batch)

    def discard_batch(self, batch: PreparedBatch) -> None:
        """Drop a prepared batch without running it (it no longer counts as running)."""
        with self._running_lock:
            if not batch.closed:
                batch.closed = True
                batch.inputs = []
                self._running -= 1

    def prepare(self, query: ImageQuery, budget: PixelBudget,
                embedder: Embedder) -> torch.Tensor | None:
        """The query's ``(1, 3, S, S)`` model input, or ``None`` when the batch has no room.

        The header is read first: the budget is charged before decoding, and an image that
        does not fit (unless the batch is still empty) is not decoded at all.

        Raises:
            ImageDecodeError: the upload is bad (ImageTooLarge: over the per-image limit).
        """
        probe = probe_image(query.data, size=embedder.spec.image_size,
                            max_pixels=self.max_pixels)
        if budget.used and not budget.fits(probe.decode_pixels):
            return None
        budget.force(probe.decode_pixels)
        return preprocess_encoded(query.data, embedder=embedder,
                                  max_pixels=self.max_pixels, gate=self.gate)


def configure_threads() -> None:
    """The search service's threads, process-wide (see :func:`limit_pthreads_blas`): NumPy's
    BLAS on one thread, so that only torch's OpenMP team (on the batcher's model thread) uses
    several cores. Torch keeps its own default, one intra-op thread per core: the forward
    pass is most of a batch's time."""
    limit_pthreads_blas(1)


def overlap_decoding() -> bool:
    """Whether the batcher decodes the next batch while the model runs: only when the model
    leaves a core free (``torch.get_num_threads() < os.cpu_count()``).

    With decoding and the event loop running beside a forward pass that uses every core, the
    forward pass slows down by more than the overlap saves; one torch thread fewer (leaving a
    core to decode) is slower still (``benchmarks/service_bench.py``,
    ``docs/service_bench.md``).
    """
    return torch.get_num_threads() < (os.cpu_count() or 1)


def build_search_batcher(
    settings: Settings, *, metrics: ServiceMetrics,
    serving: Serving | Callable[[], Serving] | None = None,
    embedder: Embedder | None = None, searcher: Searcher | None = None,
) -> DynamicBatcher[Query, Answer]:
    """The app's dynamic batcher in front of a :class:`SearchPipeline`, from the settings.

    One place turns the batching and decoding settings into objects (``IMGRET_BATCH_*``,
    ``IMGRET_MAX_IMAGE_PIXELS``, ``IMGRET_DECODE_MEMORY_MB``), so the service and the
    benchmarks build the same thing. ``serving`` (the service: follows switches) or a fixed
    ``embedder`` + ``searcher`` (benchmarks).
    """
    if serving is None:
        if embedder is None or searcher is None:
            raise ValueError("give serving, or embedder and searcher")
        serving = Serving(embedder.model_version, embedder, searcher)
    configure_threads()
    if settings.rerank_queue_max < REQUEST_RERANK_SEARCHES_MAX:
        # A maximal re-ranked request is reserved whole or refused: it would be refused forever.
        raise ValueError(f"IMGRET_RERANK_QUEUE_MAX ({settings.rerank_queue_max}) must be at "
                         f"least one request's re-ranking budget ({REQUEST_RERANK_SEARCHES_MAX})")
    limits = DecodeLimits.from_settings(settings)
    pipeline = SearchPipeline(
        serving, max_pixels=settings.max_image_pixels, metrics=metrics,
        batch_max_pixels=settings.batch_max_pixels, gate=limits.gate,
    )
    return DynamicBatcher(
        pipeline,
        max_size=settings.batch_max_size,
        max_wait_s=settings.batch_max_wait_ms / 1000.0,
        max_queue=settings.batch_queue_max,
        on_batch=metrics.batch_size.observe,
        overlap=overlap_decoding(),
        followups=FollowUpPool(workers=settings.rerank_workers,
                               capacity=settings.rerank_queue_max,
                               what="re-ranking (IMGRET_RERANK_QUEUE_MAX)",
                               name="imgret-rerank"),
        followup_cost=rerank_cost,
    )
