"""/admin: operations on the whole service. ``POST /admin/backup`` takes a consistent backup
(database snapshot, the media it refers to, checkpoints, indexes) while the service serves;
same code as `imgret backup` (:mod:`imgret.gallery.backup`).

A client names a backup, never a path: it is written to ``<data_dir>/backups/<name>``, so a
client cannot make the server write anywhere else. It is a write, so it needs ``X-API-Key``
(:mod:`imgret.service.auth`). The request returns when the backup is complete (it runs in a worker
thread; writes pause only while the snapshot is pinned, see ``write_pause_ms``). One backup at
a time per process (409 while one runs).

Disk is bounded: a backup whose estimated size would leave less than
``IMGRET_BACKUP_FREE_MARGIN_BYTES`` free on the volume is refused with 507 before anything is
written, and after each successful backup the oldest ones in ``<data_dir>/backups/`` are
removed so that at most ``IMGRET_BACKUP_KEEP`` remain, taking at most
``IMGRET_BACKUP_MAX_BYTES`` together (:func:`imgret.gallery.backup.prune_backups`; never the new
one).
"""

from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Body, Depends, HTTPException, status
from pydantic import BaseModel, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from imgret.gallery.backup import (
    ADMIN_BACKUPS_DIR,
    BACKUP_NAME,
    BackupExists,
    BackupNoSpace,
    BackupReport,
    admin_backup_path,
    create_backup,
    prune_backups,
)
from imgret.service.deps import ResourcesDep, require_api_key
from imgret.settings import COLLECTION_NAME_PATTERN

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_api_key)])

_RUNNING = threading.Lock()


class BackupRequest(BaseModel):
    """``POST /admin/backup``: what to call the backup (default ``imgret-<UTC time>``)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None, pattern=BACKUP_NAME.pattern,
        description=f"folder name under <data_dir>/{ADMIN_BACKUPS_DIR}/: 1-100 letters, "
                    "digits, '.', '_' or '-', starting with a letter or digit",
    )
    collection: str | None = Field(
        None, min_length=1, max_length=64, pattern=COLLECTION_NAME_PATTERN,
        description="back up this collection alone (default: every collection)",
    )


@pydantic_dataclass(frozen=True)
class BackupCreated(BackupReport):
    """A finished backup: what it holds (the fields of ``imgret.gallery.backup.BackupReport``, as
    `imgret backup` reports them), its ``name``, and its ``path`` relative to the data dir."""

    name: str


@router.post(
    "/backup", status_code=status.HTTP_201_CREATED,
    responses={401: {"description": "missing or wrong X-API-Key"},
               404: {"description": "no such collection"},
               409: {"description": "a backup of that name exists, or one is running"},
               507: {"description": "too little free space for the backup (nothing written)"}},
)
def create_admin_backup(
    resources: ResourcesDep, request: Annotated[BackupRequest | None, Body()] = None,
) -> BackupCreated:
    """Back up the gallery consistently while serving, into ``<data_dir>/backups/<name>``:
    every collection, or ``collection`` alone (with an empty ``default``); restore it with
    `imgret restore` (into an empty data dir and database)."""
    # The server's own IMGRET_COLLECTION (if any) never narrows a backup: the request does.
    settings = resources.settings.model_copy(
        update={"collection": request.collection if request else None})
    dest = admin_backup_path(settings, request.name if request else None)
    if not _RUNNING.acquire(blocking=False):
        raise HTTPException(status.HTTP_409_CONFLICT,
                            "a backup is running in this process; retry when it is done")
    try:
        report = create_backup(settings, dest)
        prune_backups(dest.parent, keep=settings.backup_keep,
                      max_bytes=settings.backup_max_bytes, protect=dest)
    except BackupExists:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"a backup named {dest.name!r} exists; choose another name") from None
    except BackupNoSpace as exc:
        raise HTTPException(status.HTTP_507_INSUFFICIENT_STORAGE, str(exc)) from None
    finally:
        _RUNNING.release()
    return BackupCreated(**{**asdict(report), "path": f"{ADMIN_BACKUPS_DIR}/{dest.name}"},
                         name=dest.name)
