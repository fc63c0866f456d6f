"""GET /health: liveness and what is being served."""

from __future__ import annotations

from fastapi import APIRouter

from service.deps import ResourcesDep
from service.schemas import HealthStatus

router = APIRouter(tags=["health"])


@router.get("/health")
def read_health(resources: ResourcesDep) -> HealthStatus:
    """Liveness: the model version served, the index size and the device."""
    return HealthStatus(
        status="ok",
        model_version=resources.searcher.model_version,
        index_size=resources.searcher.size,
        device=resources.embedder.device,
    )
