"""The bulk ingest: a folder / CSV / Market-1501 source, in chunks that each commit on their
own (``imgret ingest``).

Corrupt files are skipped and reported at the end, never abort the run. Each chunk is read,
hashed and planned here (:mod:`imgret.gallery.ingest.plan`), decoded and embedded by the worker pool
(:mod:`imgret.gallery.ingest.workers`), and written on a writer thread
(:mod:`imgret.gallery.ingest.writer`),
the three overlapping across consecutive chunks; an interrupted run loses only the chunks in
flight and resumes by running it again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from imgret.embedder import Embedder
from imgret.errors import GalleryError
from imgret.files import read_file
from imgret.gallery.ingest.plan import PLAN_ROUNDS, Candidate, Plan, make_plan
from imgret.gallery.ingest.report import IngestReport, StageTimer
from imgret.gallery.ingest.workers import EmbedWorkers, Slice, default_workers
from imgret.gallery.ingest.writer import ChunkWriter, register_target
from imgret.gallery.media.files import MediaBackend, sha256_hex
from imgret.gallery.storage.tables import ModelVersion, QuerySet
from imgret.images import DEFAULT_MAX_PIXELS
from imgret.process import frozen_long_lived

logger = logging.getLogger(__name__)


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

    The stages overlap (see :class:`~imgret.gallery.ingest.workers.EmbedWorkers`): worker processes
    decode, preprocess and (on the CPU) embed the images of the next slices while this
    process reads, hashes and plans the chunk after, and a writer thread writes the one
    before (media made durable as one batch, then the rows, under the gallery write lock);
    one write at a time, so chunks commit in source order. The report's stage seconds are
    summed over the processes doing the stage, so they add up to more than the wall time.

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
    # The workers are forked first: they warm up (a fresh process's first slice is slower
    # than the next ones) while this process lists the source and reads the first chunk; and
    # before tqdm's monitor thread exists. The objects that exist by then (the imports, the
    # model) are frozen out of garbage collection first: a full collection scanning them
    # stalls the pipeline every few thousand images, and the workers inherit them frozen.
    # Measurements of both: docs/ingest_bench.md.
    with frozen_long_lived(), EmbedWorkers(embedder, max_pixels, workers,
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


def _ingest_chunks(records: Sequence[Any], root: Path, *, pool: EmbedWorkers,
                   report: IngestReport, chunk_size: int,
                   session_factory: sessionmaker[Session], media: MediaBackend,
                   embedder: Embedder, model_version: ModelVersion,
                   query_set: QuerySet | None, progress: bool) -> None:
    """The chunks of the listed records, through :class:`_ChunkRun`'s stages."""
    timer = StageTimer(report)
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
                        # Every slice is back: the workers exit while the last writes run,
                        # not after them.
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


@dataclass
class _Prepared:
    """A chunk read, hashed and planned, its images handed to the workers."""

    records: Sequence[Any]
    cands: list[Candidate]
    plan: Plan
    tickets: list[tuple[int, list[Candidate]]]  # a worker ticket, the candidates it embeds


@dataclass
class _Embedded:
    """A chunk's vectors, ready to be written."""

    cands: list[Candidate]
    plan: Plan
    vectors_by_sha: dict[str, np.ndarray] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # sha256 -> why decoding failed


class _ChunkRun:
    """The stages of a chunk's work: :meth:`prepare`, :meth:`embed`, :meth:`write` (on the
    writer thread) and :meth:`settle`."""

    def __init__(self, root: Path, *, timer: StageTimer, pool: EmbedWorkers,
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
        self.writer = ChunkWriter(timer=timer, session_factory=session_factory, media=media,
                                  model_version=model_version, query_set=query_set)
        self.sources = SourceNames(root)

    def prepare(self, records: Sequence[Any], offset: int) -> _Prepared:
        """Read and hash the files, plan against the database, submit the decoding."""
        with self.timer.stage("read", len(records)):
            cands: list[Candidate] = []
            for position, record in enumerate(records, start=offset):
                try:
                    data = read_file(record.path)
                except OSError as exc:
                    self.report.failed.append((str(record.path),
                                               f"cannot read file ({exc.strerror})"))
                    continue
                cands.append(Candidate(position, data, sha256_hex(data), record.label,
                                       record.camera, None, self.sources(record.path),
                                       origin=str(record.path)))
        with self.timer.stage("dedup", len(cands)), self.session_factory() as session:
            plan = make_plan(cands, session=session, model_version=self.model_version,
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

    def write(self, embedded: _Embedded) -> tuple[list[Candidate], Plan, dict[str, int] | None]:
        """Write the embedded chunk in one transaction (:meth:`ChunkWriter.write`); runs on
        the writer thread, which touches no worker and no model."""
        return self.writer.write(embedded.cands, embedded.vectors_by_sha, embedded.errors,
                                 planned=embedded.plan)

    def settle(self, chunk: _Prepared, embedded: _Embedded, written: Future) -> None:
        """Wait for the chunk's write; when the gallery changed under it (an item it meant to
        re-use was deleted), embed what the new plan needs and write again, here."""
        cands, plan, ids_by_sha = written.result()
        for _ in range(PLAN_ROUNDS - 1):
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

    def _record(self, work: list[Candidate], done: Slice, into: _Embedded) -> None:
        ok = [c for c, error in zip(work, done.errors, strict=True) if error is None]
        into.errors.update((c.sha256, error) for c, error in zip(work, done.errors,
                                                                 strict=True) if error)
        self.timer.add("decode", len(work), done.decode_seconds)
        self.timer.add("embed", len(ok), done.embed_seconds)
        into.vectors_by_sha.update(zip((c.sha256 for c in ok), done.vectors, strict=True))

    def _submit(self, work: list[Candidate], stage: Sequence[Candidate] = ()
                ) -> list[tuple[int, list[Candidate]]]:
        size = self.embedder.batch_size
        slices = [work[at : at + size] for at in range(0, len(work), size)]
        new = {id(c) for c in stage}
        return [(self.pool.submit(part, stage=[id(c) in new for c in part]), part)
                for part in slices]


class SourceNames:
    """An image's ``source`` as stored: its path relative to the ingested folder (the path
    itself when it lies outside)."""

    def __init__(self, root: Path):
        self.root = root
        self._folders: dict[str, str | None] = {}  # folder -> its path relative to root

    def __call__(self, path: str | Path) -> str:
        # The folder's resolution is cached (resolve() is a few system calls per file), and
        # keyed by the path's text: splitting a string is far cheaper than pathlib's parent
        # and name, which showed in profiles of a chunk's preparation (docs/ingest_bench.md).
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
