"""The bad-input corpus: hostile-but-ordinary requests against a real server.

One ``imgret serve`` per backend (SQLite, then PostgreSQL), with an API key, a small gallery
and tight limits. Then, from a table:

* every **bad** request (broken and lying images, bombs by pixels and by ratio, missing,
  duplicated and mismatched fields, every parameter out of range and of the wrong type,
  hostile JSON, NUL and control characters, huge strings, unknown ids, wrong content types,
  bad keys, cross-origin writes, malformed HTTP bodies) gets the 4xx of its row with a JSON
  ``detail`` message, and afterwards the gallery (``GET /gallery``, ``/health``'s index size
  and the media files on disk) is exactly as before and the server still answers;
* every **odd-but-valid** request gets its 2xx.

Failures are collected and reported together (one line per row). ``pytest -s`` prints the
counts per backend.
"""

from __future__ import annotations

import io
import json
import socket
import struct
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

KEY = "corpus-key"
AUTH = {"X-API-Key": KEY}
MAX_UPLOAD = 2_000_000
MAX_IMAGE_PIXELS = 4_000_000
MAX_REQUEST_PIXELS = 10_000_000  # the server's per-request budget (IMGRET_MAX_REQUEST_PIXELS)
SEED_LABELS = ["cat", "dog", "bird"]
PER_LABEL = 3


# --------------------------------------------------------------------------- images


def _png(label: int, index: int, size: int = 32) -> bytes:
    return image_bytes(class_image(label, index, size=size))


def _encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_declaring(width: int, height: int, idat: bytes = b"\x00" * 64) -> bytes:
    """A PNG header that declares ``width x height`` RGB pixels, with a token IDAT."""
    return (b"\x89PNG\r\n\x1a\n"
            + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(idat)) + _png_chunk(b"IEND", b""))


def _flat_png(width: int, height: int, value: int = 0) -> bytes:
    """A real, complete PNG of one colour: kilobytes that decode to width*height pixels."""
    return _encode(Image.new("L", (width, height), value), "PNG", optimize=True)


QUERY = _png(0, 0)
JPEG = _encode(class_image(1, 7), "JPEG", quality=90)
TRUNCATED = _png(0, 1)[:60]
CORRUPT_PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 200
LYING_JPEG = b"\xff\xd8\xff\xe0" + b"garbage, not a JPEG stream" * 20
PIXEL_BOMB = _png_declaring(50_000, 50_000)  # 7.5 GB of pixels declared in ~70 bytes
# Over the per-image limit for real (all pixels present), yet only a few kilobytes.
OVER_IMAGE_LIMIT = _flat_png(2100, 2000)
# Ratio bomb: each image is within the per-image limit and about 4 KB, but three of them
# decode to 11.3 M pixels, over the per-request budget.
RATIO_BOMB = [_flat_png(1940, 1940, value) for value in (1, 2, 3)]


def _noise_png(side: int) -> bytes:
    rng = np.random.default_rng(0)
    return image_bytes(Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)))


# --------------------------------------------------------------------------- requests


def _file(name: str, data: bytes, content_type: str = "image/png") -> tuple:
    return (name, data, content_type)


def _search(image: bytes = QUERY, **data: Any) -> dict:
    return {"files": [("image", _file("q.png", image))], "data": data}


def _batch(images: list[bytes], **data: Any) -> dict:
    return {"files": [("images", _file(f"{i}.png", b)) for i, b in enumerate(images)],
            "data": data}


def _add(images: list[bytes] | None = None, labels: Any = ("new",), *, headers: Any = AUTH,
         **data: Any) -> dict:
    images = [_png(5, 0)] if images is None else images
    return {"files": [("images", _file(f"{i}.png", b)) for i, b in enumerate(images)],
            "data": {"labels": list(labels), **data}, "headers": headers}


def _multipart(parts: list[tuple[bytes, bytes | None, bytes]], *, charset: str = "",
               headers: dict | None = None) -> dict:
    """A multipart body written by hand: (field name, file name or None, content)."""
    body = b""
    for name, filename, content in parts:
        disposition = b'form-data; name="' + name + b'"'
        if filename is not None:
            disposition += b'; filename="' + filename + b'"'
        body += b"--B\r\nContent-Disposition: " + disposition + b"\r\n"
        if filename is not None:
            body += b"Content-Type: image/png\r\n"
        body += b"\r\n" + content + b"\r\n"
    body += b"--B--\r\n"
    content_type = "multipart/form-data; boundary=B" + (f"; charset={charset}" if charset else "")
    return {"content": body, "headers": {"content-type": content_type, **(headers or AUTH)}}


def _evaluate_upload(labels: list[str] | None = None, images: list[bytes] | None = None,
                     headers: Any = AUTH, **data: Any) -> dict:
    images = images or [_png(0, 9), _png(1, 9)]
    labels = labels if labels is not None else ["cat", "dog"]
    return {"files": [("images", _file(f"{i}.png", b)) for i, b in enumerate(images)],
            "data": {"labels": labels, **data}, "headers": headers}


def _evaluate_json(body: Any, headers: dict | None = None) -> dict:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return {"content": content,
            "headers": {"content-type": "application/json", **(headers or AUTH)}}


def _chunked_upload():
    """A streamed (chunked) multipart body of 3 MB: no Content-Length to refuse up front."""
    yield (b'--B\r\nContent-Disposition: form-data; name="images"; filename="a.png"\r\n'
           b"Content-Type: image/png\r\n\r\n")
    for _ in range(30):
        yield b"x" * 100_000


def _deep(levels: int) -> str:
    return '{"a": ' + "[" * levels + "]" * levels + "}"


@dataclass(frozen=True)
class Case:
    """One request of the corpus and the status it must get."""

    kind: str
    method: str
    path: str
    kwargs: dict = field(default_factory=dict)
    status: int | tuple[int, ...] = 422
    raw: bytes | None = None  # sent as is over a socket (HTTP httpx would not write)

    def accepts(self, status: int) -> bool:
        return status in (self.status if isinstance(self.status, tuple) else (self.status,))


def _raw(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n" + body


BAD: list[Case] = [
    # --- broken and lying images
    Case("search: empty file", "POST", "/search", _search(b"")),
    Case("search: text file", "POST", "/search", _search(b"hello, I am text")),
    Case("search: truncated PNG", "POST", "/search", _search(TRUNCATED)),
    Case("search: PNG signature then zeros", "POST", "/search", _search(CORRUPT_PNG)),
    Case("search: JPEG magic then garbage", "POST", "/search", _search(LYING_JPEG)),
    Case("search: HTML named .png", "POST", "/search",
         _search(b"<html><script>alert(1)</script></html>")),
    Case("gallery: corrupt image", "POST", "/gallery", _add([CORRUPT_PNG])),
    Case("gallery: one bad image among good", "POST", "/gallery",
         _add([_png(5, 1), TRUNCATED], labels=["x", "y"])),
    Case("batch: one bad image among good", "POST", "/search/batch",
         _batch([QUERY, LYING_JPEG])),
    Case("evaluate: corrupt image", "POST", "/evaluate", _evaluate_upload(
        images=[CORRUPT_PNG, QUERY])),
    # --- bombs
    Case("search: pixel bomb header (50000x50000)", "POST", "/search", _search(PIXEL_BOMB), 413),
    Case("gallery: pixel bomb header", "POST", "/gallery", _add([PIXEL_BOMB]), 413),
    Case("search: real image over the pixel limit", "POST", "/search",
         _search(OVER_IMAGE_LIMIT), 413),
    Case("evaluate: pixel bomb among queries", "POST", "/evaluate",
         _evaluate_upload(images=[QUERY, PIXEL_BOMB]), 413),
    Case("gallery: ratio bomb (3 x 4 KB files, 11 M pixels)", "POST", "/gallery",
         _add(RATIO_BOMB, labels=["a", "b", "c"]), 413),
    Case("batch: ratio bomb (3 x 4 KB files, 11 M pixels)", "POST", "/search/batch",
         _batch(RATIO_BOMB), 413),
    Case("evaluate: ratio bomb (3 x 4 KB files, 11 M pixels)", "POST", "/evaluate",
         _evaluate_upload(labels=["a", "b", "c"], images=RATIO_BOMB), 413),
    # --- wrong, missing, duplicated fields
    Case("gallery: no images", "POST", "/gallery", {"data": {"labels": "a"}, "headers": AUTH}),
    Case("gallery: no labels", "POST", "/gallery",
         {"files": [("images", _file("a.png", _png(5, 2)))], "headers": AUTH}),
    Case("gallery: 2 images, 1 label", "POST", "/gallery",
         _add([_png(5, 3), _png(5, 4)], labels=["a"])),
    Case("gallery: 1 image, 2 labels", "POST", "/gallery", _add(labels=["a", "b"])),
    Case("gallery: cameras do not line up", "POST", "/gallery", _add(cameras=["1", "2"])),
    Case("gallery: 3 metadata for 2 images", "POST", "/gallery",
         _add([_png(5, 3), _png(5, 4)], labels=["a", "b"], metadata=["{}", "{}", "{}"])),
    Case("gallery: images sent as a text field", "POST", "/gallery",
         {"data": {"images": "not a file", "labels": "a"}, "headers": AUTH}),
    Case("search: two images", "POST", "/search",
         {"files": [("image", _file("a.png", QUERY)), ("image", _file("b.png", QUERY))]}),
    Case("search: no image", "POST", "/search", {"data": {"k": "3"}}),
    Case("search: image as a text field", "POST", "/search", {"data": {"image": "abc"}}),
    Case("search: k in form and query disagree", "POST", "/search?k=3", _search(k="4")),
    Case("search: k sent twice", "POST", "/search", _search(k=["3", "5"])),
    Case("search: metadata filter sent twice", "POST", "/search",
         _search(metadata=['{"a": 1}', '{"b": 2}'])),
    Case("batch: label filter sent twice", "POST", "/search/batch",
         _batch([QUERY], label=["a", "b"])),
    Case("gallery: misspelt field (camera for cameras)", "POST", "/gallery", _add(camera="1")),
    Case("search: unknown field", "POST", "/search", _search(top_k="3")),
    Case("gallery: 1001 fields", "POST", "/gallery", _add(labels=["a"] * 1001), 400),
    Case("batch: no images", "POST", "/search/batch", {"data": {"k": "2"}}),
    Case("evaluate: no images", "POST", "/evaluate", _multipart([(b"labels", None, b"a")])),
    Case("evaluate: url-encoded form", "POST", "/evaluate",
         {"data": {"labels": "a"}, "headers": AUTH}, 415),
    Case("evaluate: labels do not line up", "POST", "/evaluate",
         _evaluate_upload(labels=["cat"])),
    Case("evaluate: unknown field", "POST", "/evaluate", _evaluate_upload(colour="red")),
    Case("evaluate: JSON with an unknown field", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "colour": "red"})),
    Case("evaluate: JSON without query_set", "POST", "/evaluate", _evaluate_json({"k": [1]})),
    # --- every parameter out of range or of the wrong type
    Case("search: k=0", "POST", "/search", _search(k="0")),
    Case("search: k=1001", "POST", "/search", _search(k="1001")),
    Case("search: k=-5 in the query", "POST", "/search?k=-5", _search()),
    Case("search: k not a number", "POST", "/search", _search(k="ten")),
    Case("search: k=2**70", "POST", "/search", _search(k=str(2**70))),
    Case("search: k=1.5", "POST", "/search", _search(k="1.5")),
    Case("search: camera=2**40", "POST", "/search", _search(camera=str(2**40))),
    Case("search: camera not a number", "POST", "/search", _search(camera="front")),
    Case("gallery: camera=2**31", "POST", "/gallery", _add(cameras=[str(2**31)])),
    Case("gallery: camera=-1", "POST", "/gallery", _add(cameras=["-1"])),
    Case("gallery: camera=2**70", "POST", "/gallery", _add(cameras=[str(2**70)])),
    Case("gallery: camera=1.5", "POST", "/gallery", _add(cameras=["1.5"])),
    Case("gallery: camera empty", "POST", "/gallery", _add(cameras=[""])),
    Case("list: offset=-1", "GET", "/gallery?offset=-1"),
    Case("list: offset=2**40", "GET", f"/gallery?offset={2**40}"),
    Case("list: offset not a number", "GET", "/gallery?offset=abc"),
    Case("list: limit=0", "GET", "/gallery?limit=0"),
    Case("list: limit=1001", "GET", "/gallery?limit=1001"),
    Case("list: limit=1.5", "GET", "/gallery?limit=1.5"),
    Case("list: limit=2**64", "GET", f"/gallery?limit={2**64}"),
    Case("item: id=0", "GET", "/gallery/0"),
    Case("item: id=-1", "GET", "/gallery/-1"),
    Case("item: id not a number", "GET", "/gallery/abc"),
    Case("item: id=2**64", "GET", f"/gallery/{2**64}"),
    Case("image: id=2**63", "GET", f"/gallery/{2**63}/image"),
    Case("delete: id=2**63", "DELETE", f"/gallery/{2**63}", {"headers": AUTH}),
    Case("delete: id not a number", "DELETE", "/gallery/1e3", {"headers": AUTH}),
    Case("evaluate: k=0", "POST", "/evaluate", _evaluate_upload(k="0")),
    Case("evaluate: k=1001", "POST", "/evaluate", _evaluate_upload(k="1,1001")),
    Case("evaluate: k not a number", "POST", "/evaluate", _evaluate_upload(k="one")),
    Case("evaluate: worst=-1", "POST", "/evaluate", _evaluate_upload(worst="-1")),
    Case("evaluate: worst=101", "POST", "/evaluate", _evaluate_upload(worst="101")),
    Case("evaluate: exclude_same_camera=maybe", "POST", "/evaluate",
         _evaluate_upload(exclude_same_camera="maybe")),
    Case("evaluate: camera not a number", "POST", "/evaluate", _evaluate_upload(
        cameras=["a", "b"])),
    Case("evaluate: camera=2**70", "POST", "/evaluate", _evaluate_upload(
        cameras=[str(2**70), "1"])),
    Case("evaluate: JSON k=[0]", "POST", "/evaluate", _evaluate_json({"query_set": "q",
                                                                     "k": [0]})),
    Case("evaluate: JSON k=[1e400]", "POST", "/evaluate",
         _evaluate_json(b'{"query_set": "q", "k": [1e400]}')),
    Case("evaluate: JSON k=[2**70]", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "k": [2**70]})),
    Case("evaluate: JSON worst=101", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "worst": 101})),
    Case("evaluate: JSON worst is a string", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "worst": "many"})),
    Case("evaluate: JSON exclude_same_camera=[]", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "exclude_same_camera": []})),
    # --- hostile JSON (form fields and bodies)
    Case("gallery: metadata not JSON", "POST", "/gallery", _add(metadata="{'a': 1}")),
    Case("gallery: metadata is an array", "POST", "/gallery", _add(metadata="[1, 2]")),
    Case("gallery: metadata NaN", "POST", "/gallery", _add(metadata='{"a": NaN}')),
    Case("gallery: metadata -Infinity", "POST", "/gallery", _add(metadata='{"a": -Infinity}')),
    Case("gallery: metadata 1e400", "POST", "/gallery", _add(metadata='{"a": 1e400}')),
    Case("gallery: metadata 2**65", "POST", "/gallery", _add(metadata=f'{{"a": {2**65}}}')),
    Case("gallery: metadata 5000-digit integer", "POST", "/gallery",
         _add(metadata='{"a": ' + "7" * 5000 + "}")),
    Case("gallery: metadata nested 5000 deep", "POST", "/gallery", _add(metadata=_deep(5000))),
    Case("gallery: metadata 20 KB", "POST", "/gallery",
         _add(metadata='{"a": "' + "x" * 20_000 + '"}')),
    Case("gallery: metadata empty key", "POST", "/gallery", _add(metadata='{"": 1}')),
    Case("search: metadata filter NaN", "POST", "/search", _search(metadata='{"a": NaN}')),
    Case("search: metadata filter nested 5000 deep", "POST", "/search",
         _search(metadata=_deep(5000))),
    Case("search: metadata filter not JSON", "POST", "/search", _search(metadata="{")),
    Case("search: metadata filter is a string", "POST", "/search", _search(metadata='"red"')),
    Case("evaluate: JSON body not JSON", "POST", "/evaluate", _evaluate_json(b"{query_set")),
    Case("evaluate: JSON body is an array", "POST", "/evaluate", _evaluate_json([1, 2])),
    Case("evaluate: JSON body nested 5000 deep", "POST", "/evaluate",
         _evaluate_json(b'{"query_set": ' + b"[" * 5000 + b"]" * 5000 + b"}")),
    Case("evaluate: JSON body NaN", "POST", "/evaluate",
         _evaluate_json(b'{"query_set": "q", "worst": NaN}')),
    # --- NUL and other control characters
    Case("gallery: NUL in label", "POST", "/gallery", _add(labels=["a\x00b"])),
    Case("gallery: ESC in label", "POST", "/gallery", _add(labels=["\x1b[2Jred"])),
    Case("gallery: newline in label", "POST", "/gallery", _add(labels=["a\nb"])),
    Case("gallery: DEL in label", "POST", "/gallery", _add(labels=["a\x7f"])),
    Case("gallery: lone surrogate label (charset=utf-7)", "POST", "/gallery", _multipart(
        [(b"images", b"a.png", _png(5, 5)), (b"labels", None, b"+2AA-")], charset="utf-7")),
    Case("gallery: NUL in file name", "POST", "/gallery", _multipart(
        [(b"images", b"a\x00.png", _png(5, 5)), (b"labels", None, b"a")])),
    Case("gallery: NUL in a metadata value", "POST", "/gallery",
         _add(metadata='{"a": "x\\u0000y"}')),
    Case("gallery: NUL in a metadata key", "POST", "/gallery", _add(metadata='{"a\\u0000": 1}')),
    Case("gallery: lone surrogate in metadata", "POST", "/gallery",
         _add(metadata='{"a": "\\udc00"}')),
    Case("gallery: bell in a metadata key", "POST", "/gallery", _add(metadata='{"a\\u0007": 1}')),
    Case("list: NUL in label", "GET", "/gallery?label=a%00b"),
    Case("list: ESC in label", "GET", "/gallery?label=%1B%5B31m"),
    Case("search: NUL in label filter", "POST", "/search", _search(label="x\x00")),
    Case("search: NUL in metadata filter", "POST", "/search",
         _search(metadata='{"a": "\\u0000"}')),
    Case("evaluate: NUL in query-set name", "POST", "/evaluate",
         _evaluate_json({"query_set": "q\x00"})),
    Case("evaluate: NUL in model version", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "model_version": "v\x00"})),
    Case("evaluate: lone surrogate in query-set name", "POST", "/evaluate",
         _evaluate_json(b'{"query_set": "\\ud800"}')),
    Case("evaluate: NUL in an uploaded label", "POST", "/evaluate",
         _evaluate_upload(labels=["cat\x00", "dog"])),
    # --- huge strings
    Case("gallery: label of 256 characters", "POST", "/gallery", _add(labels=["x" * 256])),
    Case("gallery: label of 1 MB", "POST", "/gallery", _add(labels=["x" * 1_000_000])),
    Case("gallery: empty label", "POST", "/gallery", _add(labels=[""])),
    Case("gallery: blank label", "POST", "/gallery", _add(labels=["   "])),
    Case("list: label of 256 characters", "GET", "/gallery?label=" + "x" * 256),
    Case("search: label filter of 100 KB", "POST", "/search", _search(label="y" * 100_000)),
    Case("evaluate: query-set name of 256 characters", "POST", "/evaluate",
         _evaluate_json({"query_set": "q" * 256})),
    Case("evaluate: model version of 10 KB", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "model_version": "v" * 10_000})),
    Case("evaluate: empty query-set name", "POST", "/evaluate",
         _evaluate_json({"query_set": ""})),
    # --- sizes of bodies
    Case("search: declared body over the upload limit", "POST", "/search",
         _search(_noise_png(900)), 413),
    Case("gallery: chunked body over the upload limit", "POST", "/gallery",
         {"content": _chunked_upload,
          "headers": {"content-type": "multipart/form-data; boundary=B", **AUTH}}, 413),
    Case("search: Content-Length says 10 GB", "POST", "/search",
         raw=_raw("POST /search HTTP/1.1\nHost: x\nContent-Type: multipart/form-data; "
                  "boundary=B\nContent-Length: 10000000000\nConnection: close\n", b"--B"),
         status=413),
    # --- unknown ids and names
    Case("item: unknown id", "GET", "/gallery/987654321", status=404),
    Case("image: unknown id", "GET", "/gallery/987654321/image", status=404),
    Case("delete: unknown id", "DELETE", "/gallery/987654321", {"headers": AUTH}, 404),
    Case("evaluate: unknown query set", "POST", "/evaluate",
         _evaluate_json({"query_set": "no-such-set"}), 404),
    Case("evaluate: unknown model version", "POST", "/evaluate",
         _evaluate_json({"query_set": "q", "model_version": "nope"}), 404),
    Case("unknown path", "GET", "/no-such-route", status=404),
    # --- collections and keys
    Case("collections: upper-case name", "POST", "/collections", _evaluate_json({"name": "Shop"})),
    Case("collections: reserved name", "POST", "/collections", _evaluate_json({"name": "all"})),
    Case("collections: control character", "POST", "/collections",
         _evaluate_json({"name": "a\u0007b"})),
    Case("collections: unknown version", "POST", "/collections",
         _evaluate_json({"name": "ok", "model_version": "nope"})),
    Case("collections: unknown one", "GET", "/collections/no-such/gallery", {"headers": AUTH},
         404),
    Case("collections: bad name in a path", "GET", "/collections/%2E%2E/gallery",
         {"headers": AUTH}),
    Case("collections: default cannot go", "DELETE", "/collections/default", {"headers": AUTH}),
    Case("keys: a role on no collection", "POST", "/keys",
         _evaluate_json({"name": "k", "roles": {"nowhere": "read"}})),
    Case("keys: an unknown role", "POST", "/keys",
         _evaluate_json({"name": "k", "roles": {"default": "owner"}})),
    Case("keys: revoke an unknown key", "DELETE", "/keys/424242", {"headers": AUTH}, 404),
    Case("keys: revoke id 0", "DELETE", "/keys/0", {"headers": AUTH}),
    Case("keys: revoke an id past 64 bits", "DELETE", "/keys/99999999999999999999",
         {"headers": AUTH}),
    Case("keys: revoke a negative id", "DELETE", "/keys/-1", {"headers": AUTH}),
    # Stored-key lookalikes: refused like any wrong key, whatever id they name.
    Case("search: a made-up stored-key id", "POST", "/search",
         {**_search(), "headers": {"X-API-Key": "imgret_424242_" + "A" * 43}}, 401),
    Case("search: a stored-key id with leading zeros", "POST", "/search",
         {**_search(), "headers": {"X-API-Key": "imgret_01_" + "A" * 43}}, 401),
    Case("search: a stored-key id of 11 digits", "POST", "/search",
         {**_search(), "headers": {"X-API-Key": "imgret_99999999999_" + "A" * 43}}, 401),
    Case("search: a stored-key secret one short", "POST", "/search",
         {**_search(), "headers": {"X-API-Key": "imgret_1_" + "A" * 42}}, 401),
    Case("search: a key with Latin-1 bytes", "POST", "/search",
         {**_search(), "headers": {"X-API-Key": "imgret_1_\xe9".encode("latin-1")}}, 401),
    Case("search: an 8 kB key", "POST", "/search",
         {**_search(), "headers": {"X-API-Key": "imgret_1_" + "A" * 8000}}, 401),
    Case("gallery list: a made-up key on a public read", "GET", "/gallery",
         {"headers": {"X-API-Key": "imgret_7_" + "B" * 43}}, 401),
    Case("metrics: a made-up key", "GET", "/metrics",
         {"headers": {"X-API-Key": "imgret_7_" + "B" * 43}}, 401),
    # Anonymous callers do not learn which admin paths exist.
    Case("unknown admin path, no key", "GET", "/admin", status=401),
    Case("static: path traversal", "GET", "/static/..%2F..%2Fpyproject.toml", status=404),
    # --- wrong content types and methods
    Case("gallery: JSON body", "POST", "/gallery",
         {"json": {"labels": ["a"]}, "headers": AUTH}),
    Case("gallery: url-encoded form", "POST", "/gallery",
         {"data": {"labels": "a", "images": "x"}, "headers": AUTH}),
    Case("gallery: text/plain body", "POST", "/gallery",
         {"content": b"labels=a", "headers": {"content-type": "text/plain", **AUTH}}),
    Case("search: JSON body", "POST", "/search", {"json": {"image": "aGVsbG8="}}),
    Case("search: multipart without a boundary", "POST", "/search",
         {"content": b"--B\r\n", "headers": {"content-type": "multipart/form-data"}}, 400),
    Case("search: malformed multipart", "POST", "/search",
         {"content": b"--B\r\ngarbage without headers",
          "headers": {"content-type": "multipart/form-data; boundary=B"}}, (400, 422)),
    Case("evaluate: text/plain body", "POST", "/evaluate",
         {"content": b"query_set=q", "headers": {"content-type": "text/plain", **AUTH}}, 415),
    Case("evaluate: no content type", "POST", "/evaluate",
         {"content": b"{}", "headers": AUTH}, 415),
    Case("PUT /gallery", "PUT", "/gallery", {"headers": AUTH}, 405),
    Case("GET /search", "GET", "/search", status=405),
    Case("PATCH /gallery/1", "PATCH", "/gallery/1", {"headers": AUTH}, 405),
    # --- keys and origins
    Case("gallery: no key", "POST", "/gallery", _add(headers={}), 401),
    Case("gallery: wrong key", "POST", "/gallery", _add(headers={"X-API-Key": "guess"}), 401),
    Case("gallery: key with another case", "POST", "/gallery",
         _add(headers={"X-API-Key": KEY.upper()}), 401),
    Case("gallery: wrong key then the right one", "POST", "/gallery",
         _add(headers=[("X-API-Key", "guess"), ("X-API-Key", KEY)]), 401),
    Case("gallery: wrong key, malformed 1 MB body", "POST", "/gallery",
         {"content": b"--B\r\n" + b"\x00" * 1_000_000,
          "headers": {"content-type": "multipart/form-data; boundary=B", "X-API-Key": "no"}},
         401),
    Case("delete: no key", "DELETE", "/gallery/1", status=401),
    Case("evaluate: no key", "POST", "/evaluate", _evaluate_upload(headers={}), 401),
    Case("gallery: cross-origin browser write", "POST", "/gallery",
         _add(headers={**AUTH, "Origin": "https://evil.example"}), 403),
    Case("gallery: Origin null", "POST", "/gallery", _add(headers={**AUTH, "Origin": "null"}),
         403),
    Case("delete: cross-origin", "DELETE", "/gallery/1",
         {"headers": {**AUTH, "Origin": "http://attacker.test:8080"}}, 403),
    Case("evaluate: cross-origin", "POST", "/evaluate",
         _evaluate_upload(headers={**AUTH, "Origin": "https://evil.example"}), 403),
]

# The per-request pixel budget: these rows run on their own, after the gallery
# comparison (an accepted bomb would change the gallery), and must all be refused.
RATIO_BOMBS = [case for case in BAD if "ratio bomb" in case.kind]


def _valid(seeded: dict[str, Any]) -> list[Case]:
    """Odd but valid requests (some write: they run after the gallery comparison)."""
    first = seeded["ids"][0]
    return [
        Case("search: JPEG sent as image/png named .gif", "POST", "/search",
             {"files": [("image", ("q.gif", JPEG, "image/png"))]}, 200),
        Case("search: grayscale PNG", "POST", "/search",
             _search(_encode(Image.new("L", (40, 30), 128), "PNG")), 200),
        Case("search: RGBA PNG", "POST", "/search",
             _search(_encode(Image.new("RGBA", (33, 33), (1, 2, 3, 0)), "PNG")), 200),
        Case("search: palette GIF", "POST", "/search",
             _search(_encode(class_image(2, 2).convert("P"), "GIF")), 200),
        Case("search: 1x1 image", "POST", "/search", _search(_flat_png(1, 1)), 200),
        Case("search: 1x2000 strip", "POST", "/search", _search(_flat_png(1, 2000)), 200),
        Case("search: CMYK JPEG", "POST", "/search",
             _search(_encode(class_image(2, 3).convert("CMYK"), "JPEG")), 200),
        Case("search: WebP", "POST", "/search", _search(_encode(class_image(1, 3), "WEBP")), 200),
        Case("search: image exactly at the pixel limit", "POST", "/search",
             _search(_flat_png(2000, 2000)), 200),
        Case("search: k=1000 (more than the gallery)", "POST", "/search", _search(k="1000"), 200),
        Case("search: k=1", "POST", "/search?k=1", _search(k="1"), 200),
        Case("search: unicode label filter", "POST", "/search", _search(label="猫 🐈"), 200),
        Case("search: camera filter 2**31-1", "POST", "/search",
             _search(camera=str(2**31 - 1)), 200),
        Case("search: metadata filter {}", "POST", "/search", _search(metadata="{}"), 200),
        Case("search: metadata filter, nested", "POST", "/search",
             _search(metadata='{"a": {"b": [1, 2.5, null, true]}}'), 200),
        Case("search: cross-origin (a read)", "POST", "/search",
             {**_search(), "headers": {"Origin": "https://elsewhere.example"}}, 200),
        Case("batch: one image", "POST", "/search/batch", _batch([QUERY]), 200),
        Case("batch: duplicates", "POST", "/search/batch", _batch([QUERY, QUERY, JPEG]), 200),
        Case("list: last possible offset", "GET", f"/gallery?offset={2**31}", status=200),
        Case("list: limit=1000", "GET", "/gallery?limit=1000", status=200),
        Case("list: empty label", "GET", "/gallery?label=", status=200),
        Case("list: label of 255 characters", "GET", "/gallery?label=" + "é" * 255, status=200),
        Case("list: unknown parameter", "GET", "/gallery?colour=red", status=200),
        Case("item: first item", "GET", f"/gallery/{first}", status=200),
        Case("image: first item", "GET", f"/gallery/{first}/image", status=200),
        Case("evaluate: upload", "POST", "/evaluate",
             _evaluate_upload(k="1,2", worst="1", cameras=["1", "2"],
                              exclude_same_camera="true"), 200),
        Case("evaluate: upload, k repeated", "POST", "/evaluate",
             _evaluate_upload(k=["1", "3"]), 200),
        Case("gallery: bytes already stored (no change)", "POST", "/gallery",
             _add([_png(0, 0)], labels=["other label"]), 201),
        Case("gallery: same-origin browser write", "POST", "/gallery",
             _add([_png(0, 1)], labels=["cat"], headers={**AUTH, "Origin": seeded["origin"]}),
             201),
        Case("gallery: odd but valid values", "POST", "/gallery",
             _add([_png(6, 0)], labels=["étiquette 名前 🙂 " + "x" * 200],
                  cameras=[str(2**31 - 1)],
                  metadata='{"note": "line 1\\nline 2\\ttab", "n": -9223372036854775808, '
                           '"x": 1.5e300, "deep": [[[[[[1]]]]]], "emoji": "🙂"}'), 201),
        Case("health", "GET", "/health", status=200),
        Case("metrics", "GET", "/metrics", status=200),
        Case("openapi", "GET", "/openapi.json", status=200),
        Case("web page", "GET", "/", status=200),
    ]


# --------------------------------------------------------------------------- running


def _send(client: httpx.Client, base: str, case: Case) -> httpx.Response:
    if case.raw is not None:
        return _send_raw(base, case.raw)
    kwargs = case.kwargs
    if callable(kwargs.get("content")):  # a generator function: a fresh stream each time
        kwargs = {**kwargs, "content": kwargs["content"]()}
    return client.request(case.method, base + case.path, **kwargs)


def _send_raw(base: str, data: bytes) -> httpx.Response:
    """Write bytes to the server as is; parse the status line and the JSON body."""
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = [tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:] if b": " in line]
    return httpx.Response(status, headers=headers, content=body)


def _detail(response: httpx.Response) -> Any:
    try:
        return response.json().get("detail")
    except (ValueError, AttributeError):
        return None


def _snapshot(client: httpx.Client, base: str, media: Path) -> tuple:
    listing = client.get(f"{base}/gallery", params={"limit": 1000}).json()
    size = client.get(f"{base}/health").json()["index_size"]
    files = sorted(str(p.relative_to(media)) for p in media.rglob("*") if p.is_file())
    return listing, size, files


def _seed(client: httpx.Client, base: str) -> list[int]:
    images, labels, cameras = [], [], []
    for c, label in enumerate(SEED_LABELS):
        for i in range(PER_LABEL):
            images.append(("images", _file(f"{label}{i}.png", _png(c, i))))
            labels.append(label)
            cameras.append(str(1 + i % 2))
    response = client.post(f"{base}/gallery", files=images, headers=AUTH,
                           data={"labels": labels, "cameras": cameras,
                                 "metadata": '{"a": {"b": [1, 2.5, null, true]}}'})
    assert response.status_code == 201, response.text
    return response.json()["ids"]


def _run(client: httpx.Client, base: str, cases: list[Case],
         check: Callable[[Case, httpx.Response], str | None]) -> list[str]:
    failures = []
    for case in cases:
        try:
            response = _send(client, base, case)
        except httpx.HTTPError as exc:
            failures.append(f"{case.kind}: no answer ({type(exc).__name__}: {exc})")
            continue
        problem = check(case, response)
        if problem:
            failures.append(f"{case.kind}: {problem}")
    return failures


def _changes(before: tuple, after: tuple, by: str) -> list[str]:
    return [f"{what} changed by {by}: {old!r:.300} -> {new!r:.300}"
            for what, old, new in zip(("GET /gallery", "index size", "files in the data dir"),
                                      before, after, strict=True) if old != new]


def _check_bad(case: Case, response: httpx.Response) -> str | None:
    detail = _detail(response)
    if not case.accepts(response.status_code) or not detail:
        return f"expected {case.status}, got {response.status_code} {response.text[:300]!r}"
    return None


def _check_valid(case: Case, response: httpx.Response) -> str | None:
    if not case.accepts(response.status_code):
        return f"expected {case.status}, got {response.status_code} {response.text[:300]!r}"
    return None


def test_bad_input_corpus(tmp_path: Path, db_url: str, tiny_checkpoint: Path) -> None:
    backend = db_url.split(":", 1)[0].split("+")[0]
    data_dir = tmp_path / "data"
    env = {
        "IMGRET_DATA_DIR": str(data_dir),
        "IMGRET_DATABASE_URL": db_url,
        "IMGRET_MODEL": str(tiny_checkpoint),
        "IMGRET_DEVICE": TEST_DEVICE,
        "IMGRET_API_KEY": KEY,
        "IMGRET_MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "IMGRET_MAX_IMAGE_PIXELS": str(MAX_IMAGE_PIXELS),
        "IMGRET_MAX_REQUEST_PIXELS": str(MAX_REQUEST_PIXELS),
        "IMGRET_BATCH_MAX_WAIT_MS": "1",
    }
    with running_server(env, log_path=tmp_path / "server.log") as server, \
            httpx.Client(timeout=60) as client:
        base = server.url
        ids = _seed(client, base)
        before = _snapshot(client, base, data_dir)

        failures = _run(client, base, [c for c in BAD if c not in RATIO_BOMBS], _check_bad)
        assert client.get(f"{base}/health").status_code == 200
        failures += _changes(before, _snapshot(client, base, data_dir), "bad requests")

        # Alone, so that an acceptance (it writes three items) spoils no other row.
        ratio_bomb_failed = _run(client, base, RATIO_BOMBS, _check_bad)
        if not ratio_bomb_failed:
            failures += _changes(before, _snapshot(client, base, data_dir), "the ratio bomb")

        valid = _valid({"ids": ids, "origin": base})
        failures += _run(client, base, valid, _check_valid)
        assert server.process.poll() is None, "the server died"
        assert client.get(f"{base}/health").status_code == 200

    # uvicorn's mark of an exception no handler answered (a 500 or a dropped connection).
    unhandled = server.log_path.read_text(errors="replace").count("Exception in ASGI application")
    if unhandled:
        failures.append(f"{unhandled} unhandled exceptions in {server.log_path}")
    kinds = Counter(case.status if isinstance(case.status, int) else "4xx" for case in BAD)
    print(f"\n[bad-input corpus, {backend}] {len(BAD)} bad requests (expected "
          f"{dict(sorted(kinds.items(), key=str))}), {len(valid)} odd-but-valid; "
          f"{len(failures) + len(ratio_bomb_failed)} failed "
          f"{[f[:200] for f in failures + ratio_bomb_failed]}")
    assert not failures, f"{len(failures)} of {len(BAD) + len(valid)} cases failed:\n" + \
        "\n".join(failures)
    assert not ratio_bomb_failed, "ratio bombs accepted: " + "; ".join(ratio_bomb_failed)
