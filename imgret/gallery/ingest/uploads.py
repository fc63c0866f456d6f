"""Uploads: a list of images added to the gallery in one transaction (``POST /gallery``).

All or nothing: a corrupt upload raises, so the request fails as a whole. Planned in a short
read (:mod:`imgret.gallery.ingest.plan`), decoded and embedded with no transaction open, then
written under the gallery write lock after planning again (:mod:`imgret.gallery.ingest.writer`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.errors import GalleryError
from imgret.gallery.ingest.plan import PLAN_ROUNDS, Candidate, make_plan, stack_vectors
from imgret.gallery.ingest.writer import write_planned
from imgret.gallery.media.files import MediaBackend, sha256_hex
from imgret.gallery.media.gc import purge_media
from imgret.gallery.storage import item_store
from imgret.gallery.storage.vector_store import ItemInfo
from imgret.gallery.versions import version_store
from imgret.images import DecodeLimits, embed_encoded

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewItem:
    """An image to add: its file bytes and what it is.

    Attributes:
        data: the encoded image (JPEG, PNG, ...).
        label: class / identity.
        camera: camera id (re-ID data), or ``None``.
        metadata: JSON-serialisable key/values, filterable at search time.
        source: where it came from (file name or path), for people reading the gallery.
    """

    data: bytes
    label: str
    camera: int | None = None
    metadata: Mapping[str, Any] | None = None
    source: str | None = None


@dataclass(frozen=True)
class AddedItems:
    """What :func:`add_items` did.

    Attributes:
        ids: one gallery id per input item, in input order (the existing item's id when its
            content was already in the gallery).
        created: per input item, whether a new gallery item was made.
        vector_ids: ``(m,) int64`` ids that gained an embedding for the model version.
        vectors: ``(m, d) float32`` those embeddings — hand both to ``Searcher.add`` after
            the commit so the items are searchable at once.
        infos: ``m`` filter infos (label, camera, metadata) for ``Searcher.add``.
        model_version: the version the vectors belong to.
        existing: for each input position whose image was already in the gallery, the stored
            item's label, camera and metadata (the caller's own values were not applied).
    """

    ids: list[int]
    created: list[bool]
    vector_ids: np.ndarray
    vectors: np.ndarray
    infos: list[ItemInfo]
    model_version: str
    existing: dict[int, ItemInfo] = field(default_factory=dict)


def add_items(
    items: Sequence[NewItem], *, session_factory: sessionmaker[Session], media: MediaBackend,
    embedder: Embedder, limits: DecodeLimits | None = None, require_active: bool = False,
) -> AddedItems:
    """Add uploaded images to the gallery in one transaction (all or nothing).

    Plans in a short read, decodes and embeds with no transaction open, then writes under the
    gallery write lock after planning again (:mod:`imgret.gallery.ingest.writer`). Nothing is in the
    index yet: pass ``vector_ids``/``vectors``/``infos`` to ``Searcher.add`` after this
    returns (the rows are committed by then).

    Decoding goes through ``imgret.images.embed_encoded``: every header is priced against the
    request's pixel budget first, then one image at a time is decoded (under the process's
    decode gate), shrunk and turned into model input, so memory stays bounded whatever the
    number of files.

    Args:
        items: the images, with label, camera and metadata.
        session_factory: sessions on the gallery database.
        media: where image bytes are stored.
        embedder: the one embedding path (its model version is registered; the first one
            becomes active).
        limits: the decoding limits (``DecodeLimits.from_settings``; default the built-in
            ones).
        require_active: refuse (``store.ModelSwitched``) unless the embedder's version is
            the active one when the write commits (the service: an item acknowledged after a
            switch must have the new version's vector).

    Returns:
        The ids (input order) and the new vectors; see :class:`AddedItems`.

    Raises:
        ImageDecodeError: an item is not a decodable image, or the request is over its pixel
            budget (``ImageTooLarge``); the message starts with ``images[i]``. Nothing is
            written.
    """
    limits = limits or DecodeLimits()
    cands = [
        Candidate(i, it.data, sha256_hex(it.data), it.label, it.camera, it.metadata, it.source)
        for i, it in enumerate(items)
    ]
    with session_factory.begin() as session:
        item_store.require_collection(session=session)
        model_version = version_store.register_model_version(
            session=session, version=embedder.model_version, dim=embedder.dim,
            config=embedder.spec.to_dict(),
        )
        plan = make_plan(cands, session=session, model_version=model_version, query_set=None)
    vectors_by_sha: dict[str, np.ndarray] = {}
    # Each round embeds what the last plan needed; a new round is needed only when an item
    # that was already stored got deleted in between (rare), so two rounds nearly always do.
    for _ in range(PLAN_ROUNDS):
        todo = [c for c in plan.work if c.sha256 not in vectors_by_sha]
        if todo:
            vectors = embed_encoded([c.data for c in todo], embedder=embedder, limits=limits,
                                    names=[f"images[{c.position}]" for c in todo])
            vectors_by_sha.update(zip((c.sha256 for c in todo), vectors, strict=True))
        try:
            with session_factory.begin() as session:
                if require_active:
                    item_store.lock_gallery_writes(session=session)
                    version_store.check_active(session=session, version=model_version)
                plan, ids_by_sha = write_planned(cands, vectors_by_sha, session=session,
                                                 media=media, model_version=model_version,
                                                 query_set=None)
                if ids_by_sha is None:
                    continue
                existing = item_store.get_items(
                    [*plan.resolved.values(), *(c.existing_id for c in plan.embed_existing)],
                    session=session,
                )
        except BaseException:
            _forget_stored(cands, session_factory=session_factory, media=media)
            raise
        break
    else:
        raise GalleryError("the gallery changed under this upload too often; send it again")
    ids = [
        plan.resolved[c.position] if c.position in plan.resolved
        else ids_by_sha[plan.aliases.get(c.position, c.sha256)]
        for c in cands
    ]
    created_positions = {c.position for c in plan.create}
    created = [c.position in created_positions for c in cands]
    work = plan.work
    return AddedItems(
        ids=ids,
        created=created,
        vector_ids=np.array([ids_by_sha[c.sha256] for c in work], dtype=np.int64),
        vectors=stack_vectors(vectors_by_sha, work, embedder.dim),
        infos=[ItemInfo(c.label, c.camera, dict(c.metadata or {})) for c in work],
        model_version=model_version.version,
        existing={
            position: ItemInfo(row.label, row.camera, dict(row.meta or {}))
            for position, item_id in enumerate(ids)
            if not created[position] and (row := existing.get(item_id)) is not None
        },
    )


def _forget_stored(cands: Sequence[Candidate], *, session_factory: sessionmaker[Session],
                   media: MediaBackend) -> None:
    """After a write that did not commit: remove the image files it stored, unless a row
    uses them (the same bytes in another item or collection). Files are made durable before
    their rows commit, so a failed add would otherwise leave its bytes behind until the
    next start-up sweep."""
    try:
        purge_media({c.sha256 for c in cands}, session_factory=session_factory, media=media)
    except Exception:  # noqa: BLE001 - the write's own error is the one to report
        logger.exception("could not remove the images of a failed add; the start-up sweep "
                         "will")
