"""The ingest pipeline's workers: same result with and without them, nothing left."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from sqlalchemy import select

from imgret.gallery.ingest import ingest_source, pipeline, writer
from imgret.gallery.ingest.workers import EmbedWorkers, _warm_up
from imgret.gallery.media.files import sha256_hex
from imgret.gallery.storage import item_store, vector_store
from imgret.gallery.storage.tables import GalleryItem
from imgret.gallery.versions import version_store
from imgret.images import DEFAULT_MAX_PIXELS, decode_for_embedding
from tests.support.threads import torch_threads


def _vectors(sessions) -> dict[str, np.ndarray]:
    with sessions() as session:
        items = {i.id: i.sha256 for i in session.scalars(select(GalleryItem))}
        version = version_store.get_model_version(session=session)
        page = vector_store.fetch_vectors(items, session=session, model_version=version)
    return {items[int(i)]: v for i, v in zip(page.ids, page.vectors, strict=True)}


def test_workers_and_in_process_decoding_store_the_same(sessions, media, embedder,
                                                        image_folder):
    report = ingest_source(image_folder, session_factory=sessions, media=media,
                           embedder=embedder, chunk_size=8, workers=2, progress=False)
    assert (report.added, report.failed) == (20, [])
    with_workers = _vectors(sessions)
    with sessions.begin() as session:
        item_store.delete_items(list(range(1, 100)), session=session)
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


def test_forward_passes_run_in_the_workers_on_the_cpu(sessions, media, embedder,
                                                      image_folder):
    """On the CPU the workers embed (only vectors come back); on a GPU this process does."""
    here: list[int] = []
    hook = embedder.model.register_forward_hook(lambda *_: here.append(len(here)))
    try:
        report = ingest_source(image_folder, session_factory=sessions, media=media,
                               embedder=embedder, chunk_size=8, workers=2, progress=False)
    finally:
        hook.remove()
    assert (report.added, report.counts["embed"], report.counts["decode"]) == (20, 20, 20)
    assert report.seconds["embed"] > 0 and report.seconds["decode"] > 0
    assert bool(here) == (embedder.device != "cpu")


@pytest.mark.parametrize("workers, embed_in_workers", [(2, True), (2, False), (0, None)])
def test_every_worker_mode_gives_the_same_vectors_and_errors(embedder, image_folder, tmp_path,
                                                             workers, embed_in_workers):
    """Workers that embed, workers that only decode (the GPU mode, run on the CPU here) and
    no workers: the same vectors, and the same per-image errors (a corrupt file, a file
    whose bytes changed after hashing), slice by slice in submission order."""
    paths = sorted(image_folder.rglob("*.png"))
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    changed = tmp_path / "changed.png"
    changed.write_bytes(paths[0].read_bytes())

    def candidate(path: Path, sha: str | None = None) -> SimpleNamespace:
        data = path.read_bytes()
        return SimpleNamespace(origin=str(path), data=data, sha256=sha or sha256_hex(data))

    work = [candidate(p) for p in paths]
    work.insert(3, candidate(corrupt))
    work.insert(11, candidate(changed, sha="0" * 64))
    slices = [work[at : at + embedder.batch_size]
              for at in range(0, len(work), embedder.batch_size)]
    size = embedder.spec.image_size
    # The reference runs here on two OpenMP threads before the workers fork: a child that
    # then used several threads would hang (each keeps to one).
    with torch_threads(2):
        reference = embedder.embed([decode_for_embedding(p.read_bytes(), size=size)
                                    for p in paths])
    with EmbedWorkers(embedder, DEFAULT_MAX_PIXELS, workers,
                       embed_in_workers=embed_in_workers) as pool:
        tickets = [pool.submit(part) for part in slices]
        results = []
        for ticket in tickets:
            results.append(pool.result(ticket))
            pool.release(ticket)
    vectors = np.concatenate([r.vectors for r in results])
    errors = [e for r in results for e in r.errors]
    assert [e is None for e in errors] == [c.origin not in (str(corrupt), str(changed))
                                           for c in work]
    assert "changed" in errors[11]
    np.testing.assert_allclose(vectors, reference, rtol=0, atol=1e-6)
    assert all(r.decode_seconds > 0 for r in results)


def test_a_lost_worker_leaves_its_slices_to_this_process(embedder, image_folder):
    """A worker killed (SIGKILL) before it answers: every slice still comes back, in order,
    with the vectors this process would compute (what was sent is embedded here), and no
    worker is used after the loss."""
    import os
    import signal

    paths = sorted(image_folder.rglob("*.png"))
    work = [SimpleNamespace(origin=str(p), data=p.read_bytes(),
                            sha256=sha256_hex(p.read_bytes())) for p in paths]
    size = embedder.spec.image_size
    reference = embedder.embed([decode_for_embedding(p.read_bytes(), size=size) for p in paths])
    with EmbedWorkers(embedder, DEFAULT_MAX_PIXELS, 2) as pool:
        os.kill(pool._procs[1].pid, signal.SIGKILL)
        pool._procs[1].join(timeout=10)
        tickets = [pool.submit(work[at : at + 4]) for at in range(0, len(work), 4)]
        vectors = []
        for ticket in tickets:
            vectors.append(pool.result(ticket).vectors)
            pool.release(ticket)
        assert all(conn is None for conn in pool._conns)
    np.testing.assert_allclose(np.concatenate(vectors), reference, rtol=0, atol=1e-6)


def _candidates(paths: list[Path]) -> list[SimpleNamespace]:
    return [SimpleNamespace(origin=str(p), data=p.read_bytes(), sha256=sha256_hex(p.read_bytes()))
            for p in paths]


@pytest.mark.parametrize("finish", [True, False])
def test_finished_workers_exit_and_leave_their_staged_files_to_this_process(
        embedder, image_folder, media, finish):
    """``finish()`` once every slice is back: the workers exit at once (beside the ingest's
    last writes) and keep the files they staged, which the ingest renames; ``close()`` alone
    (an ingest that failed before its end) has them removed by the workers."""
    work = _candidates(sorted(image_folder.rglob("*.png"))[:4])
    with EmbedWorkers(embedder, DEFAULT_MAX_PIXELS, 2, media=media) as pool:
        ticket = pool.submit(work, stage=[True] * len(work))
        staged = pool.result(ticket).staged
        pool.release(ticket)
        assert all(staged) and all(Path(s).exists() for s in staged)
        if finish:
            pool.finish()
            for process in pool._procs:
                process.join(timeout=30)
                assert not process.is_alive()
    assert [Path(s).exists() for s in staged] == [finish] * len(work)


def test_a_failed_last_write_leaves_no_staged_file(sessions, media, embedder, image_folder,
                                                   monkeypatch):
    """The workers were told to finish (they leave their staged files) and the last chunk's
    write fails: the ingest removes that chunk's staged files itself."""
    real = writer.ChunkWriter.write
    writes: list[int] = []

    def write(self, *args, **kwargs):
        writes.append(1)
        if len(writes) == 3:  # 20 images in chunks of 8: the last chunk
            raise OSError("the disk went away")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(writer.ChunkWriter, "write", write)
    with pytest.raises(OSError, match="went away"):
        ingest_source(image_folder, session_factory=sessions, media=media, embedder=embedder,
                      chunk_size=8, workers=2, progress=False)
    assert not list(media.root.rglob(".tmp-*"))
    assert len([p for p in media.root.rglob("*") if p.is_file()]) == 16


def test_the_worker_warm_up_embeds_one_image_and_never_fails(embedder, monkeypatch):
    shapes: list[tuple[int, ...]] = []
    monkeypatch.setattr(embedder, "embed_tensors", lambda inputs: shapes.append(inputs.shape))
    _warm_up(embedder, DEFAULT_MAX_PIXELS, embeds=True)
    _warm_up(embedder, DEFAULT_MAX_PIXELS, embeds=False)  # a GPU model's workers only decode
    size = embedder.spec.image_size
    assert shapes == [(1, 3, size, size)]

    def broken(inputs):
        raise RuntimeError("no memory left")

    monkeypatch.setattr(embedder, "embed_tensors", broken)
    _warm_up(embedder, DEFAULT_MAX_PIXELS, embeds=True)  # best effort: nothing raised


def test_the_ingest_keeps_the_objects_it_starts_with_out_of_garbage_collection(
        sessions, media, embedder, image_folder, monkeypatch):
    """Frozen (``imgret.process.frozen_long_lived``) before the workers fork and while the
    chunks go through, collectable again once the ingest returns."""
    import gc

    gc.unfreeze()
    frozen: list[int] = []
    real = pipeline._ChunkRun.prepare

    def prepare(self, *args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pipeline._ChunkRun, "prepare", prepare)
    report = ingest_source(image_folder, session_factory=sessions, media=media,
                           embedder=embedder, chunk_size=8, workers=2, progress=False)
    assert report.added == 20
    assert len(frozen) == 3 and min(frozen) > 10_000
    assert gc.get_freeze_count() == 0
