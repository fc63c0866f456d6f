"""GET /metrics: Prometheus text exposition of the server's metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
def read_metrics(request: Request) -> Response:
    """Request counts and latency per route template, batch sizes, embed time, index size.

    With several workers, all of them merged (``ServiceMetrics.exposition``).
    """
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
