"""The LISTEN connection of a PostgreSQL replica has TCP keepalives on (a database host that
vanished is noticed and the listener reconnects), and still receives notifications."""

from __future__ import annotations

import threading

import psycopg
import pytest

from imgret.gallery.storage.db import make_engine
from imgret.gallery.storage.notify import CHANNEL, KEEPALIVE, listen_for_changes

pytestmark = pytest.mark.postgres


def test_the_listen_connection_has_tcp_keepalive(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    heard: list[str] = []
    notified = threading.Event()

    def on_change(payload: str) -> None:
        heard.append(payload)
        if payload == "probe":
            notified.set()

    listener = listen_for_changes(engine, on_change)
    try:
        assert listener is not None
        assert listener.listening.wait(10)
        # What the kernel holds for the listener's own socket, not what was asked for.
        assert listener.socket_options() == KEEPALIVE
        assert all(value > 0 for value in KEEPALIVE.values())
        with psycopg.connect(postgres_url.replace("+psycopg", ""), autocommit=True) as other:
            other.execute(f"NOTIFY {CHANNEL}, 'probe'")
        assert notified.wait(10), heard
    finally:
        listener.stop()
        engine.dispose()
    assert listener.socket_options() is None  # closed with the thread
