"""The re-ranking and ``k`` surface of ``/search`` and ``/search/batch`` against a real server
(SQLite, then PostgreSQL): hostile values (negative, huge, floats for integers, strings, NaN
and infinities, over the search budget) each get a 422 with a message, nothing changes, the
server logs no unhandled exception; values at the maxima are answered.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from imgret.service.limits import (
    REQUEST_HITS_MAX,
    REQUEST_RERANK_SEARCHES_MAX,
    SEARCH_CANDIDATES_MAX,
)
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

KEY = "rerank-key"
AUTH = {"X-API-Key": KEY}
K_RECIPROCAL = {"rerank": "k_reciprocal"}
QUERY_EXPANSION = {"rerank": "query_expansion"}
FULL = REQUEST_RERANK_SEARCHES_MAX // (2 * SEARCH_CANDIDATES_MAX + 2)

# (name, form fields): each must be refused with 422 on every route.
HOSTILE = [
    *[(f"{field}={value}", {**K_RECIPROCAL, field: value})
      for field in ("rerank_k1", "rerank_k2", "rerank_candidates")
      for value in ("-1", "0", "1e3", "2.5", "1001", str(2**63), "9" * 400, "abc", "nan",
                    "inf", " ", "0x10", "1_000")
      if value.strip()],
    *[(f"rerank_lambda={value}", {**K_RECIPROCAL, "rerank_lambda": value})
      for value in ("-0.1", "1.5", "nan", "inf", "-inf", "abc", "1e400")],
    *[(f"rerank_top_m={value}", {**QUERY_EXPANSION, "rerank_top_m": value})
      for value in ("-3", "0", "101", "4.0", "many", "nan")],
    *[(f"rerank_alpha={value}", {**QUERY_EXPANSION, "rerank_alpha": value})
      for value in ("-1", "11", "nan", "inf", "x")],
    *[(f"k={value}", {"k": value})
      for value in ("-1", "0", "1001", "2.0", "ten", "nan", str(2**64))],
    ("candidates over the search maximum",
     {**K_RECIPROCAL, "rerank_candidates": str(SEARCH_CANDIDATES_MAX + 1)}),
    ("the reported flood", {**K_RECIPROCAL, "rerank_candidates": "1000", "rerank_k1": "100",
                            "k": "1000"}),
    ("unknown method", {"rerank": "k_reciprocal; DROP TABLE items"}),
    ("method as NaN", {"rerank": "nan"}),
    ("parameter of the other method", {**K_RECIPROCAL, "rerank_top_m": "3"}),
    ("parameter without a method", {"rerank_candidates": "10"}),
]


def _png(label: int, index: int) -> bytes:
    return image_bytes(class_image(label, index, size=32))


def _files(field: str, count: int) -> list:
    return [(field, (f"q{i}.png", _png(i % 3, 90 + i), "image/png")) for i in range(count)]


def _snapshot(client: httpx.Client, base: str) -> tuple:
    return (client.get(f"{base}/gallery", params={"limit": 1000}).json(),
            client.get(f"{base}/health").json()["index_size"])


def test_hostile_rerank_values_are_422_and_change_nothing(tmp_path: Path, db_url: str,
                                                         tiny_checkpoint: Path) -> None:
    env = {
        "IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_DATABASE_URL": db_url,
        "IMGRET_MODEL": str(tiny_checkpoint), "IMGRET_DEVICE": TEST_DEVICE,
        "IMGRET_API_KEY": KEY, "IMGRET_BATCH_MAX_WAIT_MS": "1",
    }
    with running_server(env, log_path=tmp_path / "server.log") as server, \
            httpx.Client(timeout=60) as client:
        base = server.url
        seeded = client.post(f"{base}/gallery", headers=AUTH, files=_files("images", 9),
                             data={"labels": [str(i % 3) for i in range(9)]})
        assert seeded.status_code == 201, seeded.text
        item = seeded.json()["ids"][0]
        before = _snapshot(client, base)

        failures = []
        for name, data in HOSTILE:
            for route, files, extra in (
                ("/search", _files("image", 1), {}),
                ("/search", None, {"id": str(item)}),
                ("/search/batch", _files("images", 3), {}),
            ):
                response = client.post(f"{base}{route}", files=files, data={**data, **extra})
                detail = response.json().get("detail") if response.headers.get(
                    "content-type", "").startswith("application/json") else None
                if response.status_code != 422 or not detail:
                    failures.append(f"{name} on {route}{' by id' if extra else ''}: "
                                    f"{response.status_code} {response.text[:200]!r}")

        # Over the per-request budgets, each value alone being allowed.
        for name, count, data, message in (
            ("re-ranking budget", FULL + 1,
             {**K_RECIPROCAL, "rerank_candidates": str(SEARCH_CANDIDATES_MAX)},
             f"at most {REQUEST_RERANK_SEARCHES_MAX} per request"),
            ("results budget", REQUEST_HITS_MAX // 1000 + 1, {"k": "1000"},
             f"at most {REQUEST_HITS_MAX} per request"),
        ):
            response = client.post(f"{base}/search/batch", files=_files("images", count),
                                   data=data)
            if response.status_code != 422 or message not in response.json().get("detail", ""):
                failures.append(f"{name}: {response.status_code} {response.text[:200]!r}")

        assert _snapshot(client, base) == before, "a refused request changed the gallery"

        # At the maxima: answered.
        for route, files, data in (
            ("/search", None, {"id": str(item), **K_RECIPROCAL, "k": "1000",
                               "rerank_candidates": str(SEARCH_CANDIDATES_MAX),
                               "rerank_k1": "100", "rerank_k2": "101"}),
            ("/search/batch", _files("images", FULL),
             {**K_RECIPROCAL, "rerank_candidates": str(SEARCH_CANDIDATES_MAX), "k": "5"}),
            ("/search/batch", _files("images", 4),
             {**QUERY_EXPANSION, "rerank_top_m": "100", "rerank_alpha": "10", "k": "1000"}),
        ):
            response = client.post(f"{base}{route}", files=files, data=data)
            if response.status_code != 200:
                failures.append(f"at the maxima on {route}: {response.status_code} "
                                f"{response.text[:200]!r}")
        assert server.process.poll() is None, "the server died"

    unhandled = server.log_path.read_text(errors="replace").count("Exception in ASGI application")
    if unhandled:
        failures.append(f"{unhandled} unhandled exceptions in {server.log_path}")
    print(f"\n[bad re-rank input] {len(HOSTILE) * 3 + 2} hostile requests, "
          f"{len(failures)} failed")
    assert not failures, "\n".join(failures)
