"""API keys: created, listed and revoked here; checked by the service
(:mod:`imgret.service.access`).

Decisions:

- **A key is ``imgret_<id>_<secret>``**: the id finds its row without a scan, the secret is
  32 random bytes (URL-safe base64). Only ``scrypt(secret, salt)`` is stored (n=2^14, r=8,
  p=1: 16 MiB and tens of milliseconds per check; the KDF and its parameters are stored with
  it, so they can be raised later). The secret is shown once, at creation.
- **Roles are per collection**: ``read`` (search, list, images, evaluate, ``GET /models``),
  ``write`` (also add and delete items), ``admin`` (also every ``/models`` write); a key
  marked admin holds every role on every collection and manages collections, keys and
  backups. A role on a collection goes with it when it is deleted.
- **Revocation keeps the row** (who had which key, until when) and is final.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import GalleryError
from imgret.gallery.storage.tables import ROLES, ApiKey, ApiKeyRole, Collection, utcnow
from imgret.gallery.tenancy import collections

KEY_PREFIX = "imgret"
_SCRYPT = {"n": 2**14, "r": 8, "p": 1}
KDF = "scrypt:n=16384,r=8,p=1"
# Enough for scrypt's 128 * n * r bytes (16 MiB) and a little more.
_SCRYPT_MAXMEM = 64 * 1024 * 1024
_KEY = re.compile(rf"^{KEY_PREFIX}_([1-9][0-9]{{0,9}})_([A-Za-z0-9_-]{{43}})$")
KEY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,63}$"
_KEY_NAME = re.compile(KEY_NAME_PATTERN)
RANK = {role: rank for rank, role in enumerate(ROLES, start=1)}
# What an unknown key id is checked against (random per process: no secret matches it).
_NO_KEY_SALT = secrets.token_bytes(16)
_NO_KEY_DIGEST = secrets.token_bytes(32)


class KeyNotFound(GalleryError, LookupError):
    """No key with that id (404)."""


@dataclass(frozen=True)
class KeyRecord:
    """A stored key as the service checks it (no secret: its salt and digest)."""

    id: int
    name: str
    is_admin: bool
    roles: Mapping[str, str]  # collection name -> role
    created_at: datetime
    revoked_at: datetime | None
    salt: bytes = field(repr=False, default=b"")
    digest: bytes = field(repr=False, default=b"")
    kdf: str = KDF

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "admin": self.is_admin,
                "roles": dict(self.roles), "created_at": self.created_at,
                "revoked_at": self.revoked_at}

    def allows(self, collection: str, role: str) -> bool:
        """Whether this key holds ``role`` (or a higher one) on ``collection``."""
        if self.revoked_at is not None:
            return False
        if self.is_admin:
            return True
        held = self.roles.get(collection)
        return held is not None and RANK[held] >= RANK[role]


def check_roles(roles: Mapping[str, str]) -> dict[str, str]:
    """``roles`` (collection name -> role) if every name and role is valid.

    Raises:
        ValueError: a bad collection name or an unknown role.
    """
    checked = {}
    for name, role in roles.items():
        collections.check_name(name)
        if role not in RANK:
            raise ValueError(f"role of {name!r}: {role!r} is not one of {', '.join(ROLES)}")
        checked[name] = role
    return checked


def parse(presented: str) -> tuple[int, str] | None:
    """``(id, secret)`` of a well-formed key, ``None`` otherwise (never an exception)."""
    match = _KEY.fullmatch(presented) if isinstance(presented, str) else None
    return (int(match.group(1)), match.group(2)) if match else None


def kdf_digest(secret: str, salt: bytes, kdf: str = KDF) -> bytes:
    """The stored form of a secret: scrypt with the parameters ``kdf`` names."""
    if kdf != KDF:
        raise GalleryError(f"unknown key derivation {kdf!r}")
    return hashlib.scrypt(secret.encode(), salt=salt, dklen=32, maxmem=_SCRYPT_MAXMEM,
                          **_SCRYPT)


def matches(record: KeyRecord | None, secret: str) -> bool:
    """Whether ``secret`` is the key's (constant-time comparison of the digests).

    ``None`` (no such key) and a revoked key run the same KDF, against a digest no secret
    has, and answer False: checking a key costs the same whether its id exists, is revoked
    or is unknown, so timing tells a caller nothing about which ids exist.
    """
    salt, digest, kdf = ((record.salt, record.digest, record.kdf) if record is not None
                         else (_NO_KEY_SALT, _NO_KEY_DIGEST, KDF))
    good = hmac.compare_digest(kdf_digest(secret, salt, kdf), digest)
    return good and record is not None and record.revoked_at is None


def create(name: str, *, session_factory: sessionmaker[Session],
           roles: Mapping[str, str] | None = None, is_admin: bool = False
           ) -> tuple[KeyRecord, str]:
    """Create a key; returns its record and the key itself (shown once, never stored).

    Raises:
        ValueError: a bad name, collection name or role.
        CollectionNotFound: a role names a collection that does not exist.
    """
    if not isinstance(name, str) or not _KEY_NAME.fullmatch(name):
        raise ValueError("a key name is 1-64 characters: letters, digits, space and . _ @ -, "
                         "starting with a letter or digit")
    wanted = check_roles(roles or {})
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    with session_factory.begin() as session:
        ids = {}
        for collection in wanted:
            ids[collection] = collections.get(collection, session=session).id
        row = ApiKey(name=name, salt=salt, digest=kdf_digest(secret, salt), kdf=KDF,
                     is_admin=is_admin)
        session.add(row)
        session.flush()
        for collection, role in wanted.items():
            session.add(ApiKeyRole(key_id=row.id, collection_id=ids[collection], role=role))
        key_id = row.id
    return get(key_id, session_factory=session_factory), f"{KEY_PREFIX}_{key_id}_{secret}"


def revoke(key_id: int, *, session_factory: sessionmaker[Session]) -> KeyRecord:
    """Revoke a key for good (a second revocation changes nothing).

    Raises:
        KeyNotFound: no key with that id.
    """
    with session_factory.begin() as session:
        if session.get(ApiKey, key_id) is None:
            raise KeyNotFound(f"no API key with id {key_id}")
        session.execute(update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                        .values(revoked_at=utcnow()))
    return get(key_id, session_factory=session_factory)


def load(*, session_factory: sessionmaker[Session]) -> dict[int, KeyRecord]:
    """Every key with its roles (what a process checks requests against)."""
    with session_factory() as session:
        return _records(session, None)


def find(key_id: int, *, session_factory: sessionmaker[Session]) -> KeyRecord | None:
    """One key with its roles, ``None`` if no key has that id (one indexed read: what a
    process checks a key it has not seen against)."""
    with session_factory() as session:
        return _records(session, key_id).get(key_id)


def _records(session: Session, key_id: int | None) -> dict[int, KeyRecord]:
    role_rows = (select(ApiKeyRole.key_id, Collection.name, ApiKeyRole.role)
                 .join(Collection, Collection.id == ApiKeyRole.collection_id))
    key_rows = select(ApiKey).order_by(ApiKey.id)
    if key_id is not None:
        role_rows = role_rows.where(ApiKeyRole.key_id == key_id)
        key_rows = key_rows.where(ApiKey.id == key_id)
    roles: dict[int, dict[str, str]] = {}
    for owner, name, role in session.execute(role_rows):
        roles.setdefault(owner, {})[name] = role
    return {
        row.id: KeyRecord(row.id, row.name, bool(row.is_admin), roles.get(row.id, {}),
                          row.created_at, row.revoked_at, bytes(row.salt),
                          bytes(row.digest), row.kdf)
        for row in session.scalars(key_rows)
    }


def get(key_id: int, *, session_factory: sessionmaker[Session]) -> KeyRecord:
    """One key.

    Raises:
        KeyNotFound: no key with that id.
    """
    record = load(session_factory=session_factory).get(key_id)
    if record is None:
        raise KeyNotFound(f"no API key with id {key_id}")
    return record
