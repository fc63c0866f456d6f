"""The database media store (``IMGRET_MEDIA_BACKEND=database``) on SQLite and PostgreSQL: bytes
stored once per hash, in the writer's transaction, and gone with the transaction that finds
them unreferenced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy import func, select

from imgret.errors import GalleryError
from imgret.gallery.ingest import NewItem, add_items
from imgret.gallery.media.blobs import DatabaseMediaStore, open_media_store
from imgret.gallery.media.files import MediaStore, sha256_hex
from imgret.gallery.media.gc import purge_media, sweep_media
from imgret.gallery.storage import item_store
from imgret.gallery.storage.tables import GalleryItem, MediaBlob
from imgret.settings import Settings
from tests.support.gallery_state import add_query_item
from tests.support.images import class_image, image_bytes


def _blob_count(sessions) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(MediaBlob))


def _live_shas(sessions) -> set[str]:
    with sessions() as session:
        return set(session.scalars(select(GalleryItem.sha256)
                                   .where(GalleryItem.deleted_at.is_(None))))


def test_settings_pick_the_store(sessions, tmp_path) -> None:
    files = open_media_store(Settings(data_dir=tmp_path), sessions)
    assert isinstance(files, MediaStore) and files.root == tmp_path / "media"
    assert isinstance(open_media_store(Settings(data_dir=tmp_path, media_backend="database"),
                                       sessions), DatabaseMediaStore)
    with pytest.raises(ValueError, match="media_backend"):
        Settings(media_backend="s3")


def test_same_bytes_are_stored_once_and_read_back(sessions) -> None:
    media = DatabaseMediaStore(sessions)
    a, b = image_bytes(class_image(1, 0)), image_bytes(class_image(2, 0))
    with sessions.begin() as session:
        paths = media.put_many([(a, sha256_hex(a)), (b, sha256_hex(b)), (a, sha256_hex(a))],
                               session=session)
    assert paths == [MediaStore.relative_path(sha256_hex(x)) for x in (a, b, a)]
    with sessions.begin() as session:  # stored again: kept, no conflict
        media.put_many([(a, sha256_hex(a))], session=session)
    assert _blob_count(sessions) == 2
    assert media.read(paths[0]) == a and media.read(paths[1]) == b
    assert media.exists(sha256_hex(b))
    assert sorted(media.stored_keys()) == sorted([sha256_hex(a), sha256_hex(b)])


def test_a_rolled_back_write_leaves_no_bytes(sessions) -> None:
    media = DatabaseMediaStore(sessions)
    data = image_bytes(class_image(3, 0))
    with pytest.raises(RuntimeError), sessions.begin() as session:
        (path,) = media.put_many([(data, sha256_hex(data))], session=session)
        raise RuntimeError("the rows failed")
    assert not media.exists(sha256_hex(data))
    with pytest.raises(FileNotFoundError):
        media.read(path)
    with pytest.raises(ValueError):  # a path that is not one of ours, as with files
        media.read(f"../{sha256_hex(data)}")


def test_a_delete_removes_the_blob_only_when_unreferenced(sessions, embedder) -> None:
    """A gallery item and a query item with the same bytes share one blob: deleting the item
    keeps it; once nothing refers to it, the purge's transaction deletes it."""
    media = DatabaseMediaStore(sessions)
    shared, alone = image_bytes(class_image(4, 0)), image_bytes(class_image(5, 0))
    added = add_items([NewItem(shared, "x"), NewItem(alone, "y")], session_factory=sessions,
                      media=media, embedder=embedder)
    assert _blob_count(sessions) == 2
    add_query_item(sessions, shared, model_version=embedder.model_version, dim=embedder.dim)
    assert _blob_count(sessions) == 2  # the query item reuses the gallery item's blob
    with sessions.begin() as session:
        deleted = item_store.delete_items(added.ids, session=session)
    assert purge_media([d.sha256 for d in deleted], session_factory=sessions, media=media) == 1
    assert media.exists(sha256_hex(shared)) and not media.exists(sha256_hex(alone))
    with pytest.raises(FileNotFoundError):
        media.read(MediaStore.relative_path(sha256_hex(alone)))


def test_the_start_up_sweep_finishes_an_interrupted_delete(sessions, embedder) -> None:
    media = DatabaseMediaStore(sessions)
    kept, deleted = image_bytes(class_image(6, 0)), image_bytes(class_image(6, 1))
    ids = add_items([NewItem(kept, "x"), NewItem(deleted, "x")], session_factory=sessions,
                    media=media, embedder=embedder).ids
    with sessions.begin() as session:
        item_store.delete_items([ids[1]], session=session)  # a crash here: never purged
    assert sweep_media(session_factory=sessions, media=media) == 1
    assert media.exists(sha256_hex(kept)) and not media.exists(sha256_hex(deleted))


def test_a_switched_backend_is_reported_at_start_up_and_deletes_nothing(
    sessions, embedder, tmp_path, caplog
) -> None:
    """A gallery filled under the files backend, then started with the database one: the sweep
    says how many images are missing and why, and removes nothing from either store."""
    files = MediaStore.in_data_dir(tmp_path / "data")
    images = [image_bytes(class_image(7, i)) for i in range(3)]
    add_items([NewItem(data, "x") for data in images], session_factory=sessions, media=files,
              embedder=embedder)
    with caplog.at_level("ERROR", logger="imgret.gallery.media.gc"):
        assert sweep_media(session_factory=sessions, media=DatabaseMediaStore(sessions)) == 0
    assert "3 of the 3 images" in caplog.text and "IMGRET_MEDIA_BACKEND" in caplog.text
    assert sorted(files.stored_keys()) == sorted(sha256_hex(data) for data in images)
    caplog.clear()
    with caplog.at_level("ERROR", logger="imgret.gallery.media.gc"):
        assert sweep_media(session_factory=sessions, media=files) == 0
    assert not caplog.text  # the right backend: nothing missing, nothing said


@pytest.mark.parametrize("backend", ["files", "database"])
def test_read_many_keeps_order_and_says_none_for_gone_bytes(sessions, tmp_path, backend) -> None:
    media = (DatabaseMediaStore(sessions) if backend == "database"
             else MediaStore.in_data_dir(tmp_path / "data"))
    a, b = image_bytes(class_image(8, 0)), image_bytes(class_image(8, 1))
    with sessions.begin() as session:
        path_a, path_b = media.put_many([(a, sha256_hex(a)), (b, sha256_hex(b))],
                                        session=session)
    gone = MediaStore.relative_path(sha256_hex(b"never stored"))
    assert media.read_many([path_b, gone, path_a, path_b]) == [b, None, a, b]
    assert media.read_many([]) == []


def test_migrate_moves_every_image_and_leaves_none_behind(sessions, db_url, embedder,
                                                          tmp_path) -> None:
    """`imgret media migrate`: files -> database -> files on each database. Every referenced
    image is readable from the target with its bytes, the source ends empty (unreferenced
    leftovers too), a batch half-moved by an interrupted run is finished, and a re-run moves
    nothing."""
    from imgret.cli.jobs import gallery as commands

    settings = Settings(data_dir=tmp_path / "data", database_url=db_url)
    files, blobs = MediaStore.in_data_dir(settings.data_dir), DatabaseMediaStore(sessions)
    images = [image_bytes(class_image(9, i)) for i in range(5)]
    ids = add_items([NewItem(data, "x") for data in images[:4]], session_factory=sessions,
                    media=files, embedder=embedder).ids
    add_query_item(sessions, images[4], model_version=embedder.model_version, dim=embedder.dim)
    with sessions.begin() as session:
        files.put_many([(images[4], sha256_hex(images[4]))], session=session)
        item_store.delete_items([ids[3]], session=session)  # deleted, bytes never purged: leftover
        # An interrupted earlier run: this image reached the target, not yet left the source.
        blobs.put_many([(images[0], sha256_hex(images[0]))], session=session)
    wanted = {sha256_hex(data): data for data in images[:3] + images[4:]}

    report = commands.migrate_media(settings, "database", progress=False)
    assert (report.moved, report.missing, report.leftovers) == (4, 0, 1)
    assert list(files.stored_keys()) == []
    assert set(blobs.stored_keys()) == set(wanted)
    assert blobs.read_many([MediaStore.relative_path(k) for k in wanted]) == list(wanted.values())

    again = commands.migrate_media(settings, "database", progress=False)
    assert (again.moved, again.leftovers) == (0, 0)
    back = commands.migrate_media(settings, "files", progress=False)
    assert back.moved == 4 and _blob_count(sessions) == 0
    assert {k: files.read(MediaStore.relative_path(k)) for k in files.stored_keys()} == wanted
    with pytest.raises(GalleryError, match="media backends are files, database"):
        commands.migrate_media(settings, "s3", progress=False)


def test_migrate_command_says_what_it_moved(tmp_path, monkeypatch, embedder) -> None:
    from typer.testing import CliRunner

    from imgret.cli.main import app
    from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
    from imgret.settings import get_settings

    url = f"sqlite:///{tmp_path / 'g.db'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    add_items([NewItem(image_bytes(class_image(3, 3)), "x")], session_factory=sessions,
              media=MediaStore.in_data_dir(tmp_path / "data"), embedder=embedder)
    engine.dispose()
    monkeypatch.setenv("IMGRET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("IMGRET_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        done = CliRunner().invoke(app, ["media", "migrate", "--to", "database",
                                        "--no-progress"])
    finally:
        get_settings.cache_clear()
    assert done.exit_code == 0, done.output
    assert "moved 1 images from the files backend to the database backend" in done.output
    assert "IMGRET_MEDIA_BACKEND=database" in done.output


def test_migrate_to_an_unknown_backend_is_one_line_naming_the_backends(tmp_path) -> None:
    """The console script (imgret.cli.main.main) refuses a bad --to before it opens the gallery:
    exit status 2, one ``error:`` line naming the backends to pick from, no traceback."""
    script = ("import sys; sys.argv = ['imgret', *sys.argv[1:]]; "
              "from imgret.cli.main import main; main()")
    db_file = tmp_path / "g.db"
    env = {**os.environ, "IMGRET_DATABASE_URL": f"sqlite:///{db_file}",
           "IMGRET_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script, "media", "migrate", "--to", "s3",
                           "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --to 's3': the media backends are files, database"]
    assert not db_file.exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize("to", ["database", "files"])
def test_migrate_beside_a_live_writer_of_the_new_backend(sessions, embedder, tmp_path,
                                                         to) -> None:
    """`imgret media migrate` while a process already on the new backend adds and deletes
    gallery items (the service's calls: add_items; delete_items then purge_media). Batches of
    two, and the writer acts at least once between batches. Afterwards the target holds
    exactly the bytes of the live items (every acknowledged add readable with its bytes,
    nothing of a deleted item, not even one deleted before its batch moved), and the source
    is empty, re-uploaded bytes of a deleted image included."""
    import threading

    from imgret.gallery.media.blobs import migrate_media

    files, blobs = MediaStore.in_data_dir(tmp_path / "data"), DatabaseMediaStore(sessions)
    source, target = (files, blobs) if to == "database" else (blobs, files)
    initial = {sha256_hex(data): data for data in (image_bytes(class_image(10, i))
                                                   for i in range(24))}
    ids = add_items([NewItem(data, "old") for data in initial.values()],
                    session_factory=sessions, media=source, embedder=embedder).ids
    live = dict(zip(ids, initial, strict=True))  # id -> sha256, as acknowledged
    data_of = dict(initial)
    # Batches go in hash order: the writer deletes the highest hash left (its bytes not yet
    # moved) and the lowest one (moved already) in turn.
    doomed = sorted(ids, key=live.__getitem__)
    migrated, progress = threading.Event(), threading.Condition()
    ops, failures = [0], []

    def delete(item_id: int) -> None:
        with sessions.begin() as session:
            deleted = item_store.delete_items([item_id], session=session)
        purge_media([d.sha256 for d in deleted], session_factory=sessions, media=target)
        del live[item_id]

    def write() -> None:
        try:
            cycle, deleted_old = 0, []
            while not migrated.is_set() and cycle < 200:
                new = image_bytes(class_image(11, cycle))
                data_of[sha256_hex(new)] = new
                (new_id,) = add_items([NewItem(new, "new")], session_factory=sessions,
                                      media=target, embedder=embedder).ids
                live[new_id] = sha256_hex(new)
                if doomed:
                    victim = doomed.pop(-1 if cycle % 2 == 0 else 0)
                    deleted_old.append(live[victim])
                    delete(victim)
                if cycle % 3 == 2:
                    delete(new_id)
                if cycle % 4 == 3 and deleted_old:  # the same bytes uploaded again
                    again = initial[deleted_old.pop(0)]
                    (again_id,) = add_items([NewItem(again, "again")],
                                            session_factory=sessions, media=target,
                                            embedder=embedder).ids
                    live[again_id] = sha256_hex(again)
                cycle += 1
                with progress:
                    ops[0] += 1
                    progress.notify_all()
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)
            with progress:
                progress.notify_all()

    seen = [0]

    def after_batch(_n: int) -> None:
        with progress:  # let the writer act between any two batches
            progress.wait_for(lambda: ops[0] > seen[0] or failures, timeout=10)
            seen[0] = ops[0]

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        report = migrate_media(source=source, target=target, session_factory=sessions,
                               batch_size=2, on_batch=after_batch)
    finally:
        migrated.set()
        writer.join(timeout=60)
    assert not writer.is_alive() and not failures, failures
    assert ops[0] >= 12 and report.moved > 0
    assert set(live.values()) == _live_shas(sessions)
    assert list(source.stored_keys()) == []
    wanted = {sha: data_of[sha] for sha in live.values()}
    assert sorted(target.stored_keys()) == sorted(wanted)
    assert target.read_many([MediaStore.relative_path(k) for k in wanted]) == list(
        wanted.values())



@pytest.mark.parametrize("to", ["database", "files"])
def test_migrate_moves_bytes_uploaded_again_after_the_listing(sessions, embedder, tmp_path,
                                                              to) -> None:
    """An image deleted before the run (its bytes left in the old store) and uploaded again
    by a process on the new backend while the run moves other batches: the key was not in
    the listing, yet afterwards the target holds its bytes and the source holds nothing."""
    from imgret.gallery.media.blobs import migrate_media

    files, blobs = MediaStore.in_data_dir(tmp_path / "data"), DatabaseMediaStore(sessions)
    source, target = (files, blobs) if to == "database" else (blobs, files)
    images = [image_bytes(class_image(12, i)) for i in range(6)]
    ids = add_items([NewItem(data, "old") for data in images], session_factory=sessions,
                    media=source, embedder=embedder).ids
    with sessions.begin() as session:  # deleted; its bytes not purged from the old store
        item_store.delete_items([ids[0]], session=session)
    again = []

    def upload_again(_n: int) -> None:
        if not again:
            again.extend(add_items([NewItem(images[0], "again")], session_factory=sessions,
                                   media=target, embedder=embedder).ids)

    report = migrate_media(source=source, target=target, session_factory=sessions,
                           batch_size=2, on_batch=upload_again)
    assert again and report.missing == 0
    assert list(source.stored_keys()) == []
    live = _live_shas(sessions)
    assert sha256_hex(images[0]) in live and sorted(target.stored_keys()) == sorted(live)
    assert target.read_many([MediaStore.relative_path(sha256_hex(images[0]))]) == [images[0]]
