"""The ingest pipeline's decode workers: same result with and without them, nothing left."""

from __future__ import annotations

import numpy as np
from sqlalchemy import select

from index import store
from index.ingest import ingest_source
from index.models import GalleryItem


def _vectors(sessions) -> dict[str, np.ndarray]:
    with sessions() as session:
        items = {i.id: i.sha256 for i in session.scalars(select(GalleryItem))}
        version = store.get_model_version(session=session)
        page = store.fetch_vectors(items, session=session, model_version=version)
    return {items[int(i)]: v for i, v in zip(page.ids, page.vectors, strict=True)}


def test_workers_and_in_process_decoding_store_the_same(sessions, media, embedder,
                                                        image_folder):
    report = ingest_source(image_folder, session_factory=sessions, media=media,
                           embedder=embedder, chunk_size=8, workers=2, progress=False)
    assert (report.added, report.failed) == (20, [])
    with_workers = _vectors(sessions)
    with sessions.begin() as session:
        store.delete_items(list(range(1, 100)), session=session)
    # Deleted items' bytes come back: added again, decoded in this process this time.
    again = ingest_source(image_folder, session_factory=sessions, media=media,
                          embedder=embedder, chunk_size=8, workers=0, progress=False)
    assert again.added == 20
    in_process = _vectors(sessions)
    assert with_workers.keys() == in_process.keys()
    for sha, vector in with_workers.items():
        np.testing.assert_array_equal(vector, in_process[sha])
    assert not list(media.root.rglob(".tmp-*"))
    assert len([p for p in media.root.rglob("*") if p.is_file()]) == 20
