"""Batched media writes (MediaStore.put_many) and the ingest's media prefetch process."""

from __future__ import annotations

import os

import pytest

from index import media as media_module
from index.media import MediaPrefetcher, MediaStore, sha256_hex


def _blobs(n: int, seed: int = 0) -> list[tuple[bytes, str]]:
    blobs = [f"image {seed}-{i} ".encode() * (i + 1) for i in range(n)]
    return [(data, sha256_hex(data)) for data in blobs]


def _files(root) -> list:
    return sorted(p for p in root.rglob("*") if p.is_file())


# Both ways to make a batch durable: below _SYNCFS_MIN_FILES the threads fsync each file and
# folder; from it on (Linux 5.8+) two syncfs calls do.
@pytest.mark.parametrize("n", [3, media_module._SYNCFS_MIN_FILES + 5])
def test_put_many_stores_each_key_once_like_put(tmp_path, n):
    store = MediaStore(tmp_path / "media")
    items = _blobs(n)
    paths = store.put_many([*items, items[0]])  # a key given twice is written once
    assert paths == [store.relative_path(key) for _, key in [*items, items[0]]]
    assert paths[0] == store.put(*items[0])  # the same layout as put
    for (data, key), path in zip(items, paths, strict=False):
        assert store.read(path) == data and store.path(key).is_file()
    assert _files(store.root) == sorted(store.path(key) for _, key in items)  # no temporaries
    assert store.put_many(items) == paths[:n]  # stored already: nothing to write


@pytest.mark.parametrize("n", [2, media_module._SYNCFS_MIN_FILES])
def test_put_many_replaces_a_file_that_does_not_hold_its_bytes(tmp_path, n):
    store = MediaStore(tmp_path / "media")
    items = _blobs(n)
    store.put_many(items)
    data, key = items[0]
    store.path(key).write_bytes(b"x" * len(data))  # same size, wrong bytes
    store.path(items[1][1]).write_bytes(b"short")
    store.put_many(items)
    assert store.path(key).read_bytes() == data
    assert store.path(items[1][1]).read_bytes() == items[1][0]


@pytest.mark.parametrize("n", [1, 3, media_module._SYNCFS_MIN_FILES])
def test_put_many_with_a_staging_folder_leaves_nothing_there(tmp_path, n):
    store = MediaStore(tmp_path / "media")
    staging = tmp_path / "staging"
    staging.mkdir()
    items = _blobs(n)
    store.put_many(items, staging=staging)
    assert [store.path(key).read_bytes() for _, key in items] == [d for d, _ in items]
    assert list(staging.iterdir()) == []


def test_syncfs_is_used_only_where_it_reports_errors():
    syncfs = media_module._syncfs()
    if syncfs is None:
        pytest.skip("no syncfs here (not Linux 5.8+): put_many fsyncs each file and folder")
    fd = os.open(".", os.O_RDONLY)
    try:
        syncfs(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        syncfs(-1)  # a failure raises, never passes for a durable write


def test_prefetcher_writes_batches_in_a_child_and_the_store_finds_them(tmp_path):
    store = MediaStore(tmp_path / "data" / "media")
    first, second = _blobs(20, seed=1), _blobs(3, seed=2)
    with MediaPrefetcher(store) as prefetch:
        prefetch.submit([])  # nothing to write: no process
        assert prefetch._process is None
        prefetch.submit(first)
        child = prefetch._process.pid
        prefetch.submit(second)  # waits for the first batch, same child
        assert prefetch._process.pid == child
        prefetch.wait()
        assert _files(store.root) == sorted(store.path(k) for _, k in [*first, *second])
        with pytest.raises(ValueError):
            prefetch.submit([(b"data", "not-a-hash")])  # refused before reaching the child
    assert prefetch._process is None  # stopped
    for data, key in [*first, *second]:
        assert store.path(key).read_bytes() == data
    # The child's temporaries lived beside the store, never in it, and none is left.
    assert list((tmp_path / "data" / ".media-staging").iterdir()) == []
    assert store.put_many(first) == [store.relative_path(k) for _, k in first]


def test_a_dead_prefetch_process_only_means_the_transaction_writes_the_files(tmp_path):
    store = MediaStore(tmp_path / "media")
    items = _blobs(4)
    with MediaPrefetcher(store) as prefetch:
        prefetch.submit(items[:2])
        prefetch.wait()
        prefetch._process.kill()
        prefetch._process.wait()
        prefetch.submit(items[2:])  # the pipe is closed: it gives up, no error
        prefetch.wait()
        prefetch.submit(items[2:])
        assert prefetch._process is None
    assert _files(store.root) == sorted(store.path(k) for _, k in items[:2])
    store.put_many(items)  # what the ingest's transaction does anyway
    assert _files(store.root) == sorted(store.path(k) for _, k in items)


def test_a_batch_cut_short_by_the_parent_writes_nothing(tmp_path):
    store = MediaStore(tmp_path / "media")
    (data, key), = _blobs(1)
    prefetch = MediaPrefetcher(store)
    process = prefetch._start()
    process.stdin.write(f"2\n{key} {len(data)}\n".encode() + data
                        + f"{'0' * 64} 100\n".encode() + b"only part")
    process.stdin.close()  # as when the parent is killed mid-write
    assert process.wait(timeout=60) == 0
    process.stdout.close()
    assert _files(store.root) == []
