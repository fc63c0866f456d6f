"""Stored vectors: their encoding as float32 bytes, and reading them back in pages or by id."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from imgret.errors import GalleryError
from imgret.gallery.storage.bulk import chunks
from imgret.gallery.storage.tables import (
    Embedding,
    GalleryItem,
    ModelVersion,
)


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """What search filters look at: an item's label, camera and metadata."""

    label: str
    camera: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VectorPage:
    """A page of embeddings: ``ids (n,) int64`` ascending, ``vectors (n, d) float32``."""

    ids: np.ndarray
    vectors: np.ndarray
    infos: list[ItemInfo]


def encode_vector(vector: np.ndarray) -> bytes:
    """One ``(d,)`` vector as little-endian float32 bytes (the ``embeddings.vector`` format)."""
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


def decode_vectors(blobs: Sequence[bytes], dim: int) -> np.ndarray:
    """Stored vector bytes back to a ``(n, dim)`` float32 array (one copy)."""
    if not blobs:
        return np.zeros((0, dim), dtype=np.float32)
    flat = np.frombuffer(b"".join(blobs), dtype="<f4")
    if flat.size != len(blobs) * dim:
        raise GalleryError(f"stored vectors are not all {dim}-dimensional")
    if not np.isfinite(flat).all():
        # Written before non-finite vectors were refused (_check_vectors): nothing can rank
        # them, so every reader (an index, an evaluation, a search by id) refuses them too.
        raise GalleryError(
            "stored vectors hold NaN or infinite values (written by an older release from a "
            "model that produced them); delete that model version and register one whose "
            "vectors are finite")
    return flat.reshape(len(blobs), dim).astype(np.float32, copy=False)


def count_vectors(*, session: Session, model_version_id: int) -> int:
    """How many live items have an embedding for the model version."""
    return int(
        session.scalar(
            select(func.count())
            .select_from(Embedding)
            .join(GalleryItem, GalleryItem.id == Embedding.item_id)
            .where(Embedding.model_version_id == model_version_id, GalleryItem.deleted_at.is_(None))
        )
        or 0
    )


def iter_vector_pages(
    *, session: Session, model_version: ModelVersion, page_size: int = 10_000,
    with_vectors: bool = True,
) -> Iterator[VectorPage]:
    """Stream the live embeddings of a model version in ascending id pages.

    Keyset pagination (``item_id > last``) on the primary key: every page is one indexed
    range scan, and at most one page is in memory, whatever the gallery size.

    Args:
        session: a session (read-only use).
        model_version: whose embeddings.
        page_size: rows per page.
        with_vectors: ``False`` streams ids and infos only (``vectors`` is then ``(n, 0)``).
    """
    last = -1
    columns = [Embedding.item_id, GalleryItem.label, GalleryItem.camera, GalleryItem.meta]
    if with_vectors:
        columns.append(Embedding.vector)
    while True:
        rows = session.execute(
            select(*columns)
            .join(GalleryItem, GalleryItem.id == Embedding.item_id)
            .where(
                Embedding.model_version_id == model_version.id,
                Embedding.item_id > last,
                GalleryItem.deleted_at.is_(None),
            )
            .order_by(Embedding.item_id)
            .limit(page_size)
        ).all()
        if not rows:
            return
        yield _page(rows, model_version.dim, with_vectors)
        last = int(rows[-1][0])


def fetch_vectors(
    item_ids: Iterable[int], *, session: Session, model_version: ModelVersion
) -> VectorPage:
    """Embeddings of specific live items for a model version (ids without one are left out)."""
    rows: list = []
    for chunk in chunks(sorted({int(i) for i in item_ids})):
        rows.extend(
            session.execute(
                select(
                    Embedding.item_id, GalleryItem.label, GalleryItem.camera, GalleryItem.meta,
                    Embedding.vector,
                )
                .join(GalleryItem, GalleryItem.id == Embedding.item_id)
                .where(
                    Embedding.model_version_id == model_version.id,
                    Embedding.item_id.in_(chunk),
                    GalleryItem.deleted_at.is_(None),
                )
                .order_by(Embedding.item_id)
            ).all()
        )
    return _page(rows, model_version.dim, True)


def _page(rows: Sequence, dim: int, with_vectors: bool) -> VectorPage:
    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    infos = [ItemInfo(r[1], r[2], r[3] or {}) for r in rows]
    if with_vectors:
        vectors = decode_vectors([r[4] for r in rows], dim)
    else:
        vectors = np.zeros((len(rows), 0), dtype=np.float32)
    return VectorPage(ids, vectors, infos)
