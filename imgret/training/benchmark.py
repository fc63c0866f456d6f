"""The Reality-Check benchmark: several losses x seeds on one shared base config.

``run_benchmark(base, losses, seeds, out)`` trains one run per (loss, seed) cell under
``out/runs/<loss>/seed<k>/`` with :func:`imgret.training.loop.train`. Every cell is the base config
with only its loss block and seed replaced, so backbone, embedding size, optimiser, learning
rate, augmentation, batch composition, split and budget are the same for every loss. The
runner is resumable: a finished cell is not run again, an interrupted one continues from its
``last.pt``. The results (``results.md``, ``results.json``, ``bars.png``, ``curves.png``) are
aggregated and written by :mod:`imgret.training.report`.

Cross-validation (``cv_folds`` = k > 0, the Reality Check's protocol): a cell is one fold
run, ``out/runs/<loss>/seed<k>/fold<j>/``; a *run* is the k fold runs of one (loss, seed).
Each fold model is tested alone (its ``metrics.json``), and when a run's last fold is done its
k models are tested concatenated (:func:`imgret.training.crossval.test_run`, ``test.json`` in
the run directory). Controls (``controls``: :data:`imgret.training.config.CONTROLS`) run
beside the losses under the same base config, with the first loss's block: shuffled labels
(k folds, like a loss) and the oracle (one model per seed, trained on the test classes).

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

from imgret.training.config import CONTROLS, LossConfig, TrainConfig, base_config, config_diff
from imgret.training.crossval import fold_dir, fold_ids, is_finished, test_run
from imgret.training.loop import train
from imgret.training.progress import Progress
from imgret.training.registry import LOSSES, loss_spec, resolve_miner
from imgret.training.report import BenchmarkMismatch, aggregate, check_comparable, describe_diff
from imgret.training.report_output import write_report

logger = logging.getLogger(__name__)

MANIFEST_FILE = "benchmark.json"
# check_comparable is re-exported for tests/unit/training/test_benchmark.py.
__all__ = ["BenchmarkMismatch", "Cell", "check_comparable", "cell_name", "parse_losses",
           "plan_cells", "run_benchmark"]


@dataclass(frozen=True)
class Cell:
    """One (loss, seed[, fold]) training run of a benchmark.

    Attributes:
        name: the row it belongs to (the loss, or the control).
        config: the base with the loss block, seed, fold and control set.
        out: its run directory.
        run: the directory of the (loss, seed) run it is part of (``out`` without folds).
    """

    name: str
    config: TrainConfig
    out: Path
    run: Path | None = None


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
    base: TrainConfig, losses: Sequence[LossConfig], seeds: Sequence[int], out: Path,
    controls: Sequence[str] = (), control_loss: LossConfig | None = None,
) -> list[Cell]:
    """Every (loss, seed[, fold]) config: the base with only ``loss`` and ``seed`` (and the
    fold, under cross-validation) replaced; then the controls' cells, trained with
    ``control_loss`` (default: the first loss)."""
    rows = [(cell_name(loss), loss, None) for loss in losses]
    for control in controls:
        if control not in CONTROLS:
            raise BenchmarkMismatch(f"unknown control {control!r}; choose from "
                                    f"{', '.join(CONTROLS)}")
        rows.append((control, control_loss or losses[0], control))
    cells = []
    for name, loss, control in rows:
        for seed in seeds:
            run_dir = out / "runs" / name / f"seed{seed}"
            config = dataclasses.replace(base, loss=loss, seed=seed, control=control)
            for fold in fold_ids(config):
                cells.append(Cell(name, dataclasses.replace(config, fold=fold),
                                  fold_dir(run_dir, fold), run_dir))
    return cells


def run_benchmark(
    base: TrainConfig, losses: Sequence[LossConfig], seeds: Sequence[int], out: str | Path,
    *, command: str = "", progress: bool = True, tuning: dict[str, Any] | None = None,
    controls: Sequence[str] = (), control_loss: LossConfig | None = None,
    tracker: Progress | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell, test each cross-validated run's fold models concatenated,
    then aggregate and write the report.

    Args:
        base: the shared config (its ``loss`` and ``seed`` are ignored).
        losses: the loss blocks to compare (tuned ones carry their tuned values).
        seeds: the training seeds (the split does not depend on them).
        out: the benchmark directory.
        command: the command line, recorded in the report for reproduction.
        tuning: how the loss blocks were tuned (``imgret.training.tune``), kept in the results
            under ``"tuning"``.
        controls: control rows to run beside the losses (:data:`CONTROLS`).
        control_loss: the loss block the controls train with (default: the first loss).
        tracker: the progress of a larger job this benchmark ends (its ``"final"`` pieces).

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
    cells = plan_cells(base, losses, seeds, out, controls, control_loss)
    manifest = {
        "base": shared, "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "losses": {cell_name(loss): dataclasses.asdict(loss) for loss in losses},
        "controls": list(controls),
        "cells": [{"loss": c.name, "seed": c.config.seed, "dir": str(c.out.relative_to(out))}
                  | ({"fold": c.config.fold} if c.config.fold is not None else {})
                  for c in cells],
    }
    manifest_path.write_text(json.dumps(manifest, indent=1))
    tracker = tracker or Progress({"final": len(cells)})
    for i, cell in enumerate(cells, start=1):
        fold = ("" if cell.config.fold is None
                else f", fold {cell.config.fold + 1}/{cell.config.cv_folds}")
        label = f"benchmark cell {i}/{len(cells)}: {cell.name} seed {cell.config.seed}{fold}"
        with tracker.piece("final", label, fresh=not is_finished(cell.out)):
            train(cell.config, cell.out, resume=True, progress=progress)
        if base.cv_folds and cell.config.fold == base.cv_folds - 1:
            # The run's last fold is done: test its fold models concatenated.
            test_run(cell.run, fold_ids(cell.config), device=base.device)
    results = aggregate(out, cells)
    results["command"] = command
    if tuning is not None:
        results["tuning"] = tuning
    write_report(results, out)
    return results
