"""The write guard: API key, exposure and ``Origin`` checks, decided before a body is read.

FastAPI parses a multipart body *before* it solves a route's dependencies, so a dependency
such as :func:`imgret.service.deps.require_api_key` would let an unauthenticated client make the
server read and spool a whole upload before the 401. :class:`WriteGuardMiddleware` is a pure
ASGI middleware that decides on the method, the path and the headers alone, and answers
401/403 without calling ``receive`` once.

What counts as a write (:func:`is_write`): every method other than GET, HEAD and OPTIONS,
except the read-only ``POST /search`` and ``POST /search/batch``. ``POST /evaluate`` and any
future route (``/models`` writes) are therefore guarded by default (fail closed).

Rules for a write, in this order:

1. **Key.** With ``IMGRET_API_KEY`` set, ``X-API-Key`` must equal it (401 otherwise; the
   comparison takes the same time wherever the strings differ).
2. **Local only, without a key.** A keyless write is accepted only from a request that is
   certainly local (:func:`is_local_request`): the peer address is loopback, the ``Host``
   header is a loopback name (``localhost``, ``*.localhost``, ``127.0.0.0/8``, ``[::1]``,
   any port), and no proxy header (``Forwarded``, ``X-Forwarded-For``,
   ``X-Forwarded-Host``, ``X-Real-IP``) is present; anything else gets 403 naming
   ``IMGRET_API_KEY``. The ``Host`` rule stops DNS rebinding: a page on
   ``rebind.example`` whose name is re-pointed at 127.0.0.1 reaches the server from the
   visitor's own machine with ``Host`` and ``Origin`` both ``rebind.example:PORT``, which
   the ``Origin`` rule alone would take for the API's own origin. The proxy rule stops a
   reverse proxy on the same host from making every client of the network look local (a
   proxy must then forward ``Host`` or add one of those headers; nginx's default
   ``Host: 127.0.0.1:PORT`` without ``X-Forwarded-For`` is indistinguishable from a local
   client, so a proxied server needs a key). A peer that is a name rather than an address is
   an in-process transport (Starlette's ``TestClient``; a server on TCP always gives an
   address): nothing can rebind or proxy it, so it counts as local. A Unix socket (no peer
   address) does not: a proxy is what connects there.
   ``IMGRET_ALLOW_ANONYMOUS_WRITES=true`` lifts this rule entirely (any client, any
   ``Host``, proxied or not: the operator accepts anonymous writes from everyone who can
   reach the server, under any name, a rebound one included); the ``Origin`` rule still
   applies. ``imgret serve`` already refuses to *start* on a non-loopback host without a
   key or that setting (:func:`check_write_exposure`); this covers servers started another
   way (``uvicorn --factory imgret.service.app:create_app --host 0.0.0.0``) and proxied ones.
3. **Origin.** A browser sends ``Origin`` on every cross-origin POST/DELETE, and a multipart
   POST needs no CORS preflight, so without this check any web page could write to the
   server through a visitor's browser. A write whose ``Origin`` is neither the API's own
   (``scheme://host[:port]`` of the request) nor listed in ``IMGRET_ALLOWED_ORIGINS`` is
   refused with 403. Requests without ``Origin`` (curl, SDKs) are not browser requests and
   pass; ``Origin: null`` (sandboxed frames, ``file:`` pages) is refused.

Behind a TLS-terminating proxy the API sees ``http`` while the browser's origin is
``https``: run uvicorn with proxy headers (``imgret serve`` keeps uvicorn's default of
trusting 127.0.0.1) or list the public origin in ``IMGRET_ALLOWED_ORIGINS``.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from imgret.errors import ImgretError
from imgret.service.access import (
    GLOBAL,
    READ_ONLY_POSTS,
    SAFE_METHODS,
    Caller,
    KeyRing,
    Need,
    need,
    split_collection,
)
from imgret.settings import Settings

API_KEY_HEADER = "X-API-Key"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_write(method: str, path: str) -> bool:
    """Whether a request is a write (guarded): any unsafe method but the read-only POSTs, in
    the default collection or under ``/collections/{name}``."""
    if method.upper() in SAFE_METHODS:
        return False
    collection, rest = split_collection(path)
    within = rest if collection is not None and rest else path
    return (within.rstrip("/") or "/") not in READ_ONLY_POSTS


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback interface.

    ``0.0.0.0``, ``::``, an empty host and any other name count as exposed: a name may
    resolve to anything, so only what is certainly local is called local.
    """
    if host is None:
        return False
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def has_api_key(settings: Settings) -> bool:
    """Whether a non-empty ``IMGRET_API_KEY`` is configured."""
    return settings.api_key is not None and bool(settings.api_key.get_secret_value())


def check_write_exposure(settings: Settings, host: str) -> None:
    """Refuse to serve keyless writes beyond loopback (the start-up check of ``imgret serve``).

    Raises:
        ImgretError: ``host`` is not loopback, no ``IMGRET_API_KEY`` is set and
            ``IMGRET_ALLOW_ANONYMOUS_WRITES`` is not true. The message names both fixes.
    """
    if is_loopback(host) or has_api_key(settings) or settings.allow_anonymous_writes:
        return
    raise ImgretError(
        f"refusing to serve on {host!r} without an API key: anyone who can reach this address "
        "(or any web page a visitor opens) could add and delete gallery items. Set "
        "IMGRET_API_KEY to a secret (clients send it as the X-API-Key header), serve on "
        "127.0.0.1, or set IMGRET_ALLOW_ANONYMOUS_WRITES=true to accept anonymous writes"
    )


def may_see_details(scope: Scope, settings: Settings, keys_in_use: bool | None = None) -> bool:
    """Whether a request may read internal error text (``/health``'s ``follower_error``).

    With keys in use: only a global admin caller (a wrong or missing key is not refused, the
    text is only withheld). Without: only a request that may also write keylessly
    (:func:`is_local_request`; ``IMGRET_ALLOW_ANONYMOUS_WRITES`` does not widen this,
    database messages are no help to anonymous writers).
    """
    if keys_in_use is None:
        keys_in_use = has_api_key(settings)
    if keys_in_use:
        caller = scope.get("state", {}).get("caller")
        return caller is not None and caller.is_admin
    return is_local_request(scope, _headers(scope))


def normalize_origin(origin: str) -> str | None:
    """``scheme://host[:port]`` in lower case without a default port; ``None`` if malformed."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


class WriteGuardMiddleware:
    """Refuse unauthorised, exposed or cross-origin requests before any of their body is read.

    With keys in use (:class:`imgret.service.access.KeyRing`), every request's key is checked
    against the role its route needs (:func:`imgret.service.access.need`) and the caller is
    left in ``scope["state"]["caller"]`` for the routes; without, writes follow the keyless
    rules of this module's docstring. The ``Origin`` rule applies to writes either way.

    Args:
        app: the wrapped ASGI app.
        settings: ``api_key``, ``allow_anonymous_writes`` and ``allowed_origins`` are read.
        keyring: the stored keys (default: ``IMGRET_API_KEY`` alone, no stored keys).
    """

    def __init__(self, app: ASGIApp, *, settings: Settings, keyring: KeyRing | None = None):
        self.app = app
        self.keyring = keyring if keyring is not None else KeyRing(bootstrap_key(settings))
        self.allow_anonymous = settings.allow_anonymous_writes
        self.allowed_origins = normalized_origins(settings.allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = await self.refusal(scope)
            if refusal is not None:
                status, detail, headers = refusal
                await _answer(send, status, detail, headers)
                return
        await self.app(scope, receive, send)

    async def refusal(self, scope: Scope) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        """``(status, detail, extra headers)`` for a request to refuse, ``None`` to let it in
        (with its caller in ``scope["state"]``)."""
        headers = _headers(scope)
        method, path = scope["method"], _route_path(scope)
        write = is_write(method, path)
        required = need(method, path)
        if required is not None and required.collection is not None:
            await self.keyring.learn(required.collection)
        if self.keyring.in_use:
            caller = await self.keyring.identify(headers.get(b"x-api-key"))
            if caller is None:
                if required is not None:
                    return _UNAUTHORISED
                caller = Caller()  # a public route (a health probe) answers anyway
            refused = self._role_refusal(caller, required)
            if refused is not None:
                return refused
        else:
            caller = Caller()
            if write and not self.allow_anonymous and not is_local_request(scope, headers):
                return (403, "writes are refused: this server has no IMGRET_API_KEY, so it "
                             "accepts writes only from this machine, addressed by a loopback "
                             "name (localhost, 127.0.0.1, [::1]) and not through a proxy; set "
                             "IMGRET_API_KEY and send it as the X-API-Key header", [])
            if (required is not None and required.role == "read" and required.collection
                    and self.keyring.public.get(required.collection) is False):
                return (401, f"collection {required.collection!r} is private: reads need a "
                             f"key with the read role on it ({API_KEY_HEADER} header)",
                        [(b"www-authenticate", API_KEY_HEADER.encode())])
        scope.setdefault("state", {})["caller"] = caller
        origin = headers.get(b"origin")
        if write and origin is not None:
            text = origin.decode("latin-1")
            normalized = normalize_origin(text)
            if normalized is None or normalized not in self._accepted(scope, headers):
                shown = text[:100].encode("ascii", "backslashreplace").decode()
                return (403, f"cross-origin write from {shown!r} refused; the API accepts "
                             "writes from its own origin and those in IMGRET_ALLOWED_ORIGINS",
                        [])
        return None

    def _role_refusal(self, caller: Caller, required: Need | None
                      ) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        if required is None:
            return None
        if required.role == GLOBAL:
            if caller.is_admin:
                return None
            return _UNAUTHORISED if caller.anonymous else (
                403, "this needs a global admin key", [])
        assert required.collection is not None
        # A key never takes away what anonymity gives: a public read answers any caller
        # whose key is good, whatever roles it holds (a bad key was refused before: 401).
        if (required.role == "read" and required.anonymous
                and self.keyring.is_public(required.collection)):
            return None
        if caller.may(required.role, required.collection):
            return None
        if caller.anonymous:
            return _UNAUTHORISED
        # The key is good but its roles do not cover this: say which role, not which names
        # exist (a collection the key knows nothing of gets the same answer).
        return (403, f"this key has no {required.role} role on collection "
                     f"{required.collection!r}", [])

    def _accepted(self, scope: Scope, headers: dict[bytes, bytes]) -> frozenset[str]:
        own = _own_origin(scope, headers)
        return self.allowed_origins | {own} if own else self.allowed_origins


_UNAUTHORISED = (401, f"missing or wrong {API_KEY_HEADER} header",
                 [(b"www-authenticate", API_KEY_HEADER.encode())])


def bootstrap_key(settings: Settings) -> bytes | None:
    """``IMGRET_API_KEY`` as the bytes a client sends, ``None`` when unset or empty."""
    return settings.api_key.get_secret_value().encode() if has_api_key(settings) else None


def normalized_origins(origins: Iterable[str]) -> frozenset[str]:
    """The origins of ``IMGRET_ALLOWED_ORIGINS``, normalised; ImgretError for a bad one."""
    result = set()
    for origin in origins:
        normalized = normalize_origin(origin)
        if normalized is None:
            raise ImgretError(
                f"IMGRET_ALLOWED_ORIGINS: {origin!r} is not an origin like https://host[:port]"
            )
        result.add(normalized)
    return frozenset(result)


def _route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path


def _headers(scope: Scope) -> dict[bytes, bytes]:
    # A repeated header: the first value decides (a second X-API-Key cannot help a client).
    headers: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", ()):
        headers.setdefault(name.lower(), value)
    return headers


def _own_origin(scope: Scope, headers: dict[bytes, bytes]) -> str | None:
    host = headers.get(b"host")
    if host is None:
        return None
    scheme = scope.get("scheme", "http")
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    return normalize_origin(f"{scheme}://{host.decode('latin-1')}")


# Headers a proxy adds: their presence means the peer address is the proxy's, not the client's.
PROXY_HEADERS = (b"forwarded", b"x-forwarded-for", b"x-forwarded-host", b"x-real-ip")


def is_local_request(scope: Scope, headers: dict[bytes, bytes] | None = None) -> bool:
    """Whether a request certainly comes from this machine, addressed by a loopback name and
    not through a proxy (the keyless write rule of this module's docstring).

    Args:
        scope: the ASGI scope (``client`` is the peer).
        headers: the scope's headers as :func:`_headers` reads them (read here if omitted).
    """
    headers = _headers(scope) if headers is None else headers
    if any(name in headers for name in PROXY_HEADERS):
        return False
    client = scope.get("client")
    if not client or not client[0]:
        return False  # a Unix socket: whatever connects there (a proxy) is not known local
    peer = str(client[0])
    if not _is_ip_address(peer):
        return True  # an in-process transport names its peer: no network is involved
    return is_loopback(peer) and is_loopback_host_header(headers.get(b"host"))


def is_loopback_host_header(value: bytes | None) -> bool:
    """Whether a ``Host`` header names a loopback host (with or without a port)."""
    if value is None:
        return False
    try:
        parts = urlsplit("http://" + value.decode("ascii"))
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except (UnicodeDecodeError, ValueError):
        return False
    if parts.hostname is None or parts.netloc != value.decode("ascii") or "@" in parts.netloc:
        return False
    return is_loopback(parts.hostname)


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


async def _answer(
    send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]]
) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
