"""A real API server in a subprocess (``imgret serve``) on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

_SERVE = "from cli.main import main; main()"


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LiveServer:
    """A running ``imgret serve`` process and its base URL (``http://127.0.0.1:PORT``)."""

    url: str
    process: subprocess.Popen
    log_path: Path


@contextlib.contextmanager
def running_server(
    env: dict[str, str], *, log_path: Path, workers: int = 1, start_timeout_s: float = 120.0
) -> Iterator[LiveServer]:
    """Start ``imgret serve`` with ``env`` added to the environment; yield it once healthy.

    The server log goes to ``log_path``; its tail is in the error when start-up fails.
    The process is stopped with SIGTERM (graceful shutdown) and killed if it hangs.
    """
    with running_servers([(env, log_path)], workers=workers,
                         start_timeout_s=start_timeout_s) as (server,):
        yield server


@contextlib.contextmanager
def running_servers(
    specs: list[tuple[dict[str, str], Path]], *, workers: int = 1,
    start_timeout_s: float = 120.0,
) -> Iterator[list[LiveServer]]:
    """Start several servers at once (start-up is mostly imports: overlap them).

    Args:
        specs: ``(env, log_path)`` per server.
        workers: uvicorn workers of each.
        start_timeout_s: how long each may take to become healthy.

    Yields:
        The servers, in the order of ``specs``.
    """
    processes: list[LiveServer] = []
    try:
        for env, log_path in specs:
            port = free_port()
            full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-c", _SERVE, "serve", "--host", "127.0.0.1",
                     "--port", str(port), "--workers", str(workers)],
                    env=full_env, stdout=log, stderr=subprocess.STDOUT,
                )
            processes.append(LiveServer(f"http://127.0.0.1:{port}", process, log_path))
        for server in processes:
            _wait_healthy(server.process, server.url, server.log_path, start_timeout_s)
        yield processes
    finally:
        for server in processes:
            if server.process.poll() is None:
                server.process.terminate()
        for server in processes:
            try:
                server.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait(timeout=10)


def _wait_healthy(
    process: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
