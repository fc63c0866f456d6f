"""Any data size trains or is refused in one line: classes x images per class x batch sizes.

The sweep runs what decides it, without training: the split, the batch plan and one epoch of
the sampler (every batch whole, ``batch / m`` distinct classes of ``m`` images). A few real
``imgret train`` runs through the CLI cover the edge cases end to end (exit code, the log line
saying what was lowered, the one-line refusal). ``python -m tests.unit.training.test_small_data``
prints the sweep as a table.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imgret.cli.train import NOT_LEARNED_EXIT
from imgret.training.config import TrainConfig, TrainConfigError
from imgret.training.data import MPerClassSampler, make_split, plan_batches
from imgret.training.data.sources import ArrayImageSource

CLASSES = (2, 3, 4, 6, 8, 20)
PER_CLASS = (1, 2, 3, 4, 6, 10, 50)
BATCHES = (2, 3, 4, 8, 16, 32, 64, 128)
PROTOCOLS = ("class-disjoint", "closed-set")


def _source(classes: int, per_class: int) -> ArrayImageSource:
    labels = np.array([f"c{c:02d}" for c in range(classes) for _ in range(per_class)],
                      dtype=object)
    pixels = np.zeros((len(labels), 8, 8), dtype=np.uint8)
    return ArrayImageSource("synthetic", pixels, labels, np.zeros(len(labels), dtype=bool))


def _cell(protocol: str, classes: int, per_class: int, batch: int) -> str:
    """``"batch B (C x M)"`` for a split that trains (lowered options marked ``*``), else
    ``"refused: <message>"``; asserts every promise of the sampler on the way."""
    source = _source(classes, per_class)
    config = TrainConfig(data="synthetic", protocol=protocol, batch_size=batch)
    try:
        split = make_split(source, config)
        train_labels = source.labels[split.indices["train"]]
        _, targets = np.unique(train_labels, return_inverse=True)
        plan = plan_batches(batch, None, np.bincount(targets))
    except TrainConfigError as exc:
        message = str(exc)
        assert "\n" not in message and message, message
        return f"refused: {message}"
    sampler = MPerClassSampler(targets, plan.m_per_class, plan.batch_size, len(targets), seed=0)
    indices = np.array(list(sampler))
    assert len(indices) >= plan.batch_size, "an epoch without a whole batch"
    for rows in indices.reshape(-1, plan.batch_size):
        kinds, counts = np.unique(targets[rows], return_counts=True)
        assert len(kinds) == plan.batch_size // plan.m_per_class
        assert set(counts.tolist()) == {plan.m_per_class}
    assert (plan.batch_size < batch) == any(c.startswith("batch ") for c in plan.changes)
    # m is at most the median class: most classes fill their share without repeats.
    assert plan.m_per_class <= np.median(np.bincount(targets))
    mark = "*" if plan.changes else ""
    return f"batch {plan.batch_size}{mark} ({plan.batch_size // plan.m_per_class} x " \
           f"{plan.m_per_class})"


def sweep(protocol: str) -> dict[tuple[int, int, int], str]:
    """Every (classes, images per class, batch) cell of one protocol."""
    return {(c, n, b): _cell(protocol, c, n, b)
            for c, n, b in itertools.product(CLASSES, PER_CLASS, BATCHES)}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_size_trains_or_is_refused_in_one_line(protocol: str) -> None:
    cells = sweep(protocol)
    for (_, per_class, _), outcome in cells.items():
        if per_class == 1:  # single-image classes are dropped: nothing is left to train on
            assert outcome.startswith("refused"), outcome
    # Enough data always trains, at any batch size.
    enough = 6 if protocol == "class-disjoint" else 2
    for (classes, per_class, batch), outcome in cells.items():
        if classes >= enough and per_class >= 4:
            assert outcome.startswith("batch"), ((classes, per_class, batch), outcome)


def test_a_requested_batch_that_fits_is_kept() -> None:
    plan = plan_batches(32, 8, [10] * 6)
    assert (plan.batch_size, plan.m_per_class, plan.changes) == (32, 8, ())


def test_a_small_split_lowers_the_batch_and_says_why() -> None:
    plan = plan_batches(64, None, [6] * 4)
    assert (plan.batch_size, plan.m_per_class) == (24, 6)
    assert plan.changes == ("batch 64 -> 24: only 24 training images",)
    plan = plan_batches(64, 16, [6] * 9 + [200])
    assert (plan.batch_size, plan.m_per_class) == (60, 6)
    assert plan.changes == (
        "batch 64 -> 60: 10 training classes x at most 6 images each (the median class size)",
        "m_per_class 16 -> 6: the median training class has 6 images",
    )


def test_each_process_needs_a_whole_batch() -> None:
    plan = plan_batches(64, None, [10] * 4, world_size=2)
    assert plan.batch_size == 20
    assert plan.changes[0] == "batch 64 -> 20: only 40 training images for 2 processes"


def test_no_positive_pair_is_refused_naming_the_fix() -> None:
    with pytest.raises(TrainConfigError, match="add images or classes"):
        plan_batches(8, None, [1, 1, 1])


# ------------------------------------------------------------------ real runs through the CLI


def _folder(root: Path, classes: int, per_class: int) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (12, 12), dtype=np.uint8)
            Image.fromarray(pixels, mode="L").save(folder / f"{i}.png")
    return root


def _train(tmp_path: Path, classes: int, per_class: int, *extra: str):
    """``imgret train`` as a user runs it (its own process: exit code, stderr)."""
    data = _folder(tmp_path / "data", classes, per_class)
    args = ["train", "--data", str(data), "--loss", "multi_similarity", "--backbone", "tiny_cnn",
            "--dim", "8", "--image-size", "12", "--epochs", "1", "--no-progress",
            "--out", str(tmp_path / "run"), *extra]
    return subprocess.run([sys.executable, "-m", "imgret.cli.main", *args], capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    ("classes", "per_class", "extra", "said"),
    # How many classes the class-disjoint split trains on is the split's business.
    [(8, 6, (), r"WARNING imgret.training.loop: batch 64 -> \d+: only \d+ training images\n"),
     (2, 4, ("--protocol", "closed-set", "--batch-size", "128"),
      r"batch 128 -> 4: only 4 training images"),
     (6, 4, ("--batch-size", "2", "--m-per-class", "2"), r"batches of 2: 1 classes x 2 images")],
)
def test_tiny_folders_train(tmp_path: Path, classes, per_class, extra, said) -> None:
    result = _train(tmp_path, classes, per_class, *extra)
    # Noise images give nothing to learn: the run either beats its untrained network by
    # chance (a model) or says it did not learn (no model); either way it trained.
    assert result.returncode in (0, NOT_LEARNED_EXIT), result.stderr
    assert re.search(said, result.stderr), result.stderr
    assert (tmp_path / "run" / "model.pt").is_file() == (result.returncode == 0)
    assert (tmp_path / "run" / "metrics.json").is_file()


@pytest.mark.parametrize(
    ("classes", "per_class", "extra", "fix"),
    [(3, 1, ("--protocol", "closed-set"), "the train split has 0 class(es)"),
     (4, 6, (), "use --protocol closed-set")],
)
def test_tiny_folders_are_refused_in_one_line(tmp_path, classes, per_class, extra, fix) -> None:
    result = _train(tmp_path, classes, per_class, *extra)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fix in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.rstrip().endswith(errors[0])


if __name__ == "__main__":
    for protocol in PROTOCOLS:
        cells = sweep(protocol)
        print(f"\n{protocol}: images per class down, classes x batch across")
        for n in PER_CLASS:
            for c in CLASSES:
                outcomes = [cells[(c, n, b)] for b in BATCHES]
                short = ["refused" if o.startswith("refused") else o.split(" ")[1]
                         for o in outcomes]
                print(f"{c:>3} x {n:<3}", " ".join(f"{o:>8}" for o in short))
