"""What the benchmarks share: generated and Fashion-MNIST images, ``wrk`` driving
``POST /search``, the server's CPU time and batch histogram; and, from the tests' support code,
a real ``imgret serve`` on loopback (:mod:`tests.support.live_server`).

Benchmarks run as ``python benchmarks/NAME.py`` and find this module beside them
(``from harness import ...``). The tests import nothing from ``benchmarks/`` (checked by
``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: the tests' support code
    sys.path.insert(0, str(ROOT))

from tests.support.live_server import (  # noqa: E402
    LiveServer,
    free_port,
    running_server,
    running_servers,
)

__all__ = ["LiveServer", "free_port", "running_server", "running_servers"]

BOUNDARY = "imgret-bench-boundary"


def class_png(label: int, index: int, size: int = 64) -> bytes:
    """A PNG of class ``label``: a class colour plus seeded noise (classes are separable)."""
    rng = np.random.default_rng([label, index])
    base = np.array([(label * 67) % 256, (label * 131) % 256, (label * 29 + 80) % 256], float)
    pixels = base + rng.normal(0, 20, (size, size, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "RGB").save(buffer, "PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class BenchImages:
    """Images for a benchmark: a labelled gallery, queries, and where they came from.

    Attributes:
        gallery: ``(png bytes, label)`` pairs.
        queries: png bytes (never in the gallery).
        note: a sentence for the report.
    """

    gallery: list[tuple[bytes, str]]
    queries: list[bytes]
    note: str


def fashion_mnist_pngs(n_gallery: int, n_queries: int) -> BenchImages:
    """The first ``n_gallery`` Fashion-MNIST train images (labelled with the class names) and
    the first ``n_queries`` test images, as PNGs; seeded random 28x28 images when Debian's
    ``dataset-fashion-mnist`` is not installed (the note says which)."""
    def png(pixels: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return buffer.getvalue()

    try:
        from imgret.datasets import FASHION_MNIST_CLASSES, load_fashion_mnist

        train, train_labels = load_fashion_mnist(split="train")
        test, _ = load_fashion_mnist(split="test")
    except Exception as exc:  # noqa: BLE001 - any reason: fall back to generated images
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (n_gallery + n_queries, 28, 28), dtype=np.uint8)
        return BenchImages(
            [(png(image), f"class-{i % 10}") for i, image in enumerate(images[:n_gallery])],
            [png(image) for image in images[n_gallery:]],
            f"generated 28x28 images (Fashion-MNIST unavailable: {exc})",
        )
    return BenchImages(
        [(png(train[i]), FASHION_MNIST_CLASSES[int(train_labels[i])]) for i in range(n_gallery)],
        [png(test[i]) for i in range(n_queries)],
        "Fashion-MNIST (train split gallery, test split queries)",
    )


def write_image_folder(folder: Path, gallery: Sequence[tuple[bytes, str]]) -> Path:
    """``gallery`` as an ImageFolder tree (one folder per label, named as the demo does)."""
    for i, (data, label) in enumerate(gallery):
        target = folder / label.replace("/", "-").replace(" ", "_")
        target.mkdir(parents=True, exist_ok=True)
        (target / f"train-{i:05d}.png").write_bytes(data)
    return folder


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Level:
    """One load level: what wrk (or an in-process driver) measured."""

    connections: int
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    non_2xx: int = 0
    socket_errors: int = 0

    @property
    def rps(self) -> float:
        """Successful requests per second."""
        return (self.requests - self.non_2xx) / self.seconds if self.seconds else 0.0

    def held(self, p99_target_ms: float) -> bool:
        """Whether this level kept p99 under the target with every request answered 2xx."""
        return self.p99_ms < p99_target_ms and not self.non_2xx and not self.socket_errors


# wrk cycles through pre-built multipart bodies and reports its own counters from done():
# parsing its human-readable summary would lose the socket-error breakdown.
_LUA = """
local n = tonumber(os.getenv("IMGRET_WRK_N"))
local dir = os.getenv("IMGRET_WRK_DIR")
local bodies = {}
for i = 1, n do
  local f = assert(io.open(dir .. "/body" .. i .. ".bin", "rb"))
  bodies[i] = f:read("*a")
  f:close()
end
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "multipart/form-data; boundary=BOUNDARY"
request = function()
  i = i % n + 1
  return wrk.format(nil, "/search", nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("IMGRET_WRK %d %d %d %d %d %d %d %d %d\\n", summary.requests,
    summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
""".replace("BOUNDARY", BOUNDARY)


def search_bodies(images: Sequence[bytes], folder: Path, *, k: int = 10) -> list[Path]:
    """One multipart ``POST /search`` body (``k`` and one PNG) per image, as files
    ``body1.bin``, ``body2.bin``, ... in ``folder`` (created), the way :func:`run_wrk` reads
    them."""
    folder.mkdir(parents=True)
    paths = []
    for i, data in enumerate(images):
        body = (
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"k\"\r\n\r\n{k}\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"image\"; "
            f"filename=\"q{i}.png\"\r\nContent-Type: image/png\r\n\r\n"
        ).encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()
        path = folder / f"body{i + 1}.bin"
        path.write_bytes(body)
        paths.append(path)
    return paths


def run_wrk(base: str, bodies: list[Path], connections: int, seconds: float, *,
            request_timeout_s: float = 10.0) -> Level:
    """``wrk -t1 -c<connections>`` for ``seconds`` against ``POST /search``, cycling through
    ``bodies`` (from :func:`search_bodies`)."""
    script = bodies[0].parent / "search.lua"
    script.write_text(_LUA)
    env = {**os.environ, "IMGRET_WRK_DIR": str(bodies[0].parent),
           "IMGRET_WRK_N": str(len(bodies))}
    done = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
         "--timeout", f"{max(1, round(request_timeout_s))}s", "-s", str(script), base],
        env=env, capture_output=True, text=True, timeout=seconds + request_timeout_s + 60,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("IMGRET_WRK ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    (requests, duration_us, connect, read, write, timeout, status, p50_us,
     p99_us) = (int(v) for v in line.split()[1:])
    return Level(connections, requests, duration_us / 1e6, p50_us / 1000, p99_us / 1000,
                 non_2xx=status, socket_errors=connect + read + write + timeout)


# --------------------------------------------------------------------------- server metrics


@dataclass(frozen=True)
class BatchHistogram:
    """The server's ``imgret_batch_size`` histogram (cumulative since it started); subtract
    two readings for what happened between them.

    Attributes:
        count: batches.
        total: images in them.
        buckets: cumulative counts by upper bound (``le``), as Prometheus writes them.
    """

    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]

    @property
    def mean(self) -> float:
        """Images per batch (0 when no batch ran)."""
        return self.total / self.count if self.count else 0.0

    def __sub__(self, other: BatchHistogram) -> BatchHistogram:
        return BatchHistogram(
            self.count - other.count, self.total - other.total,
            tuple((le, a - b) for (le, a), (_, b) in zip(self.buckets, other.buckets,
                                                         strict=True)),
        )


def server_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by a server process's main thread (uvicorn's
    event loop: HTTP parsing, routing, form fields, responses) and by the whole process, from
    /proc (Linux); (nan, nan) where that cannot be read."""
    def read(path: str) -> float:
        # Fields after the command name: utime and stime are the 12th and 13th.
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    try:
        return read(f"/proc/{pid}/task/{pid}/stat"), read(f"/proc/{pid}/stat")
    except (OSError, ValueError, IndexError):
        return float("nan"), float("nan")


def scrape(base: str) -> str:
    """The server's ``GET /metrics`` text: read once, parsed by the functions below."""
    return httpx.get(f"{base}/metrics", timeout=30).text


def histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of one of the server's unlabelled histograms in a :func:`scrape`."""
    total, count = (float(re.search(rf"^{name}_{part} (\S+)$", text, re.M).group(1))
                    for part in ("sum", "count"))
    return total, count


def batch_histogram(text: str) -> BatchHistogram:
    """The server's batch-size histogram in a :func:`scrape`."""
    buckets = tuple(
        (float(le), float(count))
        for le, count in re.findall(r'^imgret_batch_size_bucket\{le="([^"]+)"\} (\S+)$', text,
                                    re.M)
    )
    total, count = histogram_sum_count(text, "imgret_batch_size")
    return BatchHistogram(count, total, buckets)
