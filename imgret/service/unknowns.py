"""The unknowns pool as the service runs it: keep what ``/identify`` called unknown (where the
collection opted in), list the clusters, enroll one under a name, dismiss one, and expire
what is past the collection's retention (:mod:`imgret.gallery.storage.unknowns_store` has
the clustering)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from sqlalchemy.orm import Session

from imgret.gallery.ingest import NewItem
from imgret.gallery.media.files import sha256_hex, sniff_content_type
from imgret.gallery.media.gc import purge_media
from imgret.gallery.storage import identity_store, unknowns_store
from imgret.gallery.storage.identity_store import Move
from imgret.gallery.storage.tables import LabelChange
from imgret.gallery.storage.unknowns_store import ClusterView, Kept
from imgret.gallery.versions import version_store
from imgret.service import gallery
from imgret.service.pipeline import Serving
from imgret.service.request_rules import NotFound
from imgret.service.resources.bundle import Resources

logger = logging.getLogger(__name__)

ENROLL, DISMISS = "enroll", "dismiss"


@dataclass(frozen=True)
class Enrolled:
    change: LabelChange
    item_ids: list[int]


def keep(resources: Resources, data: bytes, vector: np.ndarray, serving: Serving,
         score: float | None) -> Kept | None:
    """Keep an image ``serving``'s version called unknown, if the collection keeps unknowns
    (``unknowns_days`` > 0), clustered under that version's calibrated threshold; expire
    what is past the retention first. ``None``: the collection keeps none."""
    calibration = serving.calibration
    if calibration is None:
        return None
    with resources.sessions.begin() as session:
        days = unknowns_store.retention_days(resources.collection_id, session=session)
        if days <= 0:
            return None
        expired = unknowns_store.expire(days, session=session,
                                        keep_at_most=unknowns_store.UNKNOWNS_MAX - 1)
        sha = sha256_hex(data)
        (path,) = resources.media.put_many([(data, sha)], session=session)
        version = version_store.get_model_version(session=session, version=serving.version)
        kept = unknowns_store.keep_unknown(
            session=session, sha256=sha, media_path=path,
            content_type=sniff_content_type(data), vector=vector, model_version=version,
            threshold=float(calibration.threshold), score=score)
    _purge(resources, expired)
    return kept


def clusters(*, session: Session, offset: int, limit: int,
             min_size: int) -> tuple[list[ClusterView], int]:
    """A page of clusters, largest first."""
    return unknowns_store.clusters(session=session, offset=offset, limit=limit,
                                   min_size=min_size)


def image(resources: Resources, unknown_id: int) -> gallery.StoredImage:
    """A kept unknown's image.

    Raises:
        NotFound: no such unknown (or expired).
    """
    with resources.sessions() as session:
        row = unknowns_store.get_unknown(unknown_id, session=session)
        if row is None:
            raise NotFound(f"no kept unknown {unknown_id}")
        path, kind = row.media_path, row.content_type
    try:
        data = resources.media.read(path)
    except (FileNotFoundError, ValueError):
        raise NotFound(f"the image of unknown {unknown_id} is gone") from None
    return gallery.StoredImage(data, kind)


def enroll(resources: Resources, cluster_id: int, label: str, actor: str) -> Enrolled:
    """Add a cluster's images to the gallery under ``label`` (embedded by the served model,
    as any upload), then remove them from the pool; an ``enroll`` entry in the audit log maps
    each unknown to its new item.

    Raises:
        NotFound: no such cluster in this collection.
    """
    with resources.sessions() as session:
        members = unknowns_store.cluster_members(cluster_id, session=session)
        if not members:
            raise NotFound(f"no unknowns cluster {cluster_id}")
        wanted = [(m.id, m.media_path) for m in members]
    blobs = resources.media.read_many([path for _, path in wanted])
    present = [(unknown_id, data) for (unknown_id, _), data in zip(wanted, blobs, strict=True)
               if data is not None]
    added = gallery.add(resources, [NewItem(data=data, label=label, source="unknowns pool")
                                    for _, data in present])
    moves = [Move(unknown_id, item_id, "(unknown)")
             for (unknown_id, _), item_id in zip(present, added.ids, strict=True)]
    with resources.sessions.begin() as session:
        hashes = unknowns_store.remove([u for u, _ in wanted], session=session)
        change = identity_store.record_change(ENROLL, session=session, actor=actor,
                                              moves=moves, to_label=label)
        session.expunge(change)
    _purge(resources, hashes)
    return Enrolled(change, list(added.ids))


def dismiss(resources: Resources, cluster_id: int) -> int:
    """Remove a cluster and its images from the pool; returns how many.

    Raises:
        NotFound: no such cluster in this collection.
    """
    with resources.sessions.begin() as session:
        members = unknowns_store.cluster_members(cluster_id, session=session)
        if not members:
            raise NotFound(f"no unknowns cluster {cluster_id}")
        hashes = unknowns_store.remove([m.id for m in members], session=session)
    _purge(resources, hashes)
    return len(members)


def _purge(resources: Resources, hashes: list[str]) -> None:
    if hashes:
        purge_media(hashes, session_factory=resources.sessions, media=resources.media)
