"""/evaluate names the cause when there is nothing to rank against: a model version with no
vectors (registered, not embedded) is not "an empty gallery" (SQLite and PostgreSQL)."""

from __future__ import annotations

import io

import pytest
import torch

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from tests.api.conftest import add_gallery, png


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A second version's model.pt: the tiny CNN with other random weights."""
    torch.manual_seed(7)
    run = tmp_path_factory.mktemp("other_run")
    save_checkpoint(run, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return (run / "model.pt").read_bytes()


def _queries() -> tuple[list, dict]:
    files = [("images", (f"{c}.png", png(c, 70 + c), "image/png")) for c in range(3)]
    return files, {"labels": ["0", "1", "2"]}


def test_a_version_without_vectors_is_named_not_an_empty_gallery(
        make_client, other_checkpoint: bytes) -> None:
    with make_client() as client:
        add_gallery(client, classes=3, per_class=2)
        served = client.get("/health").json()["model_version"]
        registered = client.post("/models", files={
            "checkpoint": ("model.pt", io.BytesIO(other_checkpoint), "application/octet-stream")})
        assert registered.status_code == 201, registered.text
        version = registered.json()["version"]
        files, data = _queries()
        for extra in ({"compare": [served, version]}, {"model_version": version}):
            response = client.post("/evaluate", files=files, data={**data, **extra})
            assert response.status_code == 422, (extra, response.text)
            detail = response.json()["detail"]
            assert f"model version {version} has no vectors of the 6 gallery items" in detail
            assert "embed it first" in detail and "gallery is empty" not in detail
        # The served version still evaluates: the refusal changed nothing.
        assert client.post("/evaluate", files=files, data=data).status_code == 200


def test_an_empty_gallery_is_still_called_empty(make_client) -> None:
    with make_client() as client:
        files, data = _queries()
        response = client.post("/evaluate", files=files, data=data)
        assert response.status_code == 422
        assert response.json()["detail"] == ("the gallery is empty: add items (POST /gallery) "
                                             "first")


def test_the_message_without_a_database_names_both_causes() -> None:
    from imgret.gallery.evaluation.retrieval import _nothing_to_rank

    message = _nothing_to_rank("v-x", None)
    assert "model version v-x has no vectors" in message and "embed it first" in message
