"""imgret.process: long-lived objects kept out of garbage collection for a block."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from imgret.process import frozen_long_lived


def test_objects_are_frozen_for_the_block_and_collectable_after_it() -> None:
    """An object alive when the block starts that becomes cyclic garbage inside it survives
    the collections in the block (they skip it) and goes with the first one after it."""
    gc.unfreeze()

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    ref = weakref.ref(cycle)
    with frozen_long_lived():
        assert gc.get_freeze_count() > 1000  # the test process's modules, at least
        del cycle
        gc.collect()
        assert ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_only_the_outermost_block_unfreezes() -> None:
    gc.unfreeze()
    with frozen_long_lived():
        outer = gc.get_freeze_count()
        with frozen_long_lived():
            assert gc.get_freeze_count() >= outer
        assert gc.get_freeze_count() >= outer  # the inner block's end leaves the outer's
    assert gc.get_freeze_count() == 0


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
