"""Bulk ingest on Ray Data (``imgret ingest PATH --ray [ADDRESS]``, extra ``ray``).

The plain ingest (:func:`imgret.gallery.ingest.ingest_source`) keeps one machine's cores busy; this
one
spreads the expensive stages over a Ray cluster (a local one when no address is given):

1. **known** (one actor): reads each file, hashes it and drops what the gallery already holds
   with this model version's vector, so a re-run embeds nothing twice (resumable). Only the
   path and the hash go on: the bytes are not carried through the object store twice;
2. **embed** (an actor pool, one actor per GPU when the cluster has GPUs, else one per CPU
   slot): reads each file again, checks it still has the hash, decodes and preprocesses it
   with the plain ingest's :func:`~imgret.gallery.ingest.decode.decode_slice` (the served path's
   decoder) and embeds it with the one :class:`~imgret.embedder.Embedder`, each actor
   loading the checkpoint once. Its blocks carry the encoded bytes to the writer, which
   stores them: one image's bytes are in the object store once, for one batch, and Ray
   Data's streaming back-pressure bounds how many batches wait for the writer;
3. **write** (this process): chunks of ``chunk_size`` rows, in source order, go through the
   plain ingest's writer (:func:`~imgret.gallery.ingest.writer.write_embedded`): failures reported,
   media bytes durable, then the rows in one transaction under the gallery write lock,
   planned again under it (idempotent, and safe beside other writers).

Resuming: every chunk commits on its own; after a killed run, running the same command again
drops what was committed at stage 1 and embeds the rest. A media file written for a chunk
that never committed is swept by ``imgret.gallery.media.gc.sweep_media`` like the plain ingest's.

Nothing here is specific to one machine: the workers need the files (a path every node sees)
and the database URL (stage 1 reads it); only this process writes the media store and the
rows. Ray is imported only here, and only when called, so the rest of imgret runs without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from imgret.errors import ImgretError
from imgret.files import read_file
from imgret.gallery.ingest.decode import decode_slice
from imgret.gallery.ingest.pipeline import SourceNames
from imgret.gallery.ingest.report import IngestReport
from imgret.gallery.ingest.writer import EmbeddedChunk, register_target, write_embedded
from imgret.gallery.media.files import MediaBackend

logger = logging.getLogger(__name__)

_NO_CAMERA = -1  # Ray columns are typed: a missing camera travels as -1
_KNOWN_CPUS = 0.25  # the known stage mostly waits on files and SQL


class RayUnavailable(ImgretError):
    """Ray Data is not installed, or the cluster cannot be reached."""


@dataclass(frozen=True)
class RayPlan:
    """What the Ray stages need to know (plain values: they travel to the workers).

    Attributes:
        database_url: the gallery database (the known stage reads it).
        model_version: the version being ingested (known: has an item its vector?).
        query_set: the named query set, or ``None`` for the gallery.
        checkpoint: the model's ``model.pt`` (every embed actor loads it).
        device: ``cpu``, ``cuda`` or ``auto`` for the actors.
        runtime: what runs a float model in the actors (``IMGRET_RUNTIME``).
        max_pixels: decompression-bomb limit per image.
        batch_size: images per forward pass in an embed actor.
    """

    database_url: str
    model_version: str
    query_set: str | None
    checkpoint: str
    device: str
    max_pixels: int
    batch_size: int
    runtime: str = "torch"


def import_ray() -> Any:
    """The ``ray`` module with Ray Data, or :class:`RayUnavailable` naming the fix."""
    try:
        import ray
        import ray.data  # noqa: F401 - the optional extra's part we use
    except ImportError:
        raise RayUnavailable(
            "Ray Data is not installed (imgret/gallery/ingest/ray.py needs it): "
            "pip install 'imgret[ray]', or ingest without --ray"
        ) from None
    return ray


class KnownFilter:
    """Ray stage 1 (an actor): read, hash, and drop what is already embedded."""

    def __init__(self, plan: RayPlan):
        from imgret.gallery.storage.db import make_engine, make_sessionmaker

        self.plan = plan
        self.engine = make_engine(plan.database_url)
        self.sessions = make_sessionmaker(self.engine)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from imgret.gallery.media.files import sha256_hex

        started = time.perf_counter()
        shas, errors = [], []
        for path in batch["path"]:
            try:
                shas.append(sha256_hex(read_file(path)))
                errors.append("")
            except OSError as exc:
                shas.append("")
                errors.append(f"cannot read file ({exc.strerror})")
        read = time.perf_counter()
        done = self._embedded([s for s in shas if s])
        keep = np.array([not sha or sha not in done for sha in shas], dtype=bool)
        out = {key: np.asarray(values)[keep] for key, values in batch.items()}
        out["sha256"] = np.array(shas, dtype=object)[keep]
        out["error"] = np.array(errors, dtype=object)[keep]
        # Per-row shares of the batch's time, so the writer can sum stage seconds.
        n = max(1, len(shas))
        out["t_read"] = np.full(int(keep.sum()), (read - started) / n)
        out["t_dedup"] = np.full(int(keep.sum()), (time.perf_counter() - read) / n)
        return out

    def _embedded(self, shas: list[str]) -> set[str]:
        """The hashes whose live item already has this version's vector."""
        from imgret.gallery.storage import item_store, query_set_store
        from imgret.gallery.versions import version_store

        if not shas:
            return set()
        # The writer registered the version and made the query set before Ray started.
        with self.sessions() as session:
            version = version_store.get_model_version(session=session,
                                                      version=self.plan.model_version)
            query_set = (query_set_store.get_or_create_query_set(self.plan.query_set,
                                                                 session=session)
                         if self.plan.query_set else None)
            return item_store.known_items(shas, session=session, query_set=query_set,
                                          model_version_id=version.id).embedded_shas


class EmbedActor:
    """Ray stage 2 (an actor pool): decode and embed, the checkpoint loaded once per actor."""

    def __init__(self, plan: RayPlan):
        from imgret.embedder import Embedder

        self.plan = plan
        self.embedder = Embedder.from_checkpoint(plan.checkpoint, device=plan.device,
                                                 batch_size=plan.batch_size,
                                                 runtime=plan.runtime)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        started = time.perf_counter()
        blobs: list[tuple[bytes | None, str, str | None]] = []
        for path, sha, error in zip(batch["path"], batch["sha256"], batch["error"],
                                    strict=True):
            if error:  # unreadable at stage 1
                blobs.append((None, sha, error))
                continue
            try:
                blobs.append((read_file(path), sha, None))
            except OSError as exc:
                blobs.append((None, sha, f"cannot read file ({exc.strerror})"))
        # The plain ingest's decode step: hash checked, served decoder, model preprocessing.
        inputs, errors = decode_slice(blobs, self.embedder, self.plan.max_pixels)
        decoded = time.perf_counter()
        vectors = np.zeros((len(blobs), self.embedder.dim), dtype=np.float32)
        ok = [i for i, error in enumerate(errors) if error is None]
        if ok:
            vectors[ok] = self.embedder.embed_tensors(torch.from_numpy(inputs))
        n = max(1, len(blobs))
        out = dict(batch)
        out["data"] = np.array([b"" if data is None else data for data, _, _ in blobs],
                               dtype=object)
        out["error"] = np.array([error or "" for error in errors], dtype=object)
        out["vector"] = vectors
        out["t_decode"] = np.full(len(blobs), (decoded - started) / n)
        out["t_embed"] = np.full(len(blobs), (time.perf_counter() - decoded) / n)
        return out


def ingest_with_ray(
    source: str | Path, *, session_factory: sessionmaker[Session], media: MediaBackend,
    database_url: str, checkpoint: str | Path, device: str = "auto", runtime: str = "torch",
    query_set: str | None = None, batch_size: int = 64, chunk_size: int = 256,
    max_pixels: int | None = None, address: str | None = None, actors: int | None = None,
    progress: bool = True,
) -> IngestReport:
    """Ingest ``source`` with Ray Data; see the module docstring.

    Args:
        source: what ``imgret.datasets.list_records`` accepts (on a path every worker sees).
        session_factory, media: the gallery database and media store (written from here).
        database_url: the same database, for the known stage (it runs in a Ray worker).
        checkpoint: the model's run dir or ``model.pt`` (on a path every worker sees).
        device: the embed actors' device (``auto``: CUDA when the actor has a GPU).
        query_set: put the images in this named query set instead of the gallery.
        batch_size: images per forward pass (and per embed-actor call).
        chunk_size: rows per write transaction.
        max_pixels: decompression-bomb limit per image (default: the built-in one).
        address: a Ray cluster (``ray://host:10001`` or ``auto``). ``None``: the Ray
            instance this process already started, else a local one sized to this machine
            (shut down again at the end).
        actors: embed actors (default: the cluster's GPUs, else the CPUs the known stage
            leaves, at least 1).
        progress: a tqdm bar (images/s).

    Returns:
        The :class:`~imgret.gallery.ingest.report.IngestReport` of the run: counted like the plain
        ingest's
        (an image dropped at stage 1 counts as already present). Stage seconds of read,
        dedup, decode and embed are summed over the Ray workers (busy time, not wall time).

    Raises:
        RayUnavailable: Ray Data is missing, or the cluster cannot be started or reached.
    """
    from imgret.checkpoint import load_checkpoint
    from imgret.datasets import list_records
    from imgret.images import DEFAULT_MAX_PIXELS

    ray = import_ray()
    started = time.perf_counter()
    source = Path(source)
    records = list_records(source)
    root = source if source.is_dir() else source.parent
    ckpt = load_checkpoint(checkpoint)
    model_version, target = register_target(
        session_factory, version=ckpt.model_version, dim=ckpt.spec.dim,
        config=ckpt.spec.to_dict(), query_set=query_set,
    )
    del ckpt  # the actors load their own copy
    plan = RayPlan(database_url=database_url, model_version=model_version.version,
                   query_set=query_set, checkpoint=str(checkpoint), device=device,
                   max_pixels=max_pixels or DEFAULT_MAX_PIXELS, batch_size=batch_size,
                   runtime=runtime)
    report = IngestReport(str(source), model_version.version, query_set, total=len(records))
    owned = _connect(ray, address)
    try:
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        # On CPUs: the slots the known stage leaves (an actor that cannot be placed would
        # only wait). On GPUs: one actor per GPU.
        n_actors = actors or (gpus if gpus else
                              max(1, int(resources.get("CPU", 1) - _KNOWN_CPUS)))
        sources = SourceNames(root)
        items = [
            {"position": i, "path": str(r.path), "label": str(r.label),
             "camera": _NO_CAMERA if r.camera is None else int(r.camera),
             "source": sources(r.path)}
            for i, r in enumerate(records)
        ]
        context = ray.data.DataContext.get_current()
        # Source order at the writer: of two copies of the same bytes the first one is
        # stored, as in the plain ingest, so both give the same gallery.
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        dataset = (
            ray.data.from_items(items, override_num_blocks=max(1, len(items) // chunk_size))
            .map_batches(KnownFilter, fn_constructor_kwargs={"plan": plan},
                         compute=ray.data.ActorPoolStrategy(size=1),
                         batch_size=chunk_size, num_cpus=_KNOWN_CPUS)
            .map_batches(EmbedActor, fn_constructor_kwargs={"plan": plan},
                         compute=ray.data.ActorPoolStrategy(size=n_actors),
                         batch_size=batch_size,
                         num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1)
        )
        logger.info("ingesting %d images from %s on Ray (%d embed actors on %s)",
                    len(records), source, n_actors, "GPUs" if gpus else "CPUs")
        seen = 0
        with tqdm(total=len(records), unit="img", desc="ingest (ray)",
                  disable=not progress) as bar:
            for batch in dataset.iter_batches(batch_size=chunk_size, batch_format="numpy"):
                if not report.startup_seconds:
                    report.startup_seconds = time.perf_counter() - started
                chunk = _chunk(batch)
                for stage in ("read", "dedup", "decode", "embed"):
                    report.seconds[stage] += float(batch[f"t_{stage}"].sum())
                    report.counts[stage] += len(chunk)
                write_embedded(chunk, report=report, session_factory=session_factory,
                               media=media, model_version=model_version, query_set=target)
                seen += len(chunk)
                bar.update(len(chunk))
        report.duplicates += len(records) - seen  # dropped at stage 1: already embedded
    finally:
        if owned:
            ray.shutdown()
    report.wall_seconds = time.perf_counter() - started
    for path, reason in report.failed:
        logger.warning("skipped %s: %s", path, reason)
    return report


def _connect(ray: Any, address: str | None) -> bool:
    """Join the cluster (or start a local one); returns whether this call started Ray."""
    if address is None and ray.is_initialized():
        return False  # a Ray instance this process set up itself (tests, notebooks)
    try:
        if address is None:
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - any failure to reach Ray is the user's to fix
        raise RayUnavailable(f"cannot start or reach Ray at {address or 'a local instance'}: "
                             f"{type(exc).__name__}: {exc}") from None
    return True


def _chunk(batch: dict[str, np.ndarray]) -> EmbeddedChunk:
    """A Ray numpy batch as the writer's :class:`~imgret.gallery.ingest.writer.EmbeddedChunk`."""
    errors = [str(e) or None for e in batch["error"]]
    data = [None if not blob and error else bytes(blob)
            for blob, error in zip(batch["data"], errors, strict=True)]
    return EmbeddedChunk(
        positions=[int(p) for p in batch["position"]],
        paths=[str(p) for p in batch["path"]],
        labels=[str(label) for label in batch["label"]],
        cameras=[None if c == _NO_CAMERA else int(c) for c in batch["camera"]],
        sources=[str(s) for s in batch["source"]],
        data=data,
        sha256=[str(s) for s in batch["sha256"]],
        vectors=np.asarray(batch["vector"], dtype=np.float32),
        errors=errors,
    )
