"""A search load running across an activation and a rollback on two server processes: zero
errors, zero mixed results, every response's version consistent with its neighbours.

Two real ``imgret serve`` processes share one database (each backend: for SQLite, one file)
and one data dir. Versions A and B are two untrained tiny CNNs (seeds 0 and 1). Server 1
starts with A on a fresh database, gets a labelled gallery, registers B and re-embeds the
gallery for it (``POST /models/B/embed``, polled until done); server 2 starts (A). Then
client threads search both servers while a writer adds an image every ~0.15 s through both,
and the test switches: ``POST /models/B/activate`` on server 1, an add through server 2 at
once (before its follower has seen the switch: the ``ModelSwitched`` retry), wait until both
serve B, ``POST /models/rollback``, wait until both serve A again.

Afterwards, from the vectors stored in SQL and the queries embedded here by each version's
own model (exact inner product, the served index is ``Flat``):

- every search answered 200 and names A or B, and its ids and scores are exactly that
  version's ranking over the gallery (items added during the run may appear or not, at their
  own score): a query embedded by one version and searched in the other's index would not
  match (checked: such mixed lists match neither version's);
- per server the versions follow the switches: A before the activation was sent, B once the
  process serves B (server 1: when the activation answered; server 2: when its /health said
  so), A once it serves A again; in between, a response never goes back to the older
  version after one that came back with the newer one ended;
- both servers answered with both versions; server 2 followed each switch within
  :data:`FOLLOW_S` (the follower polls every second);
- B finds the item added through server 2 right after the activation (server 1, top-1), and
  after the rollback every item added during the run is found top-1 by A on both servers.

A summary line is printed (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from imgret.embedder import Embedder
from imgret.gallery.storage import vector_store
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.versions import version_store
from imgret.images import DecodeLimits, embed_encoded
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, server_env
from tests.support.images import class_image, image_bytes
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

GALLERY = 40  # one generated image per colour/stripe pattern; labels c0..c4
QUERY_PATTERNS = (0, 7, 13, 22, 31)  # fresh noise over these gallery images' patterns
K = 10
PHASE_S = 2.0  # load on each settled phase (A, B, A again)
FOLLOW_S = 15.0  # server 2 must serve the new version within this (its poll: ~1 s)
CATCH_UP_S = 15.0  # an add reaches the other process's index within this
EMBED_TIMEOUT_S = 60.0
SEARCH_CLIENTS = 3
WRITE_EVERY_S = 0.15
SCORE_TOL = 1e-4  # float32 inner products, batched or not, agree to ~1e-6
TIE = 1e-5  # expected scores closer than this may come back in either order


@pytest.fixture(scope="module")
def versions_ab(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, Path]]:
    """``[(version, run_dir)]`` of two untrained tiny CNNs (seeds 0 and 1: A and B)."""
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32))
        run_dir = tmp_path_factory.mktemp(f"switch_seed{seed}")
        runs.append((save_checkpoint(run_dir, model), run_dir))
    assert runs[0][0] != runs[1][0]
    return runs


def _png(pattern: int, index: int) -> bytes:
    return image_bytes(class_image(pattern, index))


@dataclass(frozen=True)
class Reply:
    """One search as the client saw it (``time.monotonic()`` around the request)."""

    server: int
    query: int
    started: float
    ended: float
    status: int  # 0: the connection failed
    version: str | None
    hits: list[tuple[int, float]]
    error: str = ""


@dataclass
class Written:
    """One add during the run: where, when acknowledged, the new id and its bytes."""

    server: int
    acknowledged: float
    item_id: int
    image: bytes


@dataclass
class Log:
    lock: threading.Lock = field(default_factory=threading.Lock)
    replies: list[Reply] = field(default_factory=list)
    written: list[Written] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _search_client(urls: list[str], queries: list[bytes], stop: threading.Event, log: Log,
                   seed: int) -> None:
    rng = random.Random(seed)
    turn = seed
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            server, turn = turn % len(urls), turn + 1
            query = rng.randrange(len(queries))
            started = time.monotonic()
            try:
                response = client.post(f"{urls[server]}/search", data={"k": str(K)},
                                       files={"image": ("q.png", queries[query], "image/png")})
            except httpx.TransportError as exc:
                reply = Reply(server, query, started, time.monotonic(), 0, None, [], repr(exc))
            else:
                ended = time.monotonic()
                if response.status_code == 200:
                    body = response.json()
                    reply = Reply(server, query, started, ended, 200, body["model_version"],
                                  [(hit["id"], hit["score"]) for hit in body["results"]])
                else:
                    reply = Reply(server, query, started, ended, response.status_code, None, [],
                                  response.text[:300])
            with log.lock:
                log.replies.append(reply)


def _add(client: httpx.Client, url: str, image: bytes, label: str) -> httpx.Response:
    return client.post(f"{url}/gallery", files=[("images", ("new.png", image, "image/png"))],
                       data={"labels": [label]}, headers=KEY_HEADERS)


def _writer(urls: list[str], stop: threading.Event, log: Log) -> None:
    """Adds one new image at a time, through each server in turn."""
    n = 0
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            server = n % len(urls)
            image = _png(100 + n, 0)
            n += 1
            try:
                response = _add(client, urls[server], image, "written")
            except httpx.TransportError as exc:
                with log.lock:
                    log.failures.append(f"add on server {server + 1}: {exc!r}")
                continue
            if response.status_code != 201:
                with log.lock:
                    log.failures.append(f"add on server {server + 1}: {response.status_code} "
                                        f"{response.text[:300]}")
            else:
                with log.lock:
                    log.written.append(Written(server, time.monotonic(),
                                               response.json()["ids"][0], image))
            stop.wait(WRITE_EVERY_S)


# --------------------------------------------------------------------------- expectations


Ranking = list[tuple[int, float]]


def _stored_vectors(db_url: str, version: str) -> tuple[np.ndarray, np.ndarray]:
    """Ids and vectors of every live item with a stored embedding of ``version``."""
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            row = version_store.get_model_version(session=session, version=version)
            pages = list(vector_store.iter_vector_pages(session=session, model_version=row))
    finally:
        engine.dispose()
    return (np.concatenate([p.ids for p in pages]),
            np.concatenate([p.vectors for p in pages]).astype(np.float32))


def _rankings(queries: np.ndarray, ids: np.ndarray, vectors: np.ndarray) -> list[Ranking]:
    """Each query's whole ranking by exact inner product, best first."""
    scores = queries @ vectors.T
    rankings = []
    for row in scores:
        order = np.argsort(-row, kind="stable")
        rankings.append([(int(ids[j]), float(row[j])) for j in order])
    return rankings


def _same(hits: Ranking, expected: Ranking) -> bool:
    """``hits`` is the top of ``expected`` (scores within SCORE_TOL; ids in order, except
    among expected scores closer than TIE, whose order is free)."""
    if len(hits) != min(K, len(expected)):
        return False
    if any(abs(got - want) > SCORE_TOL
           for (_, got), (_, want) in zip(hits, expected, strict=False)):
        return False
    start = 0
    while start < len(hits):
        end = start + 1
        while end < len(expected) and expected[end - 1][1] - expected[end][1] <= TIE:
            end += 1
        # A tie group may cross position K: the hits take any of its members.
        if not {i for i, _ in hits[start:end]} <= {i for i, _ in expected[start:end]}:
            return False
        start = end
    return True


def _consistent(hits: Ranking, ranking: Ranking, optional: set[int]) -> bool:
    """``hits`` is the version's answer over the seeded gallery plus any of the items added
    during the run (``optional``: each may be visible yet or not)."""
    returned = {i for i, _ in hits}
    return _same(hits, [(i, s) for i, s in ranking if i not in optional or i in returned])


# --------------------------------------------------------------------------- the run


def _wait(check: Callable[[], bool], what: str, timeout: float) -> float:
    """Poll ``check`` until true; returns ``time.monotonic()`` when it was."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)
    return time.monotonic()


def _served(client: httpx.Client, url: str) -> str:
    return client.get(f"{url}/health").json()["model_version"]


def _finds_top1(client: httpx.Client, url: str, image: bytes, item_id: int,
                version: str) -> bool:
    """A search with ``image`` on ``url`` answers ``version`` with ``item_id`` first (or tied
    with the first)."""
    response = client.post(f"{url}/search", data={"k": "3"},
                           files={"image": ("x.png", image, "image/png")})
    assert response.status_code == 200, response.text
    body = response.json()
    results = body["results"]
    if body["model_version"] != version or not results:
        return False
    best = results[0]["score"]
    return any(hit["id"] == item_id and hit["score"] >= best - TIE for hit in results)


@pytest.mark.timeout(240)
def test_search_load_across_activation_and_rollback(
    tmp_path: Path, db_url: str, versions_ab: list[tuple[str, Path]]
) -> None:
    (version_a, run_a), (version_b, run_b) = versions_ab
    upgrade_to_head(db_url)
    env = server_env(data_dir=tmp_path / "data", db_url=db_url, checkpoint=run_a,
                     device=TEST_DEVICE)
    env["IMGRET_MODEL_ROOTS"] = str(run_b)  # where POST /models may read B from
    gallery = [_png(p, 0) for p in range(GALLERY)]
    queries = [_png(p, 999) for p in QUERY_PATTERNS]
    x_image = _png(99, 0)
    log = Log()
    with contextlib.ExitStack() as stack:
        one = stack.enter_context(running_server(env, log_path=tmp_path / "one.log")).url
        http = stack.enter_context(httpx.Client(timeout=120))
        assert _served(http, one) == version_a

        files = [("images", (f"{i}.png", data, "image/png")) for i, data in enumerate(gallery)]
        added = http.post(f"{one}/gallery", files=files, headers=KEY_HEADERS,
                          data={"labels": [f"c{i % 5}" for i in range(GALLERY)]})
        assert added.status_code == 201, added.text
        seeded = set(added.json()["ids"])
        assert len(seeded) == GALLERY

        registered = http.post(f"{one}/models", json={"path": str(run_b)}, headers=KEY_HEADERS)
        assert registered.status_code == 201, registered.text
        assert registered.json()["version"] == version_b
        embedding = http.post(f"{one}/models/{version_b}/embed", headers=KEY_HEADERS)
        assert embedding.status_code == 202, embedding.text

        def embedded() -> bool:
            info = http.get(f"{one}/models/{version_b}").json()
            assert info["embedding"]["state"] in ("running", "done"), info
            return info["coverage"]["complete"] and info["embedding"]["state"] == "done"

        _wait(embedded, f"the re-embedding of {version_b}", EMBED_TIMEOUT_S)

        two = stack.enter_context(running_server(env, log_path=tmp_path / "two.log")).url
        assert _served(http, two) == version_a
        urls = [one, two]

        stop = threading.Event()
        threads = [threading.Thread(target=_search_client, args=(urls, queries, stop, log, n),
                                    daemon=True) for n in range(SEARCH_CLIENTS)]
        threads.append(threading.Thread(target=_writer, args=(urls, stop, log), daemon=True))
        for thread in threads:
            thread.start()
        try:
            time.sleep(PHASE_S)
            activate_sent = time.monotonic()
            switched = http.post(f"{one}/models/{version_b}/activate", headers=KEY_HEADERS)
            one_on_b = time.monotonic()
            assert switched.status_code == 200, switched.text
            assert (switched.json()["active"], switched.json()["previous"]) == (version_b,
                                                                                version_a)
            # Through server 2 at once: its follower has most likely not seen the switch yet,
            # so the upload is embedded with A, refused at commit, and embedded again with B.
            two_before_x = _served(http, two)
            x_added = _add(http, two, x_image, "x")
            assert x_added.status_code == 201, x_added.text
            x_id = x_added.json()["ids"][0]
            two_on_b = _wait(lambda: _served(http, two) == version_b,
                             "server 2 follows the activation", FOLLOW_S)
            _wait(lambda: _finds_top1(http, one, x_image, x_id, version_b),
                  "B (server 1) finds the item added through server 2", CATCH_UP_S)
            time.sleep(PHASE_S)

            rollback_sent = time.monotonic()
            rolled = http.post(f"{one}/models/rollback", headers=KEY_HEADERS)
            one_on_a = time.monotonic()
            assert rolled.status_code == 200, rolled.text
            assert (rolled.json()["active"], rolled.json()["previous"]) == (version_a,
                                                                            version_b)
            two_on_a = _wait(lambda: _served(http, two) == version_a,
                             "server 2 follows the rollback", FOLLOW_S)
            time.sleep(PHASE_S)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a client hung"

        # Every item added during the run is found by A (active again) on both servers.
        written = [(x_id, x_image), *((w.item_id, w.image) for w in log.written)]
        missing: list[str] = []
        for server, url in enumerate(urls):
            for item_id, image in written:
                try:
                    _wait(lambda u=url, i=item_id, b=image: _finds_top1(http, u, b, i,
                                                                        version_a),
                          "", CATCH_UP_S if not missing else 0.5)
                except AssertionError:
                    missing.append(f"server {server + 1} (A) does not find item {item_id}")

    optional = {item_id for item_id, _ in written}
    rankings: dict[str, list[Ranking]] = {}
    query_vectors: dict[str, np.ndarray] = {}
    stored: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for version, run_dir in versions_ab:
        embedder = Embedder.from_checkpoint(run_dir, device=TEST_DEVICE)
        query_vectors[version] = embed_encoded(queries, embedder=embedder,
                                               limits=DecodeLimits())
        stored[version] = _stored_vectors(db_url, version)
        assert seeded <= set(stored[version][0].tolist()), f"{version} lacks seeded vectors"
        rankings[version] = _rankings(query_vectors[version], *stored[version])
    # The check can tell the versions apart, and a mixed search matches neither.
    mixed = _rankings(query_vectors[version_a], *stored[version_b])
    for q in range(len(queries)):
        base = {v: [(i, s) for i, s in rankings[v][q] if i in seeded] for v in rankings}
        assert not _same(base[version_a][:K], base[version_b])
        assert not _same(base[version_b][:K], base[version_a])
        mixed_top = [(i, s) for i, s in mixed[q] if i in seeded][:K]
        assert not any(_same(mixed_top, base[v]) for v in base)

    replies = sorted(log.replies, key=lambda r: r.started)
    errors = [f"server {r.server + 1}: {r.status} {r.error}" for r in replies if r.status != 200]
    wrong = [r for r in replies if r.status == 200 and (
        r.version not in rankings
        or not _consistent(r.hits, rankings[r.version][r.query], optional))]
    switches = {0: (one_on_b, one_on_a), 1: (two_on_b, two_on_a)}
    out_of_phase = []
    seen: Counter = Counter()
    for server, (on_b, on_a) in switches.items():
        mine = [r for r in replies if r.server == server and r.status == 200]
        seen.update((server, r.version) for r in mine)
        for r in mine:
            if r.ended < activate_sent or r.started > on_a:
                want = version_a
            elif on_b < r.started and r.ended < rollback_sent:
                want = version_b
            else:
                continue
            if r.version != want:
                out_of_phase.append(f"server {server + 1}: {r.version} in a search "
                                    f"{r.started - activate_sent:+.3f}..."
                                    f"{r.ended - activate_sent:+.3f} s from the activation")
        # Around each switch: once a response came back with the new version, no search
        # started afterwards goes back to the old one.
        for window, old, new in ((activate_sent, version_a, version_b),
                                 (rollback_sent, version_b, version_a)):
            newest = [r.ended for r in mine if r.version == new and r.started >= window]
            first_new = min(newest, default=float("inf"))
            went_back = [r for r in mine if r.version == old and r.started > first_new
                         and (new == version_b and r.ended < rollback_sent or new == version_a)]
            out_of_phase.extend(f"server {server + 1}: {old} again {r.started - first_new:.3f}"
                                f" s after a response with {new}" for r in went_back)

    print(f"\nmodel switch ({db_url.split(':')[0]}): {len(replies)} searches "
          f"({', '.join(f'server {s + 1} {v[:22]}: {n}' for (s, v), n in sorted(seen.items()))}), "
          f"{len(written)} adds; server 2 served B {two_on_b - one_on_b:.2f} s and A again "
          f"{two_on_a - one_on_a:.2f} s after server 1; server 2 was on {two_before_x[:22]} "
          f"just before the add that followed the activation; errors {len(errors)}, "
          f"mixed/wrong {len(wrong)}, out of phase {len(out_of_phase)}, "
          f"unfound adds {len(missing)}")
    assert not errors, "\n".join(errors[:20])
    assert not log.failures, "\n".join(log.failures[:20])
    assert not wrong, "\n".join(
        f"server {r.server + 1} query {r.query} answered {r.version}: {r.hits[:4]}, expected "
        f"{rankings.get(r.version, [[]] * len(queries))[r.query][:4]}" for r in wrong[:10])
    assert not out_of_phase, "\n".join(out_of_phase[:20])
    for server in switches:
        for version in (version_a, version_b):
            assert seen[(server, version)] > 0, f"server {server + 1} never answered {version}"
    assert not missing, "\n".join(missing[:20])
