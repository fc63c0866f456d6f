"""A run directory: what a training run writes, and how it is read back (resume, a finished run).

::

    model.pt      best checkpoint by validation MAP@R (imgret.checkpoint; `extra` holds the
                  config, split summary, per-epoch metrics, test metrics and baselines);
                  never the untrained network: a run whose best epoch is epoch 0 did not
                  learn, says so in metrics.json (``"learned": false``) and has no model.pt
    last.pt       resume state (weights, loss parameters, optimisers, schedulers, RNG, record)
    metrics.json  the record: config, split, per-epoch train loss / validation metrics / wall
                  time / embedding geometry, best epoch, whether the run learned, a collapse
                  that stopped it, test metrics, baselines, the verdict against them
    split.json    the exact split (members of train / val / test)
    curves.png    loss and validation MAP@R against epoch and wall time
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from imgret.checkpoint import EmbeddingNet, save_checkpoint
from imgret.files import write_atomic, write_atomic_with
from imgret.training.config import TrainConfig, TrainConfigError, config_diff
from imgret.training.data import DataSplit, ImageSource
from imgret.training.scoring import to_jsonable

METRICS_FILE = "metrics.json"
LAST_FILE = "last.pt"
SPLIT_FILE = "split.json"
CURVES_FILE = "curves.png"
SELECTION_METRIC = "map_at_r"


@dataclass
class RunResult:
    """What a finished run reports (all of it is also in ``metrics.json``).

    Attributes:
        out: the run directory.
        best_epoch: the epoch whose checkpoint is ``model.pt`` (0: the run did not learn).
        val: validation metrics of the best epoch.
        test: test metrics of the best checkpoint (the test split is evaluated once);
            ``None`` when the run did not learn (or did not test).
        baselines: ``{"raw_pixels": metrics, "untrained": metrics}`` on the same test split.
        split: the split summary (protocol, classes, counts, digest).
        model_version: the version of ``model.pt``; ``None`` when the run did not learn.
        verdict: trained against each baseline on the same test queries (paired intervals,
            ``imgret.training.scoring.baseline_verdicts`` under ``"baselines"``) and the
            small-split warning; ``None`` without a test (or in a run written before it).
        learned: some trained epoch beat the untrained network on validation MAP@R; when
            not, nothing was saved as the trained model.
        collapse: the embedding collapse that stopped the run
            (:func:`imgret.training.geometry.collapse`), else ``None``.
    """

    out: Path
    best_epoch: int
    val: dict[str, Any]
    test: dict[str, Any] | None
    baselines: dict[str, dict[str, Any]] | None
    split: dict[str, Any]
    model_version: str | None
    verdict: dict[str, Any] | None = None
    learned: bool = True
    collapse: dict[str, Any] | None = None

    @classmethod
    def from_metrics(cls, out: Path, data: dict[str, Any]) -> RunResult:
        best = data["best"]
        return cls(out, best["epoch"], best["val"], data.get("test"), data.get("baselines"),
                   data["split"], data.get("model_version"), data.get("verdict"),
                   learned(data), data.get("collapse"))

    def not_learned_message(self) -> str:
        """Why the run gave no model (empty when it learned)."""
        return "" if self.learned else not_learned_message(self.val, self.collapse)


def learned(record: dict[str, Any]) -> bool:
    """Whether a run's record shows learning: its best epoch is a trained one. Records
    written before the flag existed say so by their best epoch (0 = the untrained
    network)."""
    if "learned" in record:
        return bool(record["learned"])
    return record["best"] is not None and record["best"]["epoch"] > 0


def not_learned_message(val: dict[str, Any], collapse: dict[str, Any] | None = None) -> str:
    """The one-line failure of a run whose best epoch is the untrained network."""
    cause = f"; {collapse['message']}" if collapse else ""
    return (f"the run did not learn: no trained epoch beat the untrained network's validation "
            f"{SELECTION_METRIC} of {val[SELECTION_METRIC]:.4f}, so no model was saved "
            f"(metrics.json: \"learned\": false){cause}")


def finished_run(config: TrainConfig, out: Path, *, resume: bool) -> RunResult | None:
    """The result of the finished run in ``out`` when resuming one, else ``None`` (go on).

    Raises:
        TrainConfigError: ``out`` holds a run and ``resume`` is false, or the finished run had
            another config.
    """
    if not resume and ((out / LAST_FILE).exists() or (out / METRICS_FILE).exists()):
        raise TrainConfigError(
            f"{out}: already holds a run; pass --resume to continue it or choose another --out"
        )
    if resume and (out / METRICS_FILE).exists():
        previous = read_record(out)
        if previous.get("status") == "finished":
            # The saved batch composition was fitted to the data; compare what was asked.
            asked = previous["config"] | previous.get("requested_batch", {})
            check_same_config(asked, config, out)
            return RunResult.from_metrics(out, previous)
    return None


def check_same_config(saved: dict[str, Any], config: TrainConfig, out: Path) -> None:
    """Refuse to resume a run with another config (``m_per_class`` and ``image_size``
    resolved from the data at the start count as the same as not given).

    Raises:
        TrainConfigError: naming every option that differs.
    """
    current = config.to_dict()
    for key in ("m_per_class", "image_size"):
        if saved.get(key) is not None and current.get(key) is None:
            current[key] = saved[key]
    diff = config_diff(saved, current)
    if diff:
        details = "; ".join(f"{k}: run has {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise TrainConfigError(f"{out}: cannot resume with a different config ({details})")


def epoch_row(
    epoch: int, train_loss: float | None, lr: float | None, train_time: float, elapsed: float,
    steps: int, val: dict[str, Any], geometry: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One epoch's entry of the record (``geometry``: of the validation embeddings,
    :func:`imgret.training.geometry.embedding_geometry`)."""
    row = {"epoch": epoch, "train_loss": train_loss, "lr": lr, "steps": steps,
           "train_time_s": train_time, "elapsed_s": elapsed, "val": val}
    if geometry is not None:
        row["geometry"] = geometry
    return row


def keep_if_best(
    record: dict[str, Any], model: EmbeddingNet, out: Path, epoch: int, val: dict[str, Any]
) -> None:
    """Model selection on validation MAP@R only (ties keep the earlier epoch): a better epoch
    becomes ``record["best"]`` and ``model.pt``. Epoch 0, the untrained network, is the bar
    a trained epoch must clear; it is recorded as the best so far but never written as
    ``model.pt``."""
    best = record["best"]
    if best is None or val[SELECTION_METRIC] > best["val"][SELECTION_METRIC]:
        record["best"] = {"epoch": epoch, "metric": SELECTION_METRIC, "val": val}
        if epoch > 0:
            save_checkpoint(out, model, extra=checkpoint_extra(record))


def checkpoint_extra(record: dict[str, Any]) -> dict[str, Any]:
    """What ``model.pt`` carries of the record in its ``extra``."""
    keys = ("config", "split", "split_rule", "loss", "best", "test", "baselines", "verdict",
            "epochs", "collapse")
    return to_jsonable({k: record[k] for k in keys if k in record})


def save_state(out: Path, state: dict[str, Any]) -> None:
    """Write ``last.pt`` (crash-safe)."""
    write_atomic_with(out / LAST_FILE, lambda handle: torch.save(state, handle))


def load_state(out: Path, config: TrainConfig, split_digest: str) -> dict[str, Any]:
    """``last.pt``, checked against the run being resumed.

    Raises:
        TrainConfigError: another config, or data that no longer gives the run's split.
    """
    state = torch.load(out / LAST_FILE, map_location="cpu", weights_only=True)
    check_same_config(state["config"], config, out)
    if state["split_digest"] != split_digest:
        raise TrainConfigError(f"{out}: the data no longer gives the split of this run")
    return state


def write_split(out: Path, split: DataSplit, source: ImageSource) -> None:
    """Write ``split.json``: the exact members of train / val / test."""
    (out / SPLIT_FILE).write_text(json.dumps(split.to_json(source), indent=1))


def write_record(out: Path, record: dict[str, Any]) -> None:
    """Write ``metrics.json`` (crash-safe)."""
    write_atomic(out / METRICS_FILE, json.dumps(to_jsonable(record), indent=1).encode())


def read_record(out: Path) -> dict[str, Any]:
    """Read ``metrics.json``."""
    return json.loads((out / METRICS_FILE).read_text())
