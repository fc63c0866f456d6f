"""int8 graphs in checkpoints: made by ONNX Runtime's static quantisation, carried beside the
float weights, named and hashed with them, checked before ONNX Runtime sees them, and run by
ONNX Runtime only."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from imgret import onnx_runtime
from imgret.checkpoint import (
    EmbeddingNet,
    ModelSpec,
    Quantized,
    checkpoint_bytes,
    load_checkpoint,
    model_version_of,
)
from imgret.embedder import Embedder
from imgret.errors import CheckpointError

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

SPEC = ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)


@pytest.fixture(scope="module")
def model() -> EmbeddingNet:
    torch.manual_seed(0)
    return EmbeddingNet(SPEC).eval()


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.rand(24, 3, 32, 32) * 2 - 1


@pytest.fixture(scope="module")
def graph(model: EmbeddingNet, inputs: torch.Tensor) -> bytes:
    from imgret.onnx_export import onnx_bytes
    from imgret.quantize import quantize_int8

    return quantize_int8(onnx_bytes(model, SPEC), [inputs[:12].numpy(), inputs[12:].numpy()])


def test_an_int8_checkpoint_round_trips_and_runs_with_onnxruntime(
        model: EmbeddingNet, graph: bytes, inputs: torch.Tensor) -> None:
    ops = {node.op_type for node in onnx.load_from_string(graph).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    version, data = checkpoint_bytes(model, {"quantized_from": "x"}, Quantized("int8", graph))
    loaded = load_checkpoint(data)
    assert loaded.model_version == version and version.startswith("tiny_cnn-d16-int8-")
    assert loaded.quantized == Quantized("int8", graph)
    assert version != model_version_of(model, SPEC)  # not the float version's name
    embedder = Embedder.from_checkpoint(loaded, device="cpu", runtime="torch")
    assert (embedder.runtime, embedder.scheme, embedder.model_version) == \
        ("onnxruntime", "int8", version)
    assert embedder.onnx_graph == graph
    got = embedder.embed_tensors(inputs)
    with torch.inference_mode():
        want = model(inputs).numpy()
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert float(np.sum(got * want, axis=1).min()) > 0.9  # close, yet its own vectors
    assert float(np.abs(got - want).max()) > 1e-5


def test_a_changed_graph_is_another_version(model: EmbeddingNet, graph: bytes) -> None:
    """The graph is part of the content digest: swapping it under a saved name is refused."""
    _, data = checkpoint_bytes(model, None, Quantized("int8", graph))
    payload = torch.load(io.BytesIO(data), weights_only=True)
    proto = onnx.load_from_string(graph)
    from onnx import numpy_helper

    index, weight = max(enumerate(proto.graph.initializer),
                        key=lambda pair: int(np.prod(pair[1].dims)))
    values = numpy_helper.to_array(weight).copy()
    values.flat[0] = values.flat[0] + 1 if values.flat[0] < 100 else values.flat[0] - 1
    proto.graph.initializer[index].CopyFrom(numpy_helper.from_array(values, weight.name))
    payload["quantized"]["graph"] = torch.frombuffer(bytearray(proto.SerializeToString()),
                                                     dtype=torch.uint8)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with pytest.raises(CheckpointError, match="not the hash of its weights"):
        load_checkpoint(buffer.getvalue())


def _external(proto) -> None:
    tensor = proto.graph.initializer[0]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "/etc/secret-weights.bin"


def _custom_op(proto) -> None:
    proto.graph.node[0].domain = "evil.secret-domain"


def _sized_by_data(proto) -> None:
    proto.graph.node[0].op_type = "ConstantOfShape"


def _wrong_input(proto) -> None:
    proto.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 64


def _renamed_output(proto) -> None:
    proto.graph.output[0].name = "secret-output-name"


def _subgraph(proto) -> None:
    attribute = proto.graph.node[0].attribute.add()
    attribute.name = "then_branch"
    attribute.type = onnx.AttributeProto.GRAPH
    attribute.g.CopyFrom(onnx.helper.make_graph([], "secret-subgraph", [], []))
    attribute.g.doc_string = "x"


@pytest.mark.parametrize("hostile", [_external, _custom_op, _sized_by_data, _wrong_input,
                                     _renamed_output, _subgraph])
def test_a_hostile_graph_is_refused_without_quoting_it(model: EmbeddingNet, graph: bytes,
                                                       hostile) -> None:
    proto = onnx.load_from_string(graph)
    hostile(proto)
    _, data = checkpoint_bytes(model, None, Quantized("int8", proto.SerializeToString()))
    with pytest.raises(CheckpointError, match="quantized.graph") as refused:
        load_checkpoint(data)
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize("entry, problem", [
    ({"scheme": "int4", "graph": torch.zeros(4, dtype=torch.uint8)}, "scheme must be"),
    ({"scheme": "int8", "graph": torch.zeros(4)}, "uint8"),
    ({"scheme": "int8", "graph": torch.zeros(2, 2, dtype=torch.uint8)}, "1-d"),
    ({"scheme": "int8"}, "exactly scheme and graph"),
    ("int8", "exactly scheme and graph"),
    ({"scheme": "int8", "graph": torch.frombuffer(bytearray(b"secret, not onnx"),
                                                  dtype=torch.uint8)}, "not an ONNX model"),
])
def test_a_malformed_quantized_entry_is_refused(model: EmbeddingNet, entry, problem) -> None:
    _, data = checkpoint_bytes(model)
    payload = torch.load(io.BytesIO(data), weights_only=True)
    payload["quantized"] = entry
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with pytest.raises(CheckpointError, match=problem) as refused:
        load_checkpoint(buffer.getvalue())
    assert "secret" not in str(refused.value)


def test_an_int8_version_does_not_load_without_onnxruntime(
        model: EmbeddingNet, graph: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch cannot stand in: its vectors are not the int8 version's."""
    monkeypatch.setattr(onnx_runtime, "available", lambda: False)
    with pytest.raises(CheckpointError, match="onnxruntime only"):
        Embedder(model, SPEC, device="cpu", quantized=Quantized("int8", graph))
    assert Embedder(model, SPEC, device="cpu", runtime="onnxruntime").runtime == "torch"


@pytest.mark.parametrize("device, installed, expected", [
    ("cpu", ["CUDAExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]),
    ("cuda", ["CPUExecutionProvider"], ["CPUExecutionProvider"]),
    ("cuda", ["CUDAExecutionProvider", "CPUExecutionProvider"],
     ["CUDAExecutionProvider", "CPUExecutionProvider"]),
    ("cuda", ["CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"],
     ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]),
])
def test_providers_follow_the_device_and_the_installed_runtime(device, installed,
                                                               expected) -> None:
    assert onnx_runtime.providers_for(device, installed) == expected
