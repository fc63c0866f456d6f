"""/health, /metrics, the access log, OpenAPI and the web page's static files."""

from __future__ import annotations

import json
import logging

import pytest

from tests.api.conftest import add_gallery, png, search
from tests.conftest import TEST_DEVICE


def test_health_reports_model_index_and_device(local_client) -> None:
    add_gallery(local_client, classes=2, per_class=3)
    body = local_client.get("/health").json()
    assert body["status"] == "ok"
    assert body["index_size"] == 6
    assert body["device"] == TEST_DEVICE
    assert body["model_version"].startswith("tiny_cnn-d16-")


def test_metrics_count_requests_per_route_template(local_client) -> None:
    ids = sorted(add_gallery(local_client, classes=2, per_class=2))
    for item_id in ids:
        local_client.get(f"/gallery/{item_id}")
    local_client.get("/gallery/999")
    search(local_client, png(0, 9))
    local_client.get("/no/such/path")

    text = local_client.get("/metrics").text

    assert 'imgret_http_requests_total{method="GET",route="/gallery/{item_id}",status="200"} 4.0' \
        in text
    assert 'route="/gallery/{item_id}",status="404"} 1.0' in text
    assert 'route="<unmatched>",status="404"} 1.0' in text
    assert "/gallery/999" not in text  # raw paths never become labels
    assert 'imgret_http_request_duration_seconds_bucket{le="0.1",method="POST",route="/search"}' \
        in text
    assert "imgret_batch_size_count 1.0" in text
    assert "imgret_embed_seconds_count" in text
    assert "imgret_index_size 4.0" in text
    assert 'imgret_gallery_writes_total{op="add"} 4.0' in text


def test_one_json_log_line_per_request(local_client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="imgret.access"):
        local_client.get("/health", headers={"X-Request-ID": "abc-123"})
        local_client.get("/gallery/42")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "imgret.access"]
    assert [(line["route"], line["status"]) for line in lines] == [
        ("/health", 200), ("/gallery/{item_id}", 404)
    ]
    assert lines[0]["request_id"] == "abc-123"
    assert lines[1]["path"] == "/gallery/42"
    assert all(line["duration_ms"] >= 0 for line in lines)


def test_request_id_is_echoed_or_made_up(local_client) -> None:
    assert local_client.get("/health", headers={"X-Request-ID": "req-7"}).headers[
        "x-request-id"] == "req-7"
    made_up = local_client.get("/health", headers={"X-Request-ID": "bad id\r\nx"})
    assert len(made_up.headers["x-request-id"]) == 32


def test_openapi_has_stable_operation_ids(local_client) -> None:
    spec = local_client.get("/openapi.json").json()
    ids = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert {
        "health-read_health", "search-search_images", "search-search_images_batch",
        "gallery-add_gallery_items", "gallery-list_gallery_items", "gallery-read_gallery_item",
        "gallery-read_gallery_image", "gallery-delete_gallery_item",
        "evaluate-evaluate_query_set", "metrics-read_metrics",
    } <= ids
    evaluate = spec["paths"]["/evaluate"]["post"]["requestBody"]["content"]
    assert set(evaluate) == {"application/json", "multipart/form-data"}
    assert "query_set" in evaluate["application/json"]["schema"]["properties"]
    assert local_client.get("/docs").status_code == 200


def test_web_page_and_its_assets_are_served(local_client) -> None:
    page = local_client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/app.js" in page.text
    for asset, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        response = local_client.get(f"/static/{asset}")
        assert response.status_code == 200 and kind in response.headers["content-type"]


def test_no_model_configured_fails_at_start(make_local_client) -> None:
    from imgret.errors import CheckpointError

    with pytest.raises(CheckpointError, match="IMGRET_MODEL"), make_local_client(model=None):
        pass


def test_a_started_app_keeps_its_start_up_objects_out_of_garbage_collection(make_local_client):
    """``gc.freeze`` once started: a full collection under load no longer scans the ~460,000
    objects of the imports, model and index (it stopped every request for ~200 ms); they are
    collectable again once the app stops."""
    import gc

    gc.unfreeze()
    with make_local_client() as client:
        assert gc.get_freeze_count() > 10_000
        assert client.get("/health").status_code == 200
    assert gc.get_freeze_count() == 0


def test_a_request_is_counted_before_its_answer_is_complete() -> None:
    """Whoever has a whole answer finds its request in the next scrape: the access-log
    middleware counts before the last body message goes out (and, when the app raises, as a
    500 on the way out)."""
    import asyncio

    from imgret.service.telemetry import AccessLogMiddleware, ServiceMetrics

    metrics = ServiceMetrics()

    def counted(status: str) -> float:
        return metrics.registry.get_sample_value(
            "imgret_http_requests_total", {"method": "GET", "route": "<unmatched>",
                                           "status": status}) or 0.0

    async def answer(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        await send({"type": "http.response.body", "body": b"end"})

    async def fail(scope, receive, send) -> None:
        raise RuntimeError("boom")

    seen: list[tuple[bool, float]] = []

    async def send(message) -> None:
        if message["type"] == "http.response.body":
            seen.append((message.get("more_body", False), counted("200")))

    scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
    asyncio.run(AccessLogMiddleware(answer, metrics=metrics)(scope, None, send))
    assert seen == [(True, 0.0), (False, 1.0)]  # counted before the last part, once
    with pytest.raises(RuntimeError):
        asyncio.run(AccessLogMiddleware(fail, metrics=metrics)(dict(scope), None, send))
    assert counted("500") == 1.0 and counted("200") == 1.0
