"""Hostile requests to ``/models`` against a real server, on SQLite and PostgreSQL.

One ``imgret serve`` per backend with an API key, ``IMGRET_MODEL_ROOTS`` naming one folder
and a small ``IMGRET_MAX_CHECKPOINT_BYTES``. Each bad request (paths outside the roots, to
a secrets file, through a symlink or ``..``, missing, folders, non-checkpoints; uploads that
are not checkpoints, truncated, naming another version, over the cap, with a huge declared
size; deletes of the active version, the rollback target, unknown names; no key) gets its
4xx with a JSON message; every path refusal gets the same message, which never holds the
file's content or says whether the path exists; afterwards ``GET /models``, the stored
checkpoints and the data dir are as before. Then a checkpoint under the root registers.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import func, select

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.gallery.storage.db import make_engine, make_sessionmaker
from imgret.gallery.storage.tables import ModelCheckpoint
from imgret.gallery.versions.intake import PATH_REFUSED
from tests.conftest import TEST_DEVICE
from tests.integration.test_bad_input_corpus import Case, _check_bad, _detail, _raw, _run, _send
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

KEY = "models-corpus-key"
AUTH = {"X-API-Key": KEY}
CAP = 200_000  # IMGRET_MAX_CHECKPOINT_BYTES (a tiny CNN checkpoint is ~29 KB)
SECRET = "API_TOKEN=s3cr3t-do-not-echo"


def _save(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    save_checkpoint(folder, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return folder


def _torch_bytes(payload: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _layout(tmp: Path) -> dict[str, Path]:
    """A root with a good run, a folder without model.pt, an oversized file, a non-checkpoint
    and symlinks out; outside it a secrets file and another real checkpoint."""
    root, outside = tmp / "root", tmp / "outside"
    outside.mkdir(parents=True)
    secrets = outside / "secrets.env"
    secrets.write_text(SECRET + "\n")
    paths = {
        "root": root, "secrets": secrets, "outside_run": _save(outside / "run", seed=5),
        "good": _save(root / "good", seed=6), "empty_dir": root / "empty",
        "big": root / "big" / "model.pt", "junk": root / "junk.pt",
        "link_out": root / "link-out.pt", "link_dir_out": root / "link-dir",
    }
    paths["empty_dir"].mkdir()
    paths["big"].parent.mkdir()
    paths["big"].write_bytes(b"\x00" * (CAP + 1))
    paths["junk"].write_text(SECRET + "\n")
    os.symlink(secrets, paths["link_out"])
    os.symlink(paths["outside_run"], paths["link_dir_out"])
    return paths


def _path(path: str | Path) -> dict:
    return {"json": {"path": str(path)}, "headers": AUTH}


def _upload(data: bytes) -> dict:
    return {"files": {"checkpoint": ("model.pt", data, "application/octet-stream")},
            "headers": AUTH}


def _cases(p: dict[str, Path], active: str, rollback_target: str) -> tuple[list[Case],
                                                                           list[Case]]:
    """(path refusals that must all read PATH_REFUSED, the other bad requests)."""
    refused = [
        Case("path: a secrets file outside the roots", "POST", "/models", _path(p["secrets"])),
        Case("path: a real checkpoint outside the roots", "POST", "/models",
             _path(p["outside_run"])),
        Case("path: its model.pt outside the roots", "POST", "/models",
             _path(p["outside_run"] / "model.pt")),
        Case("path: missing, outside", "POST", "/models", _path(p["secrets"].parent / "nope")),
        Case("path: missing, inside", "POST", "/models", _path(p["root"] / "nope")),
        Case("path: a folder outside", "POST", "/models", _path(p["secrets"].parent)),
        Case("path: a folder inside without model.pt", "POST", "/models",
             _path(p["empty_dir"])),
        Case("path: symlink inside to a file outside", "POST", "/models",
             _path(p["link_out"])),
        Case("path: symlink inside to a run outside", "POST", "/models",
             _path(p["link_dir_out"])),
        Case("path: .. escape", "POST", "/models",
             _path(f"{p['root']}/../outside/secrets.env")),
        Case("path: relative .. escape", "POST", "/models",
             _path(os.path.relpath(p["secrets"], Path.cwd()))),
        Case("path: not a checkpoint inside the root", "POST", "/models", _path(p["junk"])),
        Case("path: /etc/passwd", "POST", "/models", _path("/etc/passwd")),
        Case("path: /proc/self/environ", "POST", "/models", _path("/proc/self/environ")),
        Case("path: a form field outside", "POST", "/models",
             {"files": {"path": (None, str(p["secrets"]))}, "headers": AUTH}),
    ]
    good = (p["good"] / "model.pt").read_bytes()
    forged = torch.load(p["good"] / "model.pt", weights_only=True)
    forged["model_version"] = "tiny_cnn-d16-000000000000"
    no_spec = torch.load(p["good"] / "model.pt", weights_only=True)
    del no_spec["spec"]
    other = [
        Case("upload: a text file", "POST", "/models", _upload(SECRET.encode())),
        Case("upload: empty", "POST", "/models", _upload(b"")),
        Case("upload: truncated checkpoint", "POST", "/models", _upload(good[: len(good) // 2])),
        Case("upload: a version that is not its weights'", "POST", "/models",
             _upload(_torch_bytes(forged))),
        Case("upload: no spec", "POST", "/models", _upload(_torch_bytes(no_spec))),
        Case("upload: a torch file that is not a checkpoint", "POST", "/models",
             _upload(_torch_bytes({"weights": [1, 2, 3]}))),
        Case("upload: one byte over the cap", "POST", "/models", _upload(b"\x00" * (CAP + 1)),
             status=413),
        # Declared over the cap (under IMGRET_MAX_UPLOAD_BYTES): refused before the body is
        # read, so it is sent by hand (a client still writing would see the reset).
        Case("upload: declared over the cap", "POST", "/models", raw=_raw(
            "POST /models HTTP/1.1\nHost: 127.0.0.1\nX-API-Key: " + KEY + "\n"
            f"Content-Type: multipart/form-data; boundary=x\nContent-Length: {4 * CAP}\n",
            b"--x\r\n"), status=413),
        Case("upload: a huge declared size", "POST", "/models", raw=_raw(
            "POST /models HTTP/1.1\nHost: 127.0.0.1\nX-API-Key: " + KEY + "\n"
            "Content-Type: multipart/form-data; boundary=x\nContent-Length: 1000000000000\n",
            b"--x\r\n"), status=413),
        Case("path: over the cap inside the root", "POST", "/models", _path(p["big"]),
             status=413),
        Case("path: empty", "POST", "/models", _path("")),
        Case("path: NUL", "POST", "/models", _path("a\x00b")),
        Case("path: not a string", "POST", "/models",
             {"json": {"path": ["x"]}, "headers": AUTH}),
        Case("both a path and an upload", "POST", "/models",
             {"files": {"checkpoint": ("m.pt", good)}, "data": {"path": str(p["good"])},
              "headers": AUTH}),
        Case("register without the key", "POST", "/models",
             {"json": {"path": str(p["good"])}}, status=401),
        Case("plain text body", "POST", "/models",
             {"content": b"path", "headers": {**AUTH, "content-type": "text/plain"}},
             status=415),
        Case("delete the active version", "DELETE", f"/models/{active}", {"headers": AUTH},
             status=409),
        Case("delete the rollback target", "DELETE", f"/models/{rollback_target}",
             {"headers": AUTH}, status=409),
        Case("delete an unknown version", "DELETE", "/models/tiny_cnn-d16-ffffffffffff",
             {"headers": AUTH}, status=404),
        Case("delete without the key", "DELETE", f"/models/{rollback_target}", status=401),
        Case("delete a name with a slash", "DELETE", "/models/..%2Fetc", {"headers": AUTH},
             status=(404, 422)),
        Case("delete a name with a space", "DELETE", "/models/a%20b", {"headers": AUTH},
             status=422),
    ]
    return refused, other


def _state(client: httpx.Client, base: str, db_url: str, data_dir: Path) -> tuple:
    listing = client.get(f"{base}/models").json()
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            stored = session.scalar(select(func.count()).select_from(ModelCheckpoint))
    finally:
        engine.dispose()
    files = sorted(str(f.relative_to(data_dir)) for f in (data_dir / "models").rglob("*"))
    return json.dumps(listing, sort_keys=True), stored, files


def test_bad_model_requests_get_a_4xx_with_a_message_and_change_nothing(
        tmp_path: Path, db_url: str, tiny_checkpoint: Path) -> None:
    paths = _layout(tmp_path)
    data_dir = tmp_path / "data"
    env = {
        "IMGRET_DATA_DIR": str(data_dir), "IMGRET_DATABASE_URL": db_url,
        "IMGRET_MODEL": str(tiny_checkpoint), "IMGRET_DEVICE": TEST_DEVICE,
        "IMGRET_API_KEY": KEY, "IMGRET_MODEL_ROOTS": str(paths["root"]),
        "IMGRET_MAX_CHECKPOINT_BYTES": str(CAP), "IMGRET_EMBED_DUTY": "1.0",
    }
    with running_server(env, log_path=tmp_path / "server.log") as server, \
            httpx.Client(timeout=60) as client:
        base = server.url
        active = client.get(f"{base}/health").json()["model_version"]
        # A second version, switched to and back: the active one and the rollback target.
        second = _save(paths["root"] / "second", seed=7)
        target = client.post(f"{base}/models", **_path(second))
        assert target.status_code == 201, target.text
        target = target.json()["version"]
        for version in (target, active):
            switched = client.post(f"{base}/models/{version}/activate", headers=AUTH)
            assert switched.status_code == 200, switched.text
        before = _state(client, base, db_url, data_dir)

        refused, other = _cases(paths, active, target)
        failures = _run(client, base, refused + other, _check_bad)
        for case in refused:
            response = _send(client, base, case)
            if _detail(response) != PATH_REFUSED:
                failures.append(f"{case.kind}: not the one path message: {response.text!r}")
        for case in refused + other:
            try:
                text = _send(client, base, case).text
            except httpx.HTTPError as exc:
                failures.append(f"{case.kind}: no answer ({type(exc).__name__})")
                continue
            if SECRET.split("=")[1] in text:
                failures.append(f"{case.kind}: the answer holds the secrets file's content")
        if _state(client, base, db_url, data_dir) != before:
            failures.append("GET /models, the stored checkpoints or data_dir/models changed")
        assert server.process.poll() is None and \
            client.get(f"{base}/health").status_code == 200

        # Inside the root: registered, and deletable (not active, not the rollback target).
        good = client.post(f"{base}/models", **_path(paths["good"]))
        assert good.status_code == 201, good.text
        version = good.json()["version"]
        assert client.delete(f"{base}/models/{version}", headers=AUTH).status_code == 204
        assert client.get(f"{base}/models/{version}").status_code == 404
        assert _state(client, base, db_url, data_dir) == before

    unhandled = server.log_path.read_text(errors="replace").count("Exception in ASGI application")
    if unhandled:
        failures.append(f"{unhandled} unhandled exceptions in {server.log_path}")
    print(f"\n[bad /models requests] {len(refused) + len(other)} cases, "
          f"{len(failures)} failed")
    assert not failures, "\n".join(failures)
