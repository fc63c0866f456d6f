"""Where a whole tune + benchmark stands, and how long the rest should take.

The work is counted in *fold runs* (one ``train`` call: a trial's fold, or a final run's
fold), plus the tests of the tuning trials' models. Each piece is logged when it starts, with
the number done of the total and an ETA: for each kind of work, the mean wall time of the
pieces of that kind *trained in this process* times the pieces of it left. A piece found
finished by an earlier process counts as done but not in the means (it took no time now), so
a resumed benchmark's ETA is not fooled by the pieces it skips. A kind with no timing yet is
estimated from a timed kind by :data:`RELATIVE_COST` (a final fold run costs a trial's fold
plus its test evaluation: about 1.3 of it, timed on tiny_cnn).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping

logger = logging.getLogger(__name__)

# The cost of a piece of each kind relative to a tuning trial's fold run.
RELATIVE_COST = {"trial": 1.0, "final": 1.3, "trial test": 0.2}


class Progress:
    """Counts pieces of work by kind and logs each with an ETA.

    Args:
        planned: how many pieces of each kind the whole job has (kinds of
            :data:`RELATIVE_COST`).
    """

    def __init__(self, planned: Mapping[str, int]):
        self.planned = dict(planned)
        self.done = dict.fromkeys(self.planned, 0)
        self.timings: dict[str, list[float]] = {kind: [] for kind in self.planned}

    @property
    def total(self) -> int:
        return sum(self.planned.values())

    def skip(self, kind: str, count: int = 1) -> None:
        """Count pieces found finished (by an earlier process) as done."""
        self.done[kind] = self.done.get(kind, 0) + count

    def remaining_s(self) -> float | None:
        """Expected seconds for the pieces left; ``None`` before anything was timed."""
        per_unit = {kind: sum(t) / len(t) / RELATIVE_COST[kind]
                    for kind, t in self.timings.items() if t}
        if not per_unit:
            return None
        unit = sum(per_unit.values()) / len(per_unit)  # a trial fold's seconds, estimated
        seconds = 0.0
        for kind, planned in self.planned.items():
            left = max(0, planned - self.done.get(kind, 0))
            timed = self.timings.get(kind)
            each = sum(timed) / len(timed) if timed else unit * RELATIVE_COST[kind]
            seconds += left * each
        return seconds

    def describe(self) -> str:
        """E.g. ``"37/1360 done; ETA 5 h 10 min"``."""
        done = sum(min(self.done.get(k, 0), n) for k, n in self.planned.items())
        left = self.remaining_s()
        eta = "ETA after the first timed piece" if left is None else f"ETA {format_eta(left)}"
        return f"{done}/{self.total} done; {eta}"

    @contextlib.contextmanager
    def piece(self, kind: str, label: str, *, fresh: bool = True) -> Iterator[None]:
        """Log ``label`` and the progress, run the piece, count it (timed when ``fresh``:
        it was not finished already)."""
        logger.info("%s | %s", label, self.describe())
        started = time.perf_counter()
        yield
        self.done[kind] = self.done.get(kind, 0) + 1
        if fresh:
            self.timings.setdefault(kind, []).append(time.perf_counter() - started)


def format_eta(seconds: float) -> str:
    """``3725`` -> ``"1 h 02 min"``; under an hour ``"12 min"``; under a minute ``"40 s"``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = int(round(seconds / 60))
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min"
