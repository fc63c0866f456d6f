"""ONNX export of the network and the Embedder's ONNX Runtime backend: the graph gives the
PyTorch network's vectors, and the runtime changes nothing a caller sees."""

from __future__ import annotations

import json
import logging
import multiprocessing
import sys

import numpy as np
import pytest
import torch

from imgret import embedder as embedder_module
from imgret.checkpoint import EmbeddingNet, ModelSpec, model_version_of
from imgret.embedder import Embedder
from imgret.onnx_export import export_onnx, onnx_bytes, preprocessing_contract
from imgret.transforms import eval_transform
from tests.support.images import class_image

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

TOLERANCE = 1e-4
SPEC = ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)


def _model(spec: ModelSpec = SPEC, seed: int = 0) -> EmbeddingNet:
    torch.manual_seed(seed)
    model = EmbeddingNet(spec)
    # Batch norm statistics away from their defaults, so the exported graph's folding of
    # them is exercised with values that matter.
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()


@pytest.fixture
def images() -> list:
    # Sizes other than the model's: the resize is part of what is compared.
    return [class_image(label, i, size=40 + 3 * i) for label in range(3) for i in range(3)]


def _torch_vectors(model: EmbeddingNet, batch: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return model(batch).numpy()


@pytest.mark.parametrize("spec", [SPEC, ModelSpec(backbone="small_cnn", dim=8, image_size=32,
                                                  grayscale=True, mean=(0.5, 0.5, 0.5),
                                                  std=(0.25, 0.25, 0.25))])
def test_exported_files_give_the_checkpoint_vectors(spec, images, tmp_path) -> None:
    model = _model(spec)
    version = model_version_of(model, spec)
    files = export_onnx(model, spec, tmp_path / "out", model_version=version)

    graph = onnx.load(str(files.model))
    onnx.checker.check_model(graph)
    batch_dim = graph.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value  # a named, dynamic batch axis
    assert files.triton_model.read_bytes() == files.model.read_bytes()

    # The preprocessing file, read back into the transform, gives the same input.
    contract = json.loads(files.preprocessing.read_text())
    assert ModelSpec(**contract["spec"]) == spec
    assert contract["image_size"] == spec.image_size and contract["grayscale"] == spec.grayscale
    assert contract["output"]["l2_normalized"] is True
    transform = eval_transform(spec)
    batch = torch.stack([transform(image) for image in images])

    session = ort.InferenceSession(str(files.model), providers=["CPUExecutionProvider"])
    expected = _torch_vectors(model, batch)
    for rows in (slice(0, 1), slice(0, len(images))):  # batch 1 and a larger one
        (got,) = session.run(None, {contract["input"]["name"]: batch[rows].numpy()})
        assert got.shape == expected[rows].shape
        assert np.abs(got - expected[rows]).max() <= TOLERANCE


def test_triton_config_describes_the_graph(tmp_path) -> None:
    model = _model()
    version = model_version_of(model, SPEC)
    files = export_onnx(model, SPEC, tmp_path, model_version=version)
    assert files.triton_config.parent.name == version
    assert files.triton_model.parent.name == "1"
    text = files.triton_config.read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert f'name: "{version}"' in lines
    assert 'backend: "onnxruntime"' in lines
    assert any(line.startswith("max_batch_size: ") and int(line.split(": ")[1]) > 1
               for line in lines)
    assert "dynamic_batching {" in lines
    assert f"dims: [ 3, {SPEC.image_size}, {SPEC.image_size} ]" in lines
    assert f"dims: [ {SPEC.dim} ]" in lines
    assert text.count("{") == text.count("}") and text.count("[") == text.count("]")
    graph = onnx.load(str(files.triton_model))
    assert [i.name for i in graph.graph.input] == ['images']
    assert [o.name for o in graph.graph.output] == ['embeddings']
    assert 'name: "images"' in lines and 'name: "embeddings"' in lines


def test_contract_names_each_step_of_the_transform() -> None:
    steps = [s["op"] for s in preprocessing_contract(SPEC)["steps"]]
    assert steps == ["to_uint8_chw", "resize", "to_float", "normalize"]
    grey = ModelSpec(backbone="tiny_cnn", dim=16, image_size=32, grayscale=True)
    assert [s["op"] for s in preprocessing_contract(grey)["steps"]][1] == "grayscale"


def test_runtimes_give_the_same_vectors(images) -> None:
    model = _model()
    by_torch = Embedder(model, SPEC, device="cpu", runtime="torch")
    by_onnx = Embedder(model, SPEC, device="cpu", runtime="onnxruntime", batch_size=4)
    assert (by_torch.runtime, by_onnx.runtime) == ("torch", "onnxruntime")
    assert by_onnx.model_version == by_torch.model_version
    expected, got = by_torch.embed(images), by_onnx.embed(images)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE
    assert by_onnx.embed([]).shape == (0, SPEC.dim)


def test_session_threads_follow_torch_threads(images) -> None:
    embedder = Embedder(_model(), SPEC, device="cpu", runtime="onnxruntime")
    before = torch.get_num_threads()
    expected = embedder.embed(images)
    assert embedder._onnx.threads == before
    try:
        torch.set_num_threads(1)
        again = embedder.embed(images)
        assert embedder._onnx.threads == 1
    finally:
        torch.set_num_threads(before)
    np.testing.assert_allclose(again, expected, atol=TOLERANCE)


def _embed_in_child(embedder, images, conn) -> None:
    torch.set_num_threads(1)  # as an ingest worker does
    conn.send(embedder.embed(images))
    conn.close()


@pytest.mark.parametrize("parent_ran", [True, False], ids=["parent-ran", "parent-idle"])
def test_a_forked_child_embeds_with_its_own_session(images, parent_ran: bool) -> None:
    """A child forked from a process whose session exists (as ingest workers are) embeds
    with one thread, as torch does there, and gets the parent's vectors. The parent's session
    is set aside in the child, never destroyed: destroying one that has not run yet waited
    forever there on pool threads that exist only in the parent (resnet18: the tiny network's
    session did not show it)."""
    spec = ModelSpec(backbone="resnet18", dim=16, image_size=32)
    embedder = Embedder(_model(spec), spec, device="cpu", runtime="onnxruntime")
    expected = embedder.embed(images) if parent_ran else None
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    child = context.Process(target=_embed_in_child, args=(embedder, images, theirs))
    child.start()
    theirs.close()
    try:
        assert mine.poll(60), "the child did not answer"
        got = mine.recv()
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    if expected is None:
        expected = embedder.embed(images)
    assert embedder._onnx.threads == torch.get_num_threads()  # the parent's is unchanged
    assert child.exitcode == 0
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_falls_back_to_torch_when_onnxruntime_is_missing(images, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails
    model = _model()
    with caplog.at_level(logging.WARNING, logger="imgret.embedder"):
        embedder = Embedder(model, SPEC, device="cpu", runtime="onnxruntime")
    assert embedder.runtime == "torch"
    assert any("onnxruntime is not installed" in r.getMessage() for r in caplog.records)
    expected = Embedder(model, SPEC, device="cpu").embed(images)
    np.testing.assert_array_equal(embedder.embed(images), expected)


def test_an_unknown_runtime_is_refused() -> None:
    with pytest.raises(ValueError, match="runtime"):
        Embedder(_model(), SPEC, device="cpu", runtime="tensorrt")


def test_export_leaves_a_training_model_in_training_mode() -> None:
    model = _model().train()
    assert onnx_bytes(model)
    assert model.training


def test_concurrent_exports_in_one_process_each_get_their_graph() -> None:
    """torch.onnx.export keeps process-global state; the service builds Embedders from
    several threads, and two at once made each other fail (then silently run torch)."""
    import threading

    models = [_model(seed=seed) for seed in (0, 1, 2, 3)]
    expected = [onnx_bytes(model, SPEC) for model in models]
    start = threading.Barrier(len(models))
    got: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def export(i: int) -> None:
        start.wait()
        try:
            got[i] = onnx_bytes(models[i], SPEC)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=export, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert [got[i] for i in range(len(models))] == expected


def test_auto_runs_onnxruntime_where_it_gives_torchs_vectors(images) -> None:
    model = _model()
    embedder = Embedder(model, SPEC, device="cpu", runtime="auto")
    choice = embedder.runtime_choice
    assert embedder.runtime == choice.runtime == "onnxruntime"
    assert choice.asked == "auto" and choice.bound == embedder_module.EQUALITY_BOUND
    assert choice.max_abs_diff is not None and 0 <= choice.max_abs_diff <= choice.bound
    by_torch = Embedder(model, SPEC, device="cpu", runtime="torch")
    assert by_torch.runtime_choice.runtime == "torch" and by_torch.runtime_choice.asked == "torch"
    np.testing.assert_allclose(embedder.embed(images), by_torch.embed(images), atol=TOLERANCE)


def test_auto_keeps_torch_when_the_graph_gives_other_vectors(images, monkeypatch) -> None:
    """A graph that is not the network (here: the same architecture with other weights) fails
    the check on the version's sample, and torch runs."""
    model, other = _model(seed=0), _model(seed=1)
    monkeypatch.setattr(embedder_module, "onnx_bytes", lambda m, s: onnx_bytes(other, s))
    embedder = Embedder(model, SPEC, device="cpu", runtime="auto",
                        model_version="other-weights-graph")
    choice = embedder.runtime_choice
    assert embedder.runtime == choice.runtime == "torch"
    assert "over the bound" in choice.reason
    expected = Embedder(model, SPEC, device="cpu", runtime="torch").embed(images)
    np.testing.assert_array_equal(embedder.embed(images), expected)


def test_auto_without_onnxruntime_is_torch_without_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with caplog.at_level(logging.WARNING, logger="imgret.embedder"):
        embedder = Embedder(_model(), SPEC, device="cpu", runtime="auto")
    assert embedder.runtime_choice.runtime == "torch"
    assert embedder.runtime_choice.reason == "onnxruntime is not installed"
    assert not caplog.records  # nothing was asked for by name


def test_a_version_is_exported_and_checked_once_per_process(monkeypatch) -> None:
    model = _model(seed=3)
    calls = []

    def counted(m, s):
        calls.append(1)
        return onnx_bytes(m, s)

    monkeypatch.setattr(embedder_module, "onnx_bytes", counted)
    first = Embedder(model, SPEC, device="cpu", runtime="auto")
    again = Embedder(model, SPEC, device="cpu", runtime="auto")
    assert len(calls) == 1
    assert again.runtime == "onnxruntime"
    assert again.runtime_choice.max_abs_diff == first.runtime_choice.max_abs_diff
