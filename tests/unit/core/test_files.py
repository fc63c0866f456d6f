"""imgret.files: read_file (a file's bytes, whole, with open's errors) and create_temp (the
temporary files of every atomic write)."""

from __future__ import annotations

import itertools
import os
import stat
import threading

import numpy as np
import pytest

from imgret import files
from imgret.files import create_temp, read_file, remove_stale_temps


@pytest.mark.parametrize("size", [0, 1, 400, (1 << 20) + 3])
def test_read_file_reads_every_byte(tmp_path, size: int) -> None:
    path = tmp_path / "blob"
    data = np.random.default_rng(size).bytes(size)
    path.write_bytes(data)
    assert read_file(path) == data
    assert read_file(str(path)) == data


def test_read_file_reads_a_file_to_its_end_not_to_its_size(tmp_path) -> None:
    """A file with no size up front (as a file that grows after ``fstat``): read whole."""
    assert read_file("/proc/self/status").startswith(b"Name:")


def test_read_file_raises_what_open_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "missing.png")
    with pytest.raises(IsADirectoryError):
        read_file(tmp_path)


def test_create_temp_makes_the_folder_and_a_private_file_named_for_its_writer(tmp_path) -> None:
    folder = tmp_path / "ab" / "cd"
    fd, path = create_temp(str(folder), "key")
    os.write(fd, b"bytes")
    os.close(fd)
    name = os.path.basename(path)
    assert os.path.dirname(path) == str(folder)
    assert name.startswith(f".tmp-{os.getpid()}-key.")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_file(path) == b"bytes"
    # Named after a live writer (this process): the start-up sweep leaves it alone.
    assert remove_stale_temps(tmp_path) == 0 and os.path.exists(path)


def test_create_temp_skips_a_name_already_taken(tmp_path, monkeypatch) -> None:
    """A name left by a process of an earlier boot with this pid is not opened again."""
    monkeypatch.setattr(files, "_TEMP_NUMBERS", itertools.count(7))
    taken = tmp_path / f".tmp-{os.getpid()}-key.7"
    taken.write_bytes(b"old")
    fd, path = create_temp(str(tmp_path), "key")
    os.close(fd)
    assert path == str(tmp_path / f".tmp-{os.getpid()}-key.8")
    assert taken.read_bytes() == b"old"


def test_create_temp_never_hands_two_threads_one_file(tmp_path) -> None:
    paths: list[str] = []

    def create() -> None:
        for _ in range(200):
            fd, path = create_temp(str(tmp_path), "same-key")
            os.close(fd)
            paths.append(path)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(paths)) == len(paths) == 800
    assert len(os.listdir(tmp_path)) == 800
