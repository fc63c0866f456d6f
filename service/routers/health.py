"""GET /health: liveness and what is being served."""

from __future__ import annotations

from fastapi import APIRouter

from service.deps import ResourcesDep
from service.schemas import HealthStatus

router = APIRouter(tags=["health"])


@router.get("/health")
def read_health(resources: ResourcesDep) -> HealthStatus:
    """Liveness: the model version served, the index size, the device, and how far this
    process's index follows the database.

    ``status`` is ``degraded`` (still HTTP 200: the process is alive, and restarting it would
    not help) when the change-log follower has not caught up for longer than the stated bound:
    other processes' adds are then missing here. Deletes are honoured either way (every search
    reads them first, and fails with 503 when it cannot).
    """
    follower = resources.follower
    serving = resources.serving  # read once: model and index of the same version
    return HealthStatus(
        status="degraded" if follower.stale() else "ok",
        model_version=serving.version,
        index_size=serving.searcher.size,
        device=serving.embedder.device,
        change_seq=serving.searcher.change_seq,
        follower_lag_s=round(follower.lag_seconds(), 3),
        follower_error=follower.last_error,
    )
