"""Hostile ONNX graphs for tests, built with ``onnx.helper``: each has the interface of an
imgret graph (``images (batch, 3, S, S)`` -> ``embeddings (batch, dim)``, float32) around
something that a graph check must refuse, or that only fails when the graph runs.

Every name a file can hold (graph, nodes, tensors, doc strings) contains :data:`SECRET`, so a
test can assert that no answer quotes the file.

The base graph: global average pooling of the image, flattened to ``(batch, 3)``, times a
``(3, dim)`` weight. :data:`GRAPHS` maps a case to its builder; :data:`NON_FINITE_ON_IMAGES`
are graphs that pass every check (finite on a zero image) and give NaN or infinite vectors on
real images.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SECRET = "secret-name"
OPSET = 18
IR_VERSION = 8  # read by every ONNX Runtime the onnx extra allows

Node = onnx.NodeProto


def _name(what: str) -> str:
    return f"{SECRET}-{what}"


def _const(what: str, values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(values, _name(what))


def _ints(what: str, values: list[int]) -> onnx.TensorProto:
    return _const(what, np.array(values, dtype=np.int64))


def _model(nodes: list[Node], initializers: list[onnx.TensorProto], *, image_size: int,
           dim: int, output: str, inputs: list | None = None,
           outputs: list | None = None, **model_fields) -> bytes:
    graph = helper.make_graph(
        nodes, _name("graph"),
        inputs or [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                 ["batch", 3, image_size, image_size])],
        outputs or [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT,
                                                  ["batch", dim])],
        initializer=initializers, doc_string=_name("doc"))
    if output != "embeddings":
        nodes.append(helper.make_node("Identity", [output], ["embeddings"], name=_name("out")))
        graph.node.append(nodes[-1])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name=_name("producer"), **model_fields)
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def _pooled() -> tuple[list[Node], list[onnx.TensorProto]]:
    """``pooled``: the image's channel means, ``(batch, 3)``."""
    nodes = [
        helper.make_node("GlobalAveragePool", ["images"], [_name("gap")], name=_name("gap")),
        helper.make_node("Flatten", [_name("gap")], [_name("pooled")], name=_name("flat"),
                         axis=1),
    ]
    return nodes, []


def _project(source: str, dim: int) -> tuple[list[Node], list[onnx.TensorProto]]:
    """``projected``: ``source (batch, 3)`` times a fixed ``(3, dim)`` weight."""
    weight = np.linspace(-1, 1, 3 * dim, dtype=np.float32).reshape(3, dim)
    return ([helper.make_node("MatMul", [source, _name("weight")], [_name("projected")],
                              name=_name("matmul"))],
            [_const("weight", weight)])


def base(image_size: int, dim: int, **fields) -> bytes:
    """A graph every check passes: a valid model of this size and dimension."""
    nodes, inits = _pooled()
    more, weights = _project(_name("pooled"), dim)
    return _model(nodes + more, inits + weights, image_size=image_size, dim=dim,
                  output=_name("projected"), **fields)


def _with(image_size: int, dim: int, extra: Callable[[str], tuple[list[Node], list, str]],
          **fields) -> bytes:
    """The base graph with ``extra(projected) -> (nodes, initializers, output)`` after the
    projection."""
    nodes, inits = _pooled()
    more, weights = _project(_name("pooled"), dim)
    added, added_inits, output = extra(_name("projected"))
    return _model(nodes + more + added, inits + weights + added_inits, image_size=image_size,
                  dim=dim, output=output, **fields)


def _plus_mean_of(big_nodes: list[Node], big: str, inits: list, source: str,
                  keep_batch: bool) -> tuple[list[Node], list, str]:
    """``source + mean(big)``: ``big`` is used, so no optimiser can drop it."""
    reduce = helper.make_node("ReduceMean", [big, _name("axes")] if keep_batch else [big],
                              [_name("mean")], name=_name("reduce"), keepdims=1 if keep_batch
                              else 0)
    add = helper.make_node("Add", [source, _name("mean")], [_name("sum")], name=_name("add"))
    more = [_ints("axes", [1])] if keep_batch else []
    return big_nodes + [reduce, add], inits + more, _name("sum")


# --------------------------------------------------------------------------- cases


def huge_initializer(image_size: int, dim: int) -> bytes:
    """An initializer declared 2^40 x dim that carries 4 bytes."""
    def extra(source: str):
        tensor = onnx.TensorProto(name=_name("huge"), data_type=TensorProto.FLOAT,
                                  dims=[2 ** 40, dim], raw_data=b"\0\0\0\0")
        nodes = [helper.make_node("Gather", [_name("huge"), _name("zero")], [_name("row")],
                                  name=_name("gather"), axis=0),
                 helper.make_node("Add", [source, _name("row")], [_name("sum")],
                                  name=_name("add"))]
        return nodes, [tensor, _const("zero", np.array(0, dtype=np.int64))], _name("sum")
    return _with(image_size, dim, extra)


def dangling_output(image_size: int, dim: int) -> bytes:
    """The declared output ``embeddings`` is produced by no node."""
    nodes, inits = _pooled()
    more, weights = _project(_name("pooled"), dim)
    return _model(nodes + more, inits + weights, image_size=image_size, dim=dim,
                  output="embeddings")


def empty_graph_attribute(image_size: int, dim: int) -> bytes:
    """A node with an empty graph-typed attribute (zero bytes: ``ByteSize() == 0``)."""
    model = onnx.load_model_from_string(base(image_size, dim))
    attribute = model.graph.node[0].attribute.add()
    attribute.name = "then_branch"
    attribute.type = onnx.AttributeProto.GRAPH
    attribute.g.SetInParent()
    return model.SerializeToString()


def empty_graphs_attribute(image_size: int, dim: int) -> bytes:
    """A node with a GRAPHS-typed attribute holding no graph at all."""
    model = onnx.load_model_from_string(base(image_size, dim))
    attribute = model.graph.node[0].attribute.add()
    attribute.name = _name("branches")
    attribute.type = onnx.AttributeProto.GRAPHS
    return model.SerializeToString()


def nested_graph_attributes(image_size: int, dim: int, depth: int = 25) -> bytes:
    """A node whose graph attribute holds a node whose graph attribute holds ... ``depth``
    levels."""
    inner = helper.make_graph([], _name("inner"), [], [])
    for level in range(depth):
        node = helper.make_node("Identity", [], [], name=_name(f"level{level}"))
        node.attribute.append(helper.make_attribute("body", inner))
        inner = helper.make_graph([node], _name(f"g{level}"), [], [])
    model = onnx.load_model_from_string(base(image_size, dim))
    model.graph.node[0].attribute.append(helper.make_attribute("then_branch", inner))
    return model.SerializeToString()


def expand_huge(image_size: int, dim: int) -> bytes:
    """``Expand`` of a constant to 2^50 elements (a constant target shape)."""
    def extra(source: str):
        nodes = [helper.make_node("Expand", [_name("one"), _name("shape")], [_name("big")],
                                  name=_name("expand"))]
        inits = [_const("one", np.ones(1, dtype=np.float32)), _ints("shape", [2 ** 25, 2 ** 25])]
        return _plus_mean_of(nodes, _name("big"), inits, source, keep_batch=False)
    return _with(image_size, dim, extra)


def expand_per_image(image_size: int, dim: int) -> bytes:
    """``Expand`` to ``(batch, 2^30)``: the batch axis taken from the data (``Shape``, as the
    export of ``F.normalize`` does), a huge constant beside it."""
    def extra(source: str):
        nodes = [
            helper.make_node("Shape", [source], [_name("shape")], name=_name("shape"), end=1),
            helper.make_node("Concat", [_name("shape"), _name("wide")], [_name("target")],
                             name=_name("concat"), axis=0),
            helper.make_node("ReduceMean", [source, _name("axes")], [_name("col")],
                             name=_name("col"), keepdims=1),
            helper.make_node("Expand", [_name("col"), _name("target")], [_name("big")],
                             name=_name("expand")),
        ]
        return _plus_mean_of(nodes, _name("big"), [_ints("wide", [2 ** 30])], source,
                             keep_batch=True)
    return _with(image_size, dim, extra)


def reshape_huge(image_size: int, dim: int) -> bytes:
    """``Reshape`` of the output to a huge constant shape (and back)."""
    def extra(source: str):
        nodes = [helper.make_node("Reshape", [source, _name("shape")], [_name("big")],
                                  name=_name("reshape")),
                 helper.make_node("Reshape", [_name("big"), _name("back")], [_name("small")],
                                  name=_name("back"))]
        return nodes, [_ints("shape", [2 ** 20, 2 ** 20, -1]),
                       _ints("back", [-1, dim])], _name("small")
    return _with(image_size, dim, extra)


def conv_huge_padding(image_size: int, dim: int) -> bytes:
    """A 1x1 ``Conv`` of the image with 2^20 pixels of padding on each side: an allowed
    operator whose attributes alone make a huge output."""
    pad = 2 ** 20
    nodes = [
        helper.make_node("Conv", ["images", _name("kernel")], [_name("padded")],
                         name=_name("conv"), pads=[pad, pad, pad, pad]),
        helper.make_node("GlobalAveragePool", [_name("padded")], [_name("gap")],
                         name=_name("gap")),
        helper.make_node("Flatten", [_name("gap")], [_name("pooled")], name=_name("flat"),
                         axis=1),
    ]
    more, weights = _project(_name("pooled"), dim)
    kernel = _const("kernel", np.ones((3, 3, 1, 1), dtype=np.float32))
    return _model(nodes + more, [kernel, *weights], image_size=image_size, dim=dim,
                  output=_name("projected"))


def concat_copies(image_size: int, dim: int, copies: int = 2000) -> bytes:
    """``Concat`` of the image with itself ``copies`` times: ``Tile`` through an allowed
    operator."""
    nodes = [
        helper.make_node("Concat", ["images"] * copies, [_name("tiled")], name=_name("tile"),
                         axis=1),
        helper.make_node("GlobalAveragePool", [_name("tiled")], [_name("gap")],
                         name=_name("gap")),
        helper.make_node("Flatten", [_name("gap")], [_name("pooled")], name=_name("flat"),
                         axis=1),
    ]
    weight = _const("weight", np.ones((3 * copies, dim), dtype=np.float32) / copies)
    return _model([*nodes, helper.make_node("MatMul", [_name("pooled"), _name("weight")],
                                            [_name("projected")], name=_name("matmul"))],
                  [weight], image_size=image_size, dim=dim, output=_name("projected"))


def constant_of_shape_in_a_function(image_size: int, dim: int) -> bytes:
    """``ConstantOfShape`` hidden in a local function named like an allowed operator."""
    function = helper.make_function(
        "", "Identity", ["x"], ["y"],
        [helper.make_node("ConstantOfShape", ["x"], ["y"])],
        opset_imports=[helper.make_opsetid("", OPSET)])
    model = onnx.load_model_from_string(base(image_size, dim))
    model.functions.append(function)
    return model.SerializeToString()


def huge_batch_dim(image_size: int, dim: int) -> bytes:
    """The input and output declare a batch of 2^40 images."""
    nodes, inits = _pooled()
    more, weights = _project(_name("pooled"), dim)
    return _model(nodes + more, inits + weights, image_size=image_size, dim=dim,
                  output=_name("projected"),
                  inputs=[helper.make_tensor_value_info(
                      "images", TensorProto.FLOAT, [2 ** 40, 3, image_size, image_size])],
                  outputs=[helper.make_tensor_value_info("embeddings", TensorProto.FLOAT,
                                                         [2 ** 40, dim])])


def negative_dim(image_size: int, dim: int) -> bytes:
    """A weight declared with a negative dimension."""
    model = onnx.load_model_from_string(base(image_size, dim))
    weight = next(t for t in model.graph.initializer if t.name == _name("weight"))
    weight.dims[0] = -3
    return model.SerializeToString()


def zero_width_weight(image_size: int, dim: int) -> bytes:
    """A ``(3, 0)`` weight: an empty output where ``(batch, dim)`` is declared."""
    nodes, inits = _pooled()
    return _model(
        [*nodes, helper.make_node("MatMul", [_name("pooled"), _name("weight")],
                                  [_name("projected")], name=_name("matmul"))],
        [*inits, _const("weight", np.zeros((3, 0), dtype=np.float32))],
        image_size=image_size, dim=dim, output=_name("projected"))


def many_nodes(image_size: int, dim: int, count: int = 100_000) -> bytes:
    """``count`` ``Identity`` nodes in a chain before the output."""
    def extra(source: str):
        names = [source] + [f"{SECRET}-{i}" for i in range(count)]
        nodes = [helper.make_node("Identity", [a], [b]) for a, b in zip(names, names[1:],
                                                                        strict=False)]
        return nodes, [], names[-1]
    return _with(image_size, dim, extra)


def zero_over_zero(image_size: int, dim: int) -> bytes:
    """Every vector is ``0 / 0``: NaN on any image."""
    def extra(source: str):
        nodes = [helper.make_node("Sub", [source, source], [_name("zero")], name=_name("sub")),
                 helper.make_node("Div", [_name("zero"), _name("zero")], [_name("nan")],
                                  name=_name("div"))]
        return nodes, [], _name("nan")
    return _with(image_size, dim, extra)


def one_over_zero(image_size: int, dim: int) -> bytes:
    """Every vector is ``1 / 0``: infinite on any image."""
    def extra(source: str):
        nodes = [helper.make_node("Sub", [source, source], [_name("zero")], name=_name("sub")),
                 helper.make_node("Div", [_name("one"), _name("zero")], [_name("inf")],
                                  name=_name("div"))]
        return nodes, [_const("one", np.ones(1, dtype=np.float32))], _name("inf")
    return _with(image_size, dim, extra)


def double_output(image_size: int, dim: int) -> bytes:
    """The output computed as float64 where float32 is declared."""
    def extra(source: str):
        return ([helper.make_node("Cast", [source], [_name("double")], name=_name("cast"),
                                  to=TensorProto.DOUBLE)], [], _name("double"))
    return _with(image_size, dim, extra)


def keeps_many_alive(image_size: int, dim: int, copies: int = 3000) -> bytes:
    """``copies`` scaled copies of the image, all alive until a chain of ``Add`` sums them:
    each is small, together they are thousands of images."""
    scaled = [helper.make_node("Mul", ["images", _name(f"s{i}")], [_name(f"c{i}")])
              for i in range(copies)]
    sums = [helper.make_node("Add", [_name("c0"), _name("c1")], [_name("t1")])]
    sums += [helper.make_node("Add", [_name(f"t{i - 1}"), _name(f"c{i}")], [_name(f"t{i}")])
             for i in range(2, copies)]
    nodes = [*scaled, *sums,
             helper.make_node("GlobalAveragePool", [_name(f"t{copies - 1}")], [_name("gap")]),
             helper.make_node("Flatten", [_name("gap")], [_name("pooled")], axis=1)]
    more, weights = _project(_name("pooled"), dim)
    scales = [_const(f"s{i}", np.full(1, 1 / copies, dtype=np.float32)) for i in range(copies)]
    return _model(nodes + more, scales + weights, image_size=image_size, dim=dim,
                  output=_name("projected"))


def batch_squared(image_size: int, dim: int) -> bytes:
    """A size computed as (batch - 1) * (batch - 2) + batch: 1 and 2 at batches of 1 and 2
    (as a proportional size would be), thousands at 64."""
    def extra(source: str):
        nodes = [
            helper.make_node("Shape", [source], [_name("n")], end=1),
            helper.make_node("Sub", [_name("n"), _name("one")], [_name("a")]),
            helper.make_node("Sub", [_name("n"), _name("two")], [_name("b")]),
            helper.make_node("Mul", [_name("a"), _name("b")], [_name("ab")]),
            helper.make_node("Add", [_name("ab"), _name("n")], [_name("rows")]),
            helper.make_node("Concat", [_name("rows"), _name("dims")], [_name("target")],
                             axis=0),
            helper.make_node("ReduceMean", [source, _name("axes")], [_name("col")],
                             keepdims=1),
            helper.make_node("Expand", [_name("col"), _name("target")], [_name("big")]),
        ]
        inits = [_ints("one", [1]), _ints("two", [2]), _ints("dims", [1]),
                 _ints("axes", [0, 1])]
        return _plus_mean_of(nodes, _name("big"), inits, source, keep_batch=False)
    return _with(image_size, dim, extra)


def nan_on_images(image_size: int, dim: int) -> bytes:
    """``sqrt(-x^2)`` of the pooled image: 0 on a zero image, NaN on any other."""
    def extra(source: str):
        nodes = [
            helper.make_node("Mul", [_name("pooled"), _name("pooled")], [_name("sq")]),
            helper.make_node("Sub", [_name("zero"), _name("sq")], [_name("neg")]),
            helper.make_node("Sqrt", [_name("neg")], [_name("root")]),
            helper.make_node("ReduceMean", [_name("root"), _name("axes")], [_name("mean")],
                             keepdims=1),
            helper.make_node("Add", [source, _name("mean")], [_name("sum")]),
        ]
        return nodes, [_const("zero", np.zeros(1, dtype=np.float32)),
                       _ints("axes", [1])], _name("sum")
    return _with(image_size, dim, extra)


def inf_on_images(image_size: int, dim: int) -> bytes:
    """The projection times 1e30, squared: 0 on a zero image, infinite on any other (squared,
    not times 1e30 again: an optimiser folds two constant factors into one infinite one)."""
    def extra(source: str):
        nodes = [helper.make_node("Mul", [source, _name("big")], [_name("x1")]),
                 helper.make_node("Mul", [_name("x1"), _name("x1")], [_name("x2")])]
        return nodes, [_const("big", np.full(1, 1e30, dtype=np.float32))], _name("x2")
    return _with(image_size, dim, extra)


# The graphs a check must refuse, by what they try.
GRAPHS: dict[str, Callable[[int, int], bytes]] = {
    "an initializer declared 2^40 x dim carrying 4 bytes": huge_initializer,
    "a declared output no node produces": dangling_output,
    "an empty graph attribute": empty_graph_attribute,
    "an empty GRAPHS attribute": empty_graphs_attribute,
    "graph attributes nested 25 deep": nested_graph_attributes,
    "Expand of a constant to 2^50 elements": expand_huge,
    "Expand to (batch, 2^30)": expand_per_image,
    "Reshape to a huge constant shape": reshape_huge,
    "Conv with 2^20 pixels of padding": conv_huge_padding,
    "Concat of 2000 copies of the image": concat_copies,
    "ConstantOfShape in a local function": constant_of_shape_in_a_function,
    "a declared batch of 2^40": huge_batch_dim,
    "a negative dimension": negative_dim,
    "a zero-width weight": zero_width_weight,
    "100k nodes": many_nodes,
    "0/0 on every image": zero_over_zero,
    "1/0 on every image": one_over_zero,
    "a float64 output declared float32": double_output,
    "3000 image-sized tensors alive at once": keeps_many_alive,
    "a size quadratic in the batch": batch_squared,
}
# Graphs that pass every check and give non-finite vectors on real images.
NON_FINITE_ON_IMAGES: dict[str, Callable[[int, int], bytes]] = {
    "NaN": nan_on_images,
    "infinite": inf_on_images,
}
