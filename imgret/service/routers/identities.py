"""/identities: the labels of a collection, merging two, moving items to another (a split),
the audit log of those changes, undoing one, and erasing a label.

HTTP only: the work is :mod:`imgret.service.identities`' (docs/identities.md).
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from imgret.gallery.storage.tables import DEFAULT_COLLECTION, LabelChange
from imgret.service import identities, unknowns
from imgret.service.deps import ResourcesDep, SessionDep, require_api_key
from imgret.service.gallery import IMAGE_HEADERS
from imgret.service.identities import aware
from imgret.service.request_rules import LABEL_MAX, SafeText
from imgret.service.schemas.identities import (
    ClusterList,
    ClusterOut,
    Dismissed,
    Enrolled,
    EnrollRequest,
    ErasedCounts,
    EraseReceipt,
    EraseRequest,
    IdentityInfo,
    IdentityList,
    LabelChangeList,
    LabelChangeOut,
    MergeRequest,
    MoveOut,
    MoveRequest,
    ProcessConfirmation,
    UnknownOut,
)

router = APIRouter(prefix="/identities", tags=["identities"])

ChangeId = Annotated[int, Path(ge=1, le=2**63 - 1, description="audit entry id")]
_WRITE = {401: {"description": "missing or wrong X-API-Key"},
          422: {"description": "invalid fields"}}


@router.get("")
def list_identities(
    session: SessionDep,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    label: Annotated[SafeText | None, Query(max_length=LABEL_MAX)] = None,
) -> IdentityList:
    """A page of the labels with live items, in label order, each with its item count."""
    rows, count = identities.labels(session=session, offset=offset, limit=limit, label=label)
    return IdentityList(data=[IdentityInfo(label=name, items=n) for name, n in rows],
                        count=count, offset=offset, limit=limit)


@router.post("/merge", dependencies=[Depends(require_api_key)],
             responses={**_WRITE, 404: {"description": "source has no live item"}})
async def merge_identities(body: MergeRequest, request: Request,
                           resources: ResourcesDep) -> LabelChangeOut:
    """Every live item of ``source`` becomes ``target``'s (an identity wrongly split in two).
    Each moved item gets a new id (``moves`` maps them); the change is in the audit log and
    can be undone."""
    entry = await anyio.to_thread.run_sync(identities.merge, resources, body.source,
                                           body.target, identities.actor_of(request))
    return _out(entry)


@router.post("/move", dependencies=[Depends(require_api_key)],
             responses={**_WRITE, 404: {"description": "an id is not a live item"}})
async def move_items(body: MoveRequest, request: Request,
                     resources: ResourcesDep) -> LabelChangeOut:
    """These items get ``label``: a new label splits them off an identity wrongly joined,
    an existing one moves them there. All or nothing: an id that is not a live item of this
    collection is a 404 and nothing changes."""
    entry = await anyio.to_thread.run_sync(identities.move, resources, body.item_ids(),
                                           body.label, identities.actor_of(request))
    return _out(entry)


@router.get("/changes")
def list_changes(
    session: SessionDep,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> LabelChangeList:
    """The audit log, newest first: who changed which items' identity, when, how."""
    rows, count = identities.changes(session=session, offset=offset, limit=limit)
    return LabelChangeList(data=[_out(row) for row in rows], count=count, offset=offset,
                           limit=limit)


@router.get("/changes/{change_id}", responses={404: {"description": "no such entry"}})
def read_change(change_id: ChangeId, session: SessionDep) -> LabelChangeOut:
    """One audit entry."""
    return _out(identities.change(change_id, session=session))


@router.post("/changes/{change_id}/undo", dependencies=[Depends(require_api_key)],
             responses={**_WRITE, 404: {"description": "no such entry"},
                        409: {"description": "already undone, or an erase"}})
async def undo_change(change_id: ChangeId, request: Request,
                      resources: ResourcesDep) -> LabelChangeOut:
    """Undo a merge, move or undo: its items go back to their old labels (each again with a
    new id). Items deleted or relabelled since are left as they are. Recorded as an
    ``undo`` entry."""
    entry = await anyio.to_thread.run_sync(identities.undo, resources, change_id,
                                           identities.actor_of(request))
    return _out(entry)


@router.post("/erase", dependencies=[Depends(require_api_key)],
             responses={**_WRITE, 404: {"description": "nothing has the label"}})
async def erase_identity(body: EraseRequest, request: Request,
                         resources: ResourcesDep) -> EraseReceipt:
    """Remove everything of one label in this collection: every gallery item (its image
    bytes, its vectors of every model version, its row's personal data), every query-set
    item with the label, and the label's name from the audit log. Answers with a receipt:
    what was removed (counts and content hashes), when it was committed, and when each
    serving process confirmed it no longer holds the items (those that did not confirm
    within the wait are named in ``unconfirmed``). Not undoable."""
    erased = await anyio.to_thread.run_sync(identities.erase, resources, body.label,
                                            identities.actor_of(request))
    rows = erased.rows
    return EraseReceipt(
        label=erased.label, change_id=erased.change.id,
        gallery_items=ErasedCounts(count=len(rows.item_ids), sha256=rows.item_hashes),
        gallery_item_ids=rows.item_ids, vectors=rows.vectors,
        query_items=ErasedCounts(count=len(rows.query_item_ids), sha256=rows.query_hashes),
        query_vectors=rows.query_vectors, media_removed=erased.media_removed,
        audit_entries_cleared=rows.audit_entries, committed_at=erased.committed_at,
        confirmed=[ProcessConfirmation(process=p, confirmed_at=at)
                   for p, at in erased.confirmed],
        unconfirmed=erased.unconfirmed)


@router.get("/unknowns", responses={401: {"description": "a key with write is needed"}})
def list_unknown_clusters(
    session: SessionDep,
    resources: ResourcesDep,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    min_size: Annotated[int, Query(ge=1, le=10_000)] = 1,
) -> ClusterList:
    """The clusters of kept unknowns (candidate identities), largest first, each with its
    cohesion and newest members. Needs ``write``: these are people the gallery does not
    hold."""
    rows, count = unknowns.clusters(session=session, offset=offset, limit=limit,
                                    min_size=min_size)
    prefix = _prefix(resources.collection)
    return ClusterList(
        data=[ClusterOut(id=c.id, model_version=c.model_version, size=c.size,
                         cohesion=c.cohesion,
                         members=[UnknownOut(id=i, uri=f"{prefix}/identities/unknowns/{i}/image")
                                  for i in c.member_ids],
                         created_at=aware(c.created_at), updated_at=aware(c.updated_at))
              for c in rows],
        count=count, offset=offset, limit=limit)


@router.get("/unknowns/{unknown_id}/image", response_class=Response,
            responses={200: {"content": {"image/*": {}}}, 404: {"description": "no such unknown"}})
def read_unknown_image(unknown_id: ChangeId, resources: ResourcesDep) -> Response:
    """A kept unknown's image."""
    image = unknowns.image(resources, unknown_id)
    return Response(image.data, media_type=image.content_type, headers=IMAGE_HEADERS)


@router.post("/unknowns/clusters/{cluster_id}/enroll", dependencies=[Depends(require_api_key)],
             responses={**_WRITE, 404: {"description": "no such cluster"}})
async def enroll_cluster(cluster_id: ChangeId, body: EnrollRequest, request: Request,
                         resources: ResourcesDep) -> Enrolled:
    """Enroll a cluster under a name: its images become gallery items with ``label`` (an
    image the gallery already holds keeps its own label), and leave the pool. Recorded in
    the audit log as ``enroll``."""
    done = await anyio.to_thread.run_sync(unknowns.enroll, resources, cluster_id, body.label,
                                          identities.actor_of(request))
    return Enrolled(change=_out(done.change), item_ids=done.item_ids)


@router.post("/unknowns/clusters/{cluster_id}/dismiss",
             dependencies=[Depends(require_api_key)],
             responses={**_WRITE, 404: {"description": "no such cluster"}})
async def dismiss_cluster(cluster_id: ChangeId, resources: ResourcesDep) -> Dismissed:
    """Remove a cluster and its images from the pool."""
    removed = await anyio.to_thread.run_sync(unknowns.dismiss, resources, cluster_id)
    return Dismissed(removed=removed)


def _prefix(collection: str) -> str:
    return "" if collection == DEFAULT_COLLECTION else f"/collections/{collection}"


def _out(entry: LabelChange) -> LabelChangeOut:
    return LabelChangeOut(
        id=entry.id, action=entry.action, from_label=entry.from_label,
        to_label=entry.to_label,
        moves=[MoveOut(old_id=o, new_id=n, old_label=lab) for o, n, lab in entry.moves or []],
        actor=entry.actor, undo_of=entry.undo_of, undone_by=entry.undone_by,
        created_at=aware(entry.created_at))
