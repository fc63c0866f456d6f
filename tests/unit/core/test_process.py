"""imgret.process: long-lived objects kept out of garbage collection for a block, and
one-off work on a thread that ends with it."""

from __future__ import annotations

import contextvars
import gc
import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from imgret.process import frozen_long_lived, in_own_thread
from tests.support.threads import (
    native_threads,
    native_threads_settle_at,
    parallel_torch_op,
    steady_native_threads,
    torch_threads,
)


class _Node:
    pass


def _cycle() -> tuple[_Node, weakref.ref]:
    """An object in a reference cycle (only a collection frees it), and a weak reference."""
    node = _Node()
    node.self = node
    return node, weakref.ref(node)


def test_objects_are_frozen_for_the_block_and_collectable_after_it() -> None:
    """An object alive when the block starts that becomes cyclic garbage inside it survives
    the collections in the block (they skip it) and goes with the first one after it."""
    gc.unfreeze()
    cycle, ref = _cycle()
    with frozen_long_lived():
        assert gc.get_freeze_count() > 1000  # the test process's modules, at least
        del cycle
        gc.collect()
        assert ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_only_the_outermost_block_unfreezes() -> None:
    """What the outer block froze stays frozen when an inner block ends. (Told by an object
    that survives collections, not by the frozen count: other threads' objects frozen here
    may be freed by reference counting meanwhile, and the count drops; a CI run saw it.)"""
    gc.unfreeze()
    cycle, ref = _cycle()
    with frozen_long_lived():
        with frozen_long_lived():
            pass
        del cycle
        gc.collect()
        assert ref() is not None  # the inner block's end left the outer's freeze
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_an_error_in_the_block_still_unfreezes() -> None:
    gc.unfreeze()
    with pytest.raises(RuntimeError), frozen_long_lived():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_the_frozen_count_is_only_taken_for_a_debug_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``gc.get_freeze_count`` walks the whole permanent generation (~35 ms in a serving
    process): entering a block must not pay it unless the debug line is logged."""
    calls = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or real())
    gc.unfreeze()
    with caplog.at_level(logging.INFO, logger="imgret.process"), frozen_long_lived():
        pass
    assert calls == []
    with caplog.at_level(logging.DEBUG, logger="imgret.process"), frozen_long_lived():
        pass
    assert len(calls) == 1
    assert "objects kept out of garbage collection" in caplog.text


def test_in_own_thread_returns_the_result_or_raises_the_error_of_a_thread_that_ended() -> None:
    ran_on = []

    def work(a: int, *, b: int) -> int:
        ran_on.append(threading.current_thread())
        return a + b

    assert in_own_thread(work, 2, b=3) == 5
    assert ran_on[0] is not threading.current_thread()
    assert not ran_on[0].is_alive()

    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        in_own_thread(fail)


def test_in_own_thread_sees_the_callers_context_variables() -> None:
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")
    request_id.set("req-7")
    assert in_own_thread(request_id.get) == "req-7"


def test_torch_threads_started_in_own_thread_end_with_it() -> None:
    """The team of OpenMP workers a parallel torch operator starts lives as long as the
    thread that ran it: a pooled thread keeps it (what this helper is for), a thread of
    ``in_own_thread`` takes it along when it ends."""
    import torch

    def parallel_work() -> None:
        assert torch.get_num_threads() == 2
        parallel_torch_op()

    with torch_threads(2):
        before = steady_native_threads()
        in_own_thread(parallel_work)
        assert native_threads_settle_at(before)
        with ThreadPoolExecutor(1) as pool:  # the contrast: a thread that stays
            pool.submit(parallel_work).result()
            assert native_threads() == before + 1  # its one OpenMP worker
        assert native_threads_settle_at(before)
