"""ModelSpec in model.pt: old payloads load to the same spec and version; bad ones are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imgret.checkpoint import (
    EmbeddingNet,
    ModelSpec,
    load_checkpoint,
    model_version_of,
    save_checkpoint,
)
from imgret.errors import CheckpointError

GREY = ModelSpec(backbone="tiny_cnn", dim=16, image_size=28, mean=(0.286,) * 3,
                 std=(0.353,) * 3, grayscale=True)


def _saved(tmp_path: Path, spec: dict | object) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    save_checkpoint(path, EmbeddingNet(GREY))
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "spec": spec}, path)
    return path


def test_a_spec_saved_as_lists_loads_as_tuples_with_the_same_version(tmp_path: Path) -> None:
    torch.manual_seed(0)
    version = model_version_of(EmbeddingNet(GREY), GREY)
    as_json = {**GREY.to_dict(), "mean": [0.286] * 3, "std": [0.353] * 3}
    loaded = load_checkpoint(_saved(tmp_path, as_json))
    assert loaded.spec == GREY and isinstance(loaded.spec.mean, tuple)
    assert loaded.model_version == version == model_version_of(loaded.model, loaded.spec)


def test_to_dict_is_what_the_version_hash_has_always_read() -> None:
    assert GREY.to_dict() == {"backbone": "tiny_cnn", "dim": 16, "image_size": 28,
                              "mean": (0.286,) * 3, "std": (0.353,) * 3, "grayscale": True}


@pytest.mark.parametrize(
    ("spec", "message"),
    [({**GREY.to_dict(), "depth": 3}, r"bad model config \(spec has an unknown field"),
     ({**GREY.to_dict(), "dim": "wide"}, "bad model config .*spec.dim: Input should be a valid "
                                         "integer"),
     ({**GREY.to_dict(), "mean": [0.5, 0.5]}, "bad model config .*spec.mean.2: Field required"),
     ("resnet18", "spec should be a dict, not str")],
)
def test_a_bad_spec_is_a_checkpoint_error(tmp_path: Path, spec: object, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(_saved(tmp_path, spec))
