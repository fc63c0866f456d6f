"""int8 versions, end to end on a real database (SQLite and PostgreSQL): `imgret export VERSION
--quantize int8` calibrates on stored images and registers a version of its own, which is
re-embedded, compared with its parent, gated by the verdict and then served by ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from imgret.cli.main import app

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture
def env(cli_env: Path) -> Path:
    return cli_env


def run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_an_int8_version_is_calibrated_registered_compared_and_gated(
        env: Path, image_folder: Path) -> None:
    from imgret.cli.jobs.gallery import open_gallery
    from imgret.gallery.versions import intake
    from imgret.settings import get_settings

    run("ingest", str(image_folder), "--no-progress")
    run("ingest", str(image_folder), "--query-set", "q", "--no-progress")
    parent = json.loads(run("models", "list", "--json"))["active"]
    out = env / "int8"
    printed = run("export", parent, "--quantize", "int8", "--query-set", "q", "--out", str(out),
                  "--calibration-images", "8", "--speed-seconds", "0.2")
    report = json.loads((out / "int8_report.json").read_text())
    int8 = report["version"]
    assert int8.startswith("tiny_cnn-d16-int8-") and int8 in printed
    assert report["parent"] == parent and report["calibration_images"] == 8
    assert set(report["speed"]) == {"torch eager", "onnxruntime", "int8"}
    assert "| int8 |" in printed
    assert 0.9 < report["cosine_min"] <= report["cosine_mean"] <= 1.0 + 1e-6
    comparison = report["comparison"]
    assert comparison["a"]["model_version"] == parent
    assert comparison["b"]["model_version"] == int8
    low, high = comparison["difference"]["map_at_r"]["ci95"]
    assert low <= comparison["difference"]["map_at_r"]["difference"] <= high

    # The exported model.onnx is the int8 version's own graph.
    graph = onnx.load(str(out / "model.onnx"))
    assert any(node.op_type == "QuantizeLinear" for node in graph.graph.node)
    assert json.loads((out / "preprocessing.json").read_text())["model_version"] == int8
    assert (out / "triton" / int8 / "config.pbtxt").is_file()

    listing = {m["version"]: m for m in json.loads(run("models", "list", "--json"))["models"]}
    assert listing[int8]["coverage"]["complete"]

    # Its stored vectors are what its embedder gives: ONNX Runtime runs it, even when the
    # service's runtime setting says torch.
    settings = get_settings()
    with open_gallery(settings) as sessions:
        embedder = intake.load_embedder(int8, session_factory=sessions,
                                        data_dir=settings.data_dir, device="cpu",
                                        runtime="torch")
        again = intake.load_embedder(parent, session_factory=sessions,
                                     data_dir=settings.data_dir, device="cpu")
    assert embedder.runtime == "onnxruntime" and embedder.scheme == "int8"
    assert again.runtime == "torch" and again.scheme is None

    # The gate decides, on the verdict the report showed.
    gated = CliRunner().invoke(app, ["models", "activate", int8, "--require", "not_worse",
                                     "--query-set", "q"])
    worse = "worse" in comparison["verdict"].values()
    assert (gated.exit_code != 0) == worse, gated.output
    if not worse:
        assert json.loads(run("models", "list", "--json"))["active"] == int8


def test_quantising_needs_stored_images_and_a_float_version(
        env: Path, image_folder: Path, tiny_checkpoint: Path) -> None:
    from imgret.cli.jobs.models import quantize
    from imgret.settings import get_settings

    parent = run("models", "register", str(tiny_checkpoint)).split()[1]
    empty = CliRunner().invoke(app, ["export", parent, "--quantize", "int8", "--out",
                                     str(env / "x"), "--speed-seconds", "0"])
    assert empty.exit_code != 0 and "ingest images first" in str(empty.exception)
    assert [m["version"] for m in json.loads(run("models", "list", "--json"))["models"]] \
        == [parent]  # nothing registered

    run("ingest", str(image_folder), "--no-progress")
    made = quantize(get_settings(), parent, images=4, speed_seconds=0)
    assert made.speed == {}
    again = CliRunner().invoke(app, ["export", made.version, "--quantize", "int8", "--out",
                                     str(env / "y"), "--speed-seconds", "0"])
    assert again.exit_code != 0 and "already a int8 version" in str(again.exception)
    # The same calibration again is the same version (content identity): a no-op.
    assert quantize(get_settings(), parent, images=4, speed_seconds=0).version == made.version
    bad = CliRunner().invoke(app, ["export", parent, "--quantize", "int4", "--out",
                                   str(env / "z")])
    assert bad.exit_code != 0 and "int8" in bad.output
    assert np.isfinite(made.cosine_mean)


def test_ingest_and_evaluate_run_the_configured_runtime(env: Path, image_folder: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """IMGRET_RUNTIME reaches every command that embeds, not only the service."""
    from imgret import onnx_runtime
    from imgret.settings import get_settings

    record = env / "runs.txt"  # ingest embeds in forked workers: they append here too
    real = onnx_runtime.OnnxRuntimeModel.run

    def counted(self, batch):
        with record.open("a") as handle:
            handle.write(f"{len(batch)}\n")
        return real(self, batch)

    def runs() -> list[int]:
        return [int(n) for n in record.read_text().split()] if record.exists() else []

    monkeypatch.setattr(onnx_runtime.OnnxRuntimeModel, "run", counted)
    monkeypatch.setenv("IMGRET_RUNTIME", "onnxruntime")
    get_settings.cache_clear()
    run("ingest", str(image_folder), "--no-progress")
    ingested = sum(runs())
    assert ingested >= len(list(image_folder.rglob("*.png")))
    run("ingest", str(image_folder), "--query-set", "q", "--no-progress")
    run("evaluate", "--query-set", "q")
    assert sum(runs()) > ingested


def test_two_concurrent_quantisations_register_one_version(
        env: Path, image_folder: Path) -> None:
    """Two processes' worth of `--quantize int8` at once (each its own engine): the same
    calibration gives the same graph, and registration under the gallery lock makes it one
    version, whichever commits second."""
    import threading

    from imgret.cli.jobs.models import quantize
    from imgret.settings import get_settings

    run("ingest", str(image_folder), "--no-progress")
    parent = json.loads(run("models", "list", "--json"))["active"]
    start = threading.Barrier(2)
    made: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        start.wait()
        try:
            made.append(quantize(get_settings(), parent, images=6, speed_seconds=0).version)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert len(made) == 2 and made[0] == made[1]
    listed = [m["version"] for m in json.loads(run("models", "list", "--json"))["models"]]
    assert sorted(listed) == sorted([parent, made[0]])
