"""What the benchmarks share: a real `imgret serve` on loopback, and generated images.

Benchmarks import nothing from ``tests/``; the scripts run as ``python benchmarks/NAME.py``,
so this module is found beside them.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

_SERVE = "from cli.main import main; main()"


@dataclass(frozen=True)
class Server:
    """A running ``imgret serve``: its base URL and process."""

    url: str
    process: subprocess.Popen


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_many(specs: list[tuple[dict[str, str], Path]], *, workers: int = 1,
               timeout_s: float = 180.0) -> Iterator[list[Server]]:
    """Start ``imgret serve`` once per ``(env, log_path)`` on free loopback ports; yield the
    servers once every one answers /health; stop them (SIGTERM, then SIGKILL) at the end."""
    servers: list[Server] = []
    try:
        for env, log_path in specs:
            port = free_port()
            with log_path.open("wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-c", _SERVE, "serve", "--host", "127.0.0.1",
                     "--port", str(port), "--workers", str(workers)],
                    env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=log,
                    stderr=subprocess.STDOUT,
                )
            servers.append(Server(f"http://127.0.0.1:{port}", process))
        for server, (_, log_path) in zip(servers, specs, strict=True):
            _wait_healthy(server, log_path, timeout_s)
        yield servers
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.process.terminate()
        for server in servers:
            try:
                server.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait(timeout=10)


@contextlib.contextmanager
def serve(env: dict[str, str], log_path: Path, *, workers: int = 1,
          timeout_s: float = 180.0) -> Iterator[Server]:
    """One ``imgret serve`` (see :func:`serve_many`)."""
    with serve_many([(env, log_path)], workers=workers, timeout_s=timeout_s) as (server,):
        yield server


def _wait_healthy(server: Server, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"imgret serve exited with {server.process.returncode}; see "
                               f"{log_path}:\n{log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"imgret serve not healthy after {timeout_s:.0f} s; see "
                               f"{log_path}")
        time.sleep(0.2)


def class_png(label: int, index: int, size: int = 64) -> bytes:
    """A PNG of class ``label``: a class colour plus seeded noise (classes are separable)."""
    rng = np.random.default_rng([label, index])
    base = np.array([(label * 67) % 256, (label * 131) % 256, (label * 29 + 80) % 256], float)
    pixels = base + rng.normal(0, 20, (size, size, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "RGB").save(buffer, "PNG")
    return buffer.getvalue()
