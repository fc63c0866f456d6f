"""Observability: Prometheus metrics of one app and one structured access-log line per request."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgret.files import process_exists
from imgret.service.limits import content_length
from imgret.timing import timed

access_logger = logging.getLogger("imgret.access")

# Latency buckets from 1 ms to 10 s: a CPU forward pass sits in the tens of milliseconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# prometheus_client's multiprocess mode: set (by `imgret serve --workers N`, N > 1) before
# the worker processes start, so that their metric values live in files of this folder.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# A live gauge's file of one process: gauge_livemax_1234.db.
_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


class ServiceMetrics:
    """The Prometheus metrics of one app, on a registry of its own.

    A registry per app (not the process-global one) lets tests build many apps in one
    process, and keeps ``/metrics`` free of other libraries' collectors.

    Several uvicorn workers (``imgret serve --workers N``) answer one port, and a scrape
    reaches whichever process accepted the connection: a per-process view would jump
    between processes' numbers. There prometheus_client's multiprocess mode is on (the
    ``PROMETHEUS_MULTIPROC_DIR`` environment set by ``serve`` before the workers start; the
    library picks its value class when it is first imported, so that, not the variable now,
    is what :attr:`multiprocess` reads): every process writes its values to files of that
    folder, and :meth:`exposition` merges all of them, dead workers' counts included
    (counters never go back). The gauges are per process, and merged as their meaning
    asks: ``imgret_index_size`` the largest index a live worker serves (``livemax``; the
    workers follow one change log, so they differ only until the next follower round),
    ``imgret_follower_lag_seconds`` the worst lag (``livemax``) and
    ``imgret_follower_applied_seq`` the change every live worker has applied (``livemin``).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = values.ValueClass is not values.MutexValue
        self._multiproc_dir = os.environ.get(MULTIPROC_DIR_ENV) if self.multiprocess else None
        # Multiprocess mode: the gauges read at scrape time, and how.
        self._live_gauges: dict[Gauge, Callable[[], float]] = {}
        self.requests = Counter(
            "imgret_http_requests", "HTTP requests by route template and status.",
            ["method", "route", "status"], registry=self.registry,
        )
        self.latency = Histogram(
            "imgret_http_request_duration_seconds", "HTTP request latency by route template.",
            ["method", "route"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.batch_size = Histogram(
            "imgret_batch_size", "Queries embedded together per dynamic batch.",
            buckets=_BATCH_BUCKETS, registry=self.registry,
        )
        self.embed_seconds = Histogram(
            "imgret_embed_seconds", "Time of one Embedder.embed call (a whole batch).",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.decode_seconds = Histogram(
            "imgret_decode_seconds", "Time to decode the images of one batch.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.search_seconds = Histogram(
            "imgret_index_search_seconds", "Time of the index search of one batch.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.index_size = Gauge(
            "imgret_index_size", "Vectors in the served index.", registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.follower_lag = Gauge(
            "imgret_follower_lag_seconds",
            "Seconds since the served index last caught up with the gallery change log "
            "(with several workers: the worst of them).",
            registry=self.registry, multiprocess_mode="livemax",
        )
        self.follower_seq = Gauge(
            "imgret_follower_applied_seq", "The last gallery change applied to the index.",
            registry=self.registry, multiprocess_mode="livemin",
        )
        self.follower_failures = Counter(
            "imgret_follower_failures", "Failed polls of the gallery change log.",
            registry=self.registry,
        )
        self.gallery_writes = Counter(
            "imgret_gallery_writes", "Gallery items added or deleted.", ["op"],
            registry=self.registry,
        )

    def track_follower(self, lag_s: Callable[[], float], seq: Callable[[], float]) -> None:
        """Read the change-log follower's lag and position at scrape time."""
        self._track(self.follower_lag, lag_s)
        self._track(self.follower_seq, seq)

    def track_index_size(self, size: Callable[[], float]) -> None:
        """Read the index size at scrape time (no stale copies to keep up to date)."""
        self._track(self.index_size, size)

    def _track(self, gauge: Gauge, value: Callable[[], float]) -> None:
        # In multiprocess mode the merge reads files only, never a set_function callback:
        # publish_gauges writes the callbacks' values instead.
        if self.multiprocess:
            self._live_gauges[gauge] = value
        else:
            gauge.set_function(value)

    def publish_gauges(self) -> None:
        """Write this process's scrape-time gauges to its multiprocess files (else nothing).

        Called before every scrape this process answers, and by the change-log follower after
        each round, so another worker's scrape sees this one's gauges at most one follower
        round (``IMGRET_FOLLOW_INTERVAL_S``) old.
        """
        for gauge, value in self._live_gauges.items():
            gauge.set(value())

    def exposition(self) -> bytes:
        """The text ``/metrics`` answers: this app's registry, or all workers' files merged.

        Before merging, the live gauges of workers that are gone (crashed, restarted by
        uvicorn's supervisor, retired by a SIGHUP reload) are dropped, so their last values
        cannot win a ``livemax``/``livemin``. A process is gone when its pid no longer
        exists: a pid reused meanwhile by an unrelated process keeps a dead worker's gauges
        until that process exits too.
        """
        if self._multiproc_dir is None:
            return generate_latest(self.registry)
        self.publish_gauges()
        for path in Path(self._multiproc_dir).glob("gauge_live*.db"):
            match = _LIVE_GAUGE_FILE.fullmatch(path.name)
            if match and not process_exists(int(match.group(1))):
                mark_process_dead(int(match.group(1)), self._multiproc_dir)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self._multiproc_dir)
        return generate_latest(merged)

    def timed(self, histogram: Histogram) -> contextlib.AbstractContextManager[None]:
        """Observe the wall time of the block in ``histogram``."""
        return timed(histogram.observe)


class AccessLogMiddleware:
    """One JSON log line and the request metrics for every HTTP request.

    Metrics are labelled by the route *template* (``/gallery/{item_id}``), never the raw path,
    so that ids cannot blow up the number of time series; unmatched paths share one label.
    Every response carries ``X-Request-ID`` (the client's, or a new one), also in the log line.
    """

    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = _header(scope, b"x-request-id") or ""
        if not _REQUEST_ID.fullmatch(request_id):
            # Echoed in a header and the log: accept only a plain token from the client.
            request_id = uuid.uuid4().hex
        status = 500  # what the client sees if the app raises before answering
        sent_bytes = 0
        elapsed: float | None = None

        def count() -> float:
            # Before the last body message goes out: a client that has its answer finds its
            # request in every scrape it makes next (counted after it, a scrape could miss it).
            seconds = time.perf_counter() - start
            method, route = scope["method"], _route_template(scope)
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(seconds)
            return seconds

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent_bytes, elapsed
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                sent_bytes += len(message.get("body", b""))
                if not message.get("more_body", False) and elapsed is None:
                    elapsed = count()
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if elapsed is None:  # no complete answer went out (the app raised, or cancelled)
                elapsed = count()
            route = _route_template(scope)
            method = scope["method"]
            client = scope.get("client")
            access_logger.info(
                json.dumps(
                    {
                        "event": "request",
                        "request_id": request_id,
                        "method": method,
                        "path": scope["path"],
                        "route": route,
                        "status": status,
                        "duration_ms": round(elapsed * 1000, 2),
                        "bytes_in": content_length(scope),
                        "bytes_out": sent_bytes,
                        "client": client[0] if client else None,
                    },
                    separators=(",", ":"),
                )
            )


def _route_template(scope: Scope) -> str:
    # The router records the matched route in the (shared) scope dict.
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else "<unmatched>"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


