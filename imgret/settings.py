"""Runtime settings: environment variables with the prefix IMGRET_, validated at start."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

_DRIVERS = ("sqlite", "postgresql")


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
    device: Literal["auto", "cpu", "cuda"] = "auto"
    api_key: SecretStr | None = Field(None, description="required in X-API-Key for writes")
    max_upload_bytes: int = Field(20 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(40_000_000, gt=0, description="decompression-bomb guard")
    index_factory: str = Field("Flat", min_length=1, description="FAISS index factory string")
    index_nprobe: int | None = Field(
        None, ge=1, description="IVF lists visited per query (default nlist/16, at least 8)"
    )
    index_ef_search: int | None = Field(None, ge=1, description="HNSW beam width (default 64)")
    batch_max_size: int = Field(32, ge=1, description="1 turns dynamic batching off")
    batch_max_wait_ms: float = Field(5.0, ge=0)

    # Write guard (issue 10, defect 5; enforced by service.auth): a keyless server beyond
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
