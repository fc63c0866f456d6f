"""The index manifest: what a saved FAISS index was built from, checked against SQL on load.

``manifest.json`` sits beside ``index.faiss`` in ``<data_dir>/indexes/<model_version>/``.
An index is trusted only when its manifest matches the request (model version, factory,
dimension), its file checksum matches, and — after replaying the change log from the
manifest's sequence number — its id set equals the database's. Anything else means a
rebuild from SQL, with the reason logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from imgret.errors import IndexStale
from imgret.files import write_atomic

logger = logging.getLogger(__name__)

FORMAT = "imgret-index-v1"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"


class Manifest(BaseModel):
    """Facts about one saved index.

    Attributes:
        model_version: whose embeddings it holds.
        factory: the FAISS factory string it was built with.
        dim: vector dimension.
        count: live vectors (searchable ids).
        change_seq: the gallery change-log sequence number it reflects: every change up to
            it is in the index (some later ones may be too; replaying them is idempotent).
        ids_sha256: :func:`ids_checksum` of the live ids.
        index_sha256: SHA-256 of the index file.
        tombstones: ids still stored in the index but deleted (indexes without
            ``remove_ids``, e.g. HNSW); they are never returned.
        faiss_version, created_at, format: provenance.
    """

    # Unknown keys are ignored, so a manifest written by a newer imgret still reads.
    model_config = ConfigDict(frozen=True, extra="ignore")

    model_version: str
    factory: str
    dim: int
    count: int
    change_seq: int
    ids_sha256: str
    index_sha256: str = ""
    tombstones: list[int] = []
    faiss_version: str = ""
    created_at: str = ""
    format: str = FORMAT

    def write(self, folder: str | Path) -> Path:
        """Write ``manifest.json`` atomically (temp file + rename); returns its path."""
        path = Path(folder) / MANIFEST_FILE
        write_atomic(path, json.dumps(self.model_dump(), indent=2, sort_keys=True).encode())
        return path

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        """Read ``manifest.json`` from ``folder``.

        Raises:
            IndexStale: missing, unreadable, of another format, lacking a field or with a
                field of the wrong type (the caller rebuilds).
        """
        path = Path(folder) / MANIFEST_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise IndexStale(f"{path}: no manifest") from None
        except (OSError, ValueError) as exc:
            raise IndexStale(f"{path}: unreadable manifest ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise IndexStale(f"{path}: not an {FORMAT} manifest")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                 for e in exc.errors())
            raise IndexStale(f"{path}: invalid manifest ({problems})") from None

    def mismatches(self, *, model_version: str, factory: str, dim: int) -> list[str]:
        """Why this manifest does not describe the index wanted (empty when it does)."""
        reasons = []
        if self.model_version != model_version:
            reasons.append(f"model version {self.model_version} != {model_version}")
        if normalise_factory(self.factory) != normalise_factory(factory):
            reasons.append(f"factory {self.factory!r} != {factory!r}")
        if self.dim != dim:
            reasons.append(f"dimension {self.dim} != {dim}")
        return reasons


def ids_checksum(ids: np.ndarray) -> str:
    """SHA-256 of the sorted, de-duplicated ids as little-endian int64 (order-independent)."""
    unique = np.unique(np.asarray(ids, dtype=np.int64))
    return hashlib.sha256(unique.astype("<i8").tobytes()).hexdigest()


def normalise_factory(factory: str) -> str:
    """A factory string without blanks (``"IVF64, Flat"`` and ``"IVF64,Flat"`` are one)."""
    return re.sub(r"\s+", "", factory)


def collection_root(data_dir: str | Path, collection_id: int) -> Path:
    """Where a collection's indexes live: the data dir itself for ``default`` (collection 1,
    where a single-gallery deployment always kept them), ``<data_dir>/collections/<id>`` for
    the others. By id, not name: ids are never reused, so a collection created again under a
    deleted one's name never opens its files."""
    if collection_id == 1:
        return Path(data_dir)
    return Path(data_dir) / "collections" / str(int(collection_id))


def index_dir(data_dir: str | Path, model_version: str) -> Path:
    """``<data_dir>/indexes/<model_version>`` (one index per model version: blue/green)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model_version)
    return Path(data_dir) / "indexes" / safe


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
