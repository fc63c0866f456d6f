"""The decode step of a bulk ingest: encoded bytes -> the model's input, per image.

Shared by the forked workers (:mod:`imgret.gallery.ingest.workers`) and the Ray actors
(:mod:`imgret.gallery.ingest.ray`), and the same decoder as the served path, so an ingested image is
preprocessed exactly as a search of the same file.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from imgret.embedder import Embedder
from imgret.errors import ImageDecodeError
from imgret.gallery.media.files import sha256_hex
from imgret.images import decode_for_embedding


def decode_slice(blobs: Sequence[tuple[bytes | None, str, str | None]], embedder: Embedder,
                 max_pixels: int) -> tuple[np.ndarray, list[str | None]]:
    """Decode and preprocess encoded images: ``(k, 3, S, S)`` float32 inputs of those that
    worked, in order, and per image ``None`` or why it failed.

    Each blob is ``(bytes, sha256, None)``, or ``(None, sha256, why)`` for a file that could
    not be read; bytes that no longer hash to ``sha256`` (the file changed since it was
    hashed) fail.
    """
    size = embedder.spec.image_size
    inputs: list[np.ndarray] = []
    errors: list[str | None] = []
    for data, sha, read_error in blobs:
        if data is None:
            errors.append(read_error or "cannot read file")
            continue
        if sha256_hex(data) != sha:
            errors.append("the file changed while it was being ingested; run ingest again")
            continue
        # The served path's decoder (JPEG draft, shrink towards the model's input at once):
        # the same preprocessing as a search of the same file, and a slice of large photos
        # holds small images, not full-size ones.
        try:
            image = decode_for_embedding(data, size=size, max_pixels=max_pixels)
        except ImageDecodeError as exc:
            errors.append(str(exc))
            continue
        try:
            inputs.append(embedder.preprocess([image]).numpy())
        except Exception as exc:  # noqa: BLE001 - an odd image fails alone
            errors.append(f"cannot prepare the image for the model ({exc})")
            continue
        errors.append(None)
    if not inputs:
        return np.zeros((0, 3, size, size), dtype=np.float32), errors
    return np.concatenate(inputs), errors
