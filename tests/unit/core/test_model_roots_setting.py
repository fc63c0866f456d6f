"""IMGRET_MODEL_ROOTS and IMGRET_MAX_CHECKPOINT_BYTES as read from the environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from imgret.settings import Settings


def test_model_roots_split_on_the_path_separator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMGRET_MODEL_ROOTS", os.pathsep.join(["/srv/models", " ", "runs"]))
    assert Settings().model_roots == [Path("/srv/models"), Path("runs")]
    monkeypatch.delenv("IMGRET_MODEL_ROOTS")
    assert Settings().model_roots == []


def test_the_checkpoint_cap_fits_a_resnet50_and_must_be_positive() -> None:
    assert Settings().max_checkpoint_bytes >= 200 * 1024 * 1024
    with pytest.raises(ValidationError, match="max_checkpoint_bytes"):
        Settings(max_checkpoint_bytes=0)
