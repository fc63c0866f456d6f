"""The SQL of the unknowns pool: images ``/identify`` called unknown, kept where the
collection opted in, clustered as they arrive into candidate identities.

**Incremental clustering.** Each kept unknown joins the cluster (of the same model version)
whose template (the normalised sum of its members' vectors) is nearest, when their cosine
reaches the version's calibrated threshold: the score at which the gallery itself would
have named the image as that person. Otherwise it starts a cluster of its own. Nothing is
re-processed: a join costs one pass over the version's cluster templates, under the
gallery write lock (one writer at a time, across processes). A cluster's quality figure is
its cohesion, the members' mean cosine with the template, ``|sum| / size`` for unit vectors.
``benchmarks/unknowns_bench.py`` measures it against ground truth and an offline clustering.

Every function takes ``session`` keyword-only and never commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from imgret.gallery.storage.bulk import chunks
from imgret.gallery.storage.item_store import lock_gallery_writes
from imgret.gallery.storage.tables import (
    Collection,
    ModelVersion,
    UnknownCluster,
    UnknownFace,
    utcnow,
)
from imgret.gallery.storage.vector_store import decode_vectors, encode_vector


def decode_vector(blob: bytes) -> np.ndarray:
    """One stored ``(d,)`` float32 vector (the ``embeddings.vector`` format)."""
    return np.frombuffer(blob, dtype="<f4").astype(np.float32)

# At most this many unknowns per collection: the oldest go first.
UNKNOWNS_MAX = 10_000


@dataclass(frozen=True)
class Kept:
    """A kept unknown and the cluster it joined (``new_cluster``: it started it)."""

    id: int
    cluster_id: int
    new_cluster: bool
    similarity: float | None


@dataclass(frozen=True)
class ClusterView:
    """A cluster with its members (newest first)."""

    id: int
    model_version: str
    size: int
    cohesion: float
    member_ids: list[int]
    created_at: datetime
    updated_at: datetime


def retention_days(collection_id: int, *, session: Session) -> int:
    """How many days the collection keeps unknowns (0: it keeps none)."""
    return int(session.scalar(select(Collection.unknowns_days)
                              .where(Collection.id == collection_id)) or 0)


def keep_unknown(*, session: Session, sha256: str, media_path: str, content_type: str,
                 vector: np.ndarray, model_version: ModelVersion, threshold: float,
                 score: float | None, now: datetime | None = None) -> Kept:
    """Store one unknown and cluster it (see the module docstring)."""
    lock_gallery_writes(session=session)
    vector = np.asarray(vector, dtype=np.float32).ravel()
    now = now or utcnow()
    clusters = session.execute(
        select(UnknownCluster.id, UnknownCluster.vector_sum)
        .where(UnknownCluster.model_version_id == model_version.id)).all()
    best_id, best = None, None
    if clusters:
        # One buffer for every template: a decode per row was most of a join's time.
        sums = decode_vectors([blob for _, blob in clusters], vector.size)
        norms = np.linalg.norm(sums, axis=1)
        cosines = (sums @ vector) / np.where(norms > 0, norms, 1.0)
        top = int(np.argmax(cosines))
        best = float(cosines[top])
        if best >= threshold:
            best_id = int(clusters[top][0])
    if best_id is None:
        cluster = UnknownCluster(model_version_id=model_version.id,
                                 vector_sum=encode_vector(vector), size=1,
                                 created_at=now, updated_at=now)
        session.add(cluster)
        session.flush()
        cluster_id, new = int(cluster.id), True
    else:
        cluster = session.get(UnknownCluster, best_id)
        summed = decode_vector(cluster.vector_sum).astype(np.float64) + vector
        cluster.vector_sum = encode_vector(summed.astype(np.float32))
        cluster.size += 1
        cluster.updated_at = now
        cluster_id, new = best_id, False
    face = UnknownFace(sha256=sha256, media_path=media_path, content_type=content_type,
                       model_version_id=model_version.id, dim=int(vector.shape[0]),
                       vector=encode_vector(vector), score=score, cluster_id=cluster_id,
                       created_at=now)
    session.add(face)
    session.flush()
    return Kept(int(face.id), cluster_id, new, best)


def expire(days: int, *, session: Session, now: datetime | None = None,
           keep_at_most: int = UNKNOWNS_MAX) -> list[str]:
    """Remove unknowns older than ``days`` (all of them for 0) and the oldest beyond
    ``keep_at_most``; fix their clusters' sums. Returns the removed images' hashes (the
    caller purges the bytes no row uses once this commits)."""
    now = now or utcnow()
    old = select(UnknownFace.id)
    if days > 0:
        old = old.where(UnknownFace.created_at < now - timedelta(days=days))
    ids = list(session.scalars(old))
    count = int(session.scalar(select(func.count()).select_from(UnknownFace)) or 0)
    extra = count - len(ids) - keep_at_most
    if extra > 0:
        ids += list(session.scalars(select(UnknownFace.id).where(UnknownFace.id.notin_(ids))
                                    .order_by(UnknownFace.id).limit(extra)))
    return remove(ids, session=session)


def remove(unknown_ids: Sequence[int], *, session: Session) -> list[str]:
    """Remove these unknowns, update their clusters (an emptied cluster goes), and return
    the hashes of their images."""
    if not unknown_ids:
        return []
    lock_gallery_writes(session=session)
    rows = []
    for chunk in chunks(sorted({int(i) for i in unknown_ids})):
        rows.extend(session.execute(select(UnknownFace.id, UnknownFace.sha256,
                                           UnknownFace.cluster_id, UnknownFace.vector)
                                    .where(UnknownFace.id.in_(chunk))))
    touched: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for _, _, cluster_id, blob in rows:
        if cluster_id is not None:
            touched[cluster_id] = touched.get(cluster_id, 0) + decode_vector(blob).astype(
                np.float64)
            counts[cluster_id] = counts.get(cluster_id, 0) + 1
    for chunk in chunks([r[0] for r in rows]):
        session.execute(delete(UnknownFace).where(UnknownFace.id.in_(chunk)))
    for cluster_id, removed in touched.items():
        cluster = session.get(UnknownCluster, cluster_id)
        if cluster is None:
            continue
        if cluster.size <= counts[cluster_id]:
            session.delete(cluster)
        else:
            cluster.size -= counts[cluster_id]
            left = decode_vector(cluster.vector_sum).astype(np.float64) - removed
            cluster.vector_sum = encode_vector(left.astype(np.float32))
    session.flush()
    return sorted({str(r[1]) for r in rows})


def clusters(*, session: Session, offset: int = 0, limit: int = 50, min_size: int = 1,
             members: int = 12) -> tuple[list[ClusterView], int]:
    """A page of clusters, largest first (then newest), with their newest members."""
    where = UnknownCluster.size >= min_size
    total = int(session.scalar(select(func.count()).select_from(UnknownCluster)
                               .where(where)) or 0)
    rows = session.execute(
        select(UnknownCluster, ModelVersion.version)
        .join(ModelVersion, ModelVersion.id == UnknownCluster.model_version_id)
        .where(where).order_by(UnknownCluster.size.desc(), UnknownCluster.id.desc())
        .offset(offset).limit(limit)).all()
    out = []
    for cluster, version in rows:
        ids = list(session.scalars(select(UnknownFace.id)
                                   .where(UnknownFace.cluster_id == cluster.id)
                                   .order_by(UnknownFace.id.desc()).limit(members)))
        summed = decode_vector(cluster.vector_sum).astype(np.float64)
        out.append(ClusterView(int(cluster.id), str(version), int(cluster.size),
                               float(np.linalg.norm(summed) / max(cluster.size, 1)), ids,
                               cluster.created_at, cluster.updated_at))
    return out, total


def cluster_members(cluster_id: int, *, session: Session) -> list[UnknownFace]:
    """Every member of a cluster of the session's collection, oldest first (empty: no such
    cluster)."""
    return list(session.scalars(select(UnknownFace).where(UnknownFace.cluster_id == cluster_id)
                                .order_by(UnknownFace.id)))


def get_unknown(unknown_id: int, *, session: Session) -> UnknownFace | None:
    return session.scalar(select(UnknownFace).where(UnknownFace.id == int(unknown_id)))
