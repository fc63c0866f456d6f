"""Set-up shared by the open-set API tests: a gallery, a query set holding identities the
gallery does not (``"cal"``), and a second model version registered and embedded."""

from __future__ import annotations

from pathlib import Path

from tests.support.images import write_image_folder


def gallery_with_unknowns_and_second_version(client, tmp_path: Path, checkpoint: Path, *,
                                             gallery_classes: int, gallery_per_class: int,
                                             query_classes: int) -> tuple[str, str]:
    """Ingest ``gallery_classes`` identities and a query set ``"cal"`` of ``query_classes``
    (3 images each; those past the gallery's are unknown), register ``checkpoint`` and embed
    the gallery with it. Returns ``(served version, new version)``."""
    from imgret.gallery.ingest import ingest_source

    resources = client.app.state.resources
    gallery = write_image_folder(tmp_path / "g", classes=gallery_classes,
                                 per_class=gallery_per_class)
    queries = write_image_folder(tmp_path / "q", classes=query_classes, per_class=3, seed=7)
    for folder, name in ((gallery, None), (queries, "cal")):
        ingest_source(folder, session_factory=resources.sessions, media=resources.media,
                      embedder=resources.embedder, query_set=name, progress=False)
    resources.searcher.refresh_from_changes()
    served = client.get("/health").json()["model_version"]
    new = client.post("/models", json={"path": str(checkpoint)}).json()["version"]
    assert client.post(f"/models/{new}/embed").status_code == 202
    resources.jobs.wait(new, timeout=60)
    return served, new
