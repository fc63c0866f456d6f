"""GET /metrics: Prometheus text exposition of this process's metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
def read_metrics(request: Request) -> Response:
    """Request counts and latency per route template, batch sizes, embed time, index size."""
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
