"""The write transaction of an ingest: media bytes, then gallery rows, under the write lock.

Concurrency: decoding and embedding run outside any transaction (no connection or lock is
held while a large upload is processed). The write transaction then takes the gallery write
lock *first* (``store.lock_gallery_writes``), plans again under it
(:mod:`imgret.gallery.ingest.plan`) and writes only what is still to write: an image that another
writer stored meanwhile becomes "already present", an existing item deleted meanwhile is never
re-embedded (its vector must not reach an index again), and two uploads of the same new bytes cannot
both insert (no unique-key race).

Crash safety (what an interrupted write can leave behind): the media file is written (under
the lock) before the rows commit, so a killed ingest may leave a media file that no row
points to; ``imgret.gallery.media.gc.sweep_media`` removes it at the next start (with the database
media backend the bytes are written in the rows' transaction, so nothing is left). Rows are written
in one transaction per batch, so there is never an item without its embedding and change row.

Uploads (:mod:`imgret.gallery.ingest.uploads`) call :func:`write_planned` directly; the bulk paths
(:mod:`imgret.gallery.ingest.pipeline`, :mod:`imgret.gallery.ingest.ray`) write chunks through
:class:`ChunkWriter`, which also counts into their report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import GalleryError
from imgret.gallery.ingest.plan import Candidate, Plan, make_plan, stack_vectors
from imgret.gallery.ingest.report import IngestReport, StageTimer
from imgret.gallery.media.files import MediaBackend, sniff_content_type
from imgret.gallery.storage import item_store, query_set_store
from imgret.gallery.storage.item_store import NewRow
from imgret.gallery.storage.tables import ModelVersion, QuerySet
from imgret.gallery.versions import version_store


def register_target(
    session_factory: sessionmaker[Session], *, version: str, dim: int,
    config: Mapping[str, Any], query_set: str | None,
) -> tuple[ModelVersion, QuerySet | None]:
    """Register the model version being ingested (the first one registered becomes active)
    and find or make the named query set; what the bulk writers write against."""
    with session_factory.begin() as session:
        model_version = version_store.register_model_version(
            session=session, version=version, dim=dim, config=dict(config))
        target = (query_set_store.get_or_create_query_set(query_set, session=session)
                  if query_set else None)
    return model_version, target


@dataclass(frozen=True)
class EmbeddedChunk:
    """Images decoded and embedded elsewhere (the Ray path's actors), ready to be written by
    :func:`write_embedded`. One entry per image, in source order.

    Attributes:
        positions: each image's index in the source (orders copies of the same bytes).
        paths: the file read (the failure report names it).
        labels, cameras: what the source says (camera ``None`` when it has none).
        sources: the stored ``source`` (:class:`imgret.gallery.ingest.pipeline.SourceNames`).
        data: the encoded bytes, or ``None`` when the file could not be read.
        sha256: hex digest of ``data`` (ignored where ``data`` is ``None``).
        vectors: ``(n, d)`` float32; rows of failed images are ignored.
        errors: ``None``, or why the image failed (unreadable, corrupt, changed).
    """

    positions: Sequence[int]
    paths: Sequence[str]
    labels: Sequence[str]
    cameras: Sequence[int | None]
    sources: Sequence[str]
    data: Sequence[bytes | None]
    sha256: Sequence[str]
    vectors: np.ndarray
    errors: Sequence[str | None]

    def __len__(self) -> int:
        return len(self.positions)


def write_embedded(
    chunk: EmbeddedChunk, *, report: IngestReport, session_factory: sessionmaker[Session],
    media: MediaBackend, model_version: ModelVersion, query_set: QuerySet | None,
) -> None:
    """Write one chunk of already embedded images exactly as the plain ingest writes its
    chunks (the same :class:`ChunkWriter`): failures reported, media bytes durable, then the
    rows in one transaction under the gallery write lock, planned again under it, so an image
    stored meanwhile (by this run or another writer) counts as already present.

    Args:
        chunk: the images, their vectors and per-image errors.
        report: counts (added, embedded, duplicates, failed) and the write time go here.
        session_factory, media: the gallery database and media store.
        model_version, query_set: from :func:`register_target`.

    Raises:
        GalleryError: the plan under the lock needs a vector the chunk lacks (cannot happen
            when every image of the chunk that did not fail was embedded).
    """
    cands: list[Candidate] = []
    errors: dict[str, str] = {}
    vectors_by_sha: dict[str, np.ndarray] = {}
    for i, position in enumerate(chunk.positions):
        data, error, path = chunk.data[i], chunk.errors[i], str(chunk.paths[i])
        if data is None:  # unreadable: reported like the plain ingest's read stage does
            report.failed.append((path, error or "cannot read file"))
            continue
        sha = chunk.sha256[i]
        cands.append(Candidate(int(position), data, sha, chunk.labels[i], chunk.cameras[i],
                               None, chunk.sources[i], origin=path))
        if error:
            errors[sha] = error
        else:
            vectors_by_sha[sha] = chunk.vectors[i]
    writer = ChunkWriter(timer=StageTimer(report), session_factory=session_factory,
                         media=media, model_version=model_version, query_set=query_set)
    _, _, ids_by_sha = writer.write(cands, vectors_by_sha, errors, planned=None)
    if ids_by_sha is None:
        raise GalleryError("an image to write has no vector; run ingest again")


@dataclass
class ChunkWriter:
    """The write half of a bulk chunk, shared by the plain ingest
    (:mod:`imgret.gallery.ingest.pipeline`) and :func:`write_embedded` (the Ray path)."""

    timer: StageTimer
    session_factory: sessionmaker[Session]
    media: MediaBackend
    model_version: ModelVersion
    query_set: QuerySet | None

    def write(
        self, cands: list[Candidate], vectors_by_sha: Mapping[str, np.ndarray],
        errors: Mapping[str, str], *, planned: Plan | None,
    ) -> tuple[list[Candidate], Plan, dict[str, int] | None]:
        """Report the failed candidates, then write the rest under the lock.

        Args:
            cands: the chunk's readable images.
            vectors_by_sha: the vectors embedded so far.
            errors: sha256 -> why decoding failed.
            planned: the plan made before decoding (its already-present items are not
                failures even when their bytes would not decode); ``None``: no plan yet.

        Returns:
            The candidates left (failures dropped), the plan made under the lock, and
            sha256 -> id of its work, or ``None`` (nothing written, counts untouched) when
            that plan needs a vector ``vectors_by_sha`` lacks: embed those and call again.
        """
        report = self.timer.report
        resolved = planned.resolved if planned is not None else {}
        # Copies of a corrupt file (same bytes) fail with it, each under its own name.
        failed = {c.position for c in cands if c.sha256 in errors
                  and c.position not in resolved}
        report.failed.extend((c.origin, errors[c.sha256]) for c in cands
                             if c.position in failed)
        if failed:
            cands = [c for c in cands if c.position not in failed]
        count = len(planned.work) if planned is not None else len(cands)
        with self.timer.stage("write", count), self.session_factory.begin() as session:
            plan, ids_by_sha = write_planned(cands, vectors_by_sha, session=session,
                                             media=self.media,
                                             model_version=self.model_version,
                                             query_set=self.query_set)
        if ids_by_sha is not None:
            report.added += len(plan.create)
            report.embedded += len(plan.embed_existing)
            report.duplicates += len(cands) - len(plan.create) - len(plan.embed_existing)
        return cands, plan, ids_by_sha


def write_planned(
    cands: list[Candidate], vectors_by_sha: Mapping[str, np.ndarray], *, session: Session,
    media: MediaBackend, model_version: ModelVersion, query_set: QuerySet | None,
) -> tuple[Plan, dict[str, int] | None]:
    """Take the gallery write lock, plan again under it, and write the plan.

    Returns:
        The new plan, and sha256 -> id of its work; ``None`` instead of the ids (nothing
        written) when the new plan needs an embedding that ``vectors_by_sha`` lacks.

    Raises:
        CollectionNotFound: the collection was deleted meanwhile (nothing written).
    """
    item_store.lock_gallery_writes(session=session)
    item_store.require_collection(session=session)
    plan = make_plan(cands, session=session, model_version=model_version, query_set=query_set)
    if any(c.sha256 not in vectors_by_sha for c in plan.work):
        return plan, None
    vectors = stack_vectors(vectors_by_sha, plan.work, model_version.dim)
    return plan, _write(plan, vectors, session=session, media=media,
                        model_version=model_version, query_set=query_set)


def _write(
    plan: Plan, vectors: np.ndarray, *, session: Session, media: MediaBackend,
    model_version: ModelVersion, query_set: QuerySet | None,
) -> dict[str, int]:
    """Store media and rows (gallery items, or items of ``query_set``); returns sha256 -> id
    for every candidate of the plan.

    The caller holds the gallery write lock (:func:`write_planned`).
    """
    n_create = len(plan.create)
    # The bytes are stored before the rows that point to them commit: files made durable now
    # (one batch of syncs), database blobs in this very transaction (session).
    paths = media.put_many([(c.data, c.sha256) for c in plan.create], session=session,
                           staged={c.sha256: c.staged for c in plan.create if c.staged})
    rows = [
        NewRow(sha256=c.sha256, media_path=path, content_type=sniff_content_type(c.data),
               label=c.label, camera=c.camera, metadata=c.metadata, source=c.source)
        for c, path in zip(plan.create, paths, strict=True)
    ]
    new_ids = item_store.insert_items(rows, vectors[:n_create], session=session,
                                      model_version=model_version, query_set=query_set)
    existing_ids = [c.existing_id for c in plan.embed_existing]
    item_store.add_embeddings(existing_ids, vectors[n_create:], session=session,
                              model_version=model_version, query_set=query_set)
    ids = {c.sha256: i for c, i in zip(plan.create, new_ids, strict=True)}
    ids.update({c.sha256: c.existing_id for c in plan.embed_existing})
    return ids
