"""Data set adapters: ImageFolder, CSV manifest, Market-1501 names, Fashion-MNIST idx files."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from imgret.datasets import (
    DatasetError,
    list_records,
    load_fashion_mnist,
    parse_market1501_name,
)
from tests.support.images import class_image, write_image_folder, write_market_folder


def test_image_folder(tmp_path: Path) -> None:
    records = list_records(write_image_folder(tmp_path / "f", classes=3, per_class=2))
    assert len(records) == 6
    assert {r.label for r in records} == {"class_0", "class_1", "class_2"}
    assert all(r.camera is None for r in records)


def test_image_folder_lists_what_rglob_sorted_lists(tmp_path: Path) -> None:
    """The scandir walk keeps ``sorted(label.rglob("*"))``'s order and rules: nested folders
    (a folder name sorting between file names), upper-case suffixes, non-images, a folder
    named like an image, symlinks (to a file: listed; to a folder: not entered; dangling:
    skipped), hidden files."""
    root = tmp_path / "tree"
    label = root / "shoes"
    (label / "b" / "deep").mkdir(parents=True)
    (label / "a.png.d").mkdir()  # a folder with an image suffix: not a file
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.png").write_bytes(b"x")
    for name in ("c.PNG", "a.jpg", "b.png", "b/z.webp", "b/deep/y.gif", "b/notes.txt",
                 ".hidden.png", "a.png.d/inner.png", "Z.JPEG"):
        (label / name).write_bytes(b"x")
    (label / "link.png").symlink_to(outside / "x.png")
    (label / "dangling.png").symlink_to(tmp_path / "missing.png")
    (label / "linked_dir").symlink_to(outside, target_is_directory=True)
    (root / "other").mkdir()
    (root / "other" / "o.png").write_bytes(b"x")

    expected = [
        (path, folder.name)
        for folder in sorted(p for p in root.iterdir() if p.is_dir())
        for path in sorted(folder.rglob("*"))
        if path.suffix.lower() in {".png", ".jpg", ".jpeg", ".webp", ".gif"} and path.is_file()
    ]
    listed = [(r.path, r.label) for r in list_records(root)]
    assert listed == expected
    assert len(listed) == 10 and all(isinstance(path, Path) for path, _ in listed)


def test_empty_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no images found"):
        list_records(tmp_path)
    with pytest.raises(DatasetError, match="no such file"):
        list_records(tmp_path / "nowhere")


def test_csv_manifest_relative_paths_cameras_and_missing_rows(tmp_path: Path) -> None:
    class_image(0, 0).save(tmp_path / "a.png")
    class_image(1, 0).save(tmp_path / "b.png")
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label,camera\na.png,cat,1\nb.png,dog,2\ngone.png,dog,3\n")
    records = list_records(manifest)
    assert [(r.path.name, r.label, r.camera) for r in records] == [("a.png", "cat", 1),
                                                                   ("b.png", "dog", 2)]
    manifest.write_text("file,class\na.png,cat\n")
    with pytest.raises(DatasetError, match="path,label"):
        list_records(manifest)
    manifest.write_text("path,label,camera\na.png,cat,left\n")
    with pytest.raises(DatasetError, match="m.csv:2"):
        list_records(manifest)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("0002_c1s1_000451_03.jpg", (2, 1)),
        ("1501_c6s4_001877_01.jpg", (1501, 6)),
        ("-1_c3s2_000100_00.jpg", (-1, 3)),
        ("0000_c1s1_000001_00.jpg", (0, 1)),
        ("Thumbs.db", None),
        ("cat.jpg", None),
    ],
)
def test_market1501_names(name: str, expected) -> None:
    assert parse_market1501_name(name) == expected


def test_market1501_folder_skips_junk_keeps_distractors(tmp_path: Path) -> None:
    root = write_market_folder(tmp_path / "market", identities=4, cameras=2, per_camera=1)
    records = list_records(root)
    labels = {r.label for r in records}
    assert "0000" in labels
    assert not any(r.label.startswith("-") for r in records)
    assert all(r.camera in (1, 2) for r in records)
    gallery = list_records(root / "bounding_box_test")
    assert {r.path.parent.name for r in gallery} == {"bounding_box_test"}


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                      *array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_idx_reader(tmp_path: Path) -> None:
    images = np.arange(3 * 28 * 28, dtype=np.uint8).reshape(3, 28, 28)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([4, 0, 9]))
    got_images, got_labels = load_fashion_mnist(tmp_path, split="test")
    np.testing.assert_array_equal(got_images, images)
    assert got_labels.tolist() == [4, 0, 9]
    with pytest.raises(DatasetError, match="dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path, split="train")
