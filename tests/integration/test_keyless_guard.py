"""A keyless server on 127.0.0.1 against DNS rebinding and proxies, its /health error text and
its security headers: a real ``imgret serve`` on SQLite and PostgreSQL.

DNS rebinding: a page on ``rebind.example`` re-points its name at 127.0.0.1, so the
visitor's browser reaches the local server with a loopback peer address and ``Host`` and
``Origin`` both ``rebind.example:PORT`` (same-origin for the browser, so the ``Origin`` rule
alone let it through). httpx sends exactly those headers over a loopback connection here.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from imgret.service.routers.health import FOLLOWER_ERROR_HIDDEN
from imgret.service.security_headers import API_POLICY, PAGE_POLICY
from tests.conftest import TEST_DEVICE, require
from tests.support.images import class_image, image_bytes
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# JS run in the page: a keyless write from the page's own origin, as the Models view sends one.
_DELETE_FROM_PAGE = """
const done = arguments[arguments.length - 1];
fetch(arguments[0], {method: "DELETE"}).then(r => done(r.status), e => done(String(e)));
"""


def _files(n: int, offset: int = 0) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("images", (f"{i}.png", image_bytes(class_image(i % 3, offset + i)), "image/png"))
            for i in range(n)]


def _state(base: str) -> tuple[int, list[int], list[str], str | None]:
    """What a write could change: gallery count and ids, model versions, the active one."""
    gallery = httpx.get(f"{base}/gallery", params={"limit": 100}).json()
    models = httpx.get(f"{base}/models").json()
    return (gallery["count"], sorted(item["id"] for item in gallery["data"]),
            sorted(m["version"] for m in models["models"]), models["active"])


def _env(tmp_path: Path, db_url: str, checkpoint: Path) -> dict[str, str]:
    return {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_DATABASE_URL": db_url,
            "IMGRET_MODEL": str(checkpoint), "IMGRET_DEVICE": TEST_DEVICE,
            "IMGRET_FOLLOW_INTERVAL_S": "0.2", "IMGRET_BATCH_MAX_WAIT_MS": "1"}


def test_rebound_or_proxied_writes_are_refused_and_the_local_page_still_writes(
    tmp_path: Path, db_url: str, tiny_checkpoint: Path
) -> None:
    with running_server(_env(tmp_path, db_url, tiny_checkpoint),
                        log_path=tmp_path / "server.log") as server:
        base = server.url
        port = base.rsplit(":", 1)[1]
        # The page's own flow: http://127.0.0.1:PORT, with its Origin.
        own = {"Origin": base}
        added = httpx.post(f"{base}/gallery", files=_files(4), data={"labels": ["a"] * 4},
                           headers=own, timeout=60)
        assert added.status_code == 201, added.text
        ids = added.json()["ids"]
        assert httpx.delete(f"{base}/gallery/{ids[0]}", headers=own).status_code == 204
        assert httpx.post(f"{base}/gallery", files=_files(1, 10), data={"labels": "b"},
                          headers={"Host": f"localhost:{port}",
                                   "Origin": f"http://localhost:{port}"}).status_code == 201
        before = _state(base)
        version = before[3]

        rebound = {"Host": f"rebind.example:{port}", "Origin": f"http://rebind.example:{port}"}
        proxied = {"X-Forwarded-For": "203.0.113.9"}
        forwarded = {"Forwarded": "for=203.0.113.9;host=api.example"}
        for headers in (rebound, proxied, forwarded, {**rebound, **proxied}):
            refusals = [
                httpx.delete(f"{base}/gallery/{ids[1]}", headers=headers),
                httpx.post(f"{base}/gallery", files=_files(1, 20), data={"labels": "c"},
                           headers=headers),
                httpx.post(f"{base}/models", json={"path": str(tiny_checkpoint)},
                           headers=headers),
                httpx.post(f"{base}/models/{version}/activate", headers=headers),
                httpx.post(f"{base}/models/rollback", headers=headers),
                httpx.post(f"{base}/admin/backup", json={"name": "stolen"}, headers=headers),
                httpx.post(f"{base}/evaluate", json={"query_set": "q"}, headers=headers),
            ]
            for response in refusals:
                assert response.status_code == 403, (headers, response.request.url,
                                                     response.text)
                assert "IMGRET_API_KEY" in response.json()["detail"]
        assert _state(base) == before
        assert not (tmp_path / "data" / "backups").exists()
        # Reads stay open (a search is a read), by any name.
        search = httpx.post(f"{base}/search", headers=rebound,
                            files={"image": ("q.png", image_bytes(class_image(0, 0)),
                                             "image/png")})
        assert search.status_code == 200
        # And the page's own writes still work afterwards.
        assert httpx.delete(f"{base}/gallery/{ids[1]}", headers=own).status_code == 204


def test_health_shows_the_database_error_only_to_local_requests(
    tmp_path: Path, db_url: str, tiny_checkpoint: Path
) -> None:
    with running_server(_env(tmp_path, db_url, tiny_checkpoint),
                        log_path=tmp_path / "server.log") as server:
        base = server.url
        port = base.rsplit(":", 1)[1]
        assert httpx.get(f"{base}/health").json()["follower_error"] is None
        engine = create_engine(db_url)
        # The change log disappears under the server: every catch-up fails with the
        # database's message.
        with engine.begin() as connection:
            connection.execute(text("ALTER TABLE gallery_changes RENAME TO gallery_changes_gone"))
        try:
            deadline = time.monotonic() + 60
            while httpx.get(f"{base}/health").json()["follower_error"] is None:
                assert time.monotonic() < deadline, "the follower never failed"
                time.sleep(0.1)
            local = httpx.get(f"{base}/health").json()["follower_error"]
            assert local != FOLLOWER_ERROR_HIDDEN and "Error" in local
            for headers in ({"Host": f"rebind.example:{port}"},
                            {"X-Forwarded-For": "203.0.113.9"}, {"X-Real-IP": "203.0.113.9"}):
                shown = httpx.get(f"{base}/health", headers=headers).json()["follower_error"]
                assert shown == FOLLOWER_ERROR_HIDDEN, headers
        finally:
            with engine.begin() as connection:
                connection.execute(
                    text("ALTER TABLE gallery_changes_gone RENAME TO gallery_changes"))
            engine.dispose()


def test_security_headers_on_the_page_the_api_and_refusals(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    env = _env(tmp_path, f"sqlite:///{tmp_path / 'h.db'}", tiny_checkpoint)
    with running_server(env, log_path=tmp_path / "server.log") as server:
        base = server.url
        responses = {
            "page": httpx.get(f"{base}/"),
            "script": httpx.get(f"{base}/static/app.js"),
            "health": httpx.get(f"{base}/health"),
            "missing": httpx.get(f"{base}/gallery/999/image"),
            "refusal": httpx.delete(f"{base}/gallery/1", headers={"Origin": "http://evil"}),
            "docs": httpx.get(f"{base}/docs"),
        }
        assert [r.status_code for r in responses.values()] == [200, 200, 200, 404, 403, 200]
        for name, response in responses.items():
            assert response.headers["x-content-type-options"] == "nosniff", name
            assert response.headers["x-frame-options"] == "DENY", name
            assert response.headers["referrer-policy"] == "no-referrer", name
        for name in ("page", "script"):
            assert responses[name].headers["content-security-policy"] == PAGE_POLICY
        for name in ("health", "missing", "refusal"):
            assert responses[name].headers["content-security-policy"] == API_POLICY
        # Swagger UI loads from a CDN with an inline script: no policy there.
        assert "content-security-policy" not in responses["docs"].headers
        # The page's policy allows no inline script: the page has none.
        page = responses["page"].text
        assert "<script>" not in page and "<script src=" in page and "style=" not in page


@pytest.fixture
def rebinding_browser(tmp_path: Path):
    """Headless Chromium that resolves ``rebind.example`` to 127.0.0.1 (a rebound name) and
    keeps the console log (Content-Security-Policy violations are reported there)."""
    require(bool(CHROMIUM and CHROMEDRIVER), "chromium and chromedriver (apt-get install "
            "chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--host-resolver-rules=MAP rebind.example 127.0.0.1",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_works_under_its_policy_and_a_rebound_page_cannot_write(
    rebinding_browser, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser = rebinding_browser
    env = _env(tmp_path, f"sqlite:///{tmp_path / 'b.db'}", tiny_checkpoint)
    with running_server(env, log_path=tmp_path / "server.log") as server:
        base = server.url
        port = base.rsplit(":", 1)[1]
        ids = httpx.post(f"{base}/gallery", files=_files(6), data={"labels": ["a"] * 6},
                         timeout=60).json()["ids"]
        query = tmp_path / "query.png"
        class_image(1, 99, size=32).save(query)

        # The page at its loopback address: search with an uploaded file (its preview is a
        # blob: URL), thumbnails from /gallery, and a keyless write from the page.
        browser.get(f"{base}/")
        wait = WebDriverWait(browser, 30)
        wait.until(ec.text_to_be_present_in_element((By.ID, "health"), "images indexed"))
        browser.find_element(By.ID, "file-input").send_keys(str(query))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .result")) == 6)
        wait.until(lambda d: d.execute_script(
            "return [...document.querySelectorAll('#results img, #query-preview')]"
            ".every(i => i.complete && i.naturalWidth > 0)"))
        assert browser.find_element(By.ID, "query-preview").get_attribute("src").startswith(
            "blob:")
        browser.get(f"{base}/#models")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#models-table tbody tr")))
        assert browser.execute_async_script(_DELETE_FROM_PAGE, f"/gallery/{ids[0]}") == 204
        violations = [entry["message"] for entry in browser.get_log("browser")
                      if "Content Security Policy" in entry["message"]]
        assert not violations, violations

        # The same page on a rebound name: it loads (reads are open) but cannot write.
        browser.get(f"http://rebind.example:{port}/")
        wait.until(ec.text_to_be_present_in_element((By.ID, "health"), "images indexed"))
        assert browser.execute_async_script(_DELETE_FROM_PAGE, f"/gallery/{ids[1]}") == 403
        assert httpx.get(f"{base}/gallery/{ids[1]}").status_code == 200
        assert httpx.get(f"{base}/gallery").json()["count"] == 5
