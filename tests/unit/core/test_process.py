"""imgret.process: long-lived objects kept out of garbage collection for a block."""

from __future__ import annotations

import gc
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
