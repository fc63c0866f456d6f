"""GET /health: liveness and what is being served."""

from __future__ import annotations

from fastapi import APIRouter, Request

from imgret.service.auth import may_see_details
from imgret.service.deps import ResourcesDep
from imgret.service.schemas.health import HealthStatus

router = APIRouter(tags=["health"])

# What /health says of a failed catch-up to a client that may not read its text: the text is
# a database driver's message (host names, table and column names, SQL).
FOLLOWER_ERROR_HIDDEN = "catching up with the database failed"


@router.get("/health")
def read_health(request: Request, resources: ResourcesDep) -> HealthStatus:
    """Liveness: the model version served, the index size, the device, and how far this
    process's index follows the database.

    ``status`` is ``degraded`` (still HTTP 200: the process is alive, and restarting it would
    not help) when the change-log follower has not caught up for longer than the stated bound:
    other processes' adds are then missing here. Deletes are honoured either way (every search
    reads them first, and fails with 503 when it cannot).

    ``follower_error`` gives the failure's text only with the right ``X-API-Key`` (or, on a
    server without a key, to a local request: :func:`imgret.service.auth.may_see_details`); others
    read a generic message.
    """
    follower = resources.follower
    serving = resources.serving  # read once: model and index of the same version
    return HealthStatus(
        status="degraded" if follower.stale() else "ok",
        model_version=serving.version,
        index_size=serving.searcher.size,
        index_backend=request.app.state.settings.index_backend,
        device=serving.embedder.device,
        change_seq=serving.searcher.change_seq,
        follower_lag_s=round(follower.lag_seconds(), 3),
        follower_error=_follower_error(follower.last_error, request),
    )


def _follower_error(error: str | None, request: Request) -> str | None:
    if error is None or may_see_details(request.scope, request.app.state.settings,
                                        request.app.state.keyring.in_use):
        return error
    return FOLLOWER_ERROR_HIDDEN
