"""Process-wide state of long-running work: the objects that live as long as it does are kept
out of Python's garbage collections.

A process that imported torch, torchvision, numpy, SQLAlchemy, pydantic and FastAPI and
loaded a model holds ~460,000 objects tracked by the cyclic garbage collector. Every full
collection scans all of them with the process stopped: ~200-300 ms on the 2-core machine
this was measured on, every 20-40 s of serving under load (every request in flight waited:
p99 217-263 ms at a p50 of ~55 ms, see docs/service_bench.md) and about once per few
thousand ingested images (the ingest's pipeline stalled meanwhile). ``gc.freeze`` moves them
to a permanent generation that collections skip, so a full collection scans only what was
made since (1-4 ms); forked workers that inherit them frozen do not write to their pages
when they collect either (the copy-on-write the ``gc.freeze`` documentation warns about).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_depth = 0  # how many frozen_long_lived blocks are open


@contextlib.contextmanager
def frozen_long_lived() -> Iterator[None]:
    """Freeze every object that exists now (after collecting the young generations) for the
    length of the block: they are still freed by reference counting, and cycles among them
    are collected once the outermost block ends (``gc.unfreeze``).

    Enter it once the long-lived objects exist (the app started, the model loaded) and, in
    a process that forks workers, before it forks. Blocks nest (an ingest inside a serving
    process): an inner one freezes what was made since, and only the outermost unfreezes.
    There is no full collection first: it takes as long as the pauses this avoids (~175 ms),
    and the tests start an app per test; what start-up left as cyclic garbage since the last
    full collection stays until the block ends.
    """
    global _depth
    started = time.perf_counter()
    with _lock:
        gc.collect(1)
        gc.freeze()
        _depth += 1
    if logger.isEnabledFor(logging.DEBUG):
        # Only then: get_freeze_count walks the whole permanent generation (~35 ms for the
        # ~500,000 objects of a serving or ingesting process), on every block.
        logger.debug("%d objects kept out of garbage collection (%.1f ms)",
                     gc.get_freeze_count(), (time.perf_counter() - started) * 1000)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
