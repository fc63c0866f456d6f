"""A real ``imgret serve`` on loopback, for end-to-end tests and benchmarks: started on a free
port with its own environment, waited for until ``/health`` answers, stopped gracefully (and
killed if it hangs), its log's tail in every error."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

_SERVE = "from imgret.cli.main import main; main()"


# --------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class LiveServer:
    """A running ``imgret serve`` process, its base URL (``http://127.0.0.1:PORT``) and log."""

    url: str
    process: subprocess.Popen
    log_path: Path


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nobody listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_servers(specs: Sequence[tuple[dict[str, str], Path]], *, workers: int = 1,
                    start_timeout_s: float = 180.0) -> Iterator[list[LiveServer]]:
    """Start ``imgret serve`` once per ``(env, log_path)`` on free loopback ports, ``env``
    added to this process's environment; yield the servers, in the order of ``specs``, once
    every one answers /health (start-up is mostly imports: they overlap).

    A server that exits or is not healthy within ``start_timeout_s`` raises, with its log's
    tail. At the end each is stopped with SIGTERM (graceful shutdown), and killed if it hangs.
    """
    servers: list[LiveServer] = []
    try:
        for env, log_path in specs:
            port = free_port()
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-c", _SERVE, "serve", "--host", "127.0.0.1",
                     "--port", str(port), "--workers", str(workers)],
                    env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=log,
                    stderr=subprocess.STDOUT,
                )
            servers.append(LiveServer(f"http://127.0.0.1:{port}", process, Path(log_path)))
        for server in servers:
            _wait_healthy(server, start_timeout_s)
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
def running_server(env: dict[str, str], *, log_path: Path, workers: int = 1,
                   start_timeout_s: float = 180.0) -> Iterator[LiveServer]:
    """One ``imgret serve`` (see :func:`running_servers`)."""
    with running_servers([(env, log_path)], workers=workers,
                         start_timeout_s=start_timeout_s) as (server,):
        yield server


def _wait_healthy(server: LiveServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"imgret serve exited with {server.process.returncode}:\n"
                               f"{_tail(server.log_path)}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"imgret serve not healthy after {timeout_s:.0f} s:\n"
                       f"{_tail(server.log_path)}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- images
