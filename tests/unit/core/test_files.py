"""imgret.files.read_file: a file's bytes, whole, with open's errors."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.files import read_file


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
