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
points to; ``index.gc.sweep_media`` removes it at the next start (with the database media
backend the bytes are written in the rows' transaction, so nothing is left). Rows are written
in one transaction per chunk, so there is never an item without its embedding and change row.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from imgret.embedder import Embedder
from imgret.errors import GalleryError, ImageDecodeError
from imgret.files import read_file
from imgret.images import (
    DEFAULT_MAX_PIXELS,
    DecodeLimits,
    decode_for_embedding,
    embed_encoded,
)
from imgret.process import frozen_long_lived
from imgret.timing import timed
from index import store
from index.media import MediaBackend, MediaStore, sha256_hex, sniff_content_type
from index.models import ModelVersion, QuerySet
from index.store import ItemInfo, NewRow

if TYPE_CHECKING:
    import torch

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
    # Seconds before the first chunk reached the writer on Ray (its actors starting and
    # loading the model); 0 for the plain ingest, whose start-up is in its stages.
    startup_seconds: float = 0.0

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
            f"in {self.wall_seconds:.1f}s"
            + (f" ({self.startup_seconds:.1f}s of it starting Ray actors)"
               if self.startup_seconds else ""),
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
    staged: str | None = None  # a temporary media file of its bytes (MediaStore.stage)


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
        return timed(lambda seconds: self.add(name, count, seconds))

    def add(self, name: str, count: int, seconds: float) -> None:
        """Count ``count`` images and ``seconds`` (timed elsewhere: a worker) for a stage."""
        self.report.seconds[name] += seconds
        self.report.counts[name] += count


# --------------------------------------------------------------------------- service path


def add_items(
    items: Sequence[NewItem], *, session_factory: sessionmaker[Session], media: MediaBackend,
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
    source: str | Path, *, session_factory: sessionmaker[Session], media: MediaBackend,
    embedder: Embedder, query_set: str | None = None, chunk_size: int = 256,
    max_pixels: int = DEFAULT_MAX_PIXELS, workers: int | None = None, progress: bool = True,
) -> IngestReport:
    """Ingest a data source (ImageFolder tree, CSV manifest, Market-1501 folder).

    Each chunk of ``chunk_size`` files is read, deduplicated against the database, decoded,
    embedded (``embedder.batch_size`` images per forward pass) and written in its own
    transaction, so an interrupted run loses only the chunk in flight, and running it again
    resumes where it stopped.

    The stages overlap (see :class:`_EmbedWorkers`): worker processes decode, preprocess and
    (on the CPU) embed the images of the next slices while this process reads, hashes and
    plans the chunk after, and a writer thread writes the one before (media made durable as
    one batch, then the rows, under the gallery write lock); one write at a time, so chunks
    commit in source order. The report's stage seconds are summed over the processes doing
    the stage, so they add up to more than the wall time.

    Args:
        source: what ``imgret.datasets.list_records`` accepts.
        session_factory: makes sessions on the target database (schema at head).
        media: the media store.
        embedder: the one embedding path; its model version is registered (the first one
            registered becomes the active one).
        query_set: put the images in this named query set instead of the gallery.
        chunk_size: files per transaction.
        max_pixels: decompression-bomb limit.
        workers: processes decoding, preprocessing and embedding images (one torch thread
            each); default :func:`default_workers`; ``0`` does all of it in this process (so
            does a platform without ``fork``).
        progress: show a tqdm bar (committed images, and images/s).

    Returns:
        An :class:`IngestReport`; corrupt or unreadable files are listed in ``failed``.
    """
    from imgret.datasets import list_records

    started = time.perf_counter()
    source = Path(source)
    if workers is None:
        workers = default_workers(embedder)
    # The workers are forked first: they warm up (a fresh process's first slice took ~20 ms
    # more than later ones, ~290 ms when it was the first decode ever: _warm_up) while this
    # process lists the source and reads the first chunk; and before tqdm's monitor thread
    # exists. The objects that exist by then (the imports, the model) are frozen out of
    # garbage collection first: a full collection scanning them stopped this process for
    # 200-300 ms once per few thousand images, and the workers inherit them frozen.
    with frozen_long_lived(), _EmbedWorkers(embedder, max_pixels, workers,
                                            media=media if media.stages_files else None
                                            ) as pool:
        records = list_records(source)
        root = source if source.is_dir() else source.parent
        model_version, target = register_target(
            session_factory, version=embedder.model_version, dim=embedder.dim,
            config=embedder.spec.to_dict(), query_set=query_set,
        )
        report = IngestReport(str(source), model_version.version, query_set,
                              total=len(records))
        logger.info(
            "ingesting %d images from %s into %s", len(records), source,
            f"query set {query_set!r}" if query_set else "the gallery",
        )
        _ingest_chunks(records, root, pool=pool, report=report, chunk_size=chunk_size,
                       session_factory=session_factory, media=media, embedder=embedder,
                       model_version=model_version, query_set=target, progress=progress)
    report.wall_seconds = time.perf_counter() - started
    for path, reason in report.failed:
        logger.warning("skipped %s: %s", path, reason)
    return report


def _ingest_chunks(records: Sequence[Any], root: Path, *, pool: _EmbedWorkers,
                   report: IngestReport, chunk_size: int,
                   session_factory: sessionmaker[Session], media: MediaBackend,
                   embedder: Embedder, model_version: ModelVersion,
                   query_set: QuerySet | None, progress: bool) -> None:
    """:func:`ingest_source`'s pipeline over the listed records."""
    timer = _Timer(report)
    chunks = [records[start : start + chunk_size]
              for start in range(0, len(records), chunk_size)]
    with tqdm(total=len(records), unit="img", desc="ingest", disable=not progress) as bar:
        run = _ChunkRun(root, timer=timer, pool=pool, session_factory=session_factory,
                        media=media, embedder=embedder, model_version=model_version,
                        query_set=query_set)
        # One chunk prepared ahead (read, hashed, planned, handed to the workers) while the
        # one before it is embedded (by the workers; here on a GPU), and the one before that
        # written on the writer thread: a write mostly waits (media syncs, the database's
        # own work). One write in flight at a time, so chunks still commit in source order;
        # leaving the block (an error, Ctrl-C) waits for it, before the workers and their
        # staged files go.
        unsettled: list[_Prepared] = []  # chunks whose staged files are not renamed yet
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="imgret-ingest-writer") as writes:
                pending: tuple[_Prepared, _Embedded, Future] | None = None
                ahead: _Prepared | None = run.prepare(chunks[0], 0) if chunks else None
                for number in range(len(chunks)):
                    current = ahead
                    ahead = (run.prepare(chunks[number + 1], (number + 1) * chunk_size)
                             if number + 1 < len(chunks) else None)
                    assert current is not None
                    unsettled.append(current)
                    embedded = run.embed(current)
                    if ahead is None:
                        # Every slice is back: the workers exit while the last writes run
                        # (~15 ms at the end of a run otherwise).
                        pool.finish()
                    if pending is not None:
                        run.settle(*pending)
                        unsettled.remove(pending[0])
                        bar.update(len(pending[0].records))
                    pending = (current, embedded, writes.submit(run.write, embedded))
                if pending is not None:
                    run.settle(*pending)
                    unsettled.remove(pending[0])
                    bar.update(len(pending[0].records))
        finally:
            if pool.finished:  # the workers handed their staged files over: ours to remove
                for chunk in unsettled:
                    for cand in chunk.cands:
                        if cand.staged:
                            Path(cand.staged).unlink(missing_ok=True)


def default_workers(embedder: Embedder) -> int:
    """Worker processes of a bulk ingest: one per core when they embed (a CPU model: one
    torch thread each), else ``min(4, cores)`` decoders beside this process's GPU."""
    cores = os.cpu_count() or 1
    return cores if embedder.device == "cpu" else min(4, cores)


@dataclass
class _Prepared:
    """A chunk read, hashed and planned, its images handed to the workers."""

    records: Sequence[Any]
    cands: list[_Candidate]
    plan: _Plan
    tickets: list[tuple[int, list[_Candidate]]]  # a worker ticket, the candidates it embeds


@dataclass
class _Embedded:
    """A chunk's vectors, ready to be written."""

    cands: list[_Candidate]
    plan: _Plan
    vectors_by_sha: dict[str, np.ndarray] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # sha256 -> why decoding failed


class _ChunkRun:
    """The stages of a chunk's work: :meth:`prepare`, :meth:`embed`, :meth:`write` (on the
    writer thread) and :meth:`settle`."""

    def __init__(self, root: Path, *, timer: _Timer, pool: _EmbedWorkers,
                 session_factory: sessionmaker[Session], media: MediaBackend,
                 embedder: Embedder, model_version: ModelVersion, query_set: QuerySet | None):
        self.timer = timer
        self.report = timer.report
        self.pool = pool
        self.session_factory = session_factory
        self.media = media
        self.embedder = embedder
        self.model_version = model_version
        self.query_set = query_set
        self.writer = _ChunkWriter(timer=timer, session_factory=session_factory, media=media,
                                   model_version=model_version, query_set=query_set)
        self.sources = SourceNames(root)

    def prepare(self, records: Sequence[Any], offset: int) -> _Prepared:
        """Read and hash the files, plan against the database, submit the decoding."""
        with self.timer.stage("read", len(records)):
            cands: list[_Candidate] = []
            for position, record in enumerate(records, start=offset):
                try:
                    data = read_file(record.path)
                except OSError as exc:
                    self.report.failed.append((str(record.path),
                                               f"cannot read file ({exc.strerror})"))
                    continue
                cands.append(_Candidate(position, data, sha256_hex(data), record.label,
                                        record.camera, None, self.sources(record.path),
                                        origin=str(record.path)))
        with self.timer.stage("dedup", len(cands)), self.session_factory() as session:
            plan = _make_plan(cands, session=session, model_version=self.model_version,
                              query_set=self.query_set)
        return _Prepared(records, cands, plan, self._submit(plan.work, stage=plan.create))

    def embed(self, chunk: _Prepared) -> _Embedded:
        """Collect the chunk's vectors from the workers, slice by slice, in order."""
        embedded = _Embedded(chunk.cands, chunk.plan)
        for ticket, work in chunk.tickets:
            done = self.pool.result(ticket)
            for cand, temp in zip(work, done.staged, strict=True):
                cand.staged = temp or cand.staged
            self._record(work, done, embedded)
            self.pool.release(ticket)
        return embedded

    def write(self, embedded: _Embedded) -> tuple[list[_Candidate], _Plan, dict[str, int] | None]:
        """Write the embedded chunk in one transaction (:meth:`_ChunkWriter.write`); runs on
        the writer thread, which touches no worker and no model."""
        return self.writer.write(embedded.cands, embedded.vectors_by_sha, embedded.errors,
                                 planned=embedded.plan)

    def settle(self, chunk: _Prepared, embedded: _Embedded, written: Future) -> None:
        """Wait for the chunk's write; when the gallery changed under it (an item it meant to
        re-use was deleted), embed what the new plan needs and write again, here."""
        cands, plan, ids_by_sha = written.result()
        for _ in range(_PLAN_ROUNDS - 1):
            if ids_by_sha is not None:
                break
            logger.info("the gallery changed under this chunk; planning it again")
            # Embedded in this process: the workers' tickets of later chunks are already out,
            # and they must be collected in order.
            again = _Embedded(cands, plan, dict(embedded.vectors_by_sha))
            work = [c for c in plan.work if c.sha256 not in again.vectors_by_sha]
            for at in range(0, len(work), self.embedder.batch_size):
                part = work[at : at + self.embedder.batch_size]
                self._record(part, self.pool.embed_here(part), again)
            embedded = again
            cands, plan, ids_by_sha = self.write(again)
        if ids_by_sha is None:
            raise GalleryError("the gallery changed under this chunk too often; "
                               "run ingest again")
        created = {id(c) for c in plan.create}
        for cand in chunk.cands:  # staged for nothing: the bytes were stored meanwhile
            if cand.staged and id(cand) not in created:
                Path(cand.staged).unlink(missing_ok=True)

    def _record(self, work: list[_Candidate], done: _Slice, into: _Embedded) -> None:
        ok = [c for c, error in zip(work, done.errors, strict=True) if error is None]
        into.errors.update((c.sha256, error) for c, error in zip(work, done.errors,
                                                                 strict=True) if error)
        self.timer.add("decode", len(work), done.decode_seconds)
        self.timer.add("embed", len(ok), done.embed_seconds)
        into.vectors_by_sha.update(zip((c.sha256 for c in ok), done.vectors, strict=True))

    def _submit(self, work: list[_Candidate], stage: Sequence[_Candidate] = ()
                ) -> list[tuple[int, list[_Candidate]]]:
        size = self.embedder.batch_size
        slices = [work[at : at + size] for at in range(0, len(work), size)]
        new = {id(c) for c in stage}
        return [(self.pool.submit(part, stage=[id(c) in new for c in part]), part)
                for part in slices]


# --------------------------------------------------------------------------- workers


@dataclass
class _Slice:
    """What became of one slice: the vectors of the candidates that decoded (``(k, d)``
    float32, in order), per candidate ``None`` or why it failed and the temporary media file
    staged for it (or ``None``), and the seconds spent decoding and embedding it, wherever
    that ran."""

    vectors: np.ndarray
    errors: list[str | None]
    staged: list[str | None]
    decode_seconds: float = 0.0
    embed_seconds: float = 0.0


@dataclass
class _Task:
    """One slice handed to the workers, and where it stands."""

    work: list[_Candidate]
    stage: list[bool]  # per candidate: also stage its bytes in the media store
    worker: int | None = None  # the worker it was sent to; None: not sent (yet)
    slot: int = -1
    done: _Slice | None = None  # embedded in this process


class _EmbedWorkers:
    """Decoding, preprocessing (``decode_for_embedding`` + ``Embedder.preprocess``, the
    served path's) and, on the CPU, the forward passes, in forked worker processes,
    overlapped with this process's reading, hashing, planning, media writes and SQL.

    Why processes: per image, decoding and preprocessing are mostly Python (Pillow's file
    parsing, torchvision's transforms) that holds the GIL; threads cannot run them beside
    each other. Forked (not spawned): the workers start in milliseconds with the model, its
    transform and the decoding code already loaded, and nothing is pickled but file paths.

    Why the forward passes too (on the CPU): with decoding cheap, the forward passes were the
    ingest's critical path, run here on the one torch thread the workers left (measured on 2
    cores, the demo's model: 0.70 s of a 1.13 s ingest of 3,000 images). Each worker now runs
    whole slices with one torch thread (a forked child cannot use more once this process has
    run OpenMP on several), so on the CPU there is one worker per core by default: as many
    forward passes at a time as cores, no OpenMP team to stall when this process's writer
    takes a core, and only vectors come back. On a GPU the workers only decode (a forked
    child cannot use CUDA; ``min(4, cores)`` of them) and this process runs the model.
    Memory: the weights are shared with this process (forked, never written), but each
    worker holds one batch's activations at a time, so ``workers`` forward passes are in
    memory at once where there was one (``--workers`` / ``--batch-size`` bound it).

    Protocol: a task is one slice of candidates (at most ``batch_size``: one forward pass),
    sent as ``(slot, [(path, sha256, stage), ...])``; the worker reads each file again, checks
    that its bytes still hash to ``sha256`` (a file changed since it was hashed fails),
    decodes and preprocesses it, embeds the slice (on the CPU), writes the ``(k, d)`` vectors
    (or the ``(k, 3, S, S)`` inputs) into that slot of its shared-memory buffer and answers
    ``(k, errors, staged, decode seconds, embed seconds)``. With ``stage`` (an image the
    plan creates) it also writes the bytes to a temporary file in the media store
    (``MediaStore.stage``: file creation is most of a media write's cost), which the chunk's
    write transaction syncs and renames under the gallery write lock (``put_many``); a worker
    removes the temporary files it made that are still there when it exits. Messages are a few
    hundred bytes, so no pipe ever fills. Each worker has ``_SLOTS`` slots; slices wait in a
    queue until a slot is free (:meth:`release` frees one), which bounds the memory whatever
    the chunk size. A worker ignores SIGINT and exits when its pipe closes (this process
    ended, or was killed), or when :meth:`finish` says no slice is left (it then leaves its
    staged files to this process). If a worker dies, the rest of the run is embedded in this
    process; with ``workers == 0`` (or no ``fork``) everything is, when :meth:`result` asks
    for it.

    While workers run, torch's intra-op threads in this process are limited to the cores the
    workers leave (at least one), and restored on exit.
    """

    def __init__(self, embedder: Embedder, max_pixels: int, workers: int, *,
                 media: MediaStore | None = None, embed_in_workers: bool | None = None):
        self.embedder = embedder
        self.max_pixels = max_pixels
        self.media = media
        size = embedder.spec.image_size
        self.shape = (3, size, size)
        self.workers = workers if workers > 0 and _can_fork() else 0
        # What a worker hands back per image: its vector, or (a GPU model: a forked child
        # cannot use CUDA) its model input. ``embed_in_workers`` forces either (tests).
        self.embeds = (embedder.device == "cpu" if embed_in_workers is None
                       else embed_in_workers)
        self.row_shape = (embedder.dim,) if self.embeds else self.shape
        self.slot_bytes = embedder.batch_size * int(np.prod(self.row_shape)) * 4
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._buffers: list[mmap.mmap] = []
        self._free: list[list[int]] = []  # free slots, per worker
        self._sent: list[collections.deque[int]] = []  # tickets in flight, per worker, in order
        self._tasks: dict[int, _Task] = {}
        self._queue: collections.deque[int] = collections.deque()  # tickets not sent yet
        self._next = 0
        self._threads: int | None = None
        self.finished = False  # finish() was called: the workers' staged files are ours

    def __enter__(self) -> _EmbedWorkers:
        if self.workers:
            try:
                self._start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- lifecycle

    def _start(self) -> None:
        import multiprocessing

        import torch

        context = multiprocessing.get_context("fork")
        parent_ends: list[Any] = []
        for _ in range(self.workers):
            buffer = mmap.mmap(-1, _SLOTS * self.slot_bytes)  # MAP_SHARED: the child's too
            mine, theirs = context.Pipe()
            parent_ends.append(mine)
            process = context.Process(
                target=_embed_worker, name="imgret-ingest-worker", daemon=True,
                args=(theirs, list(parent_ends), buffer, self.slot_bytes, self.embedder,
                      self.max_pixels, self.media, self.embeds),
            )
            process.start()
            theirs.close()
            self._procs.append(process)
            self._conns.append(mine)
            self._buffers.append(buffer)
            self._free.append(list(range(_SLOTS)))
            self._sent.append(collections.deque())
        self._threads = torch.get_num_threads()
        torch.set_num_threads(max(1, min(self._threads, (os.cpu_count() or 1) - self.workers)))
        logger.debug("%d workers (%s); torch threads here %d -> %d", self.workers,
                     "decode + embed" if self.embeds else "decode", self._threads,
                     torch.get_num_threads())

    def finish(self) -> None:
        """No more slices: each worker exits now, beside this process's last writes,
        instead of at :meth:`close`. Call once every ticket was collected; the files the
        workers staged are then this process's to rename or remove (a worker leaves them).
        If this process is killed before it does, those files stay until ``imgret gc``
        sweeps them (``MediaStore.sweep_temporaries``: their writers are gone), where a
        worker seeing its parent die would have removed them: a window of the run's last
        write or two."""
        self.finished = True
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(_FINISH)

    def close(self) -> None:
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(None)
                conn.close()
        for process in self._procs:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        # The buffers are unmapped with their last view (a caller may still hold inputs).
        self._procs, self._conns, self._buffers = [], [], []
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
            self._threads = None

    # -- tasks

    def submit(self, work: list[_Candidate], stage: list[bool] | None = None) -> int:
        """Queue a slice (at most ``batch_size`` candidates) for embedding, and for staging
        the bytes of those flagged in ``stage``; returns its ticket. Tickets must be collected
        (:meth:`result`, then :meth:`release`) in this order."""
        ticket, self._next = self._next, self._next + 1
        self._tasks[ticket] = _Task(work, stage or [False] * len(work))
        self._queue.append(ticket)
        self._pump()
        return ticket

    def result(self, ticket: int) -> _Slice:
        """The slice's vectors, errors and staged files (see :class:`_Slice`)."""
        task = self._tasks[ticket]
        self._pump()
        if task.worker is not None:
            try:
                while True:  # a worker answers in the order it got its tasks
                    count, errors, staged, decode_s, embed_s = self._conns[task.worker].recv()
                    if self._sent[task.worker].popleft() == ticket:
                        break
            except (EOFError, OSError):
                self._lost(task.worker)
            else:
                rows = np.frombuffer(
                    self._buffers[task.worker], dtype=np.float32,
                    count=count * int(np.prod(self.row_shape)),
                    offset=task.slot * self.slot_bytes,
                ).reshape(count, *self.row_shape)
                if self.embeds:  # copied: the slot takes another slice once released
                    return _Slice(rows.copy(), errors, staged, decode_s, embed_s)
                import torch

                vectors, embed_s = self._embed(torch.from_numpy(rows))
                return _Slice(vectors, errors, staged, decode_s, embed_s)
        if task.done is None:
            self._queue.remove(ticket)
            task.done = self.embed_here(task.work)
        return task.done

    def release(self, ticket: int) -> None:
        """The slice's inputs are no longer used: its slot takes the next queued slice."""
        task = self._tasks.pop(ticket)
        if task.worker is not None and self._conns[task.worker] is not None:
            self._free[task.worker].append(task.slot)
        self._pump()

    def _pump(self) -> None:
        """Send queued slices, oldest first, to the workers with free slots."""
        while self._queue:
            live = [w for w, conn in enumerate(self._conns) if conn is not None and self._free[w]]
            if not live:
                return
            worker = max(live, key=lambda w: len(self._free[w]))
            ticket = self._queue[0]
            task = self._tasks[ticket]
            slot = self._free[worker].pop()
            try:
                self._conns[worker].send((slot, [(c.origin, c.sha256, flag) for c, flag
                                                 in zip(task.work, task.stage, strict=True)]))
            except OSError:
                self._lost(worker)
                continue
            self._queue.popleft()
            task.worker, task.slot = worker, slot
            self._sent[worker].append(ticket)

    def _lost(self, worker: int) -> None:
        """A worker died: stop using workers; whatever was sent is embedded here instead."""
        process = self._procs[worker]
        process.join(timeout=1)
        logger.warning("ingest worker %s ended (exit code %s); embedding in this process",
                       process.pid, process.exitcode)
        for index, conn in enumerate(self._conns):
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(None)
                conn.close()
                self._conns[index] = None
        for sent in self._sent:
            for ticket in sent:
                self._tasks[ticket].worker = None
            sent.clear()
        # Not sent: they stay in the queue, which is decoded here from now on, in order.
        self._queue = collections.deque(sorted(
            [t for t, task in self._tasks.items() if task.worker is None and task.done is None]
        ))

    def embed_here(self, work: list[_Candidate]) -> _Slice:
        """Decode, preprocess and embed a slice in this process, outside the ticket order."""
        import torch

        start = time.perf_counter()
        inputs, errors = decode_slice([(c.data, c.sha256, None) for c in work], self.embedder,
                                      self.max_pixels)
        decode_s = time.perf_counter() - start
        vectors, embed_s = self._embed(torch.from_numpy(inputs))
        return _Slice(vectors, errors, [None] * len(work), decode_s, embed_s)

    def _embed(self, inputs: torch.Tensor) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        vectors = self.embedder.embed_tensors(inputs)
        return vectors, time.perf_counter() - start


# Shared-memory slots per worker: one being written, one waiting to be collected, one queued
# ahead.
_SLOTS = 3
# Told to a worker by _EmbedWorkers.finish (None, or its pipe closing, ends it too, but
# removes the files it staged).
_FINISH = "finish"


def _can_fork() -> bool:
    import multiprocessing

    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _embed_worker(conn, close: list, buffer: mmap.mmap, slot_bytes: int, embedder: Embedder,
                  max_pixels: int, media: MediaStore | None, embeds: bool) -> None:
    """A worker's loop (a forked child of the ingesting process)."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for other in close:  # the parent's ends: EOF here once the parent is gone
        other.close()
    # One thread: a child forked after its parent ran OpenMP regions on several threads
    # hangs in its first multi-threaded region (GNU libgomp keeps no pool across fork;
    # measured here: a resnet18 forward with 2 threads in the child never returned).
    torch.set_num_threads(1)
    _warm_up(embedder, max_pixels, embeds)
    temps: list[str] = []
    try:
        while True:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                return
            if task is None:
                return
            if task == _FINISH:
                temps = []  # every slice was collected: the parent renames or removes them
                return
            slot, items = task
            blobs: list[tuple[bytes | None, str, str | None]] = []
            for path, sha, _ in items:
                try:
                    blobs.append((read_file(path), sha, None))
                except OSError as exc:
                    blobs.append((None, sha, f"cannot read file ({exc.strerror})"))
            decoded = time.perf_counter()
            inputs, errors = decode_slice(blobs, embedder, max_pixels)
            embedded = time.perf_counter()
            rows = embedder.embed_tensors(torch.from_numpy(inputs)) if embeds else inputs
            done = time.perf_counter()
            staged: list[str | None] = [None] * len(items)
            if media is not None:
                for index, ((data, _, _), (_, sha, stage)) in enumerate(zip(blobs, items,
                                                                             strict=True)):
                    if stage and errors[index] is None and data is not None:
                        with contextlib.suppress(OSError):  # the writer writes it instead
                            staged[index] = media.stage(data, sha)
                            temps.append(staged[index])
            flat = rows.reshape(-1)
            np.frombuffer(buffer, dtype=np.float32, count=flat.size,
                          offset=slot * slot_bytes)[:] = flat
            try:
                conn.send((len(rows), errors, staged, embedded - decoded, done - embedded))
            except OSError:
                return
    finally:
        # Those the parent renamed are gone; the rest (a failed or killed run) are removed.
        for temp in temps:
            with contextlib.suppress(OSError):
                os.unlink(temp)


def _warm_up(embedder: Embedder, max_pixels: int, embeds: bool) -> None:
    """Decode (and embed) one blank image, so that a fresh worker's one-off costs are paid
    before its first slice, while the parent lists and reads: measured on 2 cores with the
    demo's model, a worker's first slice of 64 took 43-53 ms to decode and embed against
    25-28 ms for the next ones (~290 ms when it was the process's first decode ever, Pillow
    and torch setting up), and 29-34 ms after this. Best effort: a failure here is the
    first slice's to report."""
    import io

    import torch
    from PIL import Image

    try:
        size = embedder.spec.image_size
        buffer = io.BytesIO()
        Image.new("RGB", (size, size)).save(buffer, "PNG")
        data = buffer.getvalue()
        inputs, _ = decode_slice([(data, sha256_hex(data), None)], embedder, max_pixels)
        if embeds and len(inputs):
            embedder.embed_tensors(torch.from_numpy(inputs))
    except Exception:  # noqa: BLE001 - only a warm-up
        logger.debug("ingest worker warm-up failed", exc_info=True)


def decode_slice(blobs: Sequence[tuple[bytes | None, str, str | None]], embedder: Embedder,
                  max_pixels: int) -> tuple[np.ndarray, list[str | None]]:
    """Decode and preprocess encoded images: ``(k, 3, S, S)`` float32 inputs of those that
    worked, in order, and per image ``None`` or why it failed."""
    size = embedder.spec.image_size
    inputs: list[np.ndarray] = []
    errors: list[str | None] = []
    for data, sha, read_error in blobs:
        if data is None:
            errors.append(read_error or "cannot read file")
            continue
        if sha256_hex(data) != sha:
            errors.append("the file changed while it was being ingested; run ingest again")
            continue
        # The served path's decoder (JPEG draft, shrink towards the model's input at once):
        # the same preprocessing as a search of the same file, and a slice of large photos
        # holds small images, not full-size ones.
        try:
            image = decode_for_embedding(data, size=size, max_pixels=max_pixels)
        except ImageDecodeError as exc:
            errors.append(str(exc))
            continue
        try:
            inputs.append(embedder.preprocess([image]).numpy())
        except Exception as exc:  # noqa: BLE001 - an odd image fails alone
            errors.append(f"cannot prepare the image for the model ({exc})")
            continue
        errors.append(None)
    if not inputs:
        return np.zeros((0, 3, size, size), dtype=np.float32), errors
    return np.concatenate(inputs), errors


# --------------------------------------------------------------------------- shared stages


def register_target(
    session_factory: sessionmaker[Session], *, version: str, dim: int,
    config: Mapping[str, Any], query_set: str | None,
) -> tuple[ModelVersion, QuerySet | None]:
    """Register the model version being ingested (the first one registered becomes active)
    and find or make the named query set; what the bulk writers write against."""
    with session_factory.begin() as session:
        model_version = store.register_model_version(session=session, version=version, dim=dim,
                                                     config=dict(config))
        target = store.get_or_create_query_set(query_set, session=session) if query_set else None
    return model_version, target


class SourceNames:
    """An image's ``source`` as stored: its path relative to the ingested folder (the path
    itself when it lies outside)."""

    def __init__(self, root: Path):
        self.root = root
        self._folders: dict[str, str | None] = {}  # folder -> its path relative to root

    def __call__(self, path: str | Path) -> str:
        # The folder's resolution is cached (resolve() is a few system calls per file), and
        # keyed by the path's text: splitting a string costs 0.2 us a file, pathlib's parent
        # and name 4.7 us (14 % of a chunk's preparation in a profile of the demo's ingest).
        text = os.fspath(path)
        head, _, name = text.rpartition(os.sep)
        folder = self._folders.get(head, ...)
        if folder is ...:
            parent = Path(path).parent
            try:
                folder = str(parent.resolve().relative_to(self.root.resolve()))
            except ValueError:
                folder = None
            self._folders[head] = folder
        if folder is None or not name:
            return str(Path(path))
        return name if folder == "." else f"{folder}/{name}"


@dataclass(frozen=True)
class EmbeddedChunk:
    """Images decoded and embedded elsewhere (the Ray path's actors), ready to be written by
    :func:`write_embedded`. One entry per image, in source order.

    Attributes:
        positions: each image's index in the source (orders copies of the same bytes).
        paths: the file read (the failure report names it).
        labels, cameras: what the source says (camera ``None`` when it has none).
        sources: the stored ``source`` (:class:`SourceNames`).
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
    """Write one chunk of already embedded images exactly as :func:`ingest_source` writes its
    chunks (the same :class:`_ChunkWriter`): failures reported, media bytes durable, then the
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
    cands: list[_Candidate] = []
    errors: dict[str, str] = {}
    vectors_by_sha: dict[str, np.ndarray] = {}
    for i, position in enumerate(chunk.positions):
        data, error, path = chunk.data[i], chunk.errors[i], str(chunk.paths[i])
        if data is None:  # unreadable: reported like the plain ingest's read stage does
            report.failed.append((path, error or "cannot read file"))
            continue
        sha = chunk.sha256[i]
        cands.append(_Candidate(int(position), data, sha, chunk.labels[i], chunk.cameras[i],
                                None, chunk.sources[i], origin=path))
        if error:
            errors[sha] = error
        else:
            vectors_by_sha[sha] = chunk.vectors[i]
    writer = _ChunkWriter(timer=_Timer(report), session_factory=session_factory, media=media,
                          model_version=model_version, query_set=query_set)
    _, _, ids_by_sha = writer.write(cands, vectors_by_sha, errors, planned=None)
    if ids_by_sha is None:
        raise GalleryError("an image to write has no vector; run ingest again")


@dataclass
class _ChunkWriter:
    """The write half of a bulk chunk, shared by :func:`ingest_source` and
    :func:`write_embedded` (the Ray path)."""

    timer: _Timer
    session_factory: sessionmaker[Session]
    media: MediaBackend
    model_version: ModelVersion
    query_set: QuerySet | None

    def write(
        self, cands: list[_Candidate], vectors_by_sha: Mapping[str, np.ndarray],
        errors: Mapping[str, str], *, planned: _Plan | None,
    ) -> tuple[list[_Candidate], _Plan, dict[str, int] | None]:
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
            plan, ids_by_sha = _write_planned(cands, vectors_by_sha, session=session,
                                              media=self.media,
                                              model_version=self.model_version,
                                              query_set=self.query_set)
        if ids_by_sha is not None:
            report.added += len(plan.create)
            report.embedded += len(plan.embed_existing)
            report.duplicates += len(cands) - len(plan.create) - len(plan.embed_existing)
        return cands, plan, ids_by_sha



def _make_plan(
    cands: list[_Candidate], *, session: Session, model_version: ModelVersion,
    query_set: QuerySet | None,
) -> _Plan:
    known = store.known_items((c.sha256 for c in cands), session=session, query_set=query_set,
                              model_version_id=model_version.id)
    return _split(cands, known.ids, known.embedded)


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
    media: MediaBackend, model_version: ModelVersion, query_set: QuerySet | None,
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
    plan: _Plan, vectors: np.ndarray, *, session: Session, media: MediaBackend,
    model_version: ModelVersion, query_set: QuerySet | None,
) -> dict[str, int]:
    """Store media and rows (gallery items, or items of ``query_set``); returns sha256 -> id
    for every candidate of the plan.

    The caller holds the gallery write lock (:func:`_write_planned`).
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
    new_ids = store.insert_items(rows, vectors[:n_create], session=session,
                                 model_version=model_version, query_set=query_set)
    existing_ids = [c.existing_id for c in plan.embed_existing]
    store.add_embeddings(existing_ids, vectors[n_create:], session=session,
                         model_version=model_version, query_set=query_set)
    ids = {c.sha256: i for c, i in zip(plan.create, new_ids, strict=True)}
    ids.update({c.sha256: c.existing_id for c in plan.embed_existing})
    return ids
