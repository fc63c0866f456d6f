"""/metrics of `imgret serve --workers 2`: one view of the whole server, whichever worker
answers the scrape; a dead worker's counts stay in it, its gauges leave it.

A real server with two uvicorn worker processes on PostgreSQL (the shared-database shape of
a multi-worker deployment). Requests go over fresh connections, concurrently, until both
workers have served some: each worker's own count is read from its file in the metrics
folder (the server's ``TMPDIR`` points into the test's directory, so the test can find it).
Every scrape must then report the sum, which a per-process registry (the old behaviour)
cannot: it would report one worker's share.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_server

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ROUTE = "/gallery/{item_id}"  # GET of an id that does not exist: a cheap 404
BATCH = 20  # requests sent concurrently per round
MAX_REQUESTS = 400  # both workers must have served some by then
SCRAPES = 8
DEADLINE_S = 15.0


def _counted(samples, name: str) -> float:
    """The value of ``name`` for GET ``ROUTE`` 404 in ``samples`` (0 when absent)."""
    return sum(
        sample.value for sample in samples
        if sample.name == name and sample.labels.get("route") == ROUTE
        and sample.labels.get("status", "404") == "404" and sample.labels["method"] == "GET"
    )


def _per_worker_counts(metrics_dir: Path) -> dict[str, float]:
    """pid -> GET ``ROUTE`` 404s that worker counted, read from its own counter file."""
    counts = {}
    for path in metrics_dir.glob("counter_*.db"):
        samples = [s for m in MultiProcessCollector.merge([str(path)]) for s in m.samples]
        counts[path.stem.removeprefix("counter_")] = _counted(
            samples, "imgret_http_requests_total")
    return counts


def _scrape(url: str) -> dict[str, list]:
    """One /metrics over a new connection: family name -> samples."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    return {family.name: family.samples
            for family in text_string_to_metric_families(response.text)}


def test_every_scrape_reports_all_workers(tmp_path: Path, postgres_url: str,
                                          tiny_checkpoint: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = server_env(data_dir=tmp_path / "data", db_url=postgres_url,
                     checkpoint=tiny_checkpoint, device=TEST_DEVICE)
    env["TMPDIR"] = str(temp)
    with running_server(env, log_path=tmp_path / "serve.log", workers=2) as server:
        (metrics_dir,) = temp.glob("imgret-metrics-*")

        def get_missing(_: int) -> int:
            return httpx.get(f"{server.url}/gallery/999999", timeout=30).status_code

        sent = 0
        with ThreadPoolExecutor(max_workers=8) as pool:
            while True:
                assert set(pool.map(get_missing, range(BATCH))) == {404}
                sent += BATCH
                per_worker = _per_worker_counts(metrics_dir)
                if sum(count > 0 for count in per_worker.values()) >= 2 \
                        or sent >= MAX_REQUESTS:
                    break
        assert len(per_worker) == 2 and all(per_worker.values()), per_worker
        assert sum(per_worker.values()) == sent

        for _ in range(SCRAPES):
            families = _scrape(server.url)
            assert _counted(families["imgret_http_requests"], "imgret_http_requests_total") \
                == sent
            assert _counted(families["imgret_http_request_duration_seconds"],
                            "imgret_http_request_duration_seconds_count") == sent

        # Gauges: written by each worker (at scrape time, after each follower round) and
        # merged; an add through one worker is reported by every scrape once both follow it.
        files = [("images", (f"{i}.png", png(0, i), "image/png")) for i in range(3)]
        added = httpx.post(f"{server.url}/gallery", files=files, data={"labels": ["0"] * 3},
                           headers=KEY_HEADERS, timeout=60)
        assert added.status_code == 201, added.text
        deadline = time.monotonic() + DEADLINE_S
        while True:
            sizes = [_scrape(server.url)["imgret_index_size"][0].value for _ in range(SCRAPES)]
            if sizes == [3.0] * SCRAPES or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sizes == [3.0] * SCRAPES
        seq = _scrape(server.url)["imgret_follower_applied_seq"]
        assert len(seq) == 1 and seq[0].value > 0  # merged: no per-pid series

    # The folder was the server's alone: removed when it stopped.
    assert list(temp.glob("imgret-metrics-*")) == []


# One "worker": its metrics in multiprocess mode, an index of SIZE vectors, one request
# counted; it prints the merged exposition and exits.
_WORKER = """
import sys
from imgret.service.telemetry import ServiceMetrics
metrics = ServiceMetrics()
assert metrics.multiprocess
metrics.track_index_size(lambda: float(sys.argv[1]))
metrics.requests.labels("GET", "/health", "200").inc()
sys.stdout.write(metrics.exposition().decode())
"""


def _run_worker(metrics_dir: Path, size: int) -> dict[str, list]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    out = subprocess.run([sys.executable, "-c", _WORKER, str(size)], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return {family.name: family.samples for family in text_string_to_metric_families(out)}


def test_a_dead_workers_counts_stay_and_its_gauges_go(tmp_path: Path) -> None:
    first = _run_worker(tmp_path, 9)
    assert first["imgret_index_size"][0].value == 9
    # The first process has exited: its index size no longer wins the livemax ...
    second = _run_worker(tmp_path, 4)
    assert [sample.value for sample in second["imgret_index_size"]] == [4]
    # ... while the requests it counted are still part of the total.
    assert [sample.value for sample in second["imgret_http_requests"]
            if sample.name == "imgret_http_requests_total"] == [2]
