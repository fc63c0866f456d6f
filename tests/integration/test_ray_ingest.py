"""Ingest on Ray Data (``imgret ingest PATH --ray``) against the plain ingest of the same folder.

One small local Ray instance (2 CPUs, 256 MiB object store, no dashboard) is shared by the
module's tests: Ray's start-up is most of their time. A missing ``ray`` extra skips them, and
fails them under ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from imgret.gallery.ingest import IngestReport, ingest_source
from imgret.gallery.media.files import MediaStore
from imgret.gallery.storage import vector_store
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.tables import GalleryItem
from imgret.gallery.versions import version_store
from tests.conftest import TEST_DEVICE, require
from tests.support.images import write_image_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for the module; its address lets a CLI process join it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        ray = None
    require(ray is not None, "ray[data] (the `ray` extra)")
    ray.init(num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """20 generated images in 4 classes, a copy of one under another class, a corrupt file."""
    root = write_image_folder(tmp_path / "images")
    shutil.copy(root / "class_0" / "000.png", root / "class_3" / "copy.png")
    (root / "class_1" / "bad.png").write_bytes(b"not an image at all")
    return root


def _ingest_plain(folder: Path, url: str, data_dir: Path, embedder) -> tuple[object, list]:
    upgrade_to_head(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    media = MediaStore.in_data_dir(data_dir)
    reports = [ingest_source(folder, session_factory=sessions, media=media, embedder=embedder,
                             chunk_size=8, workers=0, progress=False) for _ in range(2)]
    contents = _contents(sessions)
    engine.dispose()
    return contents, reports


def _contents(sessions) -> dict[str, tuple]:
    """sha256 -> (label, camera, source, vector) of the live gallery."""
    with sessions() as session:
        items = {i.id: i for i in session.scalars(select(GalleryItem))}
        version = version_store.get_model_version(session=session)
        page = vector_store.fetch_vectors(list(items), session=session, model_version=version)
    return {items[int(i)].sha256: (items[int(i)].label, items[int(i)].camera,
                                   items[int(i)].source, vector)
            for i, vector in zip(page.ids, page.vectors, strict=True)}


def _assert_same(ray_contents: dict, plain_contents: dict) -> None:
    assert ray_contents.keys() == plain_contents.keys()
    for sha, (label, camera, source, vector) in plain_contents.items():
        assert ray_contents[sha][:3] == (label, camera, source)
        np.testing.assert_allclose(ray_contents[sha][3], vector, rtol=0, atol=1e-5)


def _counts(report: IngestReport) -> tuple:
    return (report.total, report.added, report.embedded, report.duplicates,
            sorted(path for path, _ in report.failed))


def test_ray_ingest_stores_what_plain_ingest_stores_and_runs_again_as_a_no_op(
    ray_local, folder, sessions, db_url, media, embedder, tiny_checkpoint, tmp_path,
):
    from imgret.gallery.ingest.ray import ingest_with_ray

    plain, plain_reports = _ingest_plain(folder, f"sqlite:///{tmp_path / 'plain.db'}",
                                         tmp_path / "plain-data", embedder)
    ray_reports = [
        ingest_with_ray(folder, session_factory=sessions, media=media, database_url=db_url,
                        checkpoint=tiny_checkpoint, device=TEST_DEVICE, batch_size=8,
                        chunk_size=8, progress=False)
        for _ in range(2)
    ]
    _assert_same(_contents(sessions), plain)
    # Counted alike: 20 stored (the copy is already present), the corrupt file failed; the
    # second run adds nothing and reports the corrupt file again.
    assert _counts(ray_reports[0]) == _counts(plain_reports[0])
    assert _counts(ray_reports[0])[1:4] == (20, 0, 1)
    assert _counts(ray_reports[1]) == _counts(plain_reports[1])
    assert _counts(ray_reports[1])[1:4] == (0, 0, 21)
    assert len([p for p in media.root.rglob("*") if p.is_file()]) == 20


# The real CLI in its own process, joining the module's Ray instance at ADDRESS; its chunk
# writes are held after the first N (argv[1]), so the kill lands between committed chunks by
# an event the test waits for, not by a moment a loaded machine could miss.
SCRIPT = """
import sys, threading
import imgret.gallery.ingest.ray
chunks = int(sys.argv[1])
original = imgret.gallery.ingest.ray.write_embedded
written = []
def write_then_hold(*args, **kwargs):
    written.append(None)
    if len(written) > chunks:
        threading.Event().wait()  # held until the test kills this process
    return original(*args, **kwargs)
imgret.gallery.ingest.ray.write_embedded = write_then_hold
sys.argv = ["imgret", *sys.argv[2:]]
from imgret.cli.main import main
main()
"""



def test_cli_ray_ingest_killed_mid_run_resumes_to_the_plain_result(
    ray_local, folder, embedder, tiny_checkpoint, tmp_path,
):
    url = f"sqlite:///{tmp_path / 'ray.db'}"
    env = {**os.environ, "IMGRET_DATABASE_URL": url, "IMGRET_DATA_DIR": str(tmp_path / "data"),
           "IMGRET_DEVICE": TEST_DEVICE, "PYTHONPATH": os.pathsep.join(sys.path)}

    def command(chunks: int) -> list[str]:
        return [sys.executable, "-c", SCRIPT, str(chunks), "ingest", str(folder),
                "--model", str(tiny_checkpoint), "--chunk-size", "4", "--batch-size", "4",
                "--no-progress", "--ray", ray_local]

    upgrade_to_head(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    try:
        process = subprocess.Popen(command(1), env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        committed = 0
        while time.monotonic() < deadline and process.poll() is None and committed < 4:
            time.sleep(0.2)
            with sessions() as session:
                committed = session.scalar(select(func.count()).select_from(GalleryItem))
        assert process.poll() is None, process.communicate()[0][-3000:]
        process.send_signal(signal.SIGKILL)
        process.wait()
        with sessions() as session:
            committed = session.scalar(select(func.count()).select_from(GalleryItem))
        assert committed == 4  # the one chunk written before the hold, whole

        done = subprocess.run(command(10**6), env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "22 images" in done.stdout, done.stdout
        assert f"{20 - committed} added" in done.stdout, done.stdout
        assert f"{committed + 1} already present, 1 failed" in done.stdout, done.stdout
        plain, _ = _ingest_plain(folder, f"sqlite:///{tmp_path / 'plain.db'}",
                                 tmp_path / "plain-data", embedder)
        _assert_same(_contents(sessions), plain)
    finally:
        engine.dispose()


def test_ray_without_the_extra_is_one_line_naming_the_fix(tiny_checkpoint, folder, tmp_path):
    # Runs without Ray: `import ray` fails in the child as it does where the extra is missing.
    script = ("import sys; sys.modules['ray'] = None; sys.argv = ['imgret', *sys.argv[1:]]; "
              "from imgret.cli.main import main; main()")
    env = {**os.environ, "IMGRET_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
           "IMGRET_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script, "ingest", str(folder), "--model",
                           str(tiny_checkpoint), "--ray"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "imgret/gallery/ingest/ray.py" in errors[0] and "pip install 'imgret[ray]'" in errors[0]
