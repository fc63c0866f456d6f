"""Gated activation on real trained models (Fashion-MNIST): a version trained longer on the
same data is judged better and the gated switch goes through; the same model saved again is
judged "no detectable difference" and ``require=better`` refuses with the verdict.

Both verdicts come from the paired bootstrap of ``/evaluate`` over one stored query set (the
Fashion-MNIST test file, never trained on), through each version's own index.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from imgret.settings import Settings
from tests.conftest import TEST_DEVICE

pytestmark = pytest.mark.slow

FASHION = Path("/usr/share/datasets/fashion-mnist")
GALLERY_PER_CLASS, QUERIES_PER_CLASS = 30, 20


def _train(out: Path, *, epochs: int, time_budget_s: float | None) -> Path:
    from imgret.training.config import FASHION_MNIST, LossConfig, TrainConfig
    from imgret.training.loop import train

    config = TrainConfig(
        data=FASHION_MNIST, protocol="closed-set", loss=LossConfig(name="multi_similarity"),
        backbone="small_cnn", dim=32, image_size=28, epochs=epochs, augmentation="none",
        max_train_images=1500, max_eval_images=300, time_budget_s=time_budget_s, seed=0,
        device="cpu",
    )
    train(config, out, progress=False, test=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A: a few steps; B: the same data and settings, two full epochs; C: A saved again with
    its weights nudged by 1e-6 (the same model under another version name)."""
    from tests.conftest import require

    require((FASHION / "train-images-idx3-ubyte").exists() or
            (FASHION / "train-images-idx3-ubyte.gz").exists(),
            "Debian's dataset-fashion-mnist")
    from imgret.checkpoint import load_checkpoint, save_checkpoint

    root = tmp_path_factory.mktemp("verdict_runs")
    short = _train(root / "short", epochs=1, time_budget_s=0.5)
    long = _train(root / "long", epochs=2, time_budget_s=None)
    loaded = load_checkpoint(short)
    torch.manual_seed(0)
    with torch.no_grad():
        loaded.model.head.weight.add_(1e-6 * torch.randn_like(loaded.model.head.weight))
    save_checkpoint(root / "same", loaded.model)
    return {"a": short, "b": long, "c": root / "same"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, runs) -> dict[str, Path]:
    from PIL import Image

    from imgret.datasets import FASHION_MNIST_CLASSES, load_fashion_mnist

    root = tmp_path_factory.mktemp("verdict_data")
    out = {}
    for split, name, per_class in (("train", "gallery", GALLERY_PER_CLASS),
                                   ("test", "queries", QUERIES_PER_CLASS)):
        images, labels = load_fashion_mnist(split=split)
        for label, cls in enumerate(FASHION_MNIST_CLASSES):
            target = root / name / cls.replace("/", "-").replace(" ", "_")
            target.mkdir(parents=True)
            # From the end of the train file: the runs trained on a capped, seeded subset.
            for index in (labels == label).nonzero()[0][-per_class:]:
                Image.fromarray(images[index], mode="L").save(target / f"{index:05d}.png")
        out[name] = root / name
    return out


def test_trained_longer_is_better_and_the_same_model_is_no_better(
    tmp_path: Path, db_url: str, runs: dict[str, Path], folders: dict[str, Path]
) -> None:
    from imgret.cli.jobs import gallery as commands
    from imgret.service.app import create_app

    settings = Settings(data_dir=tmp_path / "data", database_url=db_url, model=runs["a"],
                        device=TEST_DEVICE, embed_duty=1.0,
                        model_roots=[runs["b"], runs["c"]])
    commands.ingest(settings, folders["gallery"], progress=False)
    commands.ingest(settings, folders["queries"], query_set="fm-test", progress=False)
    with TestClient(create_app(settings)) as client:
        jobs_ = client.app.state.resources.jobs
        a = client.get("/health").json()["model_version"]
        versions = {}
        for name in ("b", "c"):
            response = client.post("/models", json={"path": str(runs[name])})
            assert response.status_code == 201, response.text
            versions[name] = response.json()["version"]
            assert client.post(f"/models/{versions[name]}/embed").status_code == 202
            jobs_.wait(versions[name], timeout=120)
            info = client.get(f"/models/{versions[name]}").json()
            assert info["coverage"]["complete"] and info["query_items"]["embedded"] == 200

        # The same model again: no detectable difference, so require=better refuses.
        refused = client.post(f"/models/{versions['c']}/activate",
                              params={"require": "better", "query_set": "fm-test"})
        assert refused.status_code == 409, refused.text
        body = refused.json()
        assert body["comparison"]["verdict"]["map_at_r"] == "no detectable difference"
        assert "no detectable difference" in body["detail"]
        print("same model:", _summary(body["comparison"]))
        assert client.get("/health").json()["model_version"] == a
        # ... which does not stand in the way of require=not_worse.
        compared = client.post("/evaluate", json={"query_set": "fm-test",
                                                  "compare": [a, versions["c"]]}).json()
        assert "worse" not in compared["verdict"].values()

        # Trained longer on the same data: better, and the gated switch goes through.
        switched = client.post(f"/models/{versions['b']}/activate",
                               json={"require": "better", "query_set": "fm-test"})
        assert switched.status_code == 200, switched.text
        comparison = switched.json()["comparison"]
        print("trained longer:", _summary(comparison))
        assert comparison["verdict"]["map_at_r"] == "better"
        assert comparison["difference"]["map_at_r"]["ci95"][0] > 0
        assert comparison["a"]["model_version"] == a
        assert comparison["b"]["model_version"] == versions["b"]
        assert client.get("/health").json()["model_version"] == versions["b"]
        # The comparison is on record as each version's last evaluation.
        last = client.get(f"/models/{versions['b']}").json()["last_evaluation"]
        assert last["query_set"] == "fm-test" and last["map_at_r"] == pytest.approx(
            comparison["b"]["map_at_r"])


def _summary(comparison: dict) -> str:
    row = comparison["difference"]["map_at_r"]
    low, high = row["ci95"]
    return (f"MAP@R A {row['a']:.4f}, B {row['b']:.4f}, B-A {row['difference']:+.4f} "
            f"[{low:+.4f}, {high:+.4f}] -> {comparison['verdict']['map_at_r']}")
