"""Checks on an ONNX graph that arrives inside a checkpoint (an int8 version's network).

A quantised version carries its own graph (:mod:`imgret.quantize`), and a checkpoint may be
uploaded, so the graph is untrusted input. :func:`graph_problem` decides whether it may be
registered, in an order where nothing runs the graph, and nothing large is allocated, before
the cheaper checks have bounded what that costs. A graph that passes them loads and runs in
ONNX Runtime on every machine where it registered. In turn:

1. **Structure** (reading the protobuf only):

   - it parses as an ONNX ``ModelProto`` (``onnx``), with at most
     :data:`MAX_NODES` nodes (the largest export, vit_b_16, has ~2,100);
   - no tensor keeps its data outside the file: an *external data* reference is a path that
     ONNX Runtime would open on this machine, so it is refused wherever it appears
     (initializers, ``Constant`` attributes), as are sparse tensors;
   - every stored tensor (initializer, ``Constant`` value) has non-negative dimensions, a
     numeric type of :data:`ELEMENT_BYTES`, and carries exactly the bytes its dimensions
     declare (an initializer declared 2^40 x dim that carries 4 bytes is refused here, not
     by ONNX Runtime at embed time);
   - no local functions, and no attribute holding a graph, a type or a sparse tensor
     (``GRAPH``/``GRAPHS``, even empty: ``If``, ``Loop``, ``Scan`` and the like); every
     node is one of :data:`ALLOWED_OPS` in the standard domain, the operators the exported
     backbones and ONNX Runtime's quantiser produce; custom domains, random operators and
     those that build tensors of a size read from data (``ConstantOfShape``, ``Tile``,
     ``Range``, ``Resize``) are not among them;
   - every declared output is produced by a node (or is an input or an initializer);
   - exactly the interface of :mod:`imgret.onnx_export`: one float32 input ``images`` of
     shape ``(batch, 3, S, S)`` and one float32 output ``embeddings`` of shape
     ``(batch, dim)``, ``S`` and ``dim`` from the checkpoint's spec, the batch axis dynamic;
   - ``onnx.checker`` accepts it (schemas, attributes, topological order, opsets).

2. **Sizes**, by ONNX's shape inference (strict, type-checked, with data propagation) at
   batches of 1, 2 and :data:`MAX_RUN_BATCH` images, with the shape arithmetic ONNX's data
   propagation leaves out (``Div``) evaluated here on the small integer tensors it works on:

   - every tensor's shape is known before the graph runs: a size may come only from the
     input's shape and constants, never from the image data;
   - every tensor is either *static* (the same in all three runs: weights, dequantised
     weights, shape vectors) or *per image* (exactly one axis grows, in proportion to the
     batch); shape arithmetic on the batch size is affine (``Add``, ``Sub``, ``Mul`` by a
     constant; no ``Div`` of it and no product of two such sizes), so a per-image tensor
     measured at 1, 2 and :data:`MAX_RUN_BATCH` images cannot grow faster in between;
   - a per-image tensor is at most :data:`TENSOR_RATIO` times the bytes of one input image,
     and all of them together at most :data:`ACTIVATION_RATIO` times: the widest activation
     of any backbone imgret builds is 8x its input (efficientnet_b0's expanded stage,
     convnext_tiny's MLP), and the sum over every tensor of the largest graph, an int8
     vit_b_16, is ~1,430x, so both bounds leave ~2-3x room; an ``Expand`` or ``Reshape``
     to a huge constant shape, a ``Conv`` with huge padding or a ``Concat`` of thousands of
     copies is orders of magnitude over them, whatever operator it hides behind (the
     ``Expand`` of the exported L2 normalisation takes its shape from the tensor it
     normalises, and passes);
   - the static tensors hold at most :data:`STATIC_RATIO` times the elements of the weights
     stored in the file (dequantised int8 weights are 1x), plus :data:`STATIC_FLOOR`.

   The sum bounds what ONNX Runtime can hold at once in any execution order: a run of up to
   :data:`MAX_RUN_BATCH` images (:class:`imgret.onnx_runtime.OnnxRuntimeModel` never runs a
   larger one) needs at most ``MAX_RUN_BATCH x ACTIVATION_RATIO`` input images' worth of
   activations beside the static tensors, the same order as the exported backbones at the
   spec's image size, and a graph cannot ask for more by its shapes.

3. **ONNX Runtime's own load** (:func:`open_session`, on the CPU provider, one thread, the
   optimisation level every session uses), then a **trial run** on one zero image of the
   spec's size: its output must be ``(1, dim)`` float32 and finite. The load is what an
   embed job would do first, so a graph it refuses is refused here rather than at embed
   time; the trial costs at most one image's worth of the bounds above (that is why it
   comes last), and catches a graph that computes NaN or infinity from anything (``0/0``).
   A graph that is finite on a zero image and not on real ones is refused where it runs:
   the Embedder refuses non-finite vectors (:mod:`imgret.embedder`).

Messages name the rule that failed without quoting the file (names, strings and paths in
it), nor the text of a parser, the checker or ONNX Runtime, which quote them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

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
# The bytes of an element of each tensor type a graph may hold (onnx.TensorProto's codes):
# float32, uint8, int8, int16, int32, int64, bool, float16, float64, bfloat16.
ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 16: 2}

MAX_NODES = 10_000
# The most images one run of a graph takes (OnnxRuntimeModel splits larger batches); the
# sizes are checked at this batch.
MAX_RUN_BATCH = 64
# A per-image tensor: at most this many times the bytes of one input image.
TENSOR_RATIO = 16
# All per-image tensors together: at most this many times the bytes of one input image.
ACTIVATION_RATIO = 4096
# Static tensors together: at most this many times the elements of the stored weights, plus
# the floor (shape vectors, scales; 4 MiB of float32).
STATIC_RATIO = 2
STATIC_FLOOR = 1 << 20
# Shape arithmetic evaluated at check time: integer tensors of at most this many elements.
SHAPE_VALUE_MAX = 1024
# Rounds of inference and evaluation: the exports need 2 (vit_b_16's Div of its patch grid).
SHAPE_ROUNDS = 8
# Shape arithmetic that ONNX's data propagation leaves out, evaluated here.
_EVALUATED_OPS = frozenset({"Add", "Cast", "Concat", "Div", "Gather", "Identity", "Mul",
                            "Reshape", "Slice", "Squeeze", "Sub", "Unsqueeze"})
_INTEGER_TYPES = (6, 7)  # int32, int64
# The numpy types of evaluated shape arithmetic, and their ONNX codes.
_SHAPE_DTYPES = {np.dtype(np.int32): 6, np.dtype(np.int64): 7, np.dtype(np.bool_): 9}
_FLOAT = 1  # onnx.TensorProto.FLOAT
_EXTERNAL = 1  # onnx.TensorProto.EXTERNAL
# AttributeProto types that hold no graph, type or sparse tensor: FLOAT, INT, STRING, TENSOR,
# FLOATS, INTS, STRINGS, TENSORS.
_PLAIN_ATTRIBUTES = frozenset({1, 2, 3, 4, 6, 7, 8, 9})

_EXTERNAL_DATA = "its graph refers to external data (a file outside the checkpoint)"


def graph_problem(graph: bytes, *, image_size: int, dim: int) -> str | None:
    """What makes ``graph`` unfit to run as a model of this input size and dimension; None
    when it passes every check of the module docstring."""
    try:
        import onnx
    except ImportError:
        return "it carries an ONNX graph, and onnx is not installed"
    try:
        model = onnx.load_model_from_string(bytes(graph))
    except Exception:  # protobuf's DecodeError and others; their text may quote the file
        return "its graph is not an ONNX model"
    return (_structure_problem(model, image_size=image_size, dim=dim)
            or _checker_problem(model)
            or _sizes_problem(model, image_size=image_size, dim=dim)
            or _runtime_problem(graph, image_size=image_size, dim=dim))


# --------------------------------------------------------------------------- structure


def _structure_problem(model: Any, *, image_size: int, dim: int) -> str | None:
    graph = model.graph
    if len(graph.node) > MAX_NODES:
        return f"its graph has more than {MAX_NODES} nodes"
    if len(model.functions):
        return "its graph defines local functions"
    if len(graph.sparse_initializer):
        return "its graph has sparse initializers"
    return (_tensors_problem(graph.initializer)
            or _nodes_problem(graph)
            or _outputs_problem(graph)
            or _interface_problem(graph, image_size=image_size, dim=dim))


def _tensors_problem(tensors: Iterable[Any]) -> str | None:
    for tensor in tensors:
        if tensor.data_location == _EXTERNAL or len(tensor.external_data):
            return _EXTERNAL_DATA
        if tensor.data_type not in ELEMENT_BYTES:
            return "its graph has a tensor of a type imgret's graphs do not use"
        if any(d < 0 for d in tensor.dims):
            return "its graph has a tensor with a negative dimension"
        if math.prod(tensor.dims) != _elements_carried(tensor):
            return ("its graph has a tensor whose dimensions do not match the data it "
                    "carries")
    return None


def _elements_carried(tensor: Any) -> int:
    """The elements a stored tensor's data holds (raw bytes or one of the typed fields; a
    float16, int8 or bool element takes one int32 of ``int32_data``)."""
    if tensor.raw_data:
        size = ELEMENT_BYTES[tensor.data_type]
        return len(tensor.raw_data) // size if len(tensor.raw_data) % size == 0 else -1
    return (len(tensor.float_data) + len(tensor.int32_data) + len(tensor.int64_data)
            + len(tensor.double_data) + len(tensor.uint64_data) + len(tensor.string_data))


def _nodes_problem(graph: Any) -> str | None:
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            return "its graph has an operator outside the standard ONNX domain"
        if node.op_type not in ALLOWED_OPS:
            return (f"its graph has an operator that is not allowed (allowed: "
                    f"{', '.join(sorted(ALLOWED_OPS))})")
        for attribute in node.attribute:
            if (attribute.type in (5, 10) or attribute.HasField("g") or len(attribute.graphs)):
                return "its graph has a node holding a subgraph"
            if (attribute.type not in _PLAIN_ATTRIBUTES or attribute.HasField("tp")
                    or len(attribute.type_protos) or attribute.HasField("sparse_tensor")
                    or len(attribute.sparse_tensors) or attribute.ref_attr_name):
                return "its graph has a node attribute of a kind imgret's graphs do not use"
            tensors = [attribute.t] if attribute.HasField("t") else []
            problem = _tensors_problem([*tensors, *attribute.tensors])
            if problem:
                return problem
    return None


def _outputs_problem(graph: Any) -> str | None:
    made = {name for node in graph.node for name in node.output}
    made |= {value.name for value in graph.input} | {t.name for t in graph.initializer}
    if any(output.name not in made for output in graph.output):
        return "its graph declares an output that no node produces"
    return None


def _interface_problem(graph: Any, *, image_size: int, dim: int) -> str | None:
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    want_in = (f"one float32 input {INPUT_NAME!r} of shape (batch, 3, {image_size}, "
               f"{image_size}) with a dynamic batch axis")
    want_out = f"one float32 output {OUTPUT_NAME!r} of shape (batch, {dim})"
    if len(inputs) != 1 or not _is(inputs[0], INPUT_NAME, [None, 3, image_size, image_size]):
        return f"its graph does not have {want_in}"
    if len(graph.output) != 1 or not _is(graph.output[0], OUTPUT_NAME, [None, dim]):
        return f"its graph does not have {want_out}"
    return None


def _is(value: Any, name: str, dims: list[int | None]) -> bool:
    """Whether a graph input or output is ``name``, float32, of these dims (None: the batch
    axis, which must be dynamic: a declared batch would be the size of every run)."""
    tensor = value.type.tensor_type
    if value.name != name or tensor.elem_type != _FLOAT or len(tensor.shape.dim) != len(dims):
        return False
    return all(not d.HasField("dim_value") if want is None
               else d.HasField("dim_value") and d.dim_value == want
               for d, want in zip(tensor.shape.dim, dims, strict=True))


def _checker_problem(model: Any) -> str | None:
    import onnx

    try:
        onnx.checker.check_model(model)
    except Exception:  # ValidationError and others; their text quotes the file's names
        return "its graph is not a valid ONNX graph (ONNX's checker refuses it)"
    return None


# --------------------------------------------------------------------------- sizes


class _SizeRefusal(Exception):
    """A size rule broken while shapes are worked out (its text is the message)."""


def _sizes_problem(model: Any, *, image_size: int, dim: int) -> str | None:
    batches = (1, 2, MAX_RUN_BATCH)
    try:
        runs = [_shapes_at(model, batch, image_size) for batch in batches]
        _affine_batch_arithmetic(model, runs[0][1], runs[1][1])
    except _SizeRefusal as exc:
        return str(exc)
    except Exception:  # onnx's InferenceError and others; their text quotes the file
        logger.debug("shape inference refused a graph", exc_info=True)
        return "its graph fails ONNX's shape inference (its types or shapes do not fit)"
    for batch, (shapes, _) in zip(batches, runs, strict=True):
        if shapes.get(OUTPUT_NAME) != ((batch, dim), _FLOAT):
            return f"its graph does not compute {OUTPUT_NAME!r} of shape (batch, {dim})"
    image_bytes = 3 * image_size * image_size * ELEMENT_BYTES[_FLOAT]
    per_image = static = 0
    names = [name for node in model.graph.node for name in node.output if name]
    for name in names:
        one, two, full = (run[0].get(name) for run in runs)
        if one is None or two is None or full is None:
            return ("its graph has a tensor whose size cannot be known before it runs "
                    "(sizes may come only from the input's shape and constants)")
        if one[1] not in ELEMENT_BYTES:
            return "its graph has a tensor of a type imgret's graphs do not use"
        elements = math.prod(one[0])
        if one == two == full:
            static += elements
            continue
        if not _grows_with_batch(one[0], two[0], full[0]):
            return ("its graph has a tensor whose size does not grow in proportion to the "
                    "number of images")
        size = elements * ELEMENT_BYTES[one[1]]
        if size > TENSOR_RATIO * image_bytes:
            return (f"its graph has a tensor of more than {TENSOR_RATIO} times the size of "
                    "its input image")
        per_image += size
    if per_image > ACTIVATION_RATIO * image_bytes:
        return (f"its graph's tensors together are more than {ACTIVATION_RATIO} times the "
                "size of its input image")
    stored = sum(math.prod(t.dims) for t in model.graph.initializer)
    if static > STATIC_RATIO * stored + STATIC_FLOOR:
        return "its graph computes constant tensors much larger than the weights it stores"
    return None


def _grows_with_batch(one: tuple[int, ...], two: tuple[int, ...],
                      full: tuple[int, ...]) -> bool:
    """Exactly one axis differs between the runs, and it is proportional to the batch."""
    if not len(one) == len(two) == len(full):
        return False
    axes = [i for i in range(len(one)) if not one[i] == two[i] == full[i]]
    return (len(axes) == 1 and one[axes[0]] > 0 and two[axes[0]] == 2 * one[axes[0]]
            and full[axes[0]] == MAX_RUN_BATCH * one[axes[0]])


Shapes = dict[str, tuple[tuple[int, ...], int]]
Values = dict[str, np.ndarray]


def _shapes_at(model: Any, batch: int, image_size: int) -> tuple[Shapes, Values]:
    """Every tensor's ``(dims, type)`` for a run of ``batch`` images (dims None where not
    known), and the shape arithmetic evaluated on the way.

    ONNX's inference runs on a copy without the weights' data (large initializers become
    inputs of their declared shape: the inference needs no values of them, and copying
    hundreds of MB per round would be slow). Then, in rounds, every ``Shape`` of a tensor
    whose shape is known and every :data:`_EVALUATED_OPS` node on known small integer
    tensors is evaluated, and replaced by its value, until a round adds nothing.
    """
    from onnx import helper, numpy_helper, shape_inference

    graph = model.graph
    values: Values = {}
    for tensor in graph.initializer:
        if tensor.data_type in _INTEGER_TYPES and math.prod(tensor.dims) <= SHAPE_VALUE_MAX:
            values[tensor.name] = numpy_helper.to_array(tensor)
    inputs = [helper.make_tensor_value_info(INPUT_NAME, _FLOAT,
                                            [batch, 3, image_size, image_size])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
               for t in graph.initializer if t.name not in values]
    outputs = [helper.make_tensor_value_info(o.name, o.type.tensor_type.elem_type, None)
               for o in graph.output]
    shapes: Shapes = {}
    tried: set[str] = set()
    for _ in range(SHAPE_ROUNDS):
        nodes = [n for n in graph.node if not all(o in values for o in n.output)]
        work = helper.make_model(
            helper.make_graph(nodes, "check", inputs, outputs, initializer=[
                numpy_helper.from_array(v, k) for k, v in values.items()]),
            opset_imports=model.opset_import, ir_version=model.ir_version)
        inferred = shape_inference.infer_shapes(work, check_type=True, strict_mode=True,
                                                data_prop=True)
        shapes = {}
        for value in [*inferred.graph.value_info, *inferred.graph.output,
                      *inferred.graph.input]:
            tensor = value.type.tensor_type
            if tensor.HasField("shape") and all(d.HasField("dim_value")
                                                for d in tensor.shape.dim):
                shapes[value.name] = (tuple(d.dim_value for d in tensor.shape.dim),
                                      tensor.elem_type)
        shapes.update({k: (v.shape, _SHAPE_DTYPES[v.dtype]) for k, v in values.items()})
        if not _evaluate_round(nodes, shapes, values, tried):
            break
    return shapes, values


def _evaluate_round(nodes: list[Any], shapes: Shapes, values: Values, tried: set[str]) -> bool:
    """Evaluate what can be of the shape arithmetic; whether anything was. ``tried``: the
    nodes evaluated before whose result was not shape arithmetic (not tried again)."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    added = False
    for node in nodes:
        known = [name for name in node.input if name]
        if node.op_type == "Shape" and node.input[0] in shapes:
            dims = np.array(shapes[node.input[0]][0], dtype=np.int64)
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            values[node.output[0]] = dims[attrs.get("start", 0):attrs.get("end", len(dims))]
            added = True
        elif node.output[0] not in tried and (_small_integer_constant(node) or (
                node.op_type in _EVALUATED_OPS and all(name in values for name in known))):
            tried.add(node.output[0])
            try:
                with np.errstate(all="ignore"):
                    results = ReferenceEvaluator(node).run(
                        None, {name: values[name] for name in known})
            except Exception:  # noqa: BLE001 - left to ONNX's inference, which refuses it
                continue
            arrays = [np.asarray(r) for r in results]
            if all(a.dtype in _SHAPE_DTYPES and a.size <= SHAPE_VALUE_MAX
                   for a in arrays):
                values.update(zip(node.output, arrays, strict=False))
                added = True
    return added


def _small_integer_constant(node: Any) -> bool:
    """A ``Constant`` node of a small integer tensor (one that shape arithmetic may use)."""
    if node.op_type != "Constant" or len(node.attribute) != 1:
        return False
    attribute = node.attribute[0]
    if attribute.name in ("value_int", "value_ints"):
        return len(attribute.ints) <= SHAPE_VALUE_MAX
    return (attribute.name == "value" and attribute.t.data_type in _INTEGER_TYPES
            and math.prod(attribute.t.dims) <= SHAPE_VALUE_MAX)


def _affine_batch_arithmetic(model: Any, one: Values, two: Values) -> None:
    """Refuse shape arithmetic that is not affine in the batch size: a value that differs
    between the runs of 1 and 2 images depends on it, and may be added, subtracted and
    multiplied by a value that does not, nothing else (``(b-1)*(b-2)``, ``b // 64`` and
    the like are what let a size pass at 1, 2 and 64 images and be huge in between)."""
    def varies(name: str) -> bool:
        return name in one and name in two and (
            one[name].shape != two[name].shape or not np.array_equal(one[name], two[name]))

    for node in model.graph.node:
        varying = [varies(name) for name in node.input if name]
        if (node.op_type == "Mul" and all(varying)) or (node.op_type == "Div" and any(varying)):
            raise _SizeRefusal("its graph computes a size as a product or quotient of the "
                               "number of images")


# --------------------------------------------------------------------------- runtime


def open_session(graph: bytes, *, threads: int, providers: list[str]) -> Any:
    """An ONNX Runtime session of ``graph``, as every session is opened (the check's and the
    Embedder's): one intra-op pool of ``threads``, no inter-op pool, every optimisation."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    # One graph, run one batch at a time (the Embedder's forward lock): no inter-op pool.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(graph, options, providers=providers)


def _runtime_problem(graph: bytes, *, image_size: int, dim: int) -> str | None:
    try:
        import onnxruntime  # noqa: F401 - only whether it is installed
    except ImportError:
        return None  # nothing here can run it; the Embedder refuses to load it without it
    try:
        session = open_session(graph, threads=1, providers=["CPUExecutionProvider"])
    except Exception:  # ONNX Runtime's errors quote the file's names
        logger.debug("ONNX Runtime refused a graph", exc_info=True)
        return "ONNX Runtime cannot load its graph"
    zero = np.zeros((1, 3, image_size, image_size), dtype=np.float32)
    try:
        (out,) = session.run(None, {INPUT_NAME: zero})
    except Exception:  # as above
        logger.debug("ONNX Runtime could not run a graph", exc_info=True)
        return "ONNX Runtime cannot run its graph on one image"
    out = np.asarray(out)
    if out.shape != (1, dim) or out.dtype != np.float32:
        return f"its graph does not give one float32 vector of {dim} values per image"
    if not np.isfinite(out).all():
        return "its graph gives non-finite vectors (NaN or infinite) on a zero image"
    return None
