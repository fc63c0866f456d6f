"""Dedup: which images of a batch must be created, which only need an embedding.

Items are keyed by content hash. Bytes already in the gallery (live) are not added again;
when they lack an embedding for the model version at hand, only the embedding is added
(re-embedding a gallery for a new model is the same command with another ``--model``). An
interrupted ingest therefore resumes by running it again.

A plan is made twice per batch: once in a short read before decoding (what to decode), and
again under the gallery write lock (:mod:`imgret.gallery.ingest.writer`), where the gallery may have
changed meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from imgret.gallery.storage import item_store
from imgret.gallery.storage.tables import ModelVersion, QuerySet

# Plan -> embed -> plan again under the lock: rounds before giving up on a gallery that keeps
# changing under one batch (each extra round needs a concurrent delete of a reused item).
PLAN_ROUNDS = 4


@dataclass
class Candidate:
    """One image moving through the pipeline."""

    position: int
    data: bytes
    sha256: str
    label: str
    camera: int | None
    metadata: Mapping[str, Any] | None
    source: str | None
    origin: str = ""  # the file it was read from, for the failure report
    existing_id: int | None = None  # set when only an embedding is missing
    staged: str | None = None  # a temporary media file of its bytes (MediaStore.stage)


@dataclass
class Plan:
    """The outcome of dedup: what must be created, what only needs an embedding."""

    create: list[Candidate] = field(default_factory=list)
    embed_existing: list[Candidate] = field(default_factory=list)
    resolved: dict[int, int] = field(default_factory=dict)  # position -> existing id
    aliases: dict[int, str] = field(default_factory=dict)  # position -> sha in this batch

    @property
    def work(self) -> list[Candidate]:
        return self.create + self.embed_existing


def make_plan(
    cands: list[Candidate], *, session: Session, model_version: ModelVersion,
    query_set: QuerySet | None,
) -> Plan:
    """Plan ``cands`` against what the gallery (or ``query_set``) holds now."""
    known = item_store.known_items((c.sha256 for c in cands), session=session, query_set=query_set,
                                   model_version_id=model_version.id)
    return _split(cands, known.ids, known.embedded)


def _split(cands: list[Candidate], existing: dict[str, int], embedded: set[int]) -> Plan:
    plan = Plan()
    first: dict[str, Candidate] = {}
    for cand in cands:
        item_id = existing.get(cand.sha256)
        if item_id is not None and item_id in embedded:
            plan.resolved[cand.position] = item_id
        elif cand.sha256 in first:
            plan.aliases[cand.position] = cand.sha256  # same bytes twice in this batch
        else:
            first[cand.sha256] = cand
            cand.existing_id = item_id
            (plan.create if item_id is None else plan.embed_existing).append(cand)
    return plan


def stack_vectors(vectors_by_sha: Mapping[str, np.ndarray], work: Sequence[Candidate],
                  dim: int) -> np.ndarray:
    """The vectors of ``work``, in its order, as one ``(n, dim)`` float32 array."""
    if not work:
        return np.zeros((0, dim), dtype=np.float32)
    return np.stack([vectors_by_sha[c.sha256] for c in work]).astype(np.float32, copy=False)
