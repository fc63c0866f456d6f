"""The query pipeline of /search: decode, embed and search a batch of uploaded images."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from imgret.embedder import Embedder
from imgret.errors import ImageDecodeError
from imgret.images import decode_image
from index.search import Hit, Searcher, SearchFilter
from service.telemetry import ServiceMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageQuery:
    """One uploaded query image and what to search for.

    Attributes:
        data: the encoded image bytes, not yet decoded (decoding runs in the batch thread).
        k: neighbours wanted.
        filters: restrict the candidates (label, camera, metadata), or ``None``.
    """

    data: bytes
    k: int
    filters: SearchFilter | None = None


class SearchPipeline:
    """The batch function of the dynamic batcher: many queries, one forward pass.

    Each query is decoded on its own (a corrupt upload fails only its own request), the
    good ones are embedded together through the one :class:`~imgret.embedder.Embedder` and
    searched in one index call (the Searcher groups equal filters itself).

    Args:
        embedder: the one embedding path.
        searcher: the served index.
        max_pixels: decompression-bomb limit (``IMGRET_MAX_IMAGE_PIXELS``).
        metrics: where decode, embed and search times go.
    """

    def __init__(
        self, embedder: Embedder, searcher: Searcher, *, max_pixels: int,
        metrics: ServiceMetrics,
    ):
        self.embedder = embedder
        self.searcher = searcher
        self.max_pixels = max_pixels
        self.metrics = metrics

    def __call__(self, queries: Sequence[ImageQuery]) -> list[list[Hit] | BaseException]:
        """Run a batch.

        Returns:
            Per query, in order: its hits (best first, at most ``k``), or the exception that
            failed it (``ImageDecodeError`` for a bad upload).
        """
        results: list[list[Hit] | BaseException] = [[] for _ in queries]
        images, good = [], []
        with self.metrics.timed(self.metrics.decode_seconds):
            for position, query in enumerate(queries):
                try:
                    images.append(decode_image(query.data, max_pixels=self.max_pixels))
                    good.append(position)
                except ImageDecodeError as exc:
                    results[position] = exc
        if not good:
            return results
        with self.metrics.timed(self.metrics.embed_seconds):
            vectors = self.embedder.embed(images)
        # One index call for the whole batch: per-query filters, the largest k, then each
        # query's list is cut to its own k.
        k = max(queries[position].k for position in good)
        with self.metrics.timed(self.metrics.search_seconds):
            hits = self.searcher.search(vectors, k, [queries[p].filters for p in good])
        for position, row_hits in zip(good, hits, strict=True):
            results[position] = row_hits[: queries[position].k]
        return results

