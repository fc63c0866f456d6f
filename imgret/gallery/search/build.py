"""The build of a FAISS index from the stored embeddings of a model version (no re-embedding).

The stages run in order, after autofaiss: check the factory string, create the empty index,
train it on a seeded random sample, add the vectors page by page from SQL. The Searcher
places the result (GPU or CPU) and saves it with its manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from imgret.gallery.search.faiss_index import (
    DEFAULT_FACTORY,
    check_factory,
    create_index,
    set_search_defaults,
    timed,
    train_index,
)
from imgret.gallery.search.manifest import Manifest, ids_checksum, now_iso
from imgret.gallery.storage import change_log, vector_store
from imgret.gallery.storage.vector_store import ItemInfo
from imgret.gallery.versions import version_store


@dataclass
class BuiltIndex:
    """An index built from SQL, with what the Searcher needs beside it."""

    index: faiss.Index
    infos: dict[int, ItemInfo]
    manifest: Manifest


def build_from_sql(
    session_factory: sessionmaker[Session], factory: str = DEFAULT_FACTORY, *,
    model_version: str | None = None, page_size: int = 20_000, progress: bool = False,
    seed: int = 0,
) -> BuiltIndex:
    """Build an index from the stored embeddings of a model version (no re-embedding).

    Vectors are streamed from SQL in id-ordered pages straight into the index, so only one
    page is ever held besides the index itself. A trainable index (IVF, PQ, ...) is first
    trained on a seeded random sample read by id.

    Args:
        session_factory: sessions on the gallery database.
        factory: FAISS factory string (checked by :func:`check_factory`).
        model_version: whose embeddings; default the active version.
        page_size: rows per SQL page.
        progress: show a tqdm bar.
        seed: sampling seed for training.

    Returns:
        The index (CPU), the id -> (label, camera, metadata) map, and its manifest (without
        ``index_sha256`` until saved).

    Raises:
        GalleryError: no such (or no active) model version.
        InvalidIndexFactory: a bad factory, or too few vectors to train it.
    """
    with session_factory() as session:
        version = version_store.get_model_version(session=session, version=model_version)
        # Read the sequence first: changes after it may or may not be in the pages, and
        # replaying them later is idempotent; changes before it are all in.
        seq = change_log.max_change_seq(session=session)
        total = vector_store.count_vectors(session=session, model_version_id=version.id)
    info = check_factory(factory, version.dim)
    info.check_vector_count(total, version.version)
    index = create_index(info, version.dim)
    if info.needs_training:
        sample = _training_sample(session_factory, version, info.train_size(total), seed)
        train_index(index, sample, info)
        del sample
    infos: dict[int, ItemInfo] = {}
    all_ids: list[np.ndarray] = []
    with timed(f"adding {total} vectors to {info.factory}"), session_factory() as session, tqdm(
        total=total, unit="vec", desc=f"index {info.factory}", disable=not progress
    ) as bar:
        for page in vector_store.iter_vector_pages(
            session=session, model_version=version, page_size=page_size
        ):
            index.add_with_ids(page.vectors, page.ids)
            infos.update(zip(page.ids.tolist(), page.infos, strict=True))
            all_ids.append(page.ids)
            bar.update(len(page.ids))
    ids = np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64)
    set_search_defaults(index)
    manifest = Manifest(
        model_version=version.version, factory=info.factory, dim=version.dim,
        count=len(ids), change_seq=seq, ids_sha256=ids_checksum(ids),
        faiss_version=faiss.__version__, created_at=now_iso(),
    )
    return BuiltIndex(index, infos, manifest)


def _training_sample(
    session_factory: sessionmaker[Session], version, size: int, seed: int
) -> np.ndarray:
    # A random sample, not the first pages: ids follow ingest order, which is often sorted
    # by class, and centroids trained on a few classes would be poor for the rest.
    with session_factory() as session:
        ids = np.concatenate(
            [p.ids for p in vector_store.iter_vector_pages(
                session=session, model_version=version, page_size=100_000, with_vectors=False
            )] or [np.zeros(0, np.int64)]
        )
        chosen = np.sort(np.random.default_rng(seed).choice(ids, size=size, replace=False))
        parts = []
        for start in range(0, len(chosen), 20_000):
            parts.append(vector_store.fetch_vectors(
                chosen[start : start + 20_000].tolist(), session=session, model_version=version
            ).vectors)
    return np.concatenate(parts)
