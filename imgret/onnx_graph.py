"""Checks on an ONNX graph that arrives inside a checkpoint (an int8 version's network).

A quantised version carries its own graph (:mod:`imgret.quantize`), and a checkpoint may be
uploaded, so the graph is untrusted input. Before ONNX Runtime sees it,
:func:`graph_problem` requires:

- it parses as an ONNX ``ModelProto`` (``onnx``, the ``onnx`` extra);
- no tensor keeps its data outside the file: an *external data* reference is a path that
  ONNX Runtime would open on this machine, so it is refused wherever it appears
  (initializers, ``Constant`` attributes), as are sparse initializers;
- no local functions, and no node attribute holding a graph (``If``, ``Loop``, ``Scan``):
  every node is one of :data:`ALLOWED_OPS` in the standard domain, the operators the
  exported backbones and ONNX Runtime's quantiser produce; custom domains, random
  operators and those that build tensors of a size read from data (``ConstantOfShape``,
  ``Tile``, ``Range``, ``Resize``) are not among them;
- exactly the interface of :mod:`imgret.onnx_export`: one float32 input ``images`` of shape
  ``(batch, 3, S, S)`` and one float32 output ``embeddings`` of shape ``(batch, dim)``, with
  ``S`` and ``dim`` from the checkpoint's spec.

Messages name what is wrong without quoting the file (names, strings and paths in it).
"""

from __future__ import annotations

from typing import Any

# The interface of every graph imgret writes or runs (:mod:`imgret.onnx_export`).
INPUT_NAME = "images"
OUTPUT_NAME = "embeddings"

# Operators of the standard ONNX domain that imgret's exported backbones (resnet,
# efficientnet, mobilenet, convnext, vit) and ONNX Runtime's QDQ quantiser emit, and
# nothing that reads a size from data or holds a subgraph.
ALLOWED_OPS = frozenset({
    "Add", "AveragePool", "BatchNormalization", "Cast", "Clip", "Concat", "Constant", "Conv",
    "DequantizeLinear", "Div", "Dropout", "Erf", "Expand", "Flatten", "Gather", "Gemm",
    "GlobalAveragePool", "HardSigmoid", "HardSwish", "Identity", "LayerNormalization",
    "MatMul", "MaxPool", "Mul", "Pow", "QuantizeLinear", "ReduceL2", "ReduceMean", "Relu",
    "Reshape", "Shape", "Sigmoid", "Slice", "Softmax", "Split", "Sqrt", "Squeeze", "Sub",
    "Tanh", "Transpose", "Unsqueeze",
})
_FLOAT = 1  # onnx.TensorProto.FLOAT
_EXTERNAL = 1  # onnx.TensorProto.EXTERNAL


def graph_problem(graph: bytes, *, image_size: int, dim: int) -> str | None:
    """What makes ``graph`` unfit to run as a model of this input size and dimension; None
    when it passes every check of the module docstring."""
    try:
        import onnx
    except ImportError:
        return "it carries an ONNX graph, and the onnx extra is not installed"
    try:
        model = onnx.load_model_from_string(bytes(graph))
    except Exception:  # protobuf's DecodeError and others; their text may quote the file
        return "its graph is not an ONNX model"
    if len(model.functions):
        return "its graph defines local functions"
    problem = _nodes_problem(model.graph)
    if problem:
        return problem
    if len(model.graph.sparse_initializer):
        return "its graph has sparse initializers"
    if any(t.data_location == _EXTERNAL or len(t.external_data)
           for t in model.graph.initializer):
        return "its graph refers to external data (a file outside the checkpoint)"
    return _interface_problem(model.graph, image_size=image_size, dim=dim)


def _nodes_problem(graph: Any) -> str | None:
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            return "its graph has an operator outside the standard ONNX domain"
        if node.op_type not in ALLOWED_OPS:
            return (f"its graph has an operator that is not allowed (allowed: "
                    f"{', '.join(sorted(ALLOWED_OPS))})")
        for attribute in node.attribute:
            if attribute.g.ByteSize() or len(attribute.graphs):
                return "its graph has a node holding a subgraph"
            tensors = [attribute.t] if attribute.HasField("t") else []
            tensors += list(attribute.tensors)
            if any(t.data_location == _EXTERNAL or len(t.external_data) for t in tensors):
                return "its graph refers to external data (a file outside the checkpoint)"
            if attribute.HasField("sparse_tensor") or len(attribute.sparse_tensors):
                return "its graph has sparse tensors"
    return None


def _interface_problem(graph: Any, *, image_size: int, dim: int) -> str | None:
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    want_in = f"one float32 input {INPUT_NAME!r} of shape (batch, 3, {image_size}, {image_size})"
    want_out = f"one float32 output {OUTPUT_NAME!r} of shape (batch, {dim})"
    if len(inputs) != 1 or not _is(inputs[0], INPUT_NAME, [None, 3, image_size, image_size]):
        return f"its graph does not have {want_in}"
    if len(graph.output) != 1 or not _is(graph.output[0], OUTPUT_NAME, [None, dim]):
        return f"its graph does not have {want_out}"
    return None


def _is(value: Any, name: str, dims: list[int | None]) -> bool:
    """Whether a graph input or output is ``name``, float32, of these dims (None: any, the
    batch axis)."""
    tensor = value.type.tensor_type
    if value.name != name or tensor.elem_type != _FLOAT or len(tensor.shape.dim) != len(dims):
        return False
    return all(want is None or (d.HasField("dim_value") and d.dim_value == want)
               for d, want in zip(tensor.shape.dim, dims, strict=True))
