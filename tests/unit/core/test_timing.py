"""The one timer hands the block's seconds to its recorder, also when the block raises."""

from __future__ import annotations

import time

import pytest

from imgret.timing import timed


def test_the_recorder_gets_the_wall_time_of_the_block() -> None:
    seen: list[float] = []
    with timed(seen.append):
        time.sleep(0.01)
    assert len(seen) == 1 and seen[0] >= 0.01


def test_a_block_that_raises_is_timed_and_the_error_goes_on() -> None:
    seen: list[float] = []
    with pytest.raises(KeyError), timed(seen.append):
        raise KeyError("x")
    assert len(seen) == 1 and seen[0] >= 0
