"""Observability: Prometheus metrics of one app and one structured access-log line per request."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgret.timing import timed
from service.limits import content_length

access_logger = logging.getLogger("service.access")

# Latency buckets from 1 ms to 10 s: a CPU forward pass sits in the tens of milliseconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


class ServiceMetrics:
    """The Prometheus metrics of one app, on a registry of its own.

    A registry per app (not the process-global one) lets tests build many apps in one
    process, and keeps ``/metrics`` free of other libraries' collectors. With several
    uvicorn workers each process reports its own numbers; scrape them per process or run
    one worker per container (the contract's scale-out shape).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        )
        self.follower_lag = Gauge(
            "imgret_follower_lag_seconds",
            "Seconds since this process's index last caught up with the gallery change log.",
            registry=self.registry,
        )
        self.follower_seq = Gauge(
            "imgret_follower_applied_seq", "The last gallery change applied to the index.",
            registry=self.registry,
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
        self.follower_lag.set_function(lag_s)
        self.follower_seq.set_function(seq)

    def track_index_size(self, size: Callable[[], float]) -> None:
        """Read the index size at scrape time (no stale copies to keep up to date)."""
        self.index_size.set_function(size)

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

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent_bytes
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                sent_bytes += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - start
            route = _route_template(scope)
            method = scope["method"]
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(elapsed)
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


