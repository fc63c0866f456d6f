"""The checks on an uploaded ONNX graph (imgret.onnx_graph): each hostile graph is refused
with a message that quotes nothing of the file, the exported and int8 graphs pass, and what
fails later (ONNX Runtime's load or run, non-finite vectors) is an imgret error in imgret's
words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from imgret import onnx_graph
from imgret.checkpoint import EmbeddingNet, ModelSpec, Quantized
from imgret.embedder import Embedder
from imgret.errors import ModelRunError
from imgret.gallery.versions.reembed import job_error
from imgret.onnx_runtime import OnnxRuntimeModel

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
hostile = pytest.importorskip("tests.support.hostile_graphs")

SIZE, DIM = 32, 16
SPEC = ModelSpec(backbone="tiny_cnn", dim=DIM, image_size=SIZE)


def test_the_base_graph_and_an_int8_export_pass() -> None:
    from imgret.onnx_export import onnx_bytes
    from imgret.quantize import quantize_int8

    assert onnx_graph.graph_problem(hostile.base(SIZE, DIM), image_size=SIZE, dim=DIM) is None
    torch.manual_seed(0)
    model = EmbeddingNet(SPEC).eval()
    graph = quantize_int8(onnx_bytes(model, SPEC), [np.random.rand(4, 3, SIZE, SIZE)
                                                    .astype(np.float32)])
    assert onnx_graph.graph_problem(graph, image_size=SIZE, dim=DIM) is None


@pytest.mark.parametrize("case", sorted(hostile.GRAPHS))
def test_a_hostile_graph_is_refused_with_a_message_of_our_own(case: str) -> None:
    problem = onnx_graph.graph_problem(hostile.GRAPHS[case](SIZE, DIM), image_size=SIZE,
                                       dim=DIM)
    assert problem is not None, case
    assert hostile.SECRET not in problem


@pytest.mark.parametrize("case", ["an initializer declared 2^40 x dim carrying 4 bytes",
                                  "a declared output no node produces",
                                  "an empty graph attribute"])
def test_onnx_runtime_itself_refuses_the_graphs_that_used_to_register(case: str) -> None:
    """What the checks before ONNX Runtime's own load let through: ONNX Runtime refuses them
    when it loads them (at embed time, as a 500, before the load became a check)."""
    with pytest.raises(Exception):  # noqa: B017, PT011 - ONNX Runtime's own error types
        onnx_graph.open_session(hostile.GRAPHS[case](SIZE, DIM), threads=1,
                                providers=["CPUExecutionProvider"])


def test_what_onnx_runtime_cannot_load_is_an_error_in_our_words() -> None:
    with pytest.raises(ModelRunError, match="cannot load") as refused:
        OnnxRuntimeModel(hostile.dangling_output(SIZE, DIM))
    assert hostile.SECRET not in str(refused.value)
    assert hostile.SECRET not in job_error(refused.value)


def test_a_failed_run_is_an_error_in_our_words() -> None:
    model = OnnxRuntimeModel(hostile.base(SIZE, DIM))
    with pytest.raises(ModelRunError, match="failed running") as refused:
        model.run(np.zeros((2, 3, SIZE + 1, SIZE), dtype=np.float32))  # not its input shape
    assert hostile.SECRET not in str(refused.value)


def test_a_job_keeps_no_foreign_error_text() -> None:
    assert job_error(RuntimeError(f"node {hostile.SECRET} failed")) == (
        "the re-embedding stopped on an unexpected error (RuntimeError); the server log has "
        "the details")


def test_a_run_takes_at_most_the_checked_batch() -> None:
    model = OnnxRuntimeModel(hostile.base(SIZE, DIM))
    calls = []
    session = model.session()

    class Counting:
        def run(self, names, feeds):
            calls.append(len(feeds[onnx_graph.INPUT_NAME]))
            return session.run(names, feeds)

    model._session = Counting()
    out = model.run(np.random.rand(onnx_graph.MAX_RUN_BATCH + 3, 3, SIZE, SIZE)
                    .astype(np.float32))
    assert out.shape == (onnx_graph.MAX_RUN_BATCH + 3, DIM)
    assert calls == [onnx_graph.MAX_RUN_BATCH, 3]


@pytest.mark.parametrize("case", sorted(hostile.NON_FINITE_ON_IMAGES))
def test_non_finite_vectors_are_refused_where_the_model_runs(case: str) -> None:
    """Finite on a zero image (so the graph registers), NaN or infinite on real ones: the
    Embedder refuses them, whatever called it."""
    graph = hostile.NON_FINITE_ON_IMAGES[case](SIZE, DIM)
    assert onnx_graph.graph_problem(graph, image_size=SIZE, dim=DIM) is None
    torch.manual_seed(0)
    embedder = Embedder(EmbeddingNet(SPEC).eval(), SPEC, device="cpu",
                        quantized=Quantized("int8", graph))
    assert embedder.embed_tensors(torch.zeros(1, 3, SIZE, SIZE)).shape == (1, DIM)
    with pytest.raises(ModelRunError, match="non-finite vectors"):
        embedder.embed_tensors(torch.rand(4, 3, SIZE, SIZE) + 0.5)
