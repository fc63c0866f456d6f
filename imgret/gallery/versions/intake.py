"""Checkpoint intake: a checkpoint read (from a confined path, an upload or bytes), checked,
and registered as a model version with its bytes kept in the database.

Decisions:

- **Checkpoints live in the database** (``model_checkpoints``, beside ``media_blobs``), so
  every process on the database loads every version, a replica without any local file
  included. A checkpoint is read with ``torch.load(weights_only=True)`` and its version is
  recomputed from the weights: a file that names another version than its weights is
  refused. A version's identity is the full SHA-256 of config + weights
  (``content_digest``): the same weights again are a no-op, other weights under a
  registered name are refused with 409 and never re-bound. ``<data_dir>/models/<v>/model.pt``
  is only a local copy (the backup reads it; a start-up imports such a file into the
  database when a version's bytes are missing there, for galleries from older releases).
- **Paths from clients**: ``POST /models {"path"}`` reads only under ``<data_dir>/models``
  and ``IMGRET_MODEL_ROOTS``, after resolving symlinks and ``..``, and answers every path it
  may not or cannot read, and every file that is not a checkpoint, with one message
  (:data:`PATH_REFUSED`). Operators' paths (``IMGRET_MODEL``, the CLI) are not confined.
  Every read is capped by ``IMGRET_MAX_CHECKPOINT_BYTES``, checked with ``fstat`` first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from imgret.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    load_checkpoint,
    resolve_checkpoint_path,
)
from imgret.embedder import Embedder
from imgret.errors import CheckpointError, GalleryError
from imgret.files import file_sha256, write_atomic_with
from imgret.gallery.storage import item_store
from imgret.gallery.versions import version_store
from imgret.gallery.versions.lifecycle import MODELS_DIR, checkpoint_file, describe_one
from imgret.gallery.versions.version_store import (
    VersionNotFound as VersionNotFound,  # raised here too
)

logger = logging.getLogger(__name__)

# Temporary upload files of older releases (see sweep_incoming).
INCOMING_DIR = ".incoming"


INCOMING_STALE_S = 600.0


class VersionConflict(GalleryError):
    """A version name already bound to other weights (409): a name is never re-bound."""


class CheckpointTooLarge(CheckpointError):
    """A checkpoint over ``IMGRET_MAX_CHECKPOINT_BYTES`` (413), refused before it is read."""


# The one answer to a path a client may not have read: outside the roots, missing,
# unreadable, a folder without model.pt, or not a checkpoint. Saying which would tell a
# client what exists on the server (or, from a parser's message, what a file holds).
PATH_REFUSED = ("path: no imgret checkpoint this server may read there; give a run directory "
                "or model.pt under <data_dir>/models or IMGRET_MODEL_ROOTS, or upload the file")


DEFAULT_MAX_CHECKPOINT_BYTES = 256 * 1024 * 1024




def model_roots(data_dir: str | Path, extra: Iterable[str | Path] = ()) -> list[Path]:
    """The folders ``POST /models {"path"}`` may read: ``<data_dir>/models`` and
    ``IMGRET_MODEL_ROOTS``, resolved (symlinks followed) like the paths checked against
    them."""
    return [Path(root).resolve() for root in (Path(data_dir) / MODELS_DIR, *extra)]


def read_capped(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes, its size checked with ``fstat`` before anything is read.

    Raises:
        CheckpointTooLarge: over ``max_bytes``.
        OSError: missing, unreadable, or not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(str(path))
        if info.st_size > max_bytes:
            raise CheckpointTooLarge(
                f"the checkpoint is {info.st_size} bytes, over IMGRET_MAX_CHECKPOINT_BYTES "
                f"({max_bytes})")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew since the fstat
        raise CheckpointTooLarge(f"the checkpoint is over IMGRET_MAX_CHECKPOINT_BYTES "
                                 f"({max_bytes})")
    return data


def read_under_roots(path: str | Path, roots: Iterable[Path], max_bytes: int) -> bytes:
    """The bytes of a client-given checkpoint path, only when it resolves (symlinks, ``..``)
    to a file under one of ``roots`` (a run directory: its model.pt, resolved again).

    Raises:
        CheckpointError: :data:`PATH_REFUSED` for every path that may not or cannot be read.
        CheckpointTooLarge: a file under the roots over ``max_bytes``.
    """
    roots = list(roots)

    def inside(target: Path) -> bool:
        return any(target.is_relative_to(root) for root in roots)

    try:
        target = Path(path).resolve(strict=True)
        if not inside(target):
            raise CheckpointError(PATH_REFUSED)
        if target.is_dir():
            target = (target / CHECKPOINT_FILE).resolve(strict=True)
            if not inside(target):
                raise CheckpointError(PATH_REFUSED)
        return read_capped(target, max_bytes)
    except CheckpointTooLarge:
        raise
    except (OSError, ValueError, RuntimeError):  # RuntimeError: a symlink loop
        raise CheckpointError(PATH_REFUSED) from None


def register_checkpoint(
    path: str | Path, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> dict[str, Any]:
    """Register a checkpoint an operator names (``IMGRET_MODEL``, ``imgret models register``,
    ``imgret ingest --model``): a run directory or its ``model.pt``, anywhere, with precise
    messages. See :func:`register_bytes`."""
    source = resolve_checkpoint_path(path)
    try:
        data = read_capped(source, max_bytes)
    except OSError as exc:
        raise CheckpointError(f"{source}: cannot read the checkpoint ({exc.strerror})") from None
    return register_bytes(data, session_factory=session_factory, data_dir=data_dir,
                          name=str(source))


def register_path(
    path: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    roots: Iterable[str | Path] = (), max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> dict[str, Any]:
    """Register a checkpoint by a path a client sent (``POST /models {"path"}``): read only
    under :func:`model_roots`, and any file that is not a checkpoint gets
    :data:`PATH_REFUSED` (never the parser's words, which may quote the file)."""
    data = read_under_roots(path, model_roots(data_dir, roots), max_bytes)
    try:
        loaded = _parse(data, "the checkpoint")
    except CheckpointError:
        raise CheckpointError(PATH_REFUSED) from None
    return _register_loaded(data, loaded, session_factory=session_factory, data_dir=data_dir)


def register_upload(
    data: bytes, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> dict[str, Any]:
    """Register uploaded checkpoint bytes (no temporary file: they go to the database)."""
    if len(data) > max_bytes:
        raise CheckpointTooLarge(f"the checkpoint is {len(data)} bytes, over "
                                 f"IMGRET_MAX_CHECKPOINT_BYTES ({max_bytes})")
    return register_bytes(data, session_factory=session_factory, data_dir=data_dir,
                          name="the uploaded checkpoint")


def register_bytes(
    data: bytes, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    name: str = "the checkpoint",
) -> dict[str, Any]:
    """Register a checkpoint's bytes: parsed with :func:`imgret.checkpoint.load_checkpoint`,
    its version recomputed from the weights, the bytes stored in ``model_checkpoints``.

    Identity is the full content digest: the same weights again change nothing (the first
    bytes stay), other weights under a registered name are refused (409), never re-bound.
    On a database without an active version, the version becomes active (with its history
    row).

    Returns:
        The version as :func:`describe_one` shows it.

    Raises:
        CheckpointError: not an imgret checkpoint, or a version that does not match its
            weights.
        VersionConflict: the name is bound to other weights.
        GalleryError: the version is registered with another dimension.
    """
    return _register_loaded(data, _parse(data, name), session_factory=session_factory,
                            data_dir=data_dir)


def _parse(data: bytes, name: str) -> Checkpoint:
    """:func:`imgret.checkpoint.load_checkpoint` of bytes from outside; a failure it does not
    name (a bug for a file it should refuse) is still the file's fault: 422, never 500."""
    try:
        return load_checkpoint(data)
    except CheckpointError:
        raise
    except Exception:  # noqa: BLE001 - logged; the client gets no parser text
        logger.warning("%s could not be parsed", name, exc_info=True)
        raise CheckpointError(f"{name} is not an imgret checkpoint (it cannot be rebuilt "
                              "from its spec and weights)") from None


def _register_loaded(data: bytes, loaded: Checkpoint, *, session_factory: sessionmaker[Session],
                     data_dir: str | Path) -> dict[str, Any]:
    version = loaded.model_version  # load_checkpoint checked it is its weights' hash
    sha = hashlib.sha256(data).hexdigest()
    with session_factory.begin() as session:
        # Serialised with deletes and activations (they take the same lock).
        item_store.lock_gallery_writes(session=session)
        new = version_store.find_version(version, session=session) is None
        row = version_store.register_model_version(session=session, version=version,
                                           dim=loaded.spec.dim, config=loaded.spec.to_dict())
        if row.content_digest is not None and row.content_digest != loaded.digest:
            raise VersionConflict(
                f"model version {version} is registered with other weights (content digest "
                f"{row.content_digest[:16]}..., these: {loaded.digest[:16]}...); the names "
                "share 12 digits only: a registered version is never re-bound"
            )
        stored = version_store.store_checkpoint(row, session=session, digest=loaded.digest,
                                                sha256=sha, data=data)
        if new and row.is_active:
            # The first version of a fresh database: active through a recorded switch.
            version_store.record_activation(row, session=session, previous=None,
                                            reason="register")
    if stored == sha:
        _write_local_copy(data_dir, version, data)
    return describe_one(version, session_factory=session_factory, data_dir=data_dir)


def _write_local_copy(data_dir: str | Path, version: str, data: bytes) -> None:
    """Keep ``<data_dir>/models/<v>/model.pt`` equal to the stored bytes (what the backup
    copies); best effort: the database is what every process loads from."""
    dest = checkpoint_file(data_dir, version)
    try:
        if dest.is_file() and dest.stat().st_size == len(data) \
                and file_sha256(dest) == hashlib.sha256(data).hexdigest():
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_atomic_with(dest, lambda handle: handle.write(data))
    except OSError as exc:
        logger.warning("cannot keep a local copy of checkpoint %s: %s", version, exc)


def load_version_checkpoint(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
) -> Checkpoint:
    """The loaded checkpoint of a registered version, from its bytes in the database,
    checked to be the version's weights (and kept as the local copy under ``data_dir``).

    Raises:
        VersionNotFound: unknown version.
        GalleryError: its checkpoint is not stored (register it with ``POST /models``).
        CheckpointError: the stored bytes are not the version's weights.
    """
    with session_factory() as session:
        row = version_store.get_version(version, session=session)
        digest = row.content_digest
        data = version_store.checkpoint_bytes(row.id, session=session)
    if data is None:
        raise GalleryError(
            f"model version {version} has no stored checkpoint; register it with "
            f"`imgret models register RUN_DIR` or POST /models"
        )
    loaded = load_checkpoint(data)
    if loaded.model_version != version or (digest is not None and digest != loaded.digest):
        raise CheckpointError(f"the stored checkpoint of {version} holds other weights "
                              f"({loaded.model_version})")
    _write_local_copy(data_dir, version, data)
    return loaded


def load_embedder(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    device: str = "auto", runtime: str = "torch",
) -> Embedder:
    """The Embedder of a registered version, from its checkpoint in the database, run by
    ``runtime`` (``IMGRET_RUNTIME``: torch or onnxruntime; the vectors are the same).

    Raises:
        VersionNotFound: unknown version.
        GalleryError: its checkpoint is not stored (register it with ``POST /models``).
        CheckpointError: the stored bytes are not the version's weights.
    """
    loaded = load_version_checkpoint(version, session_factory=session_factory,
                                     data_dir=data_dir)
    return Embedder.from_checkpoint(loaded, device=device, runtime=runtime)


def import_checkpoint_files(
    *, session_factory: sessionmaker[Session], data_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> list[str]:
    """Store ``<data_dir>/models/<v>/model.pt`` for every registered version whose bytes the
    database lacks (galleries from before checkpoints moved into the database); a file
    that is unreadable or holds other weights is left alone (logged).

    Returns:
        The versions imported.
    """
    with session_factory() as session:
        missing = version_store.versions_without_checkpoint(session=session)
    imported = []
    for version in missing:
        path = checkpoint_file(data_dir, version)
        if not path.is_file():
            continue
        try:
            data = read_capped(path, max_bytes)
            info = register_bytes(data, session_factory=session_factory, data_dir=data_dir,
                                  name=str(path))
        except (OSError, CheckpointError, GalleryError) as exc:
            logger.warning("not importing %s into the database: %s", path, exc)
            continue
        if info["version"] == version:
            imported.append(version)
            logger.info("imported the checkpoint of %s from %s into the database", version,
                        path)
    return imported


def sweep_incoming(data_dir: str | Path, older_than_s: float = INCOMING_STALE_S) -> int:
    """Remove files under ``<data_dir>/models/.incoming`` older than ``older_than_s``:
    temporary uploads of processes killed mid-upload (uploads now go to the database; a
    process of an older release may still write there, so a fresh file is left alone).

    Returns:
        How many files were removed.
    """
    folder = Path(data_dir) / MODELS_DIR / INCOMING_DIR
    if not folder.is_dir():
        return 0
    removed = 0
    cutoff = time.time() - older_than_s
    for path in folder.iterdir():
        try:
            if path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    if removed:
        logger.info("removed %d stale temporary uploads from %s", removed, folder)
    return removed
