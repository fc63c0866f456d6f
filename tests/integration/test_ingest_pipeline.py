"""The pipelined bulk ingest: chunk i commits after chunk i + 1 is computed, while a child
process writes chunk i's files; SQLite and PostgreSQL."""

from __future__ import annotations

import shutil

import numpy as np
from sqlalchemy import func, select

from imgret.images import decode_image
from index import store
from index.ingest import STAGES, ingest_source
from index.media import sha256_hex
from index.models import Embedding, GalleryChange, GalleryItem


def _count(sessions, model) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


def _files(media) -> list:
    return [p for p in media.root.rglob("*") if p.is_file()]


def test_pipelined_chunks_store_every_file_row_and_vector(sessions, media, embedder,
                                                         image_folder, capsys):
    # The first file's bytes again in the second chunk (class_0: 000 001 002 | 003 003a
    # 004 | ...): planned before the first chunk commits, so only the commit's own planning
    # (under the lock) sees the duplicate; its file was prefetched needlessly, and is the
    # same file.
    original = image_folder / "class_0" / "000.png"
    shutil.copy(original, image_folder / "class_0" / "003a.png")
    report = ingest_source(image_folder, session_factory=sessions, media=media,
                           embedder=embedder, chunk_size=3, progress=True)
    assert (report.total, report.added, report.duplicates, report.failed) == (21, 20, 1, [])
    assert report.counts["media"] == 21  # files handed to the prefetch process
    assert set(report.seconds) == set(STAGES)
    assert "images/s" in "\n".join(report.summary())
    # The bar counts images and shows their rate.
    bar = capsys.readouterr().err
    assert "21/21" in bar and "img/s" in bar

    assert _count(sessions, GalleryItem) == _count(sessions, Embedding) == 20
    assert _count(sessions, GalleryChange) == 20
    files = _files(media)
    assert len(files) == 20 and not [p for p in files if p.name.startswith(".tmp-")]
    assert list((media.root.parent / ".media-staging").iterdir()) == []
    with sessions() as session:
        items = session.scalars(select(GalleryItem)).all()
        version = store.get_model_version(session=session)
        page = store.fetch_vectors([i.id for i in items], session=session,
                                   model_version=version)
    by_id = {i.id: i for i in items}
    for item_id, vector in zip(page.ids, page.vectors, strict=True):
        data = media.read(by_id[int(item_id)].media_path)
        assert sha256_hex(data) == by_id[int(item_id)].sha256
        np.testing.assert_allclose(embedder.embed([decode_image(data)])[0], vector, atol=1e-5)

    again = ingest_source(image_folder, session_factory=sessions, media=media,
                          embedder=embedder, chunk_size=3, progress=False)
    assert (again.added, again.duplicates, again.counts["media"]) == (0, 21, 0)
