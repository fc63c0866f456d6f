"""The query pipeline of /search: decode, embed and search a batch of uploaded images."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from imgret.embedder import Embedder
from imgret.errors import ImageDecodeError
from imgret.images import (
    DEFAULT_BATCH_PIXELS,
    DecodeGate,
    DecodeLimits,
    PixelBudget,
    preprocess_encoded,
    probe_image,
)
from imgret.settings import Settings
from index.search import Hit, Searcher, SearchFilter
from index.search.rerank import Rerank
from service.batching import Deferred, DynamicBatcher
from service.telemetry import ServiceMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    """The served model version: its model and its index, always used together.

    A switch (``POST /models/{v}/activate``, or the follower seeing another process's switch)
    replaces the whole object, and each batch reads it once, so no query is ever embedded by
    one version and searched in another's index.
    """

    version: str
    embedder: Embedder
    searcher: Searcher


@dataclass(frozen=True)
class Answer:
    """The hits of one query (best first) and the :class:`Serving` that produced them (its
    version goes into the response; its searcher resolves the hits' labels)."""

    hits: list[Hit]
    serving: Serving


@dataclass(frozen=True)
class ImageQuery:
    """One uploaded query image and what to search for.

    Attributes:
        data: the encoded image bytes, not yet decoded (decoding runs in the batch thread).
        k: neighbours wanted.
        filters: restrict the candidates (label, camera, metadata), or ``None``.
        rerank: re-rank the results (:mod:`index.search.rerank`), or ``None``.
    """

    data: bytes
    k: int
    filters: SearchFilter | None = None
    rerank: Rerank | None = None


class SearchPipeline:
    """The batch function of the dynamic batcher: many queries, one forward pass.

    Each query is decoded on its own and turned into the model's input at once
    (:func:`imgret.images.preprocess_encoded`), so a batch holds one full-size image at a time
    plus small ``(3, S, S)`` inputs, whatever its size. A query that fails in any way while
    being decoded fails only its own request (a 4xx ``ImageDecodeError``; an unexpected error
    is logged with its traceback and reported as one): the other users of the batch get their
    results. The good ones are embedded together through the one
    :class:`~imgret.embedder.Embedder` and searched in one index call (the Searcher groups
    equal filters itself).

    The batch has a decoded-pixel budget, charged from each image's header before it is
    decoded: once it is spent, the remaining queries are handed back as
    :class:`~service.batching.Deferred` and start the next batch, so one request of huge
    images delays the others by at most one budget's worth of decoding. The first query of a
    batch is always taken (it may be as large as the per-image limit allows).

    Args:
        serving: returns the served :class:`Serving` (read once per batch), or a fixed one.
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
        self.running = 0  # batches in progress (a background job yields to them)
        self.max_pixels = max_pixels
        self.metrics = metrics
        self.batch_max_pixels = batch_max_pixels
        self.gate = gate

    def __call__(self, queries: Sequence[ImageQuery]) -> list[Answer | BaseException]:
        """Run a batch.

        Returns:
            Per query, in order: its :class:`Answer` (hits best first, at most ``k``), the
            exception that failed it (``ImageDecodeError`` for a bad upload), or ``Deferred``
            (no room left in this batch's budget).
        """
        self.running += 1
        try:
            return self._run(queries, self.serving())
        finally:
            self.running -= 1

    def _run(self, queries: Sequence[ImageQuery],
             serving: Serving) -> list[Answer | BaseException]:
        results: list[Answer | BaseException] = [Answer([], serving) for _ in queries]
        budget = PixelBudget(self.batch_max_pixels, setting="IMGRET_BATCH_MAX_PIXELS",
                             scope="batch")
        inputs: list[torch.Tensor] = []
        good: list[int] = []
        with self.metrics.timed(self.metrics.decode_seconds):
            for position, query in enumerate(queries):
                try:
                    prepared = self.prepare(query, budget, serving.embedder)
                except ImageDecodeError as exc:
                    results[position] = exc
                    continue
                except Exception as exc:  # noqa: BLE001 - one upload must not fail the batch
                    logger.exception("query %d of a batch of %d failed while decoding",
                                     position, len(queries))
                    results[position] = ImageDecodeError(
                        f"cannot decode the image ({type(exc).__name__})"
                    )
                    continue
                if prepared is None:
                    results[position] = Deferred()
                else:
                    inputs.append(prepared)
                    good.append(position)
        if not good:
            return results
        with self.metrics.timed(self.metrics.embed_seconds):
            vectors = serving.embedder.embed_tensors(torch.cat(inputs))
        del inputs
        # One index call for the whole batch: per-query filters, the largest k, then each
        # query's list is cut to its own k.
        k = max(queries[position].k for position in good)
        with self.metrics.timed(self.metrics.search_seconds):
            hits = serving.searcher.search(vectors, k, [queries[p].filters for p in good],
                                           rerank=[queries[p].rerank for p in good])
        for position, row_hits in zip(good, hits, strict=True):
            results[position] = Answer(row_hits[: queries[position].k], serving)
        return results

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


def build_search_batcher(
    settings: Settings, *, metrics: ServiceMetrics,
    serving: Serving | Callable[[], Serving] | None = None,
    embedder: Embedder | None = None, searcher: Searcher | None = None,
) -> DynamicBatcher[ImageQuery, Answer]:
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
    )
