"""Runtime settings: environment variables with the prefix IMGRET_, validated at start."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

_DRIVERS = ("sqlite", "postgresql")


# Where image bytes live: the values of IMGRET_MEDIA_BACKEND.
MediaBackendName = Literal["files", "database"]
MEDIA_BACKENDS: tuple[str, ...] = get_args(MediaBackendName)

# What a collection name may be (imgret.gallery.tenancy.collections says why); here because the
# CLI's IMGRET_COLLECTION is checked by these settings.
COLLECTION_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"


class Settings(BaseSettings):
    """Everything the service, the CLI and the indexer read from the environment.

    Each field is read from ``IMGRET_<FIELD>`` (``IMGRET_DATABASE_URL`` and so on). A bad value
    is refused when the object is built, and pydantic's message names the variable.
    """

    model_config = SettingsConfigDict(env_prefix="IMGRET_", extra="ignore")

    data_dir: Path = Field(Path("imgret-data"), description="media store, SQLite file, indexes")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default: SQLite file imgret.db under data_dir"
    )
    model: Path | None = Field(None, description="checkpoint: a run directory or its model.pt")
    # The CLI's `--collection`: which collection the gallery, model and evaluation commands
    # work in. The service serves every collection (its routes name one).
    # Unset: the default collection, and every collection for `imgret backup`.
    collection: str | None = Field(
        None, min_length=1, max_length=64, pattern=COLLECTION_NAME_PATTERN,
        description="the collection CLI commands work in (default: default; backups: all)",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # What runs a float version's network (imgret.embedder.Embedder): "auto" = ONNX Runtime
    # where its vectors are within 1e-4 of torch's on the version's sample,
    # checked at load, else torch; "torch" or "onnxruntime" force one (docs/onnx.md).
    runtime: Literal["auto", "torch", "onnxruntime"] = Field(
        "auto", description="auto, torch or onnxruntime: what runs a float model (auto: "
                            "onnxruntime where it gives torch's vectors; an int8 version "
                            "always runs with onnxruntime)"
    )
    api_key: SecretStr | None = Field(None, description="required in X-API-Key for writes")
    max_upload_bytes: int = Field(20 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(40_000_000, gt=0, description="decompression-bomb guard")
    index_factory: str = Field("Flat", min_length=1, description="FAISS index factory string")
    index_nprobe: int | None = Field(
        None, ge=1, description="IVF lists visited per query (default nlist/16, at least 8)"
    )
    index_ef_search: int | None = Field(None, ge=1, description="HNSW beam width (default 64)")
    # Where the gallery's vectors are searched (imgret.gallery.search.milvus_index): "faiss", an
    # index in each server's memory, or "milvus", a Milvus collection per (collection, model
    # version) shared by every server; SQL stays the record either way.
    index_backend: Literal["faiss", "milvus"] = Field(
        "faiss", description="vector search engine: faiss (in process) or milvus"
    )
    milvus_uri: str | None = Field(
        None, description="Milvus: a milvus-lite file (one process) or http://host:19530"
    )
    milvus_token: SecretStr | None = Field(None, description="Milvus: user:password or a token")
    # Where image bytes live (imgret.gallery.media.blobs.open_media_store): "files" under
    # data_dir/media (replicas on several machines share the data dir as a volume), or "database":
    # the media_blobs table, readable by every process that reaches the database (small images).
    media_backend: MediaBackendName = Field(
        "files", description="image bytes: files (under data_dir) or database (media_blobs)"
    )
    batch_max_size: int = Field(32, ge=1, description="1 turns dynamic batching off")
    batch_max_wait_ms: float = Field(5.0, ge=0)

    # --- Decoding budgets, file caps and the batch queue.
    # A 5 KB PNG can declare 40 M pixels, so uploads are limited by what they decode, not by
    # their bytes. PNG decodes at roughly 100 M pixels/s per core; JPEG decodes at 1/8 scale
    # for our input sizes (imgret.images.decode_for_embedding), so photos cost little.
    max_request_pixels: int = Field(
        256_000_000, gt=0,
        description="decoded pixels one request may cost (about 2.5 s of one core for PNG): "
                    "6 images at the per-image limit, 128 two-megapixel PNGs, or thousands "
                    "of JPEG photos; refused with 413 before anything is decoded",
    )
    batch_max_pixels: int = Field(
        80_000_000, gt=0,
        description="decoded pixels one search batch may cost (2 images at the per-image "
                    "limit, under a second): requests past it wait for the next batch, so "
                    "one heavy upload delays the others sharing its batch by at most this",
    )
    decode_memory_mb: int = Field(
        640, gt=0,
        description="MiB that full-size decoding may hold at once in the whole process "
                    "(search, gallery, evaluate together), whatever the number of requests; "
                    "one image alone always proceeds, and the costliest one allowed is a "
                    "WebP at the per-image limit: 40 M pixels x 16 bytes = 640 MiB",
    )
    search_batch_max_files: int = Field(
        32, ge=1,
        description="images per /search/batch request: one full batch of the batcher, so "
                    "one request cannot queue ahead of other users for several batches",
    )
    gallery_max_files: int = Field(
        256, ge=1,
        description="images per POST /gallery: one transaction; 256 embed in seconds on a "
                    "CPU, larger imports belong to `imgret ingest`",
    )
    evaluate_max_files: int = Field(
        2000, ge=1,
        description="images per uploaded /evaluate query set: enough queries for a useful "
                    "confidence interval; the request's pixel budget still applies, and "
                    "larger sets are stored with `imgret ingest --query-set`",
    )
    batch_queue_max: int = Field(
        256, ge=1,
        description="search images waiting for the batcher (8 full batches); when full, "
                    "searches get 503 with Retry-After instead of queueing without bound",
    )
    # Re-ranking pool (imgret.service.pipeline, imgret.service.limits): k-reciprocal and
    # query-expansion work
    # runs on its own threads, never on the model thread, behind a queue priced in index
    # searches (about 0.5 ms each at 100k exact vectors; a maximal request costs 808).
    rerank_workers: int = Field(
        1, ge=1, le=64,
        description="threads that re-rank search results (at a lower CPU priority than "
                    "the model thread)",
    )
    rerank_queue_max: int = Field(
        3232, ge=1,
        description="index searches of re-ranking queued or running (4 maximal requests, "
                    "about 1.6 s of work at 100k items); when full, re-ranked searches get "
                    "503 with Retry-After",
    )
    # Background re-embedding of a new model version (imgret.gallery.versions.lifecycle): the share
    # of wall time it may compute; it also waits while searches are queued.
    embed_duty: float = Field(
        0.5, gt=0, le=1,
        description="fraction of time a background re-embedding may compute (1: no pause)",
    )
    # Replicas (imgret.service.resources.follower.follow_changes): on PostgreSQL a LISTEN wakes the
    # follower as soon as another process commits a gallery write or a model switch; the poll below
    # stays as the fallback (SQLite, a lost listening connection, notifications turned off).
    follow_interval_s: float = Field(
        1.0, gt=0, le=3600,
        description="seconds between polls of the change log by other processes' writes",
    )
    change_notify: bool = Field(
        True, description="on PostgreSQL, wake on LISTEN/NOTIFY instead of waiting for a poll"
    )

    # Model versions other than the served one that /evaluate (model_version, compare), an
    # activation's comparison gate or a re-embedding opened (imgret.service.version_cache): the
    # least recently used are dropped past either bound, and loaded again when next needed.
    max_loaded_versions: int = Field(
        2, ge=0, description="versions besides the served one whose model and index stay "
                             "loaded (0: load them for each request)",
    )
    # Collections other than default open in one process (imgret.service.collection_registry): each
    # holds its index in memory; the least recently used are closed beyond this many, and any
    # idle this long, and opened again from SQL on their next request.
    max_open_collections: int = Field(
        100, ge=1, description="collections besides default kept open (index in memory)"
    )
    collection_idle_s: float = Field(
        900.0, gt=0, description="seconds unused after which a collection's index is unloaded"
    )
    max_loaded_bytes: int = Field(
        2 * 1024**3, ge=0,
        description="estimated bytes those may hold: model parameters plus index vectors "
                    "(size x dim x 4)",
    )

    # Backups (imgret.gallery.backup): retention after each successful backup, in its folder
    # (<data_dir>/backups for POST /admin/backup, the parent of DEST for `imgret backup`),
    # and the free space a backup must leave on the volume it is written to.
    backup_keep: int = Field(
        7, ge=1, description="complete backups kept in the backup folder; older ones are "
                             "removed after a successful new backup (never the new one)",
    )
    backup_max_bytes: int | None = Field(
        None, gt=0, description="bytes the backups in the backup folder may take together; "
                                "the oldest are removed past it (unset: the count alone)",
    )
    backup_free_margin_bytes: int = Field(
        1 << 30, ge=0, description="bytes that must stay free on the backup's volume after "
                                   "the estimated backup, or it is refused (507) unwritten",
    )

    # Model checkpoints (imgret.gallery.versions.lifecycle): ``POST /models {"path": ...}`` reads
    # only files under <data_dir>/models and these folders (os.pathsep-separated, like PATH); every
    # checkpoint read or upload is capped by size before it is read (resnet50 at dim 512 is
    # ~95 MB: 256 MiB leaves room; a vit_b_16 (~345 MB) needs a larger cap).
    model_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="folders POST /models may read checkpoints from by path, besides "
                    "<data_dir>/models (os.pathsep-separated)",
    )
    max_checkpoint_bytes: int = Field(
        256 * 1024 * 1024, gt=0,
        description="largest checkpoint file registered, by path or upload (checked before "
                    "reading it)",
    )

    @field_validator("model_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(os.pathsep) if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_queue_holds_a_request(self) -> Settings:
        # A /search/batch request is queued whole or refused: a queue smaller than the
        # largest request would refuse every such request with 503, forever.
        if self.batch_queue_max < self.search_batch_max_files:
            raise ValueError(
                f"IMGRET_BATCH_QUEUE_MAX ({self.batch_queue_max}) must be at least "
                f"IMGRET_SEARCH_BATCH_MAX_FILES ({self.search_batch_max_files})"
            )
        return self

    # Write guard (enforced by imgret.service.auth): a keyless server beyond
    # loopback refuses to start unless this is true; browsers may write only from these origins
    # (comma-separated, e.g. "https://ui.example.com") or from the API's own origin.
    allow_anonymous_writes: bool = Field(
        False, description="serve writes without IMGRET_API_KEY on a non-loopback host"
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="browser origins allowed to write (comma-separated)"
    )

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        try:
            url = make_url(value)
        except ArgumentError as exc:
            raise ValueError(f"not a database URL: {value!r} ({exc})") from None
        backend = url.get_backend_name()
        if backend not in _DRIVERS:
            raise ValueError(f"unsupported database {backend!r}; use sqlite or postgresql")
        if backend == "postgresql" and url.drivername == "postgresql":
            # psycopg 3 is the driver we install (extra `postgres`); make it explicit.
            url = url.set(drivername="postgresql+psycopg")
        return url.render_as_string(hide_password=False)

    @property
    def db_url(self) -> str:
        """The database URL in force (the SQLite default under data_dir when unset)."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'imgret.db').resolve()}"

    def resolved_device(self) -> str:
        """``cpu`` or ``cuda``: ``auto`` picks CUDA when torch sees a GPU."""
        return resolve_device(self.device)


def resolve_device(device: str) -> str:
    """Turn ``auto|cpu|cuda`` into a torch device name; ``cuda`` without a GPU is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("IMGRET_DEVICE=cuda but torch sees no CUDA device; use auto or cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    return device


@lru_cache
def get_settings() -> Settings:
    """The settings of this process, read once (the CLI's; the app takes its own)."""
    return Settings()
