"""Request body size limit: a pure ASGI middleware that answers 413 before the body is read."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


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
    plain text; the contract wants FastAPI's JSON error shape with the limit in the message.
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
