"""require=fnir_not_worse: a switch to a version that misses more of the known identities at
its calibrated FPIR is refused with 409 and the numbers; the way back is allowed. The worse
version is a blind network (its head ignores the image: every embedding is the same), the
served one the tiny untrained CNN, which tells the generated classes apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imgret.checkpoint import load_checkpoint, save_checkpoint
from tests.support.open_set import gallery_with_unknowns_and_second_version

TARGET = 0.2


@pytest.fixture(scope="module")
def blind_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """The tiny CNN with its head's weights zeroed: the bias alone, whatever the image."""
    loaded = load_checkpoint(tiny_checkpoint)
    with torch.no_grad():
        loaded.model.head.weight.zero_()
    run = tmp_path_factory.mktemp("blind_run")
    save_checkpoint(run, loaded.model)
    return run


def _activate(client, version: str, *require: str, **query):
    params = [("require", r) for r in require] + list(query.items())
    return client.post(f"/models/{version}/activate", params=params)


def test_a_version_with_more_misses_is_refused_and_the_way_back_allowed(
        make_client, tmp_path: Path, blind_checkpoint: Path) -> None:
    with make_client(embed_duty=1.0, model_roots=[blind_checkpoint]) as client:
        # Gallery: 5 identities; query set: 10 (5 unknown), 3 images each.
        good, blind = gallery_with_unknowns_and_second_version(
            client, tmp_path, blind_checkpoint, gallery_classes=5, gallery_per_class=4,
            query_classes=10)

        uncalibrated = _activate(client, blind, "fnir_not_worse", query_set="cal")
        assert uncalibrated.status_code == 409
        assert "calibrate it first" in uncalibrated.json()["detail"]
        for version in (good, blind):
            response = client.post(f"/models/{version}/calibrate",
                                   json={"query_set": "cal", "target_fpir": TARGET})
            assert response.status_code == 200, response.text

        refused = _activate(client, blind, "fnir_not_worse", query_set="cal")

        assert refused.status_code == 409, refused.text
        body = refused.json()
        numbers = body["open_set"]
        assert "require=fnir_not_worse" in body["detail"] and "worse" in body["detail"]
        assert (numbers["a"]["version"], numbers["b"]["version"]) == (good, blind)
        assert numbers["fpir"] == TARGET and numbers["verdict"] == "worse"
        assert numbers["b"]["fnir"] > numbers["a"]["fnir"]
        assert numbers["difference"] == pytest.approx(numbers["b"]["fnir"] -
                                                      numbers["a"]["fnir"])
        low, high = numbers["ci95"]
        assert 0 < low <= numbers["difference"] <= high
        assert f"{numbers['a']['fnir']:.4f}" in body["detail"]
        # Each side at its own threshold: the calibrated ones (same set, same target).
        for side, version in (("a", good), ("b", blind)):
            calibration = client.get(f"/models/{version}").json()["calibration"]
            assert numbers[side]["threshold"] == calibration["threshold"]
        assert client.get("/health").json()["model_version"] == good

        # Ungated, the blind version goes in; back to the better one through the gate, with
        # the retrieval verdict beside it.
        assert _activate(client, blind).status_code == 200
        back = _activate(client, good, "not_worse", "fnir_not_worse", query_set="cal")
        assert back.status_code == 200, back.text
        assert back.json()["open_set"]["verdict"] == "better"
        assert back.json()["comparison"] is not None
        gate = client.get("/models").json()["history"][0]["gate"]
        assert gate["require"] == "not_worse" and gate["fnir"]["verdict"] == "better"

        both = _activate(client, blind, "better", "not_worse", query_set="cal")
        assert both.status_code == 409 and "one of better or not_worse" in both.json()["detail"]
