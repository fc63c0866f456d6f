"""MediaStore.put_many (one batch of syncs) and stage (an ingest worker's temporary file)."""

from __future__ import annotations

import os

import pytest

from imgret.gallery.media import files as media_module
from imgret.gallery.media.files import BATCH_MIN, MediaStore, sha256_hex


def _blobs(n: int, tag: bytes = b"") -> list[tuple[bytes, str]]:
    out = []
    for i in range(n):
        data = b"image-%d-" % i + tag + os.urandom(16)
        out.append((data, sha256_hex(data)))
    return out


def _files(media: MediaStore) -> list[str]:
    return sorted(p.name for p in media.root.rglob("*") if p.is_file())


@pytest.fixture(params=["syncfs", "fsync"])
def sync_mode(request, monkeypatch):
    """Both ways of making a batch durable: syncfs (Linux 5.8+) and threaded fsyncs."""
    if request.param == "fsync":
        monkeypatch.setattr(media_module, "_SYNCFS", [None])
    elif not media_module._syncfs_reports_errors():
        pytest.skip("no syncfs that reports errors here")
    return request.param


def test_put_many_stores_every_file_once_and_leaves_no_temporary(tmp_path, sync_mode):
    media = MediaStore(tmp_path / "media")
    items = _blobs(BATCH_MIN + 5)
    paths = media.put_many([*items, items[0]])  # a key may repeat
    assert paths == [media.relative_path(k) for _, k in [*items, items[0]]]
    for data, key in items:
        assert media.read(media.relative_path(key)) == data
    assert _files(media) == sorted(k for _, k in items)
    assert media.put_many(items) == paths[:-1]  # stored already: nothing written
    assert _files(media) == sorted(k for _, k in items)


def test_put_many_replaces_a_file_that_does_not_hold_its_bytes(tmp_path, sync_mode):
    media = MediaStore(tmp_path / "media")
    items = _blobs(BATCH_MIN)
    data, key = items[0]
    target = media.path(key)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x" * len(data))  # same size, wrong bytes
    media.put_many(items)
    assert target.read_bytes() == data


def test_staged_files_are_renamed_or_dropped(tmp_path, sync_mode):
    media = MediaStore(tmp_path / "media")
    old = _blobs(1, b"old")
    media.put_many(old)
    items = _blobs(BATCH_MIN + 2)
    staged = {key: media.stage(data, key) for data, key in [*items, *old]}
    assert all(os.path.basename(t).startswith(".tmp-") for t in staged.values())
    assert not set(media.stored_keys()) & {k for _, k in items}  # not media until put_many
    media.put_many([*items, *old], staged=staged)
    assert not [t for t in staged.values() if os.path.exists(t)]
    assert _files(media) == sorted(k for _, k in [*items, *old])
    for data, key in items:
        assert media.read(media.relative_path(key)) == data


def test_a_lost_staged_file_is_written_from_the_bytes(tmp_path, sync_mode):
    media = MediaStore(tmp_path / "media")
    items = _blobs(BATCH_MIN)
    staged = {key: media.stage(data, key) for data, key in items}
    os.unlink(staged[items[0][1]])  # e.g. swept as stale
    media.put_many(items, staged=staged)
    assert media.read(media.relative_path(items[0][1])) == items[0][0]
    assert _files(media) == sorted(k for _, k in items)


def test_a_failed_batch_leaves_no_temporary_file(tmp_path, monkeypatch):
    media = MediaStore(tmp_path / "media")

    def broken(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(media_module, "_SYNCFS", [None])
    monkeypatch.setattr(media_module, "_fsync_all", lambda paths: broken(0))
    with pytest.raises(OSError):
        media.put_many(_blobs(BATCH_MIN))
    assert _files(media) == []
