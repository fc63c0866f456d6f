"""A stored version exported to ONNX by `imgret export`, and served with IMGRET_RUNTIME=onnxruntime:
the exported graph and the service give the vectors and neighbours of the torch runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from imgret.checkpoint import load_checkpoint
from imgret.settings import get_settings
from imgret.transforms import eval_transform
from tests.api.conftest import add_gallery, png, search
from tests.support.images import class_image

ort = pytest.importorskip("onnxruntime")

TOLERANCE = 1e-4


def _neighbours(client, queries: list[bytes]) -> list[list[tuple[int, float]]]:
    answers = []
    for query in queries:
        response = search(client, query, k=5)
        assert response.status_code == 200, response.text
        answers.append([(hit["id"], hit["score"]) for hit in response.json()["results"]])
    return answers


def test_search_with_onnxruntime_returns_the_torch_neighbours(make_client) -> None:
    queries = [png(label, 10 + i) for label in range(3) for i in range(2)]
    with make_client(runtime="torch") as client:
        add_gallery(client, classes=3, per_class=4)
        assert client.app.state.resources.embedder.runtime == "torch"
        expected = _neighbours(client, queries)
    # The same data dir and database, the same stored vectors; only the query's runtime
    # changes.
    with make_client(runtime="onnxruntime") as client:
        assert client.app.state.resources.embedder.runtime == "onnxruntime"
        got = _neighbours(client, queries)
    for want, have in zip(expected, got, strict=True):
        assert [i for i, _ in have] == [i for i, _ in want]
        np.testing.assert_allclose([s for _, s in have], [s for _, s in want],
                                   atol=TOLERANCE)


def test_export_writes_the_version_as_onnx(client, tmp_path: Path, tiny_checkpoint: Path,
                                           monkeypatch) -> None:
    from typer.testing import CliRunner

    from imgret.cli.main import app

    settings = client.app.state.resources.settings
    version = client.get("/health").json()["model_version"]
    for name, value in {"IMGRET_DATA_DIR": str(settings.data_dir),
                        "IMGRET_DATABASE_URL": settings.db_url,
                        "IMGRET_DEVICE": "cpu"}.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        out = tmp_path / "export"
        result = CliRunner().invoke(app, ["export", version, "--format", "onnx",
                                          "--out", str(out)])
        bad = CliRunner().invoke(app, ["export", "no-such-version", "--out", str(out)])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert bad.exit_code != 0
    assert (out / "triton" / version / "config.pbtxt").is_file()
    assert (out / "triton" / version / "1" / "model.onnx").is_file()

    # The stored version's PyTorch vectors, from the preprocessing the export describes.
    checkpoint = load_checkpoint(tiny_checkpoint)
    contract = json.loads((out / "preprocessing.json").read_text())
    assert contract["model_version"] == version == checkpoint.model_version
    import torch

    transform = eval_transform(checkpoint.spec)
    batch = torch.stack([transform(class_image(c, i, size=48)) for c in range(3)
                         for i in range(2)])
    with torch.inference_mode():
        expected = checkpoint.model(batch).numpy()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {contract["input"]["name"]: batch.numpy()})
    assert np.abs(got - expected).max() <= TOLERANCE
