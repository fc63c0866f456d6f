"""Ingest: image bytes -> media store + gallery rows + embeddings + change log.

Two entry points share one pipeline (hash, dedup, decode, embed, write):

- :func:`add_items` — a list of uploaded images, all-or-nothing (``POST /gallery``); a
  corrupt upload raises, so the request fails as a whole.
- :func:`ingest_source` — a folder / CSV / Market-1501 source, in chunks that each commit on
  their own; corrupt files are skipped and reported at the end, never abort the run.

Idempotence: items are keyed by content hash. Bytes already in the gallery (live) are not
added again; when they lack an embedding for the model version at hand, only the embedding
is added (re-embedding a gallery for a new model is the same command with another
``--model``). An interrupted ingest therefore resumes by running it again.

Concurrency: decoding and embedding run outside any transaction (no connection or lock is
held while a large upload is processed). The write transaction then takes the gallery write
lock *first* (``store.lock_gallery_writes``), plans again under it and writes only what is
still to write: an image that another writer stored meanwhile becomes "already present", an
existing item deleted meanwhile is never re-embedded (its vector must not reach an index
again), and two uploads of the same new bytes cannot both insert (no unique-key race).

Crash safety (what an interrupted chunk can leave behind): the media file is written (under
the lock) before the rows commit, so a killed ingest may leave a media file that no row
points to; ``index.gc.sweep_media`` removes it at the next start. Rows are written in one
transaction per chunk, so there is never an item without its embedding and change row.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from imgret.embedder import Embedder
from imgret.errors import GalleryError, ImageDecodeError
from imgret.images import (
    DEFAULT_MAX_PIXELS,
    DecodeLimits,
    decode_for_embedding,
    embed_encoded,
)
from imgret.timing import timed
from index import store
from index.media import MediaStore, sha256_hex, sniff_content_type
from index.models import ModelVersion, QuerySet
from index.store import ItemInfo, NewRow

logger = logging.getLogger(__name__)

STAGES = ("read", "dedup", "decode", "embed", "write")
# Plan -> embed -> plan again under the lock: rounds before giving up on a gallery that keeps
# changing under one upload (each extra round needs a concurrent delete of a reused item).
_PLAN_ROUNDS = 4


@dataclass(frozen=True)
class NewItem:
    """An image to add: its file bytes and what it is.

    Attributes:
        data: the encoded image (JPEG, PNG, ...).
        label: class / identity.
        camera: camera id (re-ID data), or ``None``.
        metadata: JSON-serialisable key/values, filterable at search time.
        source: where it came from (file name or path), for people reading the gallery.
    """

    data: bytes
    label: str
    camera: int | None = None
    metadata: Mapping[str, Any] | None = None
    source: str | None = None


@dataclass(frozen=True)
class AddedItems:
    """What :func:`add_items` did.

    Attributes:
        ids: one gallery id per input item, in input order (the existing item's id when its
            content was already in the gallery).
        created: per input item, whether a new gallery item was made.
        vector_ids: ``(m,) int64`` ids that gained an embedding for the model version.
        vectors: ``(m, d) float32`` those embeddings — hand both to ``Searcher.add`` after
            the commit so the items are searchable at once.
        infos: ``m`` filter infos (label, camera, metadata) for ``Searcher.add``.
        model_version: the version the vectors belong to.
        existing: for each input position whose image was already in the gallery, the stored
            item's label, camera and metadata (the caller's own values were not applied).
    """

    ids: list[int]
    created: list[bool]
    vector_ids: np.ndarray
    vectors: np.ndarray
    infos: list[ItemInfo]
    model_version: str
    existing: dict[int, ItemInfo] = field(default_factory=dict)


@dataclass
class IngestReport:
    """Counts and timings of one :func:`ingest_source` run."""

    source: str
    model_version: str
    query_set: str | None = None
    total: int = 0
    added: int = 0
    embedded: int = 0
    duplicates: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    wall_seconds: float = 0.0

    def rate(self, stage: str) -> float:
        """Images per second through ``stage`` (0 when it processed nothing)."""
        seconds = self.seconds.get(stage, 0.0)
        return self.counts.get(stage, 0) / seconds if seconds > 0 else 0.0

    def summary(self) -> list[str]:
        """Human-readable lines (the CLI prints them)."""
        target = f"query set {self.query_set!r}" if self.query_set else "gallery"
        lines = [
            f"{self.source} -> {target} (model version {self.model_version}): "
            f"{self.total} images, {self.added} added, {self.embedded} existing items "
            f"embedded, {self.duplicates} already present, {len(self.failed)} failed, "
            f"in {self.wall_seconds:.1f}s",
            "stage      images   seconds   images/s",
        ]
        for stage in STAGES:
            lines.append(
                f"{stage:<8} {self.counts[stage]:>8} {self.seconds[stage]:>9.2f} "
                f"{self.rate(stage):>10.1f}"
            )
        if self.failed:
            lines.append(f"skipped {len(self.failed)} unreadable or corrupt files:")
            lines.extend(f"  {path}: {reason}" for path, reason in self.failed)
        return lines


@dataclass
class _Candidate:
    """One image moving through the pipeline."""

    position: int
    data: bytes
    sha256: str
    label: str
    camera: int | None
    metadata: Mapping[str, Any] | None
    source: str | None
    origin: str = ""  # the file it was read from, for the failure report
    existing_id: int | None = None  # set when only an embedding is missing
    image: Image.Image | None = None


@dataclass
class _Plan:
    """The outcome of dedup: what must be created, what only needs an embedding."""

    create: list[_Candidate] = field(default_factory=list)
    embed_existing: list[_Candidate] = field(default_factory=list)
    resolved: dict[int, int] = field(default_factory=dict)  # position -> existing id
    aliases: dict[int, str] = field(default_factory=dict)  # position -> sha in this batch

    @property
    def work(self) -> list[_Candidate]:
        return self.create + self.embed_existing


class _Timer:
    """Accumulates seconds and item counts per stage (autofaiss's Timeit, kept as numbers)."""

    def __init__(self, report: IngestReport):
        self.report = report

    def stage(self, name: str, count: int) -> contextlib.AbstractContextManager[None]:
        def record(seconds: float) -> None:
            self.report.seconds[name] += seconds
            self.report.counts[name] += count

        return timed(record)


# --------------------------------------------------------------------------- service path


def add_items(
    items: Sequence[NewItem], *, session_factory: sessionmaker[Session], media: MediaStore,
    embedder: Embedder, limits: DecodeLimits | None = None, require_active: bool = False,
) -> AddedItems:
    """Add uploaded images to the gallery in one transaction (all or nothing).

    Plans in a short read, decodes and embeds with no transaction open, then writes under the
    gallery write lock after planning again (see the module docstring). Nothing is in the
    index yet: pass ``vector_ids``/``vectors``/``infos`` to ``Searcher.add`` after this
    returns (the rows are committed by then).

    Decoding goes through ``imgret.images.embed_encoded``: every header is priced against the
    request's pixel budget first, then one image at a time is decoded (under the process's
    decode gate), shrunk and turned into model input, so memory stays bounded whatever the
    number of files.

    Args:
        items: the images, with label, camera and metadata.
        session_factory: sessions on the gallery database.
        media: where image bytes are stored.
        embedder: the one embedding path (its model version is registered; the first one
            becomes active).
        limits: the decoding limits (``DecodeLimits.from_settings``; default the built-in
            ones).
        require_active: refuse (``store.ModelSwitched``) unless the embedder's version is
            the active one when the write commits (the service: an item acknowledged after a
            switch must have the new version's vector).

    Returns:
        The ids (input order) and the new vectors; see :class:`AddedItems`.

    Raises:
        ImageDecodeError: an item is not a decodable image, or the request is over its pixel
            budget (``ImageTooLarge``); the message starts with ``images[i]``. Nothing is
            written.
    """
    limits = limits or DecodeLimits()
    cands = [
        _Candidate(i, it.data, sha256_hex(it.data), it.label, it.camera, it.metadata, it.source)
        for i, it in enumerate(items)
    ]
    with session_factory.begin() as session:
        model_version = store.register_model_version(
            session=session, version=embedder.model_version, dim=embedder.dim,
            config=embedder.spec.to_dict(),
        )
        plan = _make_plan(cands, session=session, model_version=model_version, query_set=None)
    vectors_by_sha: dict[str, np.ndarray] = {}
    # Each round embeds what the last plan needed; a new round is needed only when an item
    # that was already stored got deleted in between (rare), so two rounds nearly always do.
    for _ in range(_PLAN_ROUNDS):
        todo = [c for c in plan.work if c.sha256 not in vectors_by_sha]
        if todo:
            vectors = embed_encoded([c.data for c in todo], embedder=embedder, limits=limits,
                                    names=[f"images[{c.position}]" for c in todo])
            vectors_by_sha.update(zip((c.sha256 for c in todo), vectors, strict=True))
        with session_factory.begin() as session:
            if require_active:
                store.lock_gallery_writes(session=session)
                store.check_active(session=session, version=model_version)
            plan, ids_by_sha = _write_planned(cands, vectors_by_sha, session=session,
                                              media=media, model_version=model_version,
                                              query_set=None)
            if ids_by_sha is None:
                continue
            existing = store.get_items(
                [*plan.resolved.values(), *(c.existing_id for c in plan.embed_existing)],
                session=session,
            )
        break
    else:
        raise GalleryError("the gallery changed under this upload too often; send it again")
    ids = [
        plan.resolved[c.position] if c.position in plan.resolved
        else ids_by_sha[plan.aliases.get(c.position, c.sha256)]
        for c in cands
    ]
    created_positions = {c.position for c in plan.create}
    created = [c.position in created_positions for c in cands]
    work = plan.work
    return AddedItems(
        ids=ids,
        created=created,
        vector_ids=np.array([ids_by_sha[c.sha256] for c in work], dtype=np.int64),
        vectors=_stack(vectors_by_sha, work, embedder.dim),
        infos=[ItemInfo(c.label, c.camera, dict(c.metadata or {})) for c in work],
        model_version=model_version.version,
        existing={
            position: ItemInfo(row.label, row.camera, dict(row.meta or {}))
            for position, item_id in enumerate(ids)
            if not created[position] and (row := existing.get(item_id)) is not None
        },
    )


# --------------------------------------------------------------------------- bulk path


def ingest_source(
    source: str | Path, *, session_factory: sessionmaker[Session], media: MediaStore,
    embedder: Embedder, query_set: str | None = None, chunk_size: int = 256,
    max_pixels: int = DEFAULT_MAX_PIXELS, workers: int | None = None, progress: bool = True,
) -> IngestReport:
    """Ingest a data source (ImageFolder tree, CSV manifest, Market-1501 folder).

    Each chunk of ``chunk_size`` files is read, deduplicated against the database, decoded,
    embedded (``embedder.batch_size`` images per forward pass) and written in its own
    transaction, so an interrupted run loses only the chunk in flight, and running it again
    resumes where it stopped.

    Args:
        source: what ``imgret.datasets.list_records`` accepts.
        session_factory: makes sessions on the target database (schema at head).
        media: the media store.
        embedder: the one embedding path; its model version is registered (the first one
            registered becomes the active one).
        query_set: put the images in this named query set instead of the gallery.
        chunk_size: files per transaction.
        max_pixels: decompression-bomb limit.
        workers: threads reading and decoding files (Pillow releases the GIL); default
            ``min(4, cpu count)``.
        progress: show a tqdm bar.

    Returns:
        An :class:`IngestReport`; corrupt or unreadable files are listed in ``failed``.
    """
    from imgret.datasets import list_records

    started = time.perf_counter()
    source = Path(source)
    records = list_records(source)
    root = source if source.is_dir() else source.parent
    with session_factory.begin() as session:
        model_version = store.register_model_version(
            session=session, version=embedder.model_version, dim=embedder.dim,
            config=embedder.spec.to_dict(),
        )
        target = store.get_or_create_query_set(query_set, session=session) if query_set else None
    report = IngestReport(str(source), model_version.version, query_set, total=len(records))
    timer = _Timer(report)
    workers = workers or min(4, os.cpu_count() or 1)
    logger.info(
        "ingesting %d images from %s into %s", len(records), source,
        f"query set {query_set!r}" if query_set else "the gallery",
    )
    with ThreadPoolExecutor(max_workers=workers) as pool, tqdm(
        total=len(records), unit="img", desc="ingest", disable=not progress
    ) as bar:
        for start in range(0, len(records), chunk_size):
            chunk = records[start : start + chunk_size]
            _ingest_chunk(
                chunk, start, root, pool=pool, timer=timer, session_factory=session_factory,
                media=media, embedder=embedder, model_version=model_version, query_set=target,
                max_pixels=max_pixels,
            )
            bar.update(len(chunk))
    report.wall_seconds = time.perf_counter() - started
    for path, reason in report.failed:
        logger.warning("skipped %s: %s", path, reason)
    return report


def _ingest_chunk(
    records, offset: int, root: Path, *, pool: ThreadPoolExecutor, timer: _Timer,
    session_factory: sessionmaker[Session], media: MediaStore, embedder: Embedder,
    model_version: ModelVersion, query_set: QuerySet | None, max_pixels: int,
) -> None:
    report = timer.report
    with timer.stage("read", len(records)):
        results = list(pool.map(_read_file, [r.path for r in records]))
    cands: list[_Candidate] = []
    for position, (record, (data, error)) in enumerate(zip(records, results, strict=True)):
        if error is not None:
            report.failed.append((str(record.path), error))
            continue
        cands.append(
            _Candidate(offset + position, data, sha256_hex(data), record.label, record.camera,
                       None, _relative(record.path, root), origin=str(record.path))
        )
    vectors_by_sha: dict[str, np.ndarray] = {}
    with timer.stage("dedup", len(cands)), session_factory() as session:
        plan = _make_plan(cands, session=session, model_version=model_version,
                          query_set=query_set)
    for _ in range(_PLAN_ROUNDS):
        work = [c for c in plan.work if c.sha256 not in vectors_by_sha]
        with timer.stage("decode", len(work)):
            decoded = list(pool.map(
                lambda c: _decode(c, max_pixels, embedder.spec.image_size), work
            ))
        errors = {c.sha256: error for c, error in zip(work, decoded, strict=True) if error}
        # Copies of a corrupt file (same bytes) fail with it, each under its own name.
        failed = {c.position for c in cands if c.sha256 in errors
                  and c.position not in plan.resolved}
        report.failed.extend((c.origin, errors[c.sha256]) for c in cands
                             if c.position in failed)
        if failed:
            cands = [c for c in cands if c.position not in failed]
        todo = [c for c in work if c.sha256 not in errors]
        with timer.stage("embed", len(todo)):
            vectors = embedder.embed([c.image for c in todo])
        vectors_by_sha.update(zip((c.sha256 for c in todo), vectors, strict=True))
        for cand in todo:
            cand.image = None
        with timer.stage("write", len(todo)), session_factory.begin() as session:
            plan, ids_by_sha = _write_planned(cands, vectors_by_sha, session=session,
                                              media=media, model_version=model_version,
                                              query_set=query_set)
        if ids_by_sha is not None:
            break
        # Another writer deleted an item this chunk meant to re-use: embed it too.
        logger.info("the gallery changed under this chunk; planning it again")
    else:
        raise GalleryError("the gallery changed under this chunk too often; run ingest again")
    report.added += len(plan.create)
    report.embedded += len(plan.embed_existing)
    report.duplicates += len(cands) - len(plan.create) - len(plan.embed_existing)


def _read_file(path: Path) -> tuple[bytes, str | None]:
    try:
        return path.read_bytes(), None
    except OSError as exc:
        return b"", f"cannot read file ({exc.strerror})"


def _decode(cand: _Candidate, max_pixels: int, size: int) -> str | None:
    # The served path's decoder (JPEG draft, shrink towards the model's input at once): the
    # same preprocessing as a search of the same file, and a chunk of large photos holds
    # small images, not chunk_size full-size ones.
    try:
        cand.image = decode_for_embedding(cand.data, size=size, max_pixels=max_pixels)
    except ImageDecodeError as exc:
        return str(exc)
    return None


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- shared stages


def _make_plan(
    cands: list[_Candidate], *, session: Session, model_version: ModelVersion,
    query_set: QuerySet | None,
) -> _Plan:
    existing = store.find_items((c.sha256 for c in cands), session=session, query_set=query_set)
    embedded = store.ids_with_embedding(existing.values(), session=session, query_set=query_set,
                                        model_version_id=model_version.id)
    return _split(cands, existing, embedded)


def _split(cands: list[_Candidate], existing: dict[str, int], embedded: set[int]) -> _Plan:
    plan = _Plan()
    first: dict[str, _Candidate] = {}
    for cand in cands:
        item_id = existing.get(cand.sha256)
        if item_id is not None and item_id in embedded:
            plan.resolved[cand.position] = item_id
        elif cand.sha256 in first:
            plan.aliases[cand.position] = cand.sha256  # same bytes twice in this batch
        else:
            first[cand.sha256] = cand
            cand.existing_id = item_id
            (plan.create if item_id is None else plan.embed_existing).append(cand)
    return plan


def _write_planned(
    cands: list[_Candidate], vectors_by_sha: Mapping[str, np.ndarray], *, session: Session,
    media: MediaStore, model_version: ModelVersion, query_set: QuerySet | None,
) -> tuple[_Plan, dict[str, int] | None]:
    """Take the gallery write lock, plan again under it, and write the plan.

    Returns:
        The new plan, and sha256 -> id of its work; ``None`` instead of the ids (nothing
        written) when the new plan needs an embedding that ``vectors_by_sha`` lacks.
    """
    store.lock_gallery_writes(session=session)
    plan = _make_plan(cands, session=session, model_version=model_version, query_set=query_set)
    if any(c.sha256 not in vectors_by_sha for c in plan.work):
        return plan, None
    vectors = _stack(vectors_by_sha, plan.work, model_version.dim)
    return plan, _write(plan, vectors, session=session, media=media,
                        model_version=model_version, query_set=query_set)


def _stack(vectors_by_sha: Mapping[str, np.ndarray], work: Sequence[_Candidate],
           dim: int) -> np.ndarray:
    if not work:
        return np.zeros((0, dim), dtype=np.float32)
    return np.stack([vectors_by_sha[c.sha256] for c in work]).astype(np.float32, copy=False)


def _write(
    plan: _Plan, vectors: np.ndarray, *, session: Session, media: MediaStore,
    model_version: ModelVersion, query_set: QuerySet | None,
) -> dict[str, int]:
    """Store media and rows (gallery items, or items of ``query_set``); returns sha256 -> id
    for every candidate of the plan.

    The caller holds the gallery write lock (:func:`_write_planned`).
    """
    n_create = len(plan.create)
    rows = [_store_media(c, media) for c in plan.create]
    new_ids = store.insert_items(rows, vectors[:n_create], session=session,
                                 model_version=model_version, query_set=query_set)
    existing_ids = [c.existing_id for c in plan.embed_existing]
    store.add_embeddings(existing_ids, vectors[n_create:], session=session,
                         model_version=model_version, query_set=query_set)
    ids = {c.sha256: i for c, i in zip(plan.create, new_ids, strict=True)}
    ids.update({c.sha256: c.existing_id for c in plan.embed_existing})
    return ids


def _store_media(cand: _Candidate, media: MediaStore) -> NewRow:
    path = media.put(cand.data, cand.sha256)
    return NewRow(
        sha256=cand.sha256, media_path=path, content_type=sniff_content_type(cand.data),
        label=cand.label, camera=cand.camera, metadata=cand.metadata, source=cand.source,
    )
