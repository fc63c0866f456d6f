"""Only the six documented formats are decoded: any other format Pillow knows (XBM, PPM, ICO,
...) is refused like non-image data, by the decoder and through the API (422), and nothing is
stored."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from imgret.errors import ImageDecodeError
from imgret.images import DECODED_FORMATS, decode_image
from tests.api.conftest import png, search
from tests.support.images import class_image

REFUSED = ("XBM", "PPM", "ICO")
MESSAGE = "not a recognised image format (expected JPEG, PNG, WebP, GIF, BMP or TIFF)"


def _encoded(fmt: str) -> bytes:
    image = class_image(1, 0, size=32)
    if fmt == "XBM":
        image = image.convert("1")  # XBM holds bitmaps only
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", REFUSED)
def test_a_format_pillow_knows_but_not_documented_is_refused(fmt: str) -> None:
    data = _encoded(fmt)
    assert Image.open(io.BytesIO(data)).format == fmt  # Pillow itself would decode it
    with pytest.raises(ImageDecodeError, match="not a recognised image format"):
        decode_image(data)


@pytest.mark.parametrize("fmt", DECODED_FORMATS)
def test_the_six_documented_formats_decode(fmt: str) -> None:
    assert decode_image(_encoded(fmt)).size == (32, 32)


@pytest.mark.parametrize("fmt", REFUSED)
def test_the_api_answers_422_and_stores_nothing(local_client, fmt: str) -> None:
    data = _encoded(fmt)
    added = local_client.post("/gallery", files={"images": (f"x.{fmt.lower()}", data,
                                                            "image/png")},
                              data={"labels": "a"})
    assert added.status_code == 422, added.text
    assert MESSAGE in added.text
    found = search(local_client, data)
    assert found.status_code == 422, found.text
    assert MESSAGE in found.text
    assert local_client.get("/gallery").json()["count"] == 0
    # The same service still takes a documented format.
    assert search(local_client, png(0, 0)).status_code == 200
