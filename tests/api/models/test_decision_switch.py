"""Decisions across switches: two versions, each calibrated to its own threshold; searches run
while the served version is activated and rolled back again and again, and no answer pairs
one version's scores with the other's threshold (the calibration travels with the version
that embedded and ranked the query)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.gallery.search.identities import FETCH_MIN, TEMPLATE, IdentityGroup
from imgret.images import DecodeLimits, embed_encoded
from tests.support.images import class_image, image_bytes
from tests.support.open_set import gallery_with_unknowns_and_second_version

# Gallery classes 0-3 and others; near-copies of gallery images score ~1 in both versions.
CANDIDATES = [image_bytes(class_image(c, 400 + c)) for c in range(12)]
SWITCHES = 6
SCORE_TOL = 1e-4


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1)
    run = tmp_path_factory.mktemp("decision_other")
    save_checkpoint(run, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return run


def _expected_top(resources, version: str) -> list[tuple[float, str, float]]:
    """Each candidate query's best item score, and the top identity's (label, template
    score) the decision is made on, in ``version``'s own index, embedded by its model."""
    vectors = embed_encoded(CANDIDATES, embedder=resources.embedder_for(version),
                            limits=DecodeLimits())
    searcher = resources.searcher_for(version)
    rows = searcher.search(vectors, FETCH_MIN)
    out = []
    for vector, row in zip(vectors, rows, strict=True):
        (top,) = searcher.identities(vector, row, IdentityGroup(1, 1, TEMPLATE))
        out.append((row[0].score, top.label, top.score))
    return out


def test_no_answer_mixes_two_versions_scores_and_thresholds(make_client, tmp_path: Path,
                                                           other_checkpoint: Path) -> None:
    with make_client(embed_duty=1.0, model_roots=[other_checkpoint]) as client:
        resources = client.app.state.resources
        a, b = gallery_with_unknowns_and_second_version(
            client, tmp_path, other_checkpoint, gallery_classes=4, gallery_per_class=5,
            query_classes=8)
        thresholds = {}
        for version, target in ((a, 0.25), (b, 0.5)):
            response = client.post(f"/models/{version}/calibrate",
                                   json={"query_set": "cal", "target_fpir": target})
            assert response.status_code == 200, response.text
            thresholds[version] = response.json()["threshold"]
        assert thresholds[a] != thresholds[b]
        tops = {v: _expected_top(resources, v) for v in (a, b)}
        # The queries whose score tells the versions apart.
        keep = [i for i, ((sa, _, _), (sb, _, _)) in enumerate(zip(tops[a], tops[b],
                                                                     strict=True))
                if abs(sa - sb) > 10 * SCORE_TOL]
        assert len(keep) >= 6, tops
        queries = [CANDIDATES[i] for i in keep]
        expected = {v: [tops[v][i] for i in keep] for v in (a, b)}

        answers: list[tuple[int, str, float, dict]] = []
        failures: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def searching(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                q = int(rng.integers(len(queries)))
                if seed % 2:
                    response = client.post("/search", data={"k": "2"},
                                           files={"image": ("q.png", queries[q], "image/png")})
                    body = response.json()
                    got = [(q, body.get("results"), body.get("decision"))]
                else:
                    pair = [q, (q + 1) % len(queries)]
                    response = client.post("/search/batch", data={"k": "2"}, files=[
                        ("images", (f"{i}.png", queries[i], "image/png")) for i in pair])
                    body = response.json()
                    if response.status_code == 503:  # split over a switch: sent again
                        continue
                    got = list(zip(pair, body.get("results") or [[]] * 2,
                                   body.get("decisions") or [None] * 2, strict=True))
                with lock:
                    if response.status_code != 200:
                        failures.append(f"{response.status_code} {response.text[:200]}")
                        continue
                    for query, results, decision in got:
                        answers.append((query, body["model_version"], results[0]["score"],
                                        decision))

        threads = [threading.Thread(target=searching, args=(n,), daemon=True) for n in range(4)]
        for thread in threads:
            thread.start()
        try:
            for turn in range(SWITCHES):
                time.sleep(0.3)
                target = "/models/rollback" if turn % 2 else f"/models/{b}/activate"
                switched = client.post(target)
                assert switched.status_code == 200, switched.text
            time.sleep(0.3)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)

    assert not failures, failures[:5]
    seen = {version for _, version, _, _ in answers}
    assert seen == {a, b}, seen
    mixed = []
    for query, version, score, decision in answers:
        want, label, identity = expected[version][query]
        threshold = thresholds[version]
        if (abs(score - want) > SCORE_TOL or decision is None
                or decision["threshold"] != threshold
                or abs(decision["score"] - identity) > SCORE_TOL
                or decision["known"] != (decision["score"] >= threshold)
                or decision["label"] != (label if decision["known"] else None)):
            mixed.append((query, version, score, want, decision))
    assert not mixed, f"{len(mixed)} of {len(answers)} answers mix versions: {mixed[:5]}"
    print(f"\n{len(answers)} decisions across {SWITCHES} switches, none mixed")
