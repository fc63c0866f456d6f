"""Who may call what: the role each route needs, and the key ring a process checks keys
against.

:func:`need` reads the role a request needs from its method and path alone (no body, no
route table), so the guard middleware decides before a byte of the body is read, and the
role × route table in ``docs/api.md`` is generated from the app's routes through the same
function (``python tools/role_table.py``; a test walks it).

- Public: ``/health``, the web page, ``/static``, the OpenAPI docs. ``GET /collections``
  answers anyone, listing what the caller may read.
- In a collection (``/collections/{name}/...``; the root routes are ``default``'s): reads
  (``GET``, ``POST /search``, ``/search/batch``, ``/identify``, ``/evaluate``) need ``read``
  (``/evaluate`` always with a key: it costs a search per query);
  ``GET /models`` too; other ``/models`` requests need ``admin``; any other write needs
  ``write`` (an unknown write route is a write: fail closed). The unknowns pool
  (``/identities/unknowns...``) needs ``write`` even to read it: its images are of people
  the gallery does not hold. ``GET /metrics`` is a read of ``default``.
- Everything else (``/keys``, ``/admin``, creating, changing and deleting collections) needs
  a global admin key: a stored key marked admin, or ``IMGRET_API_KEY``.

Keys are in use once ``IMGRET_API_KEY`` is set or a key is stored. Then a write needs a key
with the role; a read of a public collection needs none, and of a private one
(``public: false``) it needs a key with ``read``. A key never takes away what anonymity
gives: a good key without any role on a public collection reads it as an anonymous caller
would. A wrong, unknown or revoked key is 401 on every route that names a collection or
needs an admin (even a public read: a client must hear that its key is bad), a good key
without the role a route needs 403; the public routes (``/health``, the page, the docs, the
list of collections) answer as if no key was sent. Without keys, reads are anonymous and
writes follow the keyless rules of :mod:`imgret.service.auth`.

Checking a key costs the same whether its id exists, is revoked or is unknown
(:meth:`KeyRing.identify`), so its timing does not tell which ids exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import threading
import time
from dataclasses import dataclass

import anyio.to_thread
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from imgret.gallery.storage.tables import DEFAULT_COLLECTION, Collection
from imgret.gallery.tenancy import keys

logger = logging.getLogger(__name__)

GLOBAL = "global admin"
_PUBLIC_PATHS = ("/health", "/", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect",
                 "/collections")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# POST routes that only read (a query image travels in the body), in any collection.
READ_ONLY_POSTS = frozenset({"/search", "/search/batch", "/identify"})
_READ_POSTS = READ_ONLY_POSTS | {"/evaluate"}
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
_IN_COLLECTION = re.compile(r"^/collections/([^/]+)(/.*)?$")
# KDF checks at once (each takes 16 MiB and tens of milliseconds): a flood of made-up keys
# queues here instead of taking every core and a gigabyte.
KDF_CONCURRENCY = 2


@dataclass(frozen=True)
class Need:
    """What a request needs: ``role`` on ``collection``, or a global admin key
    (``role == GLOBAL``, ``collection`` None). ``anonymous``: a ``read`` that a public
    collection answers without a key (not ``/evaluate``: its cost calls for a key)."""

    role: str
    collection: str | None = None
    anonymous: bool = True


def split_collection(path: str) -> tuple[str | None, str]:
    """``(collection, rest)`` of a path under ``/collections/{name}`` (``rest`` is ``""`` for
    the collection itself), ``(None, path)`` for any other path."""
    match = _IN_COLLECTION.match(path)
    if match is None:
        return None, path
    return match.group(1), match.group(2) or ""


def need(method: str, path: str) -> Need | None:
    """The role a request needs; ``None`` for a public route (see the module docstring)."""
    method = method.upper()
    path = path.rstrip("/") or "/"
    if path.startswith("/static/") or (method in SAFE_METHODS and path in _PUBLIC_PATHS):
        return None
    if path == "/metrics":
        return Need("read", DEFAULT_COLLECTION)
    name, rest = split_collection(path)
    if name is None:
        if path.startswith(("/keys", "/admin", "/collections")):
            return Need(GLOBAL)
        return _in_collection(method, path, DEFAULT_COLLECTION)
    if not rest:  # the collection itself
        return Need("read", name) if method in SAFE_METHODS else Need(GLOBAL)
    return _in_collection(method, rest, name)


def _in_collection(method: str, rest: str, collection: str) -> Need:
    if rest.startswith("/models"):
        return Need("read" if method in SAFE_METHODS else "admin", collection)
    if rest.startswith("/identities/unknowns"):
        # People the gallery does not hold, kept without their knowledge: never public, and
        # only for those who may change the gallery.
        return Need("write", collection)
    if method in SAFE_METHODS or rest in _READ_POSTS:
        return Need("read", collection, anonymous=rest != "/evaluate")
    return Need("write", collection)


@dataclass(frozen=True)
class Caller:
    """Who a request was let in as: a stored key, the environment's key, or nobody."""

    key: keys.KeyRecord | None = None
    bootstrap: bool = False

    @property
    def anonymous(self) -> bool:
        return self.key is None and not self.bootstrap

    def may(self, role: str, collection: str) -> bool:
        if self.bootstrap:
            return True
        return self.key is not None and self.key.allows(collection, role)

    @property
    def is_admin(self) -> bool:
        return self.bootstrap or (self.key is not None and self.key.is_admin
                                  and self.key.revoked_at is None)


class KeyRing:
    """This process's view of the stored keys and which collections are public, refreshed
    from SQL every ``interval_s`` (the follower interval: a key revoked by any process is
    refused here within it) and at once after a change made here.

    Args:
        bootstrap: ``IMGRET_API_KEY`` (bytes), or ``None``.
    """

    def __init__(self, bootstrap: bytes | None):
        self.bootstrap = bootstrap
        self.keys: dict[int, keys.KeyRecord] = {}
        self.public: dict[str, bool] = {DEFAULT_COLLECTION: True}
        self._sessions: sessionmaker[Session] | None = None
        self._verified: dict[int, bytes] = {}  # key id -> SHA-256 of the secret checked
        self._lock = threading.Lock()
        self._kdf = asyncio.Semaphore(KDF_CONCURRENCY)
        self._learned_at = 0.0

    @property
    def in_use(self) -> bool:
        """Whether requests are checked against keys (a bootstrap key or a stored one)."""
        return self.bootstrap is not None or bool(self.keys)

    def attach(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self.refresh()

    def refresh(self) -> None:
        """Read the keys and the collections' public flags again (on a worker thread)."""
        if self._sessions is None:
            return
        loaded = keys.load(session_factory=self._sessions)
        with self._sessions() as session:
            public = dict(session.execute(select(Collection.name, Collection.public)).all())
        with self._lock:
            for key_id, record in loaded.items():
                old = self.keys.get(key_id)
                if old is None or old.digest != record.digest:
                    self._verified.pop(key_id, None)
            self.keys, self.public = loaded, public

    async def follow(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` until cancelled (errors are logged and retried)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await anyio.to_thread.run_sync(self.refresh)
            except Exception:  # noqa: BLE001 - the last good view stays; retried next time
                logger.exception("could not refresh the API keys")

    async def learn(self, collection: str) -> None:
        """Read the flags again if ``collection`` is not known here yet (created by another
        process since the last refresh), at most every quarter second whatever the
        requests name."""
        if collection not in self.public:
            await self._refresh_soon()

    async def _refresh_soon(self) -> None:
        # Whatever names or ids requests make up, at most four reads a second.
        now = time.monotonic()
        if self._sessions is None or now - self._learned_at < 0.25:
            return
        self._learned_at = now
        await anyio.to_thread.run_sync(self.refresh)

    def is_public(self, collection: str) -> bool:
        """Whether anonymous reads of ``collection`` are allowed (an unknown name: no, so a
        missing key does not tell which names exist)."""
        return self.public.get(collection, False)

    async def identify(self, presented: bytes | None) -> Caller | None:
        """The caller a key belongs to; ``Caller()`` without a key; ``None`` for a wrong,
        unknown or revoked key."""
        if presented is None:
            return Caller()
        if self.bootstrap is not None and hmac.compare_digest(presented, self.bootstrap):
            return Caller(bootstrap=True)
        try:
            parsed = keys.parse(presented.decode("ascii"))
        except UnicodeDecodeError:
            return None
        if parsed is None:
            return None
        key_id, secret = parsed
        fingerprint = hashlib.sha256(secret.encode()).digest()
        record, seen = self.keys.get(key_id), self._verified.get(key_id)
        if (record is not None and record.revoked_at is None and seen is not None
                and hmac.compare_digest(seen, fingerprint)):
            return Caller(key=record)  # verified before: only its holder gets here
        # Every other key costs one lookup by id and one KDF, whether its id exists, is
        # revoked or is unknown (keys.matches), so timing says nothing about which ids
        # exist; the lookup finds a key another process has just made, at once.
        async with self._kdf:
            record = await anyio.to_thread.run_sync(self._check, key_id, secret)
        if record is None:
            return None
        with self._lock:
            self.keys[key_id] = record
            self._verified[key_id] = fingerprint
        return Caller(key=record)

    def _check(self, key_id: int, secret: str) -> keys.KeyRecord | None:
        """The key ``key_id`` as stored now if ``secret`` is its secret and it is live."""
        record = (keys.find(key_id, session_factory=self._sessions)
                  if self._sessions is not None else self.keys.get(key_id))
        return record if keys.matches(record, secret) else None


def route_table(openapi: dict) -> list[tuple[str, str, str]]:
    """``(method, path, who)`` for every operation of an app's OpenAPI schema (generated from
    its routes), in its order: the table ``docs/api.md`` shows, decided by :func:`need`."""
    rows = []
    for path, operations in openapi.get("paths", {}).items():
        for method in operations:
            if method.upper() in _METHODS:
                required = need(method, path)
                rows.append((method.upper(), path, _who(required, path)))
    return rows


def _who(required: Need | None, path: str) -> str:
    if required is None:
        return "anyone (lists what the caller may read)" if path == "/collections" else "anyone"
    where = "the collection" if "{collection}" in path else "default"
    if required.role == GLOBAL:
        return "global admin"
    public = "anyone if public, else " if required.role == "read" and required.anonymous else ""
    return f"{public}{required.role} on {where}"


def markdown_table(openapi: dict) -> str:
    """The role × route table, as Markdown."""
    lines = ["| method | path | who may call it |", "|---|---|---|"]
    lines += [f"| {m} | `{p}` | {who} |" for m, p, who in route_table(openapi)]
    return "\n".join(lines) + "\n"
