"""Re-identification end to end, through the CLI a re-ID user runs: a Market-1501-style
folder -> train -> ingest the test gallery -> register the query set -> index -> evaluate
with the same-camera rule (mAP and CMC)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from imgret.cli.main import app
from imgret.settings import get_settings
from tests.support.images import write_market_folder


@pytest.fixture
def market_env(tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = write_market_folder(tmp_path / "Market-1501", identities=8, cameras=3, per_camera=2)
    monkeypatch.setenv("IMGRET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("IMGRET_DATABASE_URL", db_url)
    monkeypatch.setenv("IMGRET_DEVICE", "cpu")
    get_settings.cache_clear()
    yield root
    get_settings.cache_clear()


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


# Six training identities of generated images give a run no reliable gain over its untrained
# network, and a run that does not learn saves no model; this test is about the pipeline.
@pytest.mark.usefixtures("untrained_scores_zero")
def test_market1501_folder_to_reid_report(market_env: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run("train", "--data", str(market_env / "bounding_box_train"), "--protocol", "closed-set",
         "--loss", "triplet", "--backbone", "tiny_cnn", "--dim", "16", "--image-size", "32",
         "--epochs", "1", "--batch-size", "8", "--no-progress", "--out", str(run))
    assert (run / "model.pt").is_file()

    _run("ingest", str(market_env / "bounding_box_test"), "--model", str(run), "--no-progress")
    _run("ingest", str(market_env / "query"), "--model", str(run), "--query-set", "market-query",
         "--no-progress")
    _run("index", "build", "--no-progress")
    report_path = tmp_path / "report.json"
    _run("evaluate", "--query-set", "market-query", "--k", "1,5,10", "--exclude-same-camera",
         "--json", str(report_path))
    report = json.loads(report_path.read_text())

    # 4 test identities, one query each, all seen by cameras 2 and 3 in the gallery.
    assert report["num_queries"] == 4
    assert report["num_skipped"] == 0
    assert "same-camera" in report["protocol"] or report.get("exclude_same_camera")
    cmc = report["recall_at_k"]
    assert 0.0 <= cmc["1"] <= cmc["5"] <= cmc["10"] <= 1.0
    assert 0.0 < report["mean_average_precision"] <= 1.0
    # The junk image (identity -1) was skipped, the distractor (0000) kept as a negative.
    assert report["gallery_size"] == 4 * 3 * 2 + 1
