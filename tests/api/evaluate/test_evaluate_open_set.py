"""/evaluate's open-set section: FPIR, FNIR and the threshold recomputed by hand from /search's
answers (the same index, identities scored by template as decisions are), TAR@FAR pair
counts, and every refusal of its options."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.api.conftest import add_gallery, png, search
from tests.support.images import write_image_folder

GALLERY_CLASSES, PER_CLASS = 4, 5


def _queries(classes: range, per_class: int) -> tuple[list[bytes], list[str]]:
    pairs = [(c, 100 + i) for c in classes for i in range(per_class)]
    return [png(c, i) for c, i in pairs], [str(c) for c, _ in pairs]


def _post(client, images, labels, **data):
    files = [("images", (f"q{i}.png", image, "image/png")) for i, image in enumerate(images)]
    return client.post("/evaluate", files=files, data={"labels": labels, **data})


def _identities(client, image) -> list[dict]:
    """Every identity of the gallery for one query, scored as decisions score them (the
    template; docs/identities.md), best first: /search grouped by label."""
    return search(client, image, k=GALLERY_CLASSES, group_by="label").json()["identities"]


def _by_hand(client, images, labels, depth: int, fpir: float) -> dict:
    """The operating point from /search's identities with plain comparisons: the threshold
    lies just above the non-mated top score that the target allows to alarm next."""
    gallery = {str(c) for c in range(GALLERY_CLASSES)}
    tops, mates, firsts, mated = [], [], [], []
    for image, label in zip(images, labels, strict=True):
        found = _identities(client, image)
        tops.append(found[0]["score"])
        firsts.append(found[0]["label"] == label)
        mates.append(max((i["score"] for i in found if i["label"] == label),
                         default=-math.inf))
        mated.append(label in gallery)
    non = sorted((t for t, m in zip(tops, mated, strict=True) if not m), reverse=True)
    edge = non[math.floor(fpir * len(non))]  # the highest top score that must not alarm
    mated_rows = [i for i, m in enumerate(mated) if m]
    return {
        "edge": edge,
        "fpir_measured": sum(t > edge for t in non) / len(non),
        "fnir": sum(mates[i] <= edge for i in mated_rows) / len(mated_rows),
        "rank1": sum(firsts[i] and tops[i] > edge for i in mated_rows) / len(mated_rows),
        "genuine": sum(1 for i in mated_rows for _ in range(PER_CLASS)),
    }


def test_open_set_section_matches_the_search_answers(client) -> None:
    add_gallery(client, classes=GALLERY_CLASSES, per_class=PER_CLASS)
    # Classes 4..7 have no gallery item: 12 non-mated queries beside 12 mated ones.
    images, labels = _queries(range(8), per_class=3)

    response = _post(client, images, labels, fpirs="0.5,0.25")

    assert response.status_code == 200, response.text
    report = response.json()
    section = report["open_set"]
    assert (section["mated"], section["non_mated"]) == (12, 12)
    assert report["num_skipped"] == 12  # the closed-set metrics skip them as before
    assert section["depth"] == report["gallery_size"] and section["pairs"] == "all"
    assert [p["fpir"] for p in section["operating_points"]] == [0.5, 0.25]
    for point in section["operating_points"]:
        expected = _by_hand(client, images, labels, report["depth"], point["fpir"])
        threshold = point["threshold"]["value"]
        assert threshold == pytest.approx(expected["edge"], abs=1e-5)
        assert threshold > expected["edge"] - 1e-6
        assert point["fpir_measured"]["value"] == expected["fpir_measured"] <= point["fpir"]
        assert point["fnir"]["value"] == expected["fnir"]
        assert point["rank1_identification"]["value"] == expected["rank1"]
        for key in ("threshold", "fnir", "fpir_measured"):
            low, high = point[key]["ci95"]
            assert low <= point[key]["value"] <= high, key
    # Every pair of the full ranking is scored: a mated query's genuine pairs are its
    # label's gallery items; every other pair is an impostor.
    verification = section["verification"]
    assert verification["genuine_pairs"] == expected["genuine"]
    assert verification["genuine_pairs"] + verification["impostor_pairs"] == \
        len(images) * report["gallery_size"]
    assert [p["far"] for p in verification["points"]] == [0.5, 0.25]
    det = section["det"]
    assert det["threshold"][0] is None and det["fpir"][0] == 0.0 and det["fnir"][0] == 1.0


def test_hardest_queries_are_the_first_alarms_and_misses(client) -> None:
    add_gallery(client, classes=GALLERY_CLASSES, per_class=PER_CLASS)
    images, labels = _queries(range(8), per_class=3)

    section = _post(client, images, labels, fpirs="0.25").json()["open_set"]

    hardest = section["hardest"]
    # Each list holds every query of its kind here (12 <= 20), scored as /search scores it.
    assert len(hardest["non_mated"]) == section["non_mated"]
    assert len(hardest["mated"]) == section["mated"]
    assert section["score"] == "template"
    for row in hardest["non_mated"] + hardest["mated"]:
        found = _identities(client, images[row["index"]])
        assert row["label"] == labels[row["index"]] and row["query_id"] is None
        assert row["top_score"] == pytest.approx(found[0]["score"], abs=1e-5)
        assert row["top_label"] == found[0]["label"]
        mate = max((i["score"] for i in found if i["label"] == row["label"]), default=None)
        assert row["mate_score"] == (None if mate is None else pytest.approx(mate, abs=1e-5))
    non_tops = [row["top_score"] for row in hardest["non_mated"]]
    mates = [row["mate_score"] for row in hardest["mated"]]
    assert non_tops == sorted(non_tops, reverse=True) and mates == sorted(mates)
    # The lists are enough to recompute the operating point at its threshold.
    (point,) = section["operating_points"]
    threshold = point["threshold"]["value"]
    assert sum(t >= threshold for t in non_tops) / len(non_tops) == \
        point["fpir_measured"]["value"]
    assert sum(m < threshold for m in mates) / len(mates) == point["fnir"]["value"]


def test_the_section_follows_the_queries_unless_asked(local_client) -> None:
    add_gallery(local_client, classes=GALLERY_CLASSES, per_class=PER_CLASS)
    closed = _queries(range(GALLERY_CLASSES), per_class=2)
    mixed = _queries(range(6), per_class=2)

    assert _post(local_client, *closed).json()["open_set"] is None
    assert _post(local_client, *mixed).json()["open_set"] is not None
    assert _post(local_client, *mixed, open_set="false").json()["open_set"] is None
    refused = _post(local_client, *closed, open_set="true")
    assert refused.status_code == 422
    assert "8 mated and 0 non-mated" in refused.json()["detail"]
    # Too few non-mated queries for a rate: no number, and the reason.
    point = _post(local_client, *mixed, fpirs="0.01").json()["open_set"]["operating_points"][0]
    assert point["threshold"] is None and "needs >= 100 non-mated" in point["note"]


@pytest.mark.parametrize(("data", "message"), [
    ({"fpirs": "0"}, "(0, 1)"),
    ({"fpirs": "1"}, "(0, 1)"),
    ({"fpirs": "0.1,1.5"}, "(0, 1)"),
    ({"fpirs": "-0.2"}, "(0, 1)"),
    ({"fpirs": "often"}, "fpirs"),
    ({"unknown_labels": "9"}, "'9' is not a label of the query set"),
    ({"unknown_labels": "1"}, "the gallery holds '1' (5 items)"),
    ({"open_set": "false", "unknown_labels": "5"}, "open_set is false"),
])
def test_bad_open_set_options_are_422(local_client, data, message) -> None:
    add_gallery(local_client, classes=GALLERY_CLASSES, per_class=PER_CLASS)
    response = _post(local_client, *_queries(range(6), per_class=2), **data)
    assert response.status_code == 422, response.text
    assert message in json.dumps(response.json()["detail"])


def test_declared_unknowns_require_the_section_and_are_listed(local_client) -> None:
    add_gallery(local_client, classes=GALLERY_CLASSES, per_class=PER_CLASS)
    response = _post(local_client, *_queries(range(6), per_class=2), unknown_labels=["4", "5"])
    assert response.status_code == 200, response.text
    assert response.json()["open_set"]["unknown_labels"] == ["4", "5"]


def test_json_body_and_cli_give_the_same_section(client, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from imgret.cli.main import app
    from imgret.gallery.ingest import ingest_source

    resources = client.app.state.resources
    ingest_source(write_image_folder(tmp_path / "g", classes=3, per_class=4),
                  session_factory=resources.sessions, media=resources.media,
                  embedder=resources.embedder, progress=False)
    resources.searcher.refresh_from_changes()
    ingest_source(write_image_folder(tmp_path / "q", classes=5, per_class=3, seed=7),
                  session_factory=resources.sessions, media=resources.media,
                  embedder=resources.embedder, query_set="open", progress=False)
    body = {"query_set": "open", "fpirs": [0.2], "unknown_labels": ["class_3", "class_4"]}

    response = client.post("/evaluate", json=body)

    assert response.status_code == 200, response.text
    report = response.json()
    assert report["open_set"]["non_mated"] == 6
    settings = resources.settings
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app, ["evaluate", "--query-set", "open", "--fpir", "0.2", "--unknown-label",
              "class_3", "--unknown-label", "class_4", "--json", str(out)],
        env={"IMGRET_DATA_DIR": str(settings.data_dir), "IMGRET_DATABASE_URL": settings.db_url,
             "IMGRET_MODEL": str(settings.model), "IMGRET_DEVICE": "cpu"},
    )
    assert result.exit_code == 0, result.output
    assert "| target FPIR | threshold | FNIR |" in result.output
    assert json.loads(out.read_text())["open_set"] == report["open_set"]
    bad = CliRunner().invoke(app, ["evaluate", "--query-set", "open", "--fpir", "2"],
                             env={"IMGRET_DATABASE_URL": settings.db_url})
    assert bad.exit_code == 2 and "(0, 1)" in bad.output
