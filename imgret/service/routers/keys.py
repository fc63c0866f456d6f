"""/keys: create, list and revoke API keys (global admin only). HTTP only: the work is
:mod:`imgret.gallery.tenancy.keys`'; a change made here is checked by this process at once and by
the
others within their follower interval."""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Path, Request, Response, status

from imgret.gallery.tenancy import keys
from imgret.gallery.tenancy.collections import CollectionNotFound
from imgret.service.deps import require_api_key
from imgret.service.request_rules import InvalidRequest
from imgret.service.schemas.keys import KeyCreate, KeyCreated, KeyInfo, KeyList

router = APIRouter(prefix="/keys", tags=["keys"], dependencies=[Depends(require_api_key)])

KeyId = Annotated[int, Path(ge=1, le=2**31 - 1, description="key id")]


@router.get("")
def list_keys(request: Request) -> KeyList:
    """Every key, revoked ones included (names, roles, dates; never a secret)."""
    sessions = request.app.state.resources.sessions
    return KeyList(keys=[KeyInfo(**record.to_dict())
                         for record in keys.load(session_factory=sessions).values()])


@router.post("", status_code=status.HTTP_201_CREATED,
             responses={404: {"description": "a role names no collection"}})
async def create_key(body: KeyCreate, request: Request) -> KeyCreated:
    """Create a key; the answer holds it once (``key``), it is stored only hashed."""
    sessions = request.app.state.resources.sessions
    try:
        record, secret = await anyio.to_thread.run_sync(lambda: keys.create(
            body.name, session_factory=sessions, roles=body.roles, is_admin=body.admin))
    except CollectionNotFound as exc:
        raise InvalidRequest(f"roles: {exc}") from None
    await anyio.to_thread.run_sync(request.app.state.keyring.refresh)
    return KeyCreated(**record.to_dict(), key=secret)


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses={404: {"description": "no such key"}})
async def revoke_key(key_id: KeyId, request: Request) -> Response:
    """Revoke a key for good: refused by this process at once, by every other within its
    follower interval."""
    sessions = request.app.state.resources.sessions
    await anyio.to_thread.run_sync(lambda: keys.revoke(key_id, session_factory=sessions))
    await anyio.to_thread.run_sync(request.app.state.keyring.refresh)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
