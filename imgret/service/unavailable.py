"""Why the service cannot take or finish a piece of work right now.

These are the service's own refusals, not the client's mistakes: the client may simply retry
(on this instance after ``retry_after_s`` seconds, or on another one). :mod:`imgret.service.errors`
answers every one of them with 503 and a ``Retry-After`` header; the code that raises them
knows nothing of HTTP.
"""

from __future__ import annotations

RETRY_AFTER_S = 1


class ServiceUnavailable(Exception):
    """The work cannot be taken or finished now; retrying later may succeed.

    Attributes:
        retry_after_s: how long the client should wait before retrying.
    """

    def __init__(self, message: str, *, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(ServiceUnavailable):
    """The search queue has no room for all of a request's items (``IMGRET_BATCH_QUEUE_MAX``);
    none of them was queued."""


class PoolFull(ServiceUnavailable):
    """A bounded worker pool (re-ranking: ``IMGRET_RERANK_QUEUE_MAX``) cannot reserve the
    request's cost; nothing was reserved."""


class ShuttingDown(ServiceUnavailable):
    """The server is stopping: queued work is answered with this, and so is new work."""

    def __init__(self, message: str = "the server is shutting down; retry in a moment", *,
                 retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message, retry_after_s=retry_after_s)


class WorkerFailed(ServiceUnavailable):
    """The worker that held this item ended unexpectedly; a new one serves the retry."""
