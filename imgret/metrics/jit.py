"""numba compilation for :mod:`imgret.metrics`: each loop is written once as plain Python (so the
tests can run it step by step) and compiled here, with the names it calls swapped for compiled
ones.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def with_globals(fn: Callable, names: dict[str, Any]) -> Callable:
    """A copy of ``fn`` whose globals ``names`` are replaced (the compiled versions), so that
    the module's own functions stay plain Python."""
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__)
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return copy


def compile_loop(fn: Callable, names: dict[str, Any] | None = None, *, parallel: bool) -> Callable:
    """``fn`` compiled by numba (``_prange`` is ``numba.prange``, plus ``names``), cached on disk
    when the package directory is writable. Imports numba (~0.5 s), which only an evaluation
    should pay: call it lazily, behind ``functools.cache``."""
    import numba

    fn = with_globals(fn, {"_prange": numba.prange, **(names or {})})
    options = {"parallel": parallel, "nogil": True, "boundscheck": False}
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # no writable cache location: compile without caching
        return numba.njit(**options)(fn)
