"""Peak memory of a real server under a flood of decompression-ratio bombs.

    python benchmarks/bomb_memory.py [--seconds 30] [--clients 6] [--model PATH]
                                     [--endpoints search,batch,evaluate,gallery]

What it does, in one run (loopback only, bounded in time and in requests):

1. builds an untrained resnet18 checkpoint at 224 px (128-d) in a temporary folder, unless
   ``--model`` names one;
2. starts ``imgret serve`` on 127.0.0.1 (SQLite, fresh data dir, default limits) and adds a
   small gallery of generated images;
3. warms it up with full batches of ordinary images (a gallery add of 64, a /search/batch and
   an /evaluate of 32: the model's own working memory is in the baseline) and measures its
   idle RSS;
4. floods it from ``--clients`` concurrent connections for ``--seconds`` with ratio bombs:
   files of a few kilobytes that each declare just under ``IMGRET_MAX_IMAGE_PIXELS`` - PNG
   (RGB, RGBA, palette with transparency, 1-bit), a lossless WebP (the costliest to decode:
   16 bytes per pixel) and a flat JPEG -, sent as single searches, as /search/batch and
   /evaluate requests under and over the request's pixel budget, plus headers over the
   per-image limit and ordinary searches; with ``gallery`` in ``--endpoints``, also gallery
   adds of the most files a request may send, each new to the gallery;
5. samples the server's RSS every 10 ms (psutil when installed, else /proc/PID/status) and
   reads its VmHWM at the end;
6. prints a markdown table: idle RSS, peak RSS under the flood, the stated bound, and the
   count of responses by endpoint and status; exits 1 when the peak is over the bound, a 5xx
   was answered, or the server stopped answering.

The stated bound follows from the design (``imgret.images``): full-size decoding holds at most
``IMGRET_DECODE_MEMORY_MB`` (default 640 MiB) in the whole process, by the measured cost
model ``decode_cost`` (tested against measured peaks); the model runs one forward pass at a
time (``Embedder``), whose working memory is in the idle baseline (the warm-up runs its
largest batch); each upload request in flight holds at most one chunk of model inputs
(``batch_size`` x 3 x S x S float32) while it waits for that pass; the rest is small (reduced
images, the uploads themselves). So:
``bound = idle after warm-up + IMGRET_DECODE_MEMORY_MB + clients x one chunk of model inputs
+ 256 MiB`` (threads' stacks, allocator slack). The server runs with ``MALLOC_ARENA_MAX=2``,
as the Docker image does. Without the budget a server would hold every decoded image of a
request at once, at full size and then as float tensors: 8 bombs in one /search/batch
request would be over 8 x 1 GB, times the concurrent requests.

This imports no test code (benchmarks never do): the few lines that start a server and make
images are here.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import math
import os
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from harness import class_png, running_server
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

MIB = 1024 * 1024
SLACK = 256 * MIB
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_REQUEST_PIXELS = 256_000_000
DEFAULT_DECODE_MEMORY_MB = 640
# --------------------------------------------------------------------------- memory


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _tree_rss(pid: int) -> int:
    """RSS in bytes of ``pid`` and its children (uvicorn may fork workers)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    total = _status_kib(pid, "VmRSS")
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            total += _status_kib(int(child), "VmRSS")
    return total * 1024


class RssSampler:
    """Samples the server's RSS every ``interval_s`` in a thread; keeps the maximum."""

    def __init__(self, pid: int, interval_s: float = 0.01):
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.peak = max(self.peak, _tree_rss(self.pid))
                self.samples += 1
            self._stop.wait(self.interval_s)


# --------------------------------------------------------------------------- the bombs


def _png(image: Image.Image, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", optimize=True, **kwargs)
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` and holds no pixels (over-limit header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) \
        + _chunk(b"IDAT", zlib.compress(b"")) + _chunk(b"IEND", b"")


def make_bombs(max_pixels: int) -> dict[str, bytes]:
    """Ratio bombs that each declare just under ``max_pixels``, by kind (PNG kinds first)."""
    side = math.isqrt(max_pixels)
    while side * side > max_pixels:
        side -= 1
    bombs = {
        "png-rgb": _png(Image.new("RGB", (side, side), (40, 90, 200))),
        "png-rgba": _png(Image.new("RGBA", (side, side), (40, 90, 200, 128))),
        "png-palette": _png(Image.new("P", (side, side), 0), transparency=0),
        "png-1bit": _png(Image.new("1", (side, side), 0)),
    }
    webp = io.BytesIO()
    Image.new("RGB", (side, side), (9, 9, 9)).save(webp, "WEBP", lossless=True)
    bombs["webp"] = webp.getvalue()
    jpeg = io.BytesIO()
    Image.new("RGB", (side, side), (200, 60, 60)).save(jpeg, "JPEG", quality=50)
    bombs["jpeg"] = jpeg.getvalue()
    return bombs


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(
        ">I", zlib.crc32(kind + body) & 0xFFFFFFFF
    )


def with_nonce(png: bytes, nonce: int) -> bytes:
    """The same PNG with a tEXt chunk after IHDR: same pixels, new bytes (the gallery dedups
    uploads by their bytes, so a flood of adds needs fresh ones)."""
    return png[:33] + _chunk(b"tEXt", b"nonce\x00" + str(nonce).encode()) + png[33:]


# --------------------------------------------------------------------------- the flood


@dataclass
class Tally:
    counts: collections.Counter = field(default_factory=collections.Counter)
    transport_errors: int = 0
    requests: int = 0


def _files(blobs: list[bytes], name: str = "images") -> list[tuple[str, tuple]]:
    return [(name, (f"b{i}.png", data, "application/octet-stream"))
            for i, data in enumerate(blobs)]


def request_mix(bombs: dict[str, bytes], endpoints: set[str], request_pixels: int,
                max_pixels: int, gallery_max_files: int) -> list[tuple[str, dict | Callable]]:
    """(label, httpx request kwargs or a function making them) cycled by every client."""
    # Budget requests use PNG bombs only: a JPEG decodes at 1/8 scale and costs ~1/64.
    kinds = [data for name, data in bombs.items() if name.startswith("png")]
    under = max(1, request_pixels // max_pixels)  # bombs per request that fit the budget
    over = under + 2
    over_limit = _png_header_only(100_000, 100_000)
    mix: list[tuple[str, dict | Callable]] = []
    if "search" in endpoints:
        for name, data in bombs.items():
            mix.append((f"/search 1x {name}", {"url": "/search", "files": _files([data], "image")}))
        mix.append(("/search over-limit header",
                    {"url": "/search", "files": _files([over_limit], "image")}))
        mix.append(("/search normal",
                    {"url": "/search", "files": _files([class_png(1, 99)], "image")}))
    if "batch" in endpoints:
        mix.append((f"/search/batch {under} bombs (fits budget)",
                    {"url": "/search/batch",
                     "files": _files([kinds[i % len(kinds)] for i in range(under)])}))
        mix.append((f"/search/batch {over} bombs (over budget)",
                    {"url": "/search/batch",
                     "files": _files([kinds[i % len(kinds)] for i in range(over)])}))
    if "evaluate" in endpoints:
        for count, note in ((under, "fits budget"), (over, "over budget")):
            mix.append((f"/evaluate {count} bombs ({note})",
                        {"url": "/evaluate",
                         "files": _files([kinds[i % len(kinds)] for i in range(count)]),
                         "data": {"labels": [str(i % 3) for i in range(count)]}}))
    if "gallery" in endpoints:
        mix.append((f"/gallery {over} bombs (over budget)",
                    {"url": "/gallery",
                     "files": _files([kinds[i % len(kinds)] for i in range(over)]),
                     "data": {"labels": ["bomb"] * over}}))
        # The most files a request may send, each as large as the budget then allows (1 M
        # pixels: too small to be shrunk for a 224 px model), each new to the gallery.
        count = min(gallery_max_files, request_pixels // 1_000_000)
        base = _png(Image.new("RGB", (1000, 1000), (90, 160, 30)))
        nonces = iter(range(10**9))

        def fresh_files() -> dict:
            blobs = [with_nonce(base, next(nonces)) for _ in range(count)]
            return {"url": "/gallery", "files": _files(blobs),
                    "data": {"labels": ["bomb"] * count}}

        mix.append((f"/gallery {count} x 1 M-pixel PNG (fits budget)", fresh_files))
    return mix


def _model_input_chunk_bytes(model: Path) -> int:
    """Bytes of one chunk of model inputs (``Embedder`` default batch of 64, float32)."""
    from imgret.checkpoint import load_checkpoint

    size = load_checkpoint(model).spec.image_size
    return 64 * 3 * size * size * 4


async def flood(url: str, mix: list[tuple[str, dict | Callable]], *, clients: int,
                seconds: float,
                max_requests: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients)

    async def client(offset: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            i = offset
            while time.monotonic() < deadline and tally.requests < max_requests:
                label, request = mix[i % len(mix)]
                kwargs = request() if callable(request) else request
                i += 1
                tally.requests += 1
                try:
                    response = await http.post(**kwargs)
                    tally.counts[(label, response.status_code)] += 1
                except httpx.TransportError:
                    tally.transport_errors += 1

    await asyncio.gather(*(client(k * 3) for k in range(clients)))
    return tally


# --------------------------------------------------------------------------- main


def build_checkpoint(folder: Path) -> Path:
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(folder, EmbeddingNet(ModelSpec(backbone="resnet18", dim=128,
                                                   image_size=224)))
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="flood duration")
    parser.add_argument("--clients", type=int, default=6, help="concurrent connections")
    parser.add_argument("--max-requests", type=int, default=5000, help="stop after this many")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: "
                        "an untrained resnet18 at 224 px)")
    parser.add_argument("--endpoints", default="search,batch,evaluate,gallery",
                        help="comma-separated: search,batch,evaluate,gallery")
    args = parser.parse_args()
    endpoints = {e.strip() for e in args.endpoints.split(",") if e.strip()}
    max_pixels = int(os.environ.get("IMGRET_MAX_IMAGE_PIXELS", DEFAULT_MAX_IMAGE_PIXELS))
    request_pixels = int(os.environ.get("IMGRET_MAX_REQUEST_PIXELS", DEFAULT_REQUEST_PIXELS))
    gallery_max_files = int(os.environ.get("IMGRET_GALLERY_MAX_FILES", 256))
    decode_memory = int(os.environ.get("IMGRET_DECODE_MEMORY_MB",
                                       DEFAULT_DECODE_MEMORY_MB)) * MIB

    with tempfile.TemporaryDirectory(prefix="imgret-bomb-") as tmp:
        tmp_path = Path(tmp)
        model = args.model or build_checkpoint(tmp_path / "model")
        print(f"making ratio bombs of {max_pixels:,} pixels ...", flush=True)
        bombs = make_bombs(max_pixels)
        env = {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_MODEL": str(model),
               "IMGRET_DEVICE": "cpu", "IMGRET_API_KEY": "", "MALLOC_ARENA_MAX": "2"}
        chunk_bytes = _model_input_chunk_bytes(model)
        with running_server(env, log_path=tmp_path / "server.log") as server:
            url, process = server.url, server.process
            # 64 items in one add: one forward pass of embedder.batch_size, so the model's own
            # working memory at its largest batch is in the idle baseline.
            gallery = [("images", (f"g{i}.png", class_png(i % 3, i), "image/png"))
                       for i in range(64)]
            response = httpx.post(f"{url}/gallery", files=gallery,
                                  data={"labels": [str(i % 3) for i in range(64)]}, timeout=300)
            response.raise_for_status()
            warm = [("images", (f"w{i}.png", class_png(i % 3, 100 + i), "image/png"))
                    for i in range(32)]
            for path, data in (("/search/batch", {}),
                               ("/evaluate", {"labels": [str(i % 3) for i in range(32)]})):
                httpx.post(f"{url}{path}", files=warm, data=data, timeout=120).raise_for_status()
            time.sleep(1.0)
            with RssSampler(process.pid) as idle:
                time.sleep(1.0)
            idle_rss = idle.peak
            mix = request_mix(bombs, endpoints, request_pixels, max_pixels, gallery_max_files)
            print(f"flooding {url} from {args.clients} clients for {args.seconds:.0f} s "
                  f"({len(mix)} kinds of request) ...", flush=True)
            start = time.monotonic()
            with RssSampler(process.pid) as flood_rss:
                tally = asyncio.run(flood(url, mix, clients=args.clients,
                                          seconds=args.seconds, max_requests=args.max_requests))
            elapsed = time.monotonic() - start
            hwm = _status_kib(process.pid, "VmHWM") * 1024
            alive = httpx.get(f"{url}/health", timeout=10).status_code == 200
            normal = httpx.post(f"{url}/search", timeout=30, files={
                "image": ("q.png", class_png(1, 7), "image/png")}).status_code

    inputs = args.clients * chunk_bytes
    bound = idle_rss + decode_memory + inputs + SLACK
    bomb_sizes = ", ".join(f"{name} {len(data) / 1024:.0f} KiB" for name, data in bombs.items())
    print()
    print(f"Ratio-bomb flood: {tally.requests} requests in {elapsed:.1f} s from {args.clients} "
          f"clients; each bomb declares {max_pixels:,} pixels ({bomb_sizes}); "
          f"{flood_rss.samples} RSS samples.")
    print()
    print("| measure | MiB |")
    print("|---|---:|")
    print(f"| idle RSS after start and warm-up | {idle_rss / MIB:.0f} |")
    print(f"| peak RSS under the flood (sampled) | {flood_rss.peak / MIB:.0f} |")
    print(f"| peak RSS since start (VmHWM) | {hwm / MIB:.0f} |")
    print(f"| stated bound: idle + IMGRET_DECODE_MEMORY_MB ({decode_memory // MIB}) + "
          f"{args.clients} clients x {chunk_bytes / MIB:.0f} MiB of model inputs + "
          f"{SLACK // MIB} | {bound / MIB:.0f} |")
    print()
    print("| request | status | count |")
    print("|---|---:|---:|")
    for (label, status), count in sorted(tally.counts.items()):
        print(f"| {label} | {status} | {count} |")
    print(f"| (transport errors) | - | {tally.transport_errors} |")
    print()
    server_errors = sum(c for (_, status), c in tally.counts.items() if status >= 500)
    ok = (max(flood_rss.peak, hwm) <= bound and server_errors == 0 and alive
          and normal == 200 and tally.transport_errors == 0)
    print(f"after the flood: /health {'200' if alive else 'FAILED'}, a normal search {normal}; "
          f"5xx: {server_errors}; peak {'within' if ok else 'OVER or errors:'} the bound")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
