"""The Reality-Check benchmark: several losses x seeds on one shared base config.

``run_benchmark(base, losses, seeds, out)`` trains one run per (loss, seed) cell under
``out/runs/<loss>/seed<k>/`` with :func:`imgret.training.loop.train`. Every cell is the base config
with only its loss block and seed replaced, so backbone, embedding size, optimiser, learning
rate, augmentation, batch composition, split and budget are the same for every loss. The
runner is resumable: a finished cell is not run again, an interrupted one continues from its
``last.pt``. The results (``results.md``, ``results.json``, ``bars.png``, ``curves.png``) are
aggregated and written by :mod:`imgret.training.report`.

Comparing runs whose base configs differ is refused (:class:`BenchmarkMismatch`): in an
existing benchmark directory, and among the cells found there. Tuned hyper-parameters
(``imgret.training.tune``: learning rate, loss options, proxy rate, miner settings) travel in each
loss's block, so a tuned benchmark still shares one identical base.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgret.training.config import LossConfig, TrainConfig, base_config, config_diff
from imgret.training.loop import train
from imgret.training.registry import LOSSES, loss_spec, resolve_miner
from imgret.training.report import (
    BenchmarkMismatch,
    aggregate,
    check_comparable,
    describe_diff,
    write_report,
)

logger = logging.getLogger(__name__)

MANIFEST_FILE = "benchmark.json"
# check_comparable is re-exported for tests/unit/training/test_benchmark.py.
__all__ = ["BenchmarkMismatch", "Cell", "check_comparable", "parse_losses", "plan_cells",
           "run_benchmark"]


@dataclass(frozen=True)
class Cell:
    """One (loss, seed) run of a benchmark."""

    name: str
    config: TrainConfig
    out: Path


def parse_losses(text: str | Sequence[str]) -> list[LossConfig]:
    """``"triplet,triplet:hard,arcface"`` -> loss blocks (``name[:miner]``), validated now so
    that a typo fails before hours of training.

    Raises:
        UnknownName: an unknown loss or miner (the message lists the valid ones).
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    blocks = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, _, miner = item.partition(":")
        loss_spec(name)
        if miner:
            resolve_miner(name, miner)
        blocks.append(LossConfig(name=name, miner=miner or None))
    if not blocks:
        raise BenchmarkMismatch(f"no losses given; choose from {', '.join(LOSSES)}")
    return blocks


def cell_name(loss: LossConfig) -> str:
    return loss.name if loss.miner is None else f"{loss.name}-{loss.miner}"


def plan_cells(
    base: TrainConfig, losses: Sequence[LossConfig], seeds: Sequence[int], out: Path
) -> list[Cell]:
    """Every (loss, seed) config: the base with only ``loss`` and ``seed`` replaced."""
    return [
        Cell(cell_name(loss), dataclasses.replace(base, loss=loss, seed=seed),
             out / "runs" / cell_name(loss) / f"seed{seed}")
        for loss in losses for seed in seeds
    ]


def run_benchmark(
    base: TrainConfig, losses: Sequence[LossConfig], seeds: Sequence[int], out: str | Path,
    *, command: str = "", progress: bool = True, tuning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell, then aggregate and write the report.

    Args:
        base: the shared config (its ``loss`` and ``seed`` are ignored).
        losses: the loss blocks to compare (tuned ones carry their tuned values).
        seeds: the training seeds (the split does not depend on them).
        out: the benchmark directory.
        command: the command line, recorded in the report for reproduction.
        tuning: how the loss blocks were tuned (``imgret.training.tune``), kept in the results
            under ``"tuning"``.

    Returns:
        The aggregated results (also written to ``results.json``).

    Raises:
        BenchmarkMismatch: ``out`` holds a benchmark with a different base config.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shared = base_config(base)
    manifest_path = out / MANIFEST_FILE
    if manifest_path.exists():
        previous = json.loads(manifest_path.read_text())
        diff = config_diff(previous["base"], shared)
        if diff:
            raise BenchmarkMismatch(
                f"{out}: holds a benchmark with a different base config; the runs would not be "
                f"comparable ({describe_diff(diff)}). Use another --out or the same options."
            )
    cells = plan_cells(base, losses, seeds, out)
    manifest = {
        "base": shared, "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "losses": {cell_name(loss): dataclasses.asdict(loss) for loss in losses},
        "cells": [{"loss": c.name, "seed": c.config.seed, "dir": str(c.out.relative_to(out))}
                  for c in cells],
    }
    manifest_path.write_text(json.dumps(manifest, indent=1))
    for i, cell in enumerate(cells, start=1):
        logger.info("benchmark cell %d/%d: %s seed %d", i, len(cells), cell.name, cell.config.seed)
        train(cell.config, cell.out, resume=True, progress=progress)
    results = aggregate(out, cells)
    results["command"] = command
    if tuning is not None:
        results["tuning"] = tuning
    write_report(results, out)
    return results
