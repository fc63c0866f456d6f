"""The threads of this process that Python did not start (OpenMP workers among them), and
torch work that starts them."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator


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
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` intra-op threads for the block (threads started in it begin with that
    count too), then back to what it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parallel_torch_op() -> None:
    """A torch operator large enough to be split across the calling thread's OpenMP team
    (4 Mi elements), so that the thread starts one."""
    import torch

    torch.ones(1 << 22).add_(1)
