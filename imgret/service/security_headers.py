"""Security headers on every response, decided by the path alone.

* ``X-Content-Type-Options: nosniff``: a stored image or a JSON answer is never run as a
  script or rendered as HTML by a browser that guesses types.
* ``X-Frame-Options: DENY`` and CSP ``frame-ancestors 'none'``: no page may frame this one
  (clickjacking of the Models view's activate/rollback buttons).
* ``Referrer-Policy: no-referrer``: item ids and query-set names in URLs stay here.
* ``Content-Security-Policy``: the web page (``/`` and ``/static/*``) loads only its own
  scripts and style sheets (no inline script or style: the page has none), images from
  here and the ``blob:`` URL of the query preview, and talks only to this origin
  (:data:`PAGE_POLICY`). Every other answer (JSON, stored images) gets
  :data:`API_POLICY`, which allows nothing: such a response opened as a document can run
  nothing. FastAPI's ``/docs`` and ``/redoc`` load Swagger UI and ReDoc from a CDN with an
  inline start-up script, so they get no policy (the other headers still apply).

A header the route set itself is kept.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_POLICY = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' blob:",
    "connect-src 'self'",
    "form-action 'self'",
    "base-uri 'none'",
    "frame-ancestors 'none'",
))
API_POLICY = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
COMMON_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)


def content_security_policy(path: str, no_policy: frozenset[str]) -> str | None:
    """The policy for a response to ``path`` (``None``: none)."""
    if path in no_policy:
        return None
    if path == "/" or path.startswith("/static/"):
        return PAGE_POLICY
    return API_POLICY


class SecurityHeadersMiddleware:
    """Add :data:`COMMON_HEADERS` and the path's Content-Security-Policy to every response.

    Args:
        app: the wrapped ASGI app.
        no_policy: paths served without a Content-Security-Policy (the API docs pages).
    """

    def __init__(self, app: ASGIApp, *, no_policy: Iterable[str | None] = ()):
        self.app = app
        self.no_policy = frozenset(p for p in no_policy if p)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        policy = content_security_policy(path, self.no_policy)
        extra = list(COMMON_HEADERS)
        if policy is not None:
            extra.append((b"content-security-policy", policy.encode()))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.lower() for name, _ in headers}
                headers += [(name, value) for name, value in extra if name not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
