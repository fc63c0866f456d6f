"""Hostile or broken input: size limits, bombs, corrupt files. Always a 4xx, never a 500."""

from __future__ import annotations

import asyncio
import struct
import zlib

import pytest
from PIL import Image

from imgret.service.limits import UploadLimitMiddleware
from tests.api.conftest import add_gallery, png, search
from tests.support.images import class_image, image_bytes

LIMIT = 50_000


def _big_png(side: int) -> bytes:
    # Noise does not compress: the file is about 3 * side**2 bytes.
    import numpy as np

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (side, side, 3), dtype=np.uint8)
    return image_bytes(Image.fromarray(pixels, "RGB"))


def test_declared_oversize_body_is_413_and_the_server_stays_up(make_local_client) -> None:
    with make_local_client(max_upload_bytes=LIMIT) as client:
        big = _big_png(200)
        assert len(big) > LIMIT
        response = search(client, big)
        assert response.status_code == 413
        assert f"upload limit of {LIMIT} bytes" in response.json()["detail"]
        gallery = client.post("/gallery", files={"images": ("b.png", big, "image/png")},
                              data={"labels": "a"})
        assert gallery.status_code == 413
        # Still serving, and nothing was stored.
        assert search(client, png(0, 0)).status_code == 200
        assert client.get("/gallery").json()["count"] == 0


def test_chunked_oversize_body_is_413(make_local_client) -> None:
    with make_local_client(max_upload_bytes=LIMIT) as client:
        def chunks():  # no Content-Length: the body streams (Transfer-Encoding: chunked)
            for _ in range(20):
                yield b"x" * 10_000

        response = client.post(
            "/search", content=chunks(),
            headers={"content-type": "multipart/form-data; boundary=abc"},
        )
        assert response.status_code == 413
        assert client.get("/health").status_code == 200


def test_middleware_stops_reading_at_the_first_chunk_over_the_limit() -> None:
    """A lying Content-Length: the body is counted as it streams, the rest is never read."""
    sent: list[dict] = []
    reads = 0

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"y" * 400, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive_, send_) -> None:
        while True:  # an app that would read forever
            await receive_()

    middleware = UploadLimitMiddleware(app, max_bytes=1000)
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"10")]}
    asyncio.run(middleware(scope, receive, send))

    assert reads == 3  # 400, 800, 1200 > 1000: stop
    assert sent[0]["status"] == 413
    assert b"upload limit of 1000 bytes" in sent[1]["body"]


def test_decompression_bomb_is_413(make_local_client) -> None:
    with make_local_client(max_image_pixels=64 * 64) as client:
        add_gallery(client, classes=1, per_class=1)
        response = search(client, image_bytes(class_image(0, 0, size=65)))
        assert response.status_code == 413
        assert "IMGRET_MAX_IMAGE_PIXELS" in response.json()["detail"]
        assert search(client, image_bytes(class_image(0, 0, size=64))).status_code == 200


def test_real_bomb_header_is_refused_without_decoding(local_client) -> None:
    # A PNG that declares 50000 x 50000 RGB pixels (7.5 GB decoded) in a 60-byte file.
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    bomb = (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))
    response = search(local_client, bomb)
    assert response.status_code == 413
    assert "IMGRET_MAX_IMAGE_PIXELS" in response.json()["detail"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty file"),
        (b"hello, I am text", "not a recognised image format"),
        (png(0, 0)[:60], "corrupt or truncated"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 200, ""),
    ],
    ids=["empty", "text", "truncated", "corrupt-png"],
)
def test_broken_files_are_422_with_a_message(local_client, data, message) -> None:
    response = search(local_client, data)
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"]
    gallery = local_client.post("/gallery", files={"images": ("x.png", data, "image/png")},
                                data={"labels": "a"})
    assert gallery.status_code == 422
    assert local_client.get("/health").status_code == 200


def test_malformed_multipart_is_4xx(local_client) -> None:
    response = local_client.post(
        "/search", content=b"--abc\r\ngarbage",
        headers={"content-type": "multipart/form-data; boundary=abc"},
    )
    assert 400 <= response.status_code < 500


def test_no_endpoint_reads_a_client_chosen_path(local_client) -> None:
    """Traversal attempts reach no file: ids are integers, static files stay in their folder."""
    assert local_client.get("/gallery/..%2F..%2Fetc%2Fpasswd/image").status_code in (404, 422)
    assert local_client.get("/static/..%2F..%2Fpyproject.toml").status_code == 404
    assert local_client.get("/static/../app.py").status_code == 404
