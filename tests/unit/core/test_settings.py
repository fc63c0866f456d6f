"""Settings: defaults, environment overrides, and refusals that name the variable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from imgret.settings import Settings, resolve_device


def test_defaults_use_sqlite_under_data_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("IMGRET_DATA_DIR", str(tmp_path))
    settings = Settings()
    assert settings.db_url == f"sqlite:///{tmp_path.resolve() / 'imgret.db'}"
    assert settings.batch_max_size == 32
    assert settings.device == "auto"


def test_environment_overrides(monkeypatch) -> None:
    monkeypatch.setenv("IMGRET_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    monkeypatch.setenv("IMGRET_BATCH_MAX_SIZE", "1")
    monkeypatch.setenv("IMGRET_API_KEY", "s3cret")
    settings = Settings()
    assert settings.db_url == "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    assert settings.batch_max_size == 1
    assert settings.api_key.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("IMGRET_DEVICE", "tpu", "device"),
        ("IMGRET_MAX_UPLOAD_BYTES", "-1", "max_upload_bytes"),
        ("IMGRET_MAX_IMAGE_PIXELS", "0", "max_image_pixels"),
        ("IMGRET_DATABASE_URL", "not a url", "database_url"),
        ("IMGRET_DATABASE_URL", "mysql://root@localhost/db", "database_url"),
        ("IMGRET_BATCH_MAX_SIZE", "0", "batch_max_size"),
        ("IMGRET_BATCH_MAX_WAIT_MS", "-5", "batch_max_wait_ms"),
        ("IMGRET_INDEX_NPROBE", "0", "index_nprobe"),
        ("IMGRET_INDEX_EF_SEARCH", "zero", "index_ef_search"),
    ],
)
def test_bad_values_are_refused_naming_the_field(monkeypatch, variable, value, field) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert field in str(info.value)


def test_resolve_device() -> None:
    import torch

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="IMGRET_DEVICE=cuda"):
            resolve_device("cuda")
