"""The one timer: time a block and hand its wall-clock seconds to whoever keeps them
(a Prometheus histogram, an ingest report, a log line, a demo's stage table)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def timed(record: Callable[[float], object]) -> Iterator[None]:
    """Call ``record(seconds)`` when the block ends, whether it returned or raised."""
    start = time.perf_counter()
    try:
        yield
    finally:
        record(time.perf_counter() - start)
