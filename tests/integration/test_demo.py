"""`imgret demo` end to end at a tiny scale (the README's first command runs the full size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from imgret.cli.demo import METRICS
from imgret.cli.main import app
from imgret.datasets import FASHION_MNIST_DIR
from imgret.settings import get_settings
from tests.conftest import require


@pytest.fixture(autouse=True)
def _fashion_mnist() -> None:
    require(FASHION_MNIST_DIR.is_dir(), "Fashion-MNIST (apt-get install dataset-fashion-mnist)")


@pytest.mark.slow
def test_the_demo_runs_every_stage_beats_both_baselines_and_reuses_its_work(
    tmp_path: Path, monkeypatch
) -> None:
    """At the demo's own settings (what `make demo` shows a newcomer): every stage runs, the
    trained model's 95% interval lies above both baselines' on MAP@R, R-Precision and P@1, and
    a second run reuses the trained model and the export. One full-size run serves every
    check: it is the slowest test of the suite."""
    monkeypatch.delenv("IMGRET_DATABASE_URL", raising=False)
    monkeypatch.setenv("IMGRET_DATA_DIR", str(tmp_path / "elsewhere"))  # --data-dir wins
    args = ["demo", "--data-dir", str(tmp_path), "--no-serve"]
    try:
        first = CliRunner().invoke(app, args, catch_exceptions=False)
        assert first.exit_code == 0, first.output
        for stage in ("train", "ingest gallery", "ingest query set", "build index", "evaluate"):
            assert f"== {stage}" in first.output
        assert "closed-set retrieval" in first.output
        report = json.loads((tmp_path / "demo_report.json").read_text())
        assert set(report) == {"trained (served index)", "untrained network", "raw pixels"}
        assert not (tmp_path / "elsewhere").exists()
        trained = report["trained (served index)"]
        for name in ("untrained network", "raw pixels"):
            for metric in METRICS:
                assert trained["ci95"][metric][0] > report[name]["ci95"][metric][1], (
                    name, metric, trained["ci95"][metric], report[name]["ci95"][metric])
            assert f"trained vs {name}: better on every metric" in first.output

        second = CliRunner().invoke(app, args, catch_exceptions=False)
        assert second.exit_code == 0, second.output
        assert "trained already" in second.output
        assert "exported already" in second.output
        assert json.loads((tmp_path / "demo_report.json").read_text()) == report
    finally:
        get_settings.cache_clear()
