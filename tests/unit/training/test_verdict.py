"""The run's verdict: trained vs raw pixels and the untrained network on the same test queries
(paired bootstrap), and the warning for a class-disjoint test split too small to mean much."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from imgret.cli.main import app
from imgret.stats import BETTER, NO_DIFFERENCE, WORSE, bootstrap_ci
from imgret.training.scoring import (
    MIN_TEST_CLASSES,
    MIN_TEST_IMAGES,
    baseline_verdicts,
    small_split_warning,
    verdict_lines,
)
from tests.conftest import TEST_DEVICE


def _report(map_at_r: np.ndarray, query_index: list[int] | None = None) -> dict:
    """A metrics dict with hand-made per-query values (P@1 follows AP@R: a hit first when the
    query's AP@R is at least a half)."""
    n = len(map_at_r)
    first = [1 if v >= 0.5 else 2 for v in map_at_r]
    return {"map_at_r": float(np.mean(map_at_r)), "per_query": {
        "query_index": query_index if query_index is not None else list(range(n)),
        "num_relevant": [5] * n, "average_precision": [float(v) for v in map_at_r],
        "map_at_r": [float(v) for v in map_at_r], "first_relevant_rank": first}}


# Per-query values that spread widely between queries, as real ones do.
BASE = np.random.default_rng(0).uniform(0.05, 0.75, 60)


@pytest.mark.parametrize(("trained", "expected", "said"), [
    (BASE + 0.2, BETTER, "trained beats {} on MAP@R by +"),
    (BASE + np.where(np.arange(60) % 2, 0.1, -0.1), NO_DIFFERENCE,
     "trained vs {} on MAP@R: no detectable difference, "),
    (BASE - 0.2, WORSE, "trained is worse than {} on MAP@R by -"),
])
def test_the_verdict_reads_the_paired_interval(trained, expected, said) -> None:
    verdicts = baseline_verdicts(_report(trained), {"raw_pixels": _report(BASE)})
    found = verdicts["raw_pixels"]["map_at_r"]
    assert found["verdict"] == expected
    assert found["difference"] == pytest.approx(float(np.mean(trained - BASE)))
    assert found["ci95"][0] <= found["difference"] <= found["ci95"][1]
    assert found["num_paired"] == len(BASE)
    (line,) = verdict_lines({"baselines": verdicts})
    assert line.startswith("verdict: " + said.format("raw pixels")), line
    assert line.endswith("(paired 95% interval)")


def test_pairing_finds_a_small_gain_that_unpaired_intervals_hide() -> None:
    """+0.02 on every query: the two unpaired intervals overlap, the paired one is above 0."""
    trained = BASE + 0.02
    verdicts = baseline_verdicts(_report(trained), {"untrained": _report(BASE)})
    assert verdicts["untrained"]["map_at_r"]["verdict"] == BETTER
    (lo_t,), (hi_t,) = bootstrap_ci(trained[:, None], 1000, 0)
    (lo_b,), (hi_b,) = bootstrap_ci(BASE[:, None], 1000, 0)
    assert lo_t < hi_b  # unpaired: not apart


def test_queries_are_paired_by_index() -> None:
    """A query the baseline skipped is left out; the rest pair by their index, not position."""
    order = list(range(1, 60))[::-1]
    baseline = _report(BASE[order], query_index=order)
    verdicts = baseline_verdicts(_report(BASE + 0.2), {"raw_pixels": baseline})
    found = verdicts["raw_pixels"]["map_at_r"]
    assert found["num_paired"] == 59
    assert found["difference"] == pytest.approx(0.2)
    assert found["ci95"][1] - found["ci95"][0] == pytest.approx(0.0, abs=1e-9)


def _summary(protocol: str, classes: int, images: int) -> dict:
    return {"protocol": protocol,
            "splits": {"test": {"num_classes": classes, "num_images": images}}}


def test_the_small_split_warning_follows_the_test_split_size() -> None:
    assert small_split_warning(_summary("class-disjoint", MIN_TEST_CLASSES, MIN_TEST_IMAGES)) \
        is None
    for classes, images in ((MIN_TEST_CLASSES - 1, 1000), (40, MIN_TEST_IMAGES - 1)):
        text = small_split_warning(_summary("class-disjoint", classes, images))
        assert text is not None and "--protocol closed-set" in text and "\n" not in text
    assert small_split_warning(_summary("closed-set", 2, 8)) is None


# ------------------------------------------------------------------ through `imgret train`

LINE = re.compile(r"^verdict: trained (?:beats|is worse than|vs) (raw pixels|the untrained "
                  r"network) on MAP@R(?::| by)?(?: ([a-z ]+),)? ?([+-]\d\.\d{4}) "
                  r"\[(-?\d\.\d{4}), (-?\d\.\d{4})\] \(paired 95% interval\)$")
NAMES = {"raw pixels": "raw_pixels", "the untrained network": "untrained"}


@pytest.fixture(scope="module")
def twenty_four_glyphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 classes x 6 images: 12 test classes, 72 test images (above both thresholds)."""
    from tests.support.images import write_glyph_folder

    return write_glyph_folder(tmp_path_factory.mktemp("glyphs"), classes=24, per_class=6,
                              size=16)


@pytest.mark.usefixtures("untrained_scores_zero")
@pytest.mark.parametrize("folder", ["eight_classes", "twenty_four_glyphs"])
def test_train_prints_the_verdict_that_metrics_json_holds(
    folder: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    data = request.getfixturevalue(folder)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--data", str(data), "--loss", "multi_similarity", "--backbone", "tiny_cnn",
        "--dim", "8", "--image-size", "16", "--epochs", "1", "--device", TEST_DEVICE,
        "--no-progress", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output + repr(result.exception)
    metrics = json.loads((out / "metrics.json").read_text())
    verdict = metrics["verdict"]
    assert "per_query" not in metrics["test"]  # the record keeps summaries only

    lines = [line for line in result.output.splitlines() if line.startswith("verdict: ")]
    assert len(lines) == 2, result.output
    for line in lines:
        match = LINE.match(line)
        assert match, line
        name = NAMES[match.group(1)]
        stored = verdict["baselines"][name]["map_at_r"]
        assert float(match.group(3)) == pytest.approx(stored["difference"], abs=5e-5)
        assert [float(match.group(4)), float(match.group(5))] == pytest.approx(
            stored["ci95"], abs=5e-5)
        word = {BETTER: "beats", WORSE: "is worse than", NO_DIFFERENCE: "vs"}[stored["verdict"]]
        assert line.startswith(f"verdict: trained {word} "), line
        # Every test query is paired, so the paired mean difference is the difference of the
        # reported means.
        assert stored["difference"] == pytest.approx(
            metrics["test"]["map_at_r"] - metrics["baselines"][name]["map_at_r"], abs=1e-9)

    test = metrics["split"]["splits"]["test"]
    small = test["num_classes"] < MIN_TEST_CLASSES or test["num_images"] < MIN_TEST_IMAGES
    assert small == (folder == "eight_classes")
    warnings = [line for line in result.output.splitlines()
                if "class-disjoint result is not meaningful" in line]
    assert len(warnings) == int(small), result.output
    assert verdict["small_split_warning"] == (warnings[0] if small else None)
