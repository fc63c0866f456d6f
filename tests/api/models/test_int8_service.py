"""An int8 version through the service (SQLite and PostgreSQL): uploaded like any checkpoint,
re-embedded, switched to, and served by ONNX Runtime with the vectors it stored; a hostile
graph inside a checkpoint is a 422 that quotes nothing and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imgret.checkpoint import Quantized, checkpoint_bytes, load_checkpoint
from tests.api.conftest import add_gallery, png, search

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def int8_parts(tiny_checkpoint: Path):
    from imgret.onnx_export import onnx_bytes
    from imgret.quantize import quantize_int8

    loaded = load_checkpoint(tiny_checkpoint)
    torch.manual_seed(2)
    graph = quantize_int8(onnx_bytes(loaded.model, loaded.spec),
                          [torch.rand(16, 3, 32, 32).numpy() * 2 - 1])
    return loaded, graph


def test_an_uploaded_int8_version_is_embedded_switched_to_and_served(make_client,
                                                                     int8_parts) -> None:
    loaded, graph = int8_parts
    version, data = checkpoint_bytes(loaded.model, {"quantized_from": loaded.model_version},
                                     Quantized("int8", graph))
    with make_client(embed_duty=1.0) as client:
        ids = add_gallery(client, classes=3, per_class=3)
        uploaded = client.post("/models", files={"checkpoint": ("model.pt", data)})
        assert uploaded.status_code == 201, uploaded.text
        assert uploaded.json()["version"] == version and "-int8-" in version
        assert client.post(f"/models/{version}/embed").status_code == 202
        client.app.state.resources.jobs.wait(version, timeout=60)
        activated = client.post(f"/models/{version}/activate")
        assert activated.status_code == 200, activated.text
        assert client.get("/health").json()["model_version"] == version
        # A stored image finds itself: the query runs through the same int8 graph that made
        # the stored vectors.
        first = next(i for i, c in ids.items() if c == 1)
        hits = search(client, png(1, 0), k=3).json()["results"]
        assert hits[0]["id"] == first and hits[0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_a_hostile_graph_in_an_upload_is_a_422_that_changes_nothing(make_client,
                                                                    int8_parts) -> None:
    loaded, graph = int8_parts
    proto = onnx.load_from_string(graph)
    tensor = proto.graph.initializer[0]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "/etc/shadow"
    _, data = checkpoint_bytes(loaded.model, None, Quantized("int8", proto.SerializeToString()))
    with make_client() as client:
        add_gallery(client, classes=2, per_class=2)
        before = client.get("/models").json()
        refused = client.post("/models", files={"checkpoint": ("model.pt", data)})
        assert refused.status_code == 422
        assert "external data" in refused.json()["detail"]
        assert "/etc" not in refused.json()["detail"]
        assert client.get("/models").json() == before
