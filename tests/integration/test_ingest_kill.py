"""An `imgret ingest` process killed with SIGKILL mid-run, then resumed: whole chunks only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from imgret.gallery.ingest import ingest_source
from imgret.gallery.media.files import MediaStore, sha256_hex
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.tables import Embedding, GalleryChange, GalleryItem
from tests.conftest import TEST_DEVICE
from tests.support.images import write_image_folder

CHUNK = 8
TOTAL = 40

# The real CLI, its chunk writer held after the first N chunks commit (argv[1]): the test
# kills the process while the next chunk is embedded or waits to be written, an event it
# can wait for rather than a moment a loaded machine could miss.
SCRIPT = """
import sys, threading
from imgret.gallery.ingest.writer import ChunkWriter
chunks = int(sys.argv[1])
original = ChunkWriter.write
written = []
def write_then_hold(self, *args, **kwargs):
    written.append(None)
    if len(written) > chunks:
        threading.Event().wait()  # held until the test kills this process
    return original(self, *args, **kwargs)
ChunkWriter.write = write_then_hold
sys.argv = ["imgret", *sys.argv[2:]]
from imgret.cli.main import main
main()
"""


def _counts(sessions) -> tuple[int, int, int, int]:
    with sessions() as session:
        items = session.scalar(select(func.count()).select_from(GalleryItem))
        embeddings = session.scalar(select(func.count()).select_from(Embedding))
        changes = session.scalar(select(func.count()).select_from(GalleryChange))
        shas = session.scalar(select(func.count(func.distinct(GalleryItem.sha256))))
    return items, embeddings, changes, shas


@pytest.mark.slow
def test_killed_ingest_leaves_whole_chunks_and_resumes(db_url, tmp_path, tiny_checkpoint):
    from imgret.embedder import Embedder

    folder = write_image_folder(tmp_path / "images", classes=4, per_class=TOTAL // 4)
    data_dir = tmp_path / "data"
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    env = dict(os.environ, IMGRET_DATABASE_URL=db_url, IMGRET_DATA_DIR=str(data_dir),
               IMGRET_DEVICE=TEST_DEVICE)
    log = (tmp_path / "ingest.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "1", "ingest", str(folder), "--model",
         str(tiny_checkpoint), "--batch-size", "4", "--chunk-size", str(CHUNK),
         "--no-progress"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while _counts(sessions)[0] < CHUNK:  # poll until the first chunk is committed
            assert process.poll() is None, (tmp_path / "ingest.log").read_text()
            assert time.monotonic() < deadline, "the ingest never committed a chunk"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    assert process.returncode == -signal.SIGKILL

    items, embeddings, changes, shas = _counts(sessions)
    assert 0 < items < TOTAL, "killed mid-run"
    assert items % CHUNK == 0, "a chunk is one transaction: all of it or none"
    assert embeddings == changes == shas == items  # no item without embedding or change row
    media = MediaStore.in_data_dir(data_dir)
    with sessions() as session:
        stored = session.execute(select(GalleryItem.sha256, GalleryItem.media_path)).all()
    for sha, path in stored:
        assert sha256_hex(media.read(path)) == sha  # every row's image is whole
    # The ingest workers see their parent gone (their pipe closes) and remove the temporary
    # files they staged for the chunks in flight: wait for that (a second at most, usually).
    deadline = time.monotonic() + 30
    while [p for p in media.root.rglob(".tmp-*")] and time.monotonic() < deadline:
        time.sleep(0.05)
    files = [p for p in media.root.rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.startswith(".tmp-")]
    # Files of the chunk in flight may exist without rows: harmless (see
    # imgret.gallery.ingest.writer).
    assert items <= len(files) <= items + CHUNK

    embedder = Embedder.from_checkpoint(tiny_checkpoint, device=TEST_DEVICE)
    report = ingest_source(folder, session_factory=sessions, media=media, embedder=embedder,
                           chunk_size=CHUNK, progress=False)
    assert (report.added, report.duplicates) == (TOTAL - items, items)
    assert _counts(sessions) == (TOTAL, TOTAL, TOTAL, TOTAL)
    assert len([p for p in media.root.rglob("*") if p.is_file()]) == TOTAL
    engine.dispose()
