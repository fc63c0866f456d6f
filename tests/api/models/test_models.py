"""/models: register, re-embed from the media store, activate, roll back, search by item id, on
SQLite and PostgreSQL (the app in-process; real database, real FAISS, real tiny models)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.embedder import Embedder
from imgret.service.schemas.versions import RegisterUpload
from tests.api.conftest import add_gallery, png, search
from tests.conftest import require


def _checkpoint(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    save_checkpoint(folder, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return folder


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second version: the tiny CNN with other random weights."""
    return _checkpoint(tmp_path_factory.mktemp("other_run"), seed=1)


@pytest.fixture
def make_client(make_client, other_checkpoint: Path, tmp_path: Path):
    """The app with the test checkpoints' folders as IMGRET_MODEL_ROOTS (paths elsewhere are
    refused)."""
    def factory(**overrides):
        overrides.setdefault("model_roots", [other_checkpoint.parent, tmp_path])
        return make_client(**overrides)

    return factory


def _register(client, run: Path) -> dict:
    response = client.post("/models", json={"path": str(run)})
    assert response.status_code == 201, response.text
    return response.json()


def _embed_and_wait(client, version: str) -> dict:
    assert client.post(f"/models/{version}/embed").status_code == 202
    client.app.state.resources.jobs.wait(version, timeout=60)
    info = client.get(f"/models/{version}").json()
    assert info["embedding"]["state"] == "done", info
    return info


def test_the_default_runtime_and_its_check_are_shown_by_the_model(
        make_client, other_checkpoint: Path) -> None:
    """IMGRET_RUNTIME unset: the served version runs with ONNX Runtime after the equality
    check, and GET /models/{v} says so with the measured difference; a version this process
    has not loaded shows no runtime (a read loads nothing)."""
    with make_client() as client:
        a = client.get("/health").json()["model_version"]
        runtime = client.get(f"/models/{a}").json()["runtime"]
        assert runtime["asked"] == "auto" and runtime["runtime"] == "onnxruntime"
        assert 0 <= runtime["max_abs_diff"] <= runtime["bound"] == 1e-4
        b = _register(client, other_checkpoint)["version"]
        assert client.get(f"/models/{b}").json()["runtime"] is None
        listed = {m["version"]: m["runtime"] for m in client.get("/models").json()["models"]}
        assert listed == {a: runtime, b: None}
    with make_client(runtime="torch") as client:
        assert client.get(f"/models/{a}").json()["runtime"] == {
            "asked": "torch", "runtime": "torch", "reason": "IMGRET_RUNTIME=torch",
            "max_abs_diff": None, "bound": None}


def test_register_embed_activate_and_roll_back(make_client, other_checkpoint: Path) -> None:
    with make_client(embed_duty=1.0) as client:
        ids = add_gallery(client, classes=3, per_class=4)
        a = client.get("/health").json()["model_version"]
        b = _register(client, other_checkpoint)
        assert b["version"] != a and not b["active"] and b["checkpoint_stored"]
        assert b["coverage"] == {"embedded": 0, "live": 12, "fraction": 0.0, "complete": False}
        assert _register(client, other_checkpoint)["version"] == b["version"]  # idempotent
        version_b = b["version"]

        # Not embedded: the switch is refused and nothing changes.
        refused = client.post(f"/models/{version_b}/activate")
        assert refused.status_code == 409 and "0 of 12" in refused.json()["detail"]
        assert client.get("/health").json()["model_version"] == a

        # Deleted before the job runs: never embedded, never back.
        gone = next(iter(ids))
        assert client.delete(f"/gallery/{gone}").status_code == 204
        info = _embed_and_wait(client, version_b)
        assert info["coverage"]["complete"] and info["coverage"]["live"] == 11
        assert info["index"]["state"] == "built" and info["index"]["size"] == 11

        switched = client.post(f"/models/{version_b}/activate")
        assert switched.status_code == 200, switched.text
        assert switched.json()["active"] == version_b and switched.json()["previous"] == a
        response = search(client, png(1, 99), k="5").json()
        assert response["model_version"] == version_b
        assert gone not in [hit["id"] for hit in response["results"]]
        # The query was embedded by B and ranked in B's index: the score is B's inner product.
        embedder_b = Embedder.from_checkpoint(other_checkpoint, device="cpu")
        top = response["results"][0]
        stored = client.get(f"/gallery/{top['id']}/image").content
        vectors = embedder_b.embed([_image(png(1, 99)), _image(stored)])
        assert abs(top["score"] - float(vectors[0] @ vectors[1])) < 1e-4
        listing = client.get("/models").json()
        assert listing["active"] == version_b
        assert [m["active"] for m in listing["models"]] == [False, True]
        assert listing["history"][0]["version"] == version_b

        # A write after the switch is embedded by B and searchable at once.
        new = client.post("/gallery", files=[("images", ("n.png", png(2, 50), "image/png"))],
                          data={"labels": ["2"]}).json()["ids"][0]
        assert search(client, png(2, 50), k="1").json()["results"][0]["id"] == new

        back = client.post("/models/rollback")
        assert back.status_code == 200, back.text
        assert back.json()["active"] == a and back.json()["previous"] == version_b
        # The item added under B got A's vector during the rollback (no gap).
        assert back.json()["stragglers_embedded"] == 1
        response = search(client, png(2, 50), k="1").json()
        assert response["model_version"] == a and response["results"][0]["id"] == new
        assert client.get(f"/models/{a}").json()["coverage"]["complete"]


def test_a_switch_survives_a_restart(make_client, other_checkpoint: Path) -> None:
    with make_client(embed_duty=1.0) as client:
        add_gallery(client, classes=2, per_class=3)
        version_b = _register(client, other_checkpoint)["version"]
        _embed_and_wait(client, version_b)
        assert client.post(f"/models/{version_b}/activate").status_code == 200
    # IMGRET_MODEL still names A: the database's active version is what is served.
    with make_client() as client:
        assert client.get("/health").json()["model_version"] == version_b
        assert search(client, png(0, 0)).json()["model_version"] == version_b


def test_search_by_item_uses_its_stored_vector_and_leaves_it_out(make_client) -> None:
    with make_client() as client:
        ids = add_gallery(client, classes=3, per_class=4)
        item = next(iter(ids))
        by_id = client.post("/search", data={"id": str(item), "k": "5"})
        assert by_id.status_code == 200, by_id.text
        by_image = search(client, png(0, 0), k="6").json()["results"]
        # Same query vector: the image's neighbours without the item itself.
        assert [h["id"] for h in by_id.json()["results"]] == [
            h["id"] for h in by_image if h["id"] != item][:5]
        assert by_id.json()["model_version"] == client.get("/health").json()["model_version"]
        filtered = client.post("/search", data={"id": str(item), "k": "3", "label": "1"})
        assert {h["label"] for h in filtered.json()["results"]} == {"1"}
        assert client.delete(f"/gallery/{item}").status_code == 204
        assert client.post("/search", data={"id": str(item)}).status_code == 404
        both = client.post("/search", data={"id": str(item)},
                           files={"image": ("q.png", png(0, 0), "image/png")})
        assert both.status_code == 422
        assert client.post("/search", data={"k": "3"}).status_code == 422
        assert client.post("/search", data={"id": "0"}).status_code == 422


def test_bad_registrations_are_refused_and_change_nothing(make_client, tmp_path: Path,
                                                          other_checkpoint: Path) -> None:
    with make_client() as client:
        before = client.get("/models").json()
        assert client.post("/models", json={"path": str(tmp_path / "nothing")}).status_code == 422
        assert client.post("/models", files={"checkpoint": ("m.pt", b"not a checkpoint")}
                           ).status_code == 422
        # A checkpoint whose stated version does not match its weights.
        payload = torch.load(other_checkpoint / "model.pt", weights_only=True)
        payload["model_version"] = "tiny_cnn-d16-000000000000"
        forged = tmp_path / "forged.pt"
        torch.save(payload, forged)
        refused = client.post("/models", files={"checkpoint": ("m.pt", forged.read_bytes())})
        assert refused.status_code == 422 and "hash" in refused.json()["detail"]
        # By path, the same file gets the one message every refused path gets.
        refused = client.post("/models", json={"path": str(forged)})
        assert refused.status_code == 422 and "hash" not in refused.json()["detail"]
        assert client.post("/models", json={"path": "x", "extra": 1}).status_code == 422
        assert client.post("/models", content=b"path", headers={"content-type": "text/plain"}
                           ).status_code == 415
        assert client.get("/models").json() == before
        assert client.get("/models/nope").status_code == 404
        assert client.post("/models/nope/activate").status_code == 404
        assert client.post("/models/nope/embed").status_code == 404
        assert client.post("/models/rollback").status_code == 409
        # An upload of a real checkpoint registers it like a path does.
        uploaded = client.post("/models", files={
            "checkpoint": ("model.pt", (other_checkpoint / "model.pt").read_bytes())})
        assert uploaded.status_code == 201, uploaded.text
        assert len(client.get("/models").json()["models"]) == len(before["models"]) + 1


def test_the_upload_form_is_read_by_the_form_rules_and_documented_from_its_model(
        make_client, other_checkpoint: Path) -> None:
    checkpoint = ("model.pt", (other_checkpoint / "model.pt").read_bytes())
    with make_client() as client:
        before = client.get("/models").json()
        refusals = {
            # A misspelt field is refused, as on /gallery and /search, not dropped.
            "unknown form fields ['checkpiont']": {"files": {"checkpiont": checkpoint}},
            "unknown form fields ['name']": {"files": {"checkpoint": checkpoint},
                                             "data": {"name": "v2"}},
            # A part without a file name is a text field.
            "checkpoint: send a file, not a text field": {
                "files": {"checkpoint": (None, "model.pt")}},
            "path: send a text field, not a file": {"files": {"path": checkpoint}},
            "path was sent more than once": {
                "files": [("path", (None, str(other_checkpoint)))] * 2},
            "send one of `checkpoint` (a file) or `path`": {
                "files": {"checkpoint": checkpoint}, "data": {"path": str(other_checkpoint)}},
        }
        for message, kwargs in refusals.items():
            response = client.post("/models", **kwargs)
            assert response.status_code == 422, (message, response.text)
            assert message in response.json()["detail"], (message, response.text)
        assert client.get("/models").json() == before

        body = client.get("/openapi.json").json()["paths"]["/models"]["post"]["requestBody"]
        form = body["content"]["multipart/form-data"]["schema"]
        assert set(form["properties"]) == set(RegisterUpload.model_fields)
        assert form["additionalProperties"] is False and "required" not in form
        for name, field in RegisterUpload.model_fields.items():
            assert form["properties"][name]["description"] == field.description
        assert form["properties"]["checkpoint"]["format"] == "binary"
        assert form["properties"]["path"]["type"] == "string"
        assert body["content"]["application/json"]["schema"]["required"] == ["path"]
        # A path sent as a form field registers like a JSON one.
        registered = client.post("/models", files={"path": (None, str(other_checkpoint))})
        assert registered.status_code == 201, registered.text


def test_an_interrupted_job_resumes_where_it_stopped(make_client, other_checkpoint: Path
                                                     ) -> None:
    from imgret.gallery.versions import reembed

    with make_client() as client:
        add_gallery(client, classes=4, per_class=5)
        version_b = _register(client, other_checkpoint)["version"]
        resources = client.app.state.resources
        # One chunk of 8, then "the process dies" (the job stops; its heartbeat is cleared).
        stop = threading.Event()
        calls = []

        def progress(done: int, total: int) -> None:
            calls.append(done)
            stop.set()

        reembed.run_embed_job(version_b, session_factory=resources.sessions,
                              media=resources.media, embedder=resources.embedder_for(version_b),
                              chunk_size=8, progress=progress, stop=stop)
        info = client.get(f"/models/{version_b}").json()
        assert info["coverage"]["embedded"] == 8 and info["embedding"]["state"] == "interrupted"
    # The next start resumes it (no POST needed) and finishes the other 12.
    with make_client() as client:
        resources = client.app.state.resources
        deadline = time.monotonic() + 60
        while resources.jobs.running(version_b) and time.monotonic() < deadline:
            time.sleep(0.05)
        resources.jobs.wait(version_b, 60)
        info = client.get(f"/models/{version_b}").json()
        assert info["coverage"] == {"embedded": 20, "live": 20, "fraction": 1.0,
                                    "complete": True}
        assert info["embedding"]["state"] == "done"


def _image(data: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def test_uploaded_queries_compare_two_versions(make_client, other_checkpoint: Path) -> None:
    with make_client(embed_duty=1.0) as client:
        add_gallery(client, classes=3, per_class=4)
        a = client.get("/health").json()["model_version"]
        version_b = _register(client, other_checkpoint)["version"]
        _embed_and_wait(client, version_b)
        files = [("images", (f"{c}.png", png(c, 70 + c), "image/png")) for c in range(3)]
        data = {"labels": ["0", "1", "2"], "compare": [a, version_b]}
        body = client.post("/evaluate", files=files, data=data)
        assert body.status_code == 200, body.text
        body = body.json()
        assert body["a"]["model_version"] == a and body["b"]["model_version"] == version_b
        assert set(body["verdict"]) >= {"map_at_r", "precision_at_1"}
        assert body["difference"]["map_at_r"]["num_paired"] == 3
        one = client.post("/evaluate", files=files,
                          data={"labels": ["0", "1", "2"], "model_version": version_b})
        assert one.json()["model_version"] == version_b
        for bad in ({"compare": [a]}, {"compare": [a, a]}, {"compare": [a, "nope"]},
                    {"compare": [a, version_b], "model_version": a}):
            response = client.post("/evaluate", files=files,
                                   data={"labels": ["0", "1", "2"], **bad})
            assert response.status_code in (404, 422), (bad, response.text)


def test_adds_and_deletes_during_a_re_embedding_leave_no_gap_and_no_ghost(
    make_client, other_checkpoint: Path
) -> None:
    """The job runs chunk by chunk (4 items, slowed down) while the gallery changes: every item
    added meanwhile gets its vector, no item deleted meanwhile keeps one or comes back."""
    from sqlalchemy import func, select

    from imgret.gallery.storage.tables import Embedding, ModelVersion
    from imgret.gallery.versions import reembed

    with make_client() as client:
        ids = list(add_gallery(client, classes=4, per_class=6))
        version_b = _register(client, other_checkpoint)["version"]
        resources = client.app.state.resources
        report: list = []
        job = threading.Thread(target=lambda: report.append(reembed.run_embed_job(
            version_b, session_factory=resources.sessions, media=resources.media,
            embedder=resources.embedder_for(version_b), chunk_size=4,
            throttle=reembed.Throttle(duty=0.02))))
        job.start()
        added, deleted = [], []
        for i in range(6):
            response = client.post("/gallery", data={"labels": [str(i % 4)]},
                                   files=[("images", (f"n{i}.png", png(i % 4, 200 + i),
                                                      "image/png"))])
            added.append(response.json()["ids"][0])
            for victim in (ids[3 * i], added[0] if i == 5 else None):
                if victim is not None:
                    assert client.delete(f"/gallery/{victim}").status_code == 204
                    deleted.append(victim)
            time.sleep(0.02)
        assert job.is_alive()  # every change above happened while the job ran
        job.join(60)
        assert report and report[0].gallery_embedded > 0
        info = client.get(f"/models/{version_b}").json()
        assert info["coverage"]["complete"], info["coverage"]
        with resources.sessions() as session:
            b_id = session.scalar(select(ModelVersion.id).where(
                ModelVersion.version == version_b))
            ghosts = session.scalar(select(func.count()).select_from(Embedding).where(
                Embedding.model_version_id == b_id, Embedding.item_id.in_(deleted)))
        assert ghosts == 0
        assert client.post(f"/models/{version_b}/activate").status_code == 200
        served = resources.searcher_for(version_b)
        live = set(served.ids().tolist())
        assert not live & set(deleted) and set(added[1:]) <= live
        for i in range(1, 6):
            hit = search(client, png(i % 4, 200 + i), k="1").json()
            assert hit["model_version"] == version_b
            assert hit["results"][0]["id"] == added[i]


def test_a_deleted_version_is_gone_from_the_database_disk_and_this_process(
        make_client, other_checkpoint: Path) -> None:
    with make_client(embed_duty=1.0) as client:
        add_gallery(client, classes=2, per_class=3)
        a = client.get("/health").json()["model_version"]
        version_b = _register(client, other_checkpoint)["version"]
        _embed_and_wait(client, version_b)
        resources = client.app.state.resources
        data_dir = resources.settings.data_dir
        assert version_b in resources.searchers and (data_dir / "indexes" / version_b).is_dir()
        assert client.delete(f"/models/{a}").status_code == 409  # active
        assert client.delete("/models/nope").status_code == 404
        assert client.delete(f"/models/{version_b}").status_code == 204
        assert client.get(f"/models/{version_b}").status_code == 404
        assert version_b not in resources.searchers and version_b not in resources.embedders
        assert not (data_dir / "indexes" / version_b).exists()
        assert not (data_dir / "models" / version_b).exists()
        again = _register(client, other_checkpoint)
        assert again["version"] == version_b and again["coverage"]["embedded"] == 0
        assert again["index"]["state"] == "missing"
        assert client.post(f"/models/{version_b}/activate").status_code == 409


def test_a_collection_switches_its_version_and_leaves_the_others(make_client,
                                                                 other_checkpoint: Path) -> None:
    """Register, re-embed and activate a second version in one collection: its searches use
    the new version; the default collection keeps serving its own, with the same name
    registered nowhere else."""
    with make_client(embed_duty=1.0) as client:
        add_gallery(client, classes=2, per_class=3)
        a = client.get("/health").json()["model_version"]
        assert client.post("/collections", json={"name": "shop"}).status_code == 201
        shop = "/collections/shop"
        files = [("images", (f"{i}.png", png(3, i), "image/png")) for i in range(4)]
        assert client.post(f"{shop}/gallery", files=files,
                           data={"labels": ["s"] * 4}).status_code == 201
        registered = client.post(f"{shop}/models", json={"path": str(other_checkpoint)})
        assert registered.status_code == 201, registered.text
        b = registered.json()["version"]
        assert client.post(f"{shop}/models/{b}/embed").status_code == 202
        deadline = time.monotonic() + 60
        info = client.get(f"{shop}/models/{b}").json()
        while info["embedding"]["state"] != "done" and time.monotonic() < deadline:
            time.sleep(0.1)
            info = client.get(f"{shop}/models/{b}").json()
        assert info["coverage"] == {"embedded": 4, "live": 4, "fraction": 1.0, "complete": True}
        switched = client.post(f"{shop}/models/{b}/activate")
        assert switched.status_code == 200, switched.text
        found = client.post(f"{shop}/search", files={"image": ("q.png", png(3, 0),
                                                               "image/png")}).json()
        assert found["model_version"] == b and len(found["results"]) == 4
        assert search(client, png(0, 0)).json()["model_version"] == a
        assert [m["version"] for m in client.get("/models").json()["models"]] == [a]
        assert client.get(f"/models/{b}").status_code == 404
        assert client.get("/collections/shop").json()["active_version"] == b


def test_deleting_a_version_or_a_collection_drops_its_milvus_collections(
    make_client, other_checkpoint: Path, tmp_path: Path,
) -> None:
    """On the Milvus backend a version's vectors live in its own Milvus collection: deleting
    the version, or the imgret collection, drops them there too (nothing deleted lingers)."""
    from imgret.gallery.search.milvus_index import client_for, close_clients
    from tests.integration.test_index_backends import _milvus_available

    require(_milvus_available(), "pymilvus and milvus-lite (the `milvus` extra)")

    uri = str(tmp_path / "milvus.db")

    def ours() -> set[str]:
        return {n for n in client_for(uri).list_collections() if n.startswith("imgret_")}

    try:
        with make_client(embed_duty=1.0, index_backend="milvus", milvus_uri=uri) as client:
            add_gallery(client, classes=2, per_class=3)
            a = client.get("/health").json()["model_version"]
            b = _register(client, other_checkpoint)["version"]
            _embed_and_wait(client, b)
            assert len(ours()) == 2  # the served version's and b's
            assert client.delete(f"/models/{b}").status_code == 204
            assert len(ours()) == 1 and all(b.replace("-", "_") not in n for n in ours())

            assert client.post("/collections", json={"name": "beta"}).status_code == 201
            files = [("images", ("x.png", png(0, 9), "image/png"))]
            added = client.post("/collections/beta/gallery", files=files, data={"labels": ["x"]})
            assert added.status_code == 201, added.text
            found = client.post("/collections/beta/search", data={"k": "1"},
                                files={"image": ("q.png", png(0, 9), "image/png")})
            assert found.status_code == 200, found.text
            assert len(ours()) == 2  # beta's collection of the served version
            assert client.delete("/collections/beta").status_code == 204
            assert len(ours()) == 1, ours()
            assert client.get("/health").json()["model_version"] == a  # still served
    finally:
        close_clients()
