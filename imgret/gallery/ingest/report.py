"""What a bulk ingest reports: counts per outcome and seconds per stage."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from imgret.timing import timed

STAGES = ("read", "dedup", "decode", "embed", "write")


@dataclass
class IngestReport:
    """Counts and timings of one bulk ingest (:func:`imgret.gallery.ingest.ingest_source`, or its
    Ray Data variant)."""

    source: str
    model_version: str
    query_set: str | None = None
    total: int = 0
    added: int = 0
    embedded: int = 0
    duplicates: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    wall_seconds: float = 0.0
    # Seconds before the first chunk reached the writer on Ray (its actors starting and
    # loading the model); 0 for the plain ingest, whose start-up is in its stages.
    startup_seconds: float = 0.0

    def rate(self, stage: str) -> float:
        """Images per second through ``stage`` (0 when it processed nothing)."""
        seconds = self.seconds.get(stage, 0.0)
        return self.counts.get(stage, 0) / seconds if seconds > 0 else 0.0

    def summary(self) -> list[str]:
        """Human-readable lines (the CLI prints them)."""
        target = f"query set {self.query_set!r}" if self.query_set else "gallery"
        lines = [
            f"{self.source} -> {target} (model version {self.model_version}): "
            f"{self.total} images, {self.added} added, {self.embedded} existing items "
            f"embedded, {self.duplicates} already present, {len(self.failed)} failed, "
            f"in {self.wall_seconds:.1f}s"
            + (f" ({self.startup_seconds:.1f}s of it starting Ray actors)"
               if self.startup_seconds else ""),
            "stage      images   seconds   images/s",
        ]
        for stage in STAGES:
            lines.append(
                f"{stage:<8} {self.counts[stage]:>8} {self.seconds[stage]:>9.2f} "
                f"{self.rate(stage):>10.1f}"
            )
        if self.failed:
            lines.append(f"skipped {len(self.failed)} unreadable or corrupt files:")
            lines.extend(f"  {path}: {reason}" for path, reason in self.failed)
        return lines


class StageTimer:
    """Accumulates seconds and item counts per stage into a report (autofaiss's Timeit, kept
    as numbers)."""

    def __init__(self, report: IngestReport):
        self.report = report

    def stage(self, name: str, count: int) -> contextlib.AbstractContextManager[None]:
        return timed(lambda seconds: self.add(name, count, seconds))

    def add(self, name: str, count: int, seconds: float) -> None:
        """Count ``count`` images and ``seconds`` (timed elsewhere: a worker) for a stage."""
        self.report.seconds[name] += seconds
        self.report.counts[name] += count
