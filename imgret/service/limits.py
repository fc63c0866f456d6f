"""What one request may cost: the body size (a pure ASGI middleware that answers 413 before the
body is read) and the search budget (``k`` and re-ranking, refused with 422 before any work).

Search budget. The unit costs (measured by ``benchmarks/rerank_bench.py --grid`` at 100k x
128-d, exact ``Flat``; the table is in docs/rerank.md):

- k-reciprocal re-ranking costs about 1 ms per candidate N (two index searches each: the
  candidate's neighbourhood and its farthest item), whatever k1 and k; N = 1,000 costs most of
  a second per query. Query expansion costs two searches.
- ``k`` costs nothing measurable in the index, but every hit is built and serialised on the
  event loop, ~6 us each, during which no other request moves.

So, with :func:`~imgret.gallery.search.rerank.index_searches` as the cost unit (~0.5 ms at 100k):

- ``rerank_candidates`` at most 100 (the paper's and our default): at most 202 searches, about
  0.1 s per query at 100k, and N^3 work inside U stays negligible (10^6);
- one request's re-ranking at most 808 searches (4 queries at N = 100, or 32 at N = 11): about
  0.4 s of the re-ranking pool's time at 100k;
- one request's hits (queries x k) at most 4,000: ~25 ms on the event loop; a single query
  keeps k up to 1,000 (``imgret.service.schemas.common.K_MAX``).

The re-ranking itself runs on its own bounded pool, never on the model thread
(``imgret.service.followups.FollowUpPool``, set up by ``imgret.service.pipeline``): plain searches
keep being
answered while it works, and its queue (``IMGRET_RERANK_QUEUE_MAX``, in the same unit) answers
503 with Retry-After when full.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgret.gallery.search.rerank import Rerank, index_searches

SEARCH_CANDIDATES_MAX = 100
REQUEST_RERANK_SEARCHES_MAX = 4 * (2 * SEARCH_CANDIDATES_MAX + 2)
REQUEST_HITS_MAX = 4000


def check_search_budget(k: int, reranks: Sequence[Rerank | None]) -> None:
    """Refuse a search request (one entry of ``reranks`` per query) that costs more than the
    budget above: 422 with what it costs and what is allowed, before anything is queued.

    Raises:
        HTTPException: 422.
    """
    queries = len(reranks)
    if queries * k > REQUEST_HITS_MAX:
        raise HTTPException(
            422, f"{queries} queries x k={k} asks for {queries * k} results; at most "
                 f"{REQUEST_HITS_MAX} per request: send a smaller k or fewer images")
    searches = sum(index_searches(option) for option in reranks)
    if searches > REQUEST_RERANK_SEARCHES_MAX:
        per_query = index_searches(reranks[0]) if len(set(reranks)) == 1 else None
        cost = (f"{queries} queries x {per_query} index searches"
                if per_query is not None else f"{searches} index searches")
        raise HTTPException(
            422, f"re-ranking this request costs {cost} (k_reciprocal: 2 per candidate + 2); "
                 f"at most {REQUEST_RERANK_SEARCHES_MAX} per request: send fewer images or "
                 "fewer rerank_candidates")


class BodyTooLarge(Exception):
    """Raised from ``receive`` once the streamed body passes the limit."""


class UploadLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413 ``{"detail": ...}``.

    Two checks, so that no client can make the server buffer more than the limit:

    * a declared ``Content-Length`` over the limit is refused before the app runs, so not one
      byte of the body is read (with ``Expect: 100-continue`` the client never sends it);
    * a chunked body or a lying ``Content-Length`` is counted as it streams, and the request
      is cut off at the first chunk past the limit.

    Starlette's ``RequestBodyLimitMiddleware`` only looks at the first ``receive`` and answers in
    plain text; the API answers in FastAPI's JSON error shape with the limit in the message.
    A pure ASGI class (not ``BaseHTTPMiddleware``) keeps streaming intact.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the largest body accepted (``IMGRET_MAX_UPLOAD_BYTES``).
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return

        received = 0
        too_large = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if too_large:
                # The app caught BodyTooLarge and answered (FastAPI turns a form-parsing
                # failure into 400); the client must see the real reason instead.
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            # BodyTooLarge itself, or wrapped by whatever the app does with it (a task
            # group's ExceptionGroup, a framework's own error): the flag says which it was.
            if not too_large or started:
                raise
        if too_large and not started:
            await self._refuse(send, None)

    async def _refuse(self, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "the request body"
        body = json.dumps(
            {"detail": f"{size} is over the upload limit of {self.max_bytes} bytes "
                       "(IMGRET_MAX_UPLOAD_BYTES)"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    # The unread rest of the body makes the connection unusable.
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def content_length(scope: Scope) -> int | None:
    """The request's declared ``Content-Length``; ``None`` when absent or not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
