"""Models and indexes of versions other than the served one are an LRU bounded by count and
bytes (``imgret.service.version_cache``), on SQLite and PostgreSQL: the app in-process, real
checkpoints registered through ``POST /models``, real indexes."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.embedder import Embedder
from imgret.service.resources.bundle import Resources
from imgret.service.version_cache import index_bytes, model_bytes
from tests.api.conftest import add_gallery, png


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four more versions: the tiny CNN with other random weights."""
    runs = []
    for seed in range(1, 5):
        folder = tmp_path_factory.mktemp(f"run{seed}")
        torch.manual_seed(seed)
        save_checkpoint(folder, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16,
                                                       image_size=32)))
        runs.append(folder / "model.pt")
    return runs


def _register_all(client, checkpoints: list[Path]) -> list[str]:
    registered = []
    for path in checkpoints:
        response = client.post("/models", files={"checkpoint": ("model.pt", path.read_bytes())})
        assert response.status_code == 201, response.text
        registered.append(response.json()["version"])
    assert len(set(registered)) == len(checkpoints)
    return registered


def _others(resources: Resources) -> set[str]:
    served = resources.serving.version
    return {v for kind in ("embedder", "searcher") for v in resources.loaded.loaded(kind)
            if v != served}


def test_other_versions_are_bounded_by_count_and_the_served_one_stays(
    make_client, checkpoints: list[Path]
) -> None:
    with make_client(max_loaded_versions=2) as client:
        add_gallery(client, classes=2, per_class=2)
        resources: Resources = client.app.state.resources
        served = resources.serving
        versions = _register_all(client, checkpoints)
        used: list[str] = []
        for version in versions + versions[:2]:  # the first two again: dropped by then
            embedder = resources.embedder_for(version)
            searcher = resources.searcher_for(version)
            assert embedder.model_version == version and searcher.model_version == version
            used.append(version)
            kept = _others(resources)
            assert len(kept) <= 2 and resources.loaded.usage()[0] == len(kept)
            # The most recent ones, in use order.
            assert kept == set(list(dict.fromkeys(reversed(used)))[:2])
            # The served pair is never dropped and is the very same objects.
            assert resources.embedders[served.version] is served.embedder
            assert resources.searchers[served.version] is served.searcher
        # An evicted version loads again on demand, as a new object, and works.
        dropped = versions[2]
        assert dropped not in _others(resources)
        again = resources.embedder_for(dropped)
        assert again.model_version == dropped
        assert again.embed([Image.new("RGB", (32, 32))]).shape == (1, 16)
        # Searches still run through the served pair.
        assert client.post("/search", files={"image": ("q.png", png(0, 0), "image/png")}
                           ).json()["model_version"] == served.version
        metrics = client.get("/metrics").text
        assert "imgret_loaded_versions 2.0" in metrics
        assert "imgret_loaded_bytes " in metrics


def test_other_versions_are_bounded_by_bytes(make_client, checkpoints: list[Path]) -> None:
    # As the service loads it (the default runtime: ONNX Runtime's copy of the weights counts).
    one_model = model_bytes(Embedder.from_checkpoint(checkpoints[0], device="cpu",
                                                     runtime="auto"))
    # Room for one model (and its small index), not two.
    with make_client(max_loaded_versions=10, max_loaded_bytes=one_model * 3 // 2) as client:
        add_gallery(client, classes=2, per_class=2)
        resources: Resources = client.app.state.resources
        versions = _register_all(client, checkpoints)
        for version in versions:
            held = resources.embedder_for(version)
            count, total = resources.loaded.usage()
            assert total <= one_model * 3 // 2 and count <= 1
            assert _others(resources) == {version}
            assert held.model_version == version
        # Nothing fits: every other version is dropped once its request has it.
        resources.loaded.max_bytes = 0
        held = resources.embedder_for(versions[0])
        assert _others(resources) == set() and held.model_version == versions[0]
        assert held.embed([Image.new("RGB", (32, 32))]).shape == (1, 16)
        assert resources.serving.version in resources.embedders


def test_a_switch_pins_the_new_version_and_bounds_the_old_one(
    make_client, checkpoints: list[Path]
) -> None:
    # No follower rounds after start-up: they would serve the database's active one again.
    with make_client(max_loaded_versions=0, follow_interval_s=3600,
                     change_notify=False) as client:
        add_gallery(client, classes=2, per_class=2)
        resources: Resources = client.app.state.resources
        first = resources.serving.version
        version = _register_all(client, checkpoints[:1])[0]
        resources.serve(version)  # this process only: the pair is loaded, then served
        assert resources.serving.version == version
        assert resources.embedders[version] is resources.serving.embedder
        assert resources.searchers[version] is resources.serving.searcher
        assert _others(resources) == set()  # the first one is an "other" now: bound 0
        assert first not in resources.embedders and first not in resources.searchers
        assert resources.index_sizes() == {version: (resources.serving.searcher.size,
                                                     resources.serving.searcher.factory)}


def test_concurrent_loads_keep_the_bound_and_every_caller_gets_a_working_pair(
    make_client, checkpoints: list[Path]
) -> None:
    with make_client(max_loaded_versions=1) as client:
        add_gallery(client, classes=2, per_class=2)
        resources: Resources = client.app.state.resources
        versions = _register_all(client, checkpoints)
        served = resources.serving
        violations: list[str] = []
        lock = threading.Lock()

        def work(seed: int) -> int:
            rng = random.Random(seed)
            for _ in range(6):
                version = rng.choice(versions)
                embedder = resources.embedder_for(version)
                searcher = resources.searcher_for(version)
                count, _ = resources.loaded.usage()
                with lock:
                    if count > 1:
                        violations.append(f"{count} other versions kept")
                    if resources.embedders.get(served.version) is not served.embedder:
                        violations.append("the served model was dropped")
                # Whatever was dropped meanwhile, the pair this caller holds works.
                assert embedder.model_version == searcher.model_version == version
                vector = embedder.embed([Image.new("RGB", (32, 32))])
                assert vector.shape == (1, 16)
                assert searcher.size >= 0 and index_bytes(searcher) >= 0
            return seed

        with ThreadPoolExecutor(max_workers=4) as pool:
            assert sorted(pool.map(work, range(8))) == list(range(8))
        assert not violations, violations[:5]
        assert len(_others(resources)) <= 1
