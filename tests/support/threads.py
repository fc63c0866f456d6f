"""The threads of this process that Python did not start (OpenMP workers among them), torch
work that starts them, thread counts set for a block, and concurrent calls with a gauge of
how many overlap."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


def native_threads() -> int:
    """How many threads of this process are not Python threads."""
    python = {thread.native_id for thread in threading.enumerate()}
    return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python)


def native_threads_settle_at(expected: int, timeout_s: float = 5.0) -> bool:
    """Whether :func:`native_threads` comes to ``expected`` within ``timeout_s`` (a thread
    that ends takes a moment to be gone from ``/proc``)."""
    deadline = time.monotonic() + timeout_s
    while native_threads() != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def steady_native_threads(steady_s: float = 0.2, timeout_s: float = 5.0) -> int:
    """:func:`native_threads` once it has not changed for ``steady_s`` (threads that were
    ending are gone): a baseline to compare with."""
    deadline = time.monotonic() + timeout_s
    count, since = native_threads(), time.monotonic()
    while time.monotonic() - since < steady_s and time.monotonic() < deadline:
        time.sleep(0.01)
        now = native_threads()
        if now != count:
            count, since = now, time.monotonic()
    return count


@contextlib.contextmanager
def thread_count(n: int, get: Callable[[], int], set_: Callable[[int], Any]) -> Iterator[None]:
    """A library's thread count (read with ``get``, changed with ``set_``) at ``n`` for the
    block, then back to what it was."""
    before = get()
    set_(n)
    try:
        yield
    finally:
        set_(before)


def torch_threads(n: int) -> contextlib.AbstractContextManager[None]:
    """torch on ``n`` intra-op threads for the block (threads started in it begin with that
    count too), then back to what it was."""
    import torch

    return thread_count(n, torch.get_num_threads, torch.set_num_threads)


def omp_threads(n: int) -> contextlib.AbstractContextManager[None]:
    """FAISS's OpenMP on ``n`` threads (for this thread) for the block."""
    import faiss

    return thread_count(n, faiss.omp_get_max_threads, faiss.omp_set_num_threads)


def parallel_torch_op() -> None:
    """A torch operator large enough to be split across the calling thread's OpenMP team
    (4 Mi elements), so that the thread starts one."""
    import torch

    torch.ones(1 << 22).add_(1)


def run_in_threads(fn: Callable[[], Any], n: int,
                   timeout_s: float | None = None) -> tuple[list[Any], list[BaseException]]:
    """Call ``fn`` from ``n`` threads at once: ``(results, errors)``, each in the order the
    calls ended (an error in a thread is returned, not lost in the thread)."""
    results: list[Any] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            results.append(fn())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return results, errors


class Overlap:
    """How many threads were inside a section at once, at most (``most``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self.most = 0

    def enter(self, linger_s: float = 0.0) -> None:
        """Count this thread in, then stay ``linger_s`` (a slow section: threads that
        overlap are caught in it)."""
        with self._lock:
            self._inside += 1
            self.most = max(self.most, self._inside)
        time.sleep(linger_s)

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1

    @contextlib.contextmanager
    def section(self, linger_s: float = 0.0) -> Iterator[None]:
        self.enter(linger_s)
        try:
            yield
        finally:
            self.leave()
