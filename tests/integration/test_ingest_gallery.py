"""Ingest on SQLite and PostgreSQL: idempotence, corrupt files, query sets, uploads, CLI."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from imgret.embedder import Embedder
from imgret.errors import ImageDecodeError
from imgret.gallery.ingest import NewItem, add_items, ingest_source
from imgret.gallery.media.files import sha256_hex
from imgret.gallery.storage import change_log, item_store, query_set_store, vector_store
from imgret.gallery.storage.tables import (
    Embedding,
    GalleryChange,
    GalleryItem,
    ModelVersion,
    QueryItem,
)
from imgret.gallery.versions import version_store
from imgret.images import decode_image
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes, write_market_folder


def count(sessions, model) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


def test_ingest_twice_adds_nothing_and_skips_corrupt_files(sessions, media, embedder,
                                                          image_folder):
    good = image_folder / "class_0" / "000.png"
    (image_folder / "class_0" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (image_folder / "class_1" / "truncated.png").write_bytes(good.read_bytes()[:60])
    shutil.copy(good, image_folder / "class_2" / "same-bytes.png")  # a duplicate file
    first = ingest_source(image_folder, session_factory=sessions, media=media,
                          embedder=embedder, chunk_size=7, progress=False)
    assert (first.total, first.added, first.duplicates) == (23, 20, 1)
    assert sorted(Path(p).name for p, _ in first.failed) == ["corrupt.png", "truncated.png"]
    assert all("corrupt" in why or "truncated" in why or "recognised" in why
               for _, why in first.failed)
    # 20 new images embedded, plus the copy when its first copy had not committed by the
    # time its chunk was planned (a chunk is planned before the two before it commit; it is found
    # under the write lock, so it is still stored once).
    assert first.counts["embed"] in (20, 21) and first.rate("embed") > 0
    text = "\n".join(first.summary())
    assert "corrupt.png" in text and "images/s" in text

    second = ingest_source(image_folder, session_factory=sessions, media=media,
                           embedder=embedder, chunk_size=7, progress=False)
    assert (second.added, second.embedded, second.duplicates) == (0, 0, 21)
    assert second.counts["decode"] == 2  # only the corrupt files: known content is skipped
    assert count(sessions, GalleryItem) == count(sessions, Embedding) == 20
    assert count(sessions, GalleryChange) == 20
    assert len([p for p in media.root.rglob("*") if p.is_file()]) == 20

    with sessions() as session:
        items = session.scalars(select(GalleryItem)).all()
        version = version_store.get_model_version(session=session)
        page = vector_store.fetch_vectors([i.id for i in items], session=session,
                                          model_version=version)
    by_id = {i.id: i for i in items}
    for item_id, vector in zip(page.ids, page.vectors, strict=True):
        item = by_id[int(item_id)]
        data = media.read(item.media_path)
        assert sha256_hex(data) == item.sha256 and item.content_type == "image/png"
        assert item.label.startswith("class_") and item.source.endswith(".png")
        # The stored vector is what the Embedder gives for the stored bytes.
        np.testing.assert_allclose(embedder.embed([decode_image(data)])[0], vector, atol=1e-5)
    assert version.is_active and version.version == embedder.model_version


def test_query_set_images_are_not_gallery_items(sessions, media, embedder, image_folder):
    report = ingest_source(image_folder, session_factory=sessions, media=media,
                           embedder=embedder, query_set="holdout", progress=False)
    again = ingest_source(image_folder, session_factory=sessions, media=media,
                          embedder=embedder, query_set="holdout", progress=False)
    assert (report.added, again.added, again.duplicates) == (20, 0, 20)
    assert count(sessions, GalleryItem) == 0 and count(sessions, QueryItem) == 20
    with sessions() as session:
        version = version_store.get_model_version(session=session)
        items, vectors = query_set_store.load_query_set("holdout", session=session,
                                                        model_version=version)
        assert vector_store.count_vectors(session=session, model_version_id=version.id) == 0
    assert len(items) == 20 and vectors.shape == (20, 16)
    assert {i.label for i in items} == {f"class_{c}" for c in range(4)}


def test_market1501_cameras_are_stored_and_junk_skipped(sessions, media, embedder, tmp_path):
    root = write_market_folder(tmp_path / "market")
    report = ingest_source(root / "bounding_box_test", session_factory=sessions, media=media,
                           embedder=embedder, progress=False)
    with sessions() as session:
        items = session.scalars(select(GalleryItem)).all()
    assert report.added == len(items) > 0
    assert all(i.camera in (1, 2, 3) for i in items)
    assert "0000" in {i.label for i in items}  # distractors are kept
    assert not any(i.source.startswith("-1_") for i in items)  # junk is not


def test_add_items_for_uploads_in_one_transaction(sessions, media, embedder):
    a, b = image_bytes(class_image(1, 0)), image_bytes(class_image(2, 0), "JPEG")
    first = add_items([NewItem(a, "one", 3, {"shop": "x"}, "a.png")], session_factory=sessions,
                      media=media, embedder=embedder)
    added = add_items([NewItem(b, "two"), NewItem(a, "other"), NewItem(b, "two")],
                      session_factory=sessions, media=media, embedder=embedder)
    assert added.ids[1] == first.ids[0] and added.ids[0] == added.ids[2]
    assert added.created == [True, False, False]
    # The image that was already stored says so, with what is stored (not the caller's label).
    assert added.existing == {1: vector_store.ItemInfo("one", 3, {"shop": "x"})}
    assert added.vector_ids.tolist() == [added.ids[0]] and added.vectors.shape == (1, 16)
    assert added.infos[0].label == "two"
    with sessions() as session:
        item = item_store.get_item(first.ids[0], session=session)
        assert (item.label, item.camera, item.meta) == ("one", 3, {"shop": "x"})
        assert item_store.get_item(added.ids[0], session=session).content_type == "image/jpeg"
        assert [c.op for c in change_log.changes_after(0, session=session)] == ["add", "add"]

    with pytest.raises(ImageDecodeError, match=r"images\[1\]"):
        add_items([NewItem(image_bytes(class_image(3, 0)), "ok"), NewItem(b"junk", "bad")],
                  session_factory=sessions, media=media, embedder=embedder)
    assert count(sessions, GalleryItem) == 2  # the failed request wrote nothing


def test_delete_is_soft_logged_and_content_can_come_back(sessions, media, embedder):
    data = image_bytes(class_image(1, 0))
    (item_id,) = add_items([NewItem(data, "x")], session_factory=sessions, media=media,
                           embedder=embedder).ids
    with sessions.begin() as session:
        assert [d.id for d in item_store.delete_items([item_id, 999], session=session)] == [item_id]
        assert item_store.delete_items([item_id], session=session) == []
    with sessions.begin() as session:
        assert item_store.get_item(item_id, session=session) is None
        assert item_store.get_item(item_id, session=session, include_deleted=True) is not None
    again = add_items([NewItem(data, "x")], session_factory=sessions, media=media,
                      embedder=embedder)
    assert again.created == [True] and again.ids[0] > item_id  # ids are never reused
    with sessions() as session:
        ops = [(c.item_id, c.op) for c in change_log.changes_after(0, session=session)]
    assert ops == [(item_id, "add"), (item_id, "delete"), (again.ids[0], "add")]


def test_a_new_model_version_embeds_the_existing_gallery(sessions, media, embedder,
                                                        image_folder, tmp_path):
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    ingest_source(image_folder, session_factory=sessions, media=media, embedder=embedder,
                  progress=False)
    torch.manual_seed(1)
    save_checkpoint(tmp_path / "v2", EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16,
                                                            image_size=32)))
    second = Embedder.from_checkpoint(tmp_path / "v2", device=TEST_DEVICE)
    report = ingest_source(image_folder, session_factory=sessions, media=media,
                           embedder=second, progress=False)
    assert (report.added, report.embedded) == (0, 20)
    assert count(sessions, GalleryItem) == 20 and count(sessions, Embedding) == 40
    with sessions() as session:
        versions = session.scalars(select(ModelVersion).order_by(ModelVersion.id)).all()
        assert [v.is_active for v in versions] == [True, False]  # the first stays active
        version_store.activate_model_version(session=session, version=second.model_version)
        session.commit()
        assert version_store.get_model_version(session=session).version == second.model_version


def _run_cli(monkeypatch, capsys, env: dict[str, str], *args: str) -> tuple[int, str, str]:
    from imgret.cli import main as cli
    from imgret.settings import get_settings

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    monkeypatch.setattr(sys, "argv", ["imgret", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        get_settings.cache_clear()
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_ingest_then_index_build(db_url, tmp_path, tiny_checkpoint, image_folder,
                                     monkeypatch, capsys):
    env = {"IMGRET_DATABASE_URL": db_url, "IMGRET_DATA_DIR": str(tmp_path / "data"),
           "IMGRET_DEVICE": TEST_DEVICE}
    code, out, _ = _run_cli(monkeypatch, capsys, env, "ingest", str(image_folder),
                            "--model", str(tiny_checkpoint), "--batch-size", "4",
                            "--no-progress")
    assert code == 0 and "20 added" in out and "images/s" in out
    code, out, _ = _run_cli(monkeypatch, capsys, env, "index", "build", "--no-progress")
    assert code == 0 and "built Flat index" in out and "20 vectors" in out
    assert (tmp_path / "data" / "indexes").is_dir()
    code, _, err = _run_cli(monkeypatch, capsys, env, "index", "build", "--factory",
                            "IVF256,Flat", "--no-progress")
    assert code == 2 and "needs at least 256 vectors" in err and "Traceback" not in err
    code, _, err = _run_cli(monkeypatch, capsys, env, "index", "build", "--factory",
                            "L2norm,Flat")
    assert code == 2 and "already L2-normalises" in err
    code, _, err = _run_cli(monkeypatch, capsys, env, "ingest", str(tmp_path / "missing"),
                            "--model", str(tiny_checkpoint))
    assert code == 2 and "missing" in err and "no such file" in err


def test_ingest_and_search_embed_a_large_photo_the_same_way(sessions, media, embedder,
                                                            tmp_path):
    """One embedding path: a photo many times the model's input size gets the same vector
    from `imgret ingest` as from a search upload (both decode with decode_for_embedding)."""
    from PIL import Image

    from imgret.images import DecodeLimits, embed_encoded

    rng = np.random.default_rng(0)
    big = Image.fromarray(rng.integers(0, 255, (600, 900, 3), dtype=np.uint8), "RGB")
    folder = tmp_path / "photos" / "cat"
    folder.mkdir(parents=True)
    data = image_bytes(big, "JPEG")
    (folder / "big.jpg").write_bytes(data)
    ingest_source(folder.parent, session_factory=sessions, media=media, embedder=embedder,
                  progress=False)
    with sessions() as session:
        version = version_store.get_model_version(session=session)
        (item,) = session.scalars(select(GalleryItem)).all()
        stored = vector_store.fetch_vectors([item.id], session=session, model_version=version)
    served = embed_encoded([data], embedder=embedder, limits=DecodeLimits())
    np.testing.assert_allclose(stored.vectors, served, atol=1e-5)
