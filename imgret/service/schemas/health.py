"""``GET /health``."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    Field,
)


class HealthStatus(BaseModel):
    """Liveness and what is being served."""

    status: Literal["ok", "degraded"] = Field(
        description="degraded: the index has not caught up with the database for a while"
    )
    model_version: str
    index_size: int = Field(description="vectors in the served index")
    index_backend: str = Field(
        "faiss", description="where the vectors are searched: faiss (this process) or milvus",
        examples=["faiss", "milvus"])
    device: str = Field(examples=["cpu", "cuda"])
    change_seq: int = Field(description="the last gallery change applied to this index")
    follower_lag_s: float = Field(description="seconds since the index last caught up")
    follower_error: str | None = Field(
        None, description="why the last catch-up failed: the database's message with the "
                          "right X-API-Key (or, without a key, from this machine), else a "
                          "generic one",
    )
