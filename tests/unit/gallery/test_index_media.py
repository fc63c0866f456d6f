"""The content-addressed media store."""

from __future__ import annotations

import pytest

from imgret.gallery.media.files import MediaStore, sha256_hex, sniff_content_type
from tests.support.images import class_image, image_bytes


def test_put_is_content_addressed_with_fan_out_and_stored_once(tmp_path):
    media = MediaStore.in_data_dir(tmp_path)
    data = image_bytes(class_image(1, 0))
    key = sha256_hex(data)
    path = media.put(data)
    assert path == f"{key[:2]}/{key[2:4]}/{key}"
    assert media.read(path) == data
    assert media.put(data, key) == path  # a duplicate is a no-op
    files = [p for p in media.root.rglob("*") if p.is_file()]
    assert files == [media.path(key)]  # no temporary file left behind


def test_sniffed_content_types():
    png = image_bytes(class_image(1, 0))
    jpeg = image_bytes(class_image(1, 0), "JPEG")
    webp = image_bytes(class_image(1, 0), "WEBP")
    assert sniff_content_type(png) == "image/png"
    assert sniff_content_type(jpeg) == "image/jpeg"
    assert sniff_content_type(webp) == "image/webp"
    assert sniff_content_type(b"hello") == "application/octet-stream"


def test_paths_outside_the_store_are_refused(tmp_path):
    media = MediaStore(tmp_path / "media")
    with pytest.raises(ValueError):
        media.resolve("../../etc/passwd")
    with pytest.raises(ValueError):
        media.relative_path("not-a-hash")
