"""Data set adapters: list labelled image files (ImageFolder, CSV manifest, Market-1501) and
read Fashion-MNIST's raw idx files. Used by training and by ingest alike.
"""

from __future__ import annotations

import csv
import gzip
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgret.errors import ImgretError

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
MARKET_SPLITS = ("bounding_box_train", "bounding_box_test", "query", "gt_bbox")
# 0002_c1s1_000451_03.jpg -> identity 2, camera 1; "-1" is junk, "0000" a distractor.
_MARKET_NAME = re.compile(r"^(-1|\d{4})_c(\d)s\d+_\d+_\d+\.(jpg|jpeg|png)$", re.IGNORECASE)

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)


class DatasetError(ImgretError, ValueError):
    """A data source that cannot be read as labelled images; the message names the path."""


@dataclass(frozen=True)
class Record:
    """One labelled image file. ``camera`` is set for re-ID data (Market-1501, CSV)."""

    path: Path
    label: str
    camera: int | None = None


def list_records(source: str | Path) -> list[Record]:
    """List the labelled images of a source, detecting its layout.

    A ``.csv`` file is a manifest; a folder whose image names follow Market-1501 (directly or
    in ``bounding_box_train``/``bounding_box_test``/``query``) is Market-1501; any other
    folder is an ImageFolder tree (label = sub-folder name).

    Raises:
        DatasetError: the source is missing, empty, or malformed.
    """
    source = Path(source)
    if not source.exists():
        raise DatasetError(f"{source}: no such file or folder")
    if source.is_file():
        if source.suffix.lower() == ".csv":
            return list_csv_manifest(source)
        raise DatasetError(f"{source}: expected a folder of images or a .csv manifest")
    if _looks_like_market(source):
        return list_market1501(source)
    return list_image_folder(source)


def list_image_folder(root: str | Path) -> list[Record]:
    """``root/<label>/<image>`` (nested folders below a label are included)."""
    root = Path(root)
    records = [
        Record(Path(path), label_dir.name)
        for label_dir in sorted(p for p in root.iterdir() if p.is_dir())
        for path in _image_files_under(label_dir)
    ]
    if not records:
        raise DatasetError(
            f"{root}: no images found; expected an ImageFolder tree root/<label>/<image>.jpg, "
            "a Market-1501 folder, or a CSV manifest (path,label[,camera])"
        )
    return records


def _image_files_under(folder: Path) -> list[str]:
    """The image files below ``folder`` at any depth, in ``sorted(folder.rglob("*"))``'s
    order (path components compared one by one) and with its rules: symlinked folders are
    not entered, symlinked files are listed, an unreadable folder is passed over.

    One ``os.scandir`` per folder: a directory entry knows whether it is a file, so the
    regular files cost no ``stat`` and no ``Path`` until they are kept (``rglob`` + ``sorted``
    + ``is_file`` cost a noticeable share of ingesting a folder of small images).
    """
    found: list[tuple[tuple[str, ...], str]] = []
    pending: list[tuple[str, tuple[str, ...]]] = [(str(folder), ())]
    while pending:
        path, parts = pending.pop()
        try:
            with os.scandir(path) as listing:
                entries = list(listing)
        except PermissionError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                pending.append((entry.path, (*parts, entry.name)))
            elif (os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES
                  and entry.is_file()):
                found.append(((*parts, entry.name), entry.path))
    found.sort()
    return [path for _, path in found]


def list_csv_manifest(csv_path: str | Path) -> list[Record]:
    """A CSV with a header ``path,label[,camera]``; relative paths are relative to the file.

    Rows naming a missing file are skipped with a warning (a partial copy of a data set still
    ingests); a malformed header or camera value is an error naming the line.
    """
    csv_path = Path(csv_path)
    records: list[Record] = []
    missing = 0
    with csv_path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        fields = [f.strip() for f in reader.fieldnames or []]
        if "path" not in fields or "label" not in fields:
            raise DatasetError(
                f"{csv_path}: the header must name columns path,label[,camera]; found {fields}"
            )
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
            if not row.get("path") or not row.get("label"):
                raise DatasetError(f"{csv_path}:{line}: empty path or label")
            path = Path(row["path"])
            if not path.is_absolute():
                path = csv_path.parent / path
            if not path.is_file():
                missing += 1
                logger.warning("%s:%d: %s does not exist, skipped", csv_path, line, path)
                continue
            camera = None
            if row.get("camera"):
                try:
                    camera = int(row["camera"])
                except ValueError:
                    raise DatasetError(
                        f"{csv_path}:{line}: camera must be an integer, got {row['camera']!r}"
                    ) from None
            records.append(Record(path, row["label"], camera))
    if not records:
        raise DatasetError(f"{csv_path}: no rows point at existing image files")
    if missing:
        logger.warning("%s: %d rows skipped (file not found)", csv_path, missing)
    return records


def parse_market1501_name(name: str) -> tuple[int, int] | None:
    """``0002_c1s1_000451_03.jpg`` -> ``(2, 1)``; ``None`` for a name not in that form."""
    match = _MARKET_NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def list_market1501(folder: str | Path) -> list[Record]:
    """Market-1501 images of one split folder, or of every split below a data set root.

    Junk images (identity -1) are skipped, as the protocol ignores them; distractors (identity
    0000) are kept with label ``"0000"``, which no query shares, so they count as negatives.
    """
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    if not any(parse_market1501_name(p.name) for p in files):
        files = [
            p for split in MARKET_SPLITS if (folder / split).is_dir()
            for p in sorted((folder / split).iterdir()) if p.is_file()
        ]
    records, junk = [], 0
    for path in files:
        parsed = parse_market1501_name(path.name)
        if parsed is None:
            continue
        pid, camera = parsed
        if pid == -1:
            junk += 1
            continue
        records.append(Record(path, f"{pid:04d}", camera))
    if not records:
        raise DatasetError(f"{folder}: no Market-1501 images (names like 0002_c1s1_000451_03.jpg)")
    if junk:
        logger.info("%s: skipped %d junk images (identity -1)", folder, junk)
    return records


def _looks_like_market(folder: Path) -> bool:
    candidates = [folder, *(folder / s for s in MARKET_SPLITS if (folder / s).is_dir())]
    for candidate in candidates:
        names = [p.name for p in candidate.iterdir() if p.is_file()][:50]
        if names and sum(parse_market1501_name(n) is not None for n in names) > len(names) // 2:
            return True
    return False


def load_fashion_mnist(
    root: str | Path | None = None, split: str = "train"
) -> tuple[np.ndarray, np.ndarray]:
    """Read Fashion-MNIST's raw idx files (torchvision's format, gzipped or not).

    Args:
        root: the folder with ``train-images-idx3-ubyte[.gz]`` and friends; default
            ``/usr/share/datasets/fashion-mnist`` (Debian's ``dataset-fashion-mnist``), or a
            torchvision ``FashionMNIST/raw`` folder.
        split: ``train`` (60,000 images) or ``test`` (10,000).

    Returns:
        ``(images uint8 (n, 28, 28), labels int64 (n,))``.
    """
    if split not in ("train", "test"):
        raise DatasetError(f"Fashion-MNIST split must be train or test, not {split!r}")
    root = Path(root) if root is not None else FASHION_MNIST_DIR
    prefix = "train" if split == "train" else "t10k"
    images = _read_idx(_find_idx(root, f"{prefix}-images-idx3-ubyte"))
    labels = _read_idx(_find_idx(root, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    if images.ndim != 3 or len(images) != len(labels):
        raise DatasetError(f"{root}: Fashion-MNIST {split} images and labels do not match")
    return images, labels


def _find_idx(root: Path, stem: str) -> Path:
    for candidate in (root / stem, root / f"{stem}.gz", root / "raw" / stem,
                      root / "raw" / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DatasetError(
        f"{root}: Fashion-MNIST file {stem}[.gz] not found; install it with "
        "`apt-get install dataset-fashion-mnist` or pass the folder holding the idx files"
    )


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            data = handle.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError("bad idx magic number")
        shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
        array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
        return array.reshape(shape)
    except (OSError, ValueError, struct.error, EOFError) as exc:
        raise DatasetError(f"{path}: not a valid idx file ({exc})") from None
