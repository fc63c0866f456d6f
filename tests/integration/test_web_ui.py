"""The web page in headless Chromium (selenium + chromedriver) against a real server: the
Search view (upload, search by a neighbour's stored item), the Evaluate view (metrics chart,
per-label table, worst queries as images; with unknown identities, the DET and TAR@FAR plots,
the operating points and the threshold slider) and the Models view (coverage, re-embedding,
comparison verdict, activation and rollback, calibration).

Set IMGRET_SAVE_SCREENSHOT=1 to also write docs/screenshot.png (the README's picture),
docs/screenshot_evaluate.png, docs/screenshot_open_set.png and docs/screenshot_models.png.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.conftest import TEST_DEVICE, require
from tests.support.images import class_image
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
CLASSES, PER_CLASS, SIZE = 4, 6, 64
QUERIES_PER_CLASS = 3
BLEND = (0.0, 0.4, 0.6)  # per query of a class: its weight of the next class
WORST = 8  # the Evaluate view asks for the 8 worst queries
UNKNOWN, PER_UNKNOWN = 10, 2  # identities the gallery does not hold, queries of each


@pytest.fixture
def browser(tmp_path: Path):
    """Headless Chromium with a fresh profile, no network chatter."""
    require(bool(CHROMIUM and CHROMEDRIVER), "chromium and chromedriver (apt-get install "
            "chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_upload_see_neighbours_and_search_by_a_neighbour(
    browser, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    env = {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_MODEL": str(tiny_checkpoint),
           "IMGRET_DEVICE": TEST_DEVICE}
    with running_server(env, log_path=tmp_path / "server.log") as server:
        _fill_gallery(server.url, tmp_path / "gallery")
        query = tmp_path / "query.png"
        class_image(2, 999, size=SIZE).save(query)

        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 30)
        wait.until(ec.text_to_be_present_in_element((By.ID, "health"), "images indexed"))
        assert f"{CLASSES * PER_CLASS} images indexed" in browser.find_element(By.ID, "health").text

        browser.find_element(By.ID, "file-input").send_keys(str(query))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .result")) == 12)
        cards = browser.find_elements(By.CSS_SELECTOR, "#results .result")
        labels = [card.find_element(By.CSS_SELECTOR, ".label").text for card in cards]
        assert labels[:PER_CLASS] == ["class-2"] * PER_CLASS
        scores = [float(card.find_element(By.CSS_SELECTOR, ".score").text.split()[1])
                  for card in cards]
        assert scores == sorted(scores, reverse=True)
        # Every thumbnail really loaded from /gallery/{id}/image.
        wait.until(lambda d: d.execute_script(
            "return [...document.querySelectorAll('#results img')]"
            ".every(i => i.complete && i.naturalWidth > 0)"))
        assert "neighbours in" in browser.find_element(By.ID, "status").text
        browser.save_screenshot(str(tmp_path / "screenshot.png"))
        if os.environ.get("IMGRET_SAVE_SCREENSHOT") == "1":
            (ROOT / "docs").mkdir(exist_ok=True)
            browser.save_screenshot(str(ROOT / "docs" / "screenshot.png"))

        # Click a neighbour of another class: the search is by its stored item id (no upload);
        # its image becomes the query preview and it is left out of its own results.
        other = next(card for card, label in zip(cards, labels, strict=True)
                     if label != "class-2")
        other_id, other_label = other.get_attribute("data-id"), labels[cards.index(other)]
        other.click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "status"), f"of item #{other_id}"))
        status = browser.find_element(By.ID, "status").text
        assert "model " in status and "error" not in browser.find_element(
            By.ID, "status").get_attribute("class")
        # Read through JS: the grid is replaced while we poll (no stale element handles).
        shown = browser.execute_script(
            "return [...document.querySelectorAll('#results .result')].map(c => "
            "[c.dataset.id, c.querySelector('.label').textContent])")
        assert other_id not in [item for item, _ in shown]
        assert [label for _, label in shown[:PER_CLASS - 1]] == [other_label] * (PER_CLASS - 1)
        assert browser.find_element(By.ID, "query-preview").get_attribute("src").endswith(
            f"/gallery/{other_id}/image")
        assert browser.execute_script(
            "const p = document.getElementById('query-preview'); "
            "return p.complete && p.naturalWidth > 0")

        # A file that is not an image: the page shows the API's message, no results crash.
        bad = tmp_path / "notes.png"
        bad.write_bytes(b"not an image")
        browser.find_element(By.ID, "file-input").send_keys(str(bad))
        wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "not a recognised image"))
        assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    assert (tmp_path / "screenshot.png").stat().st_size > 10_000


def test_evaluate_view_shows_chart_labels_and_worst_queries(
    browser, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    env = {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_MODEL": str(tiny_checkpoint),
           "IMGRET_DEVICE": TEST_DEVICE}
    _ingest_query_set(env, tmp_path / "queries", "holdout")
    with running_server(env, log_path=tmp_path / "server.log") as server:
        _fill_gallery(server.url, tmp_path / "gallery")
        active = httpx.get(f"{server.url}/models").json()["active"]

        browser.get(server.url + "/#evaluate")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: d.execute_script(
            "return document.getElementById('eval-query-set').value") == "holdout")
        assert browser.find_element(By.ID, "view-search").get_attribute("hidden")
        assert browser.find_element(By.ID, "eval-version").get_attribute("value") == active
        browser.find_element(By.ID, "evaluate-button").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#eval-report .chart"))

        # The chart: one bar per metric (4 + Recall@1, @5, @10), each with its interval.
        bars = browser.execute_script(
            "return [...document.querySelectorAll('.chart .bar')].map(g => "
            "[g.dataset.metric, g.querySelectorAll('.whisker').length])")
        assert [m for m, _ in bars] == ["map_at_r", "r_precision", "precision_at_1",
                                        "mean_average_precision", "recall_at_1", "recall_at_5",
                                        "recall_at_10"]
        assert all(whiskers == 3 for _, whiskers in bars)
        assert "MAP@R" in browser.find_element(By.ID, "chart-desc").get_attribute("textContent")
        # Per label: one row per class, worst (lowest MAP@R) first.
        rows = browser.find_elements(By.CSS_SELECTOR, ".per-label tbody tr")
        assert sorted(r.find_element(By.TAG_NAME, "th").text for r in rows) == [
            f"class-{c}" for c in range(CLASSES)]
        maps = [float(r.find_elements(By.TAG_NAME, "td")[1].text) for r in rows]
        assert maps == sorted(maps)
        # The worst queries (8 of 12): the query image, then its neighbours framed by
        # relevance; every picture really loads.
        worst = browser.find_elements(By.CSS_SELECTOR, ".worst-row")
        assert len(worst) == min(WORST, CLASSES * QUERIES_PER_CLASS)
        for row in worst:
            query = row.find_element(By.CSS_SELECTOR, ".thumb.query img")
            assert "/query-sets/holdout/items/" in query.get_attribute("src")
            assert row.find_elements(By.CSS_SELECTOR, ".neighbours .thumb")
        assert browser.find_elements(By.CSS_SELECTOR, ".worst .thumb.relevant")
        assert browser.find_elements(By.CSS_SELECTOR, ".worst .thumb.irrelevant")
        wait.until(lambda d: d.execute_script(
            "return [...document.querySelectorAll('#eval-report img')]"
            ".every(i => i.complete && i.naturalWidth > 0)"))
        assert f"model {active}" in browser.find_element(By.ID, "eval-status").text
        _screenshot(browser, tmp_path, "screenshot_evaluate.png")


def test_models_view_embeds_compares_activates_and_rolls_back(
    browser, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    import torch
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(1)
    other_run = tmp_path / "other_run"
    save_checkpoint(other_run, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16,
                                                      image_size=32)))
    key = {"X-API-Key": "ui-secret"}
    env = {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_MODEL": str(tiny_checkpoint),
           "IMGRET_DEVICE": TEST_DEVICE, "IMGRET_API_KEY": key["X-API-Key"],
           "IMGRET_EMBED_DUTY": "1.0", "IMGRET_MODEL_ROOTS": str(other_run)}
    _ingest_query_set(env, tmp_path / "queries", "holdout")
    with running_server(env, log_path=tmp_path / "server.log") as server:
        _fill_gallery(server.url, tmp_path / "gallery", headers=key)
        a = httpx.get(f"{server.url}/models").json()["active"]
        registered = httpx.post(f"{server.url}/models", json={"path": str(other_run)},
                                headers=key, timeout=60)
        assert registered.status_code == 201, registered.text
        b = registered.json()["version"]
        live = CLASSES * PER_CLASS

        browser.get(server.url + "/#models")
        wait = WebDriverWait(browser, 60)

        def row_text(version: str, column: int) -> str:
            return browser.execute_script(
                "const r = [...document.querySelectorAll('#models-table tbody tr')]"
                ".find(r => r.dataset.version === arguments[0]);"
                " return r ? r.children[arguments[1]].textContent : null", version, column)

        wait.until(lambda d: row_text(b, 3) is not None)
        assert "active" in row_text(a, 0) and "active" not in row_text(b, 0)
        assert row_text(a, 3) == f"{live} / {live} (100%)"
        assert row_text(b, 3) == f"0 / {live} (0%)"
        assert row_text(b, 1).startswith("tiny_cnn · 16-d")

        def runtime_text(version: str) -> str:
            return browser.execute_script(
                "const r = document.querySelector(`#models-table tr[data-version='${arguments[0]}']"
                " .runtime`); return r ? r.textContent : null", version)

        # The served version's runtime and its measured check; the other is not loaded yet.
        assert runtime_text(a).startswith("onnxruntime · Δ ")
        assert runtime_text(b) == "not loaded here"

        # A write without the key is refused with the API's message; with it, it runs.
        embed_b = f"#models-table tr[data-version='{b}'] .actions button:first-child"
        browser.find_element(By.CSS_SELECTOR, embed_b).click()
        wait.until(lambda d: "X-API-Key" in d.find_element(By.ID, "models-status").text)
        browser.find_element(By.ID, "api-key").send_keys(key["X-API-Key"])
        browser.find_element(By.CSS_SELECTOR, embed_b).click()
        # The table polls GET /models while the job runs, until the coverage is complete.
        wait.until(lambda d: row_text(b, 3) == f"{live} / {live} (100%)"
                   and row_text(b, 5) == "done")
        assert row_text(b, 4).startswith(f"built · {live}")

        # Compare A (active) and B on the query set: a verdict per metric.
        assert Select(browser.find_element(By.ID, "compare-a")).first_selected_option \
            .get_attribute("value") == a
        assert Select(browser.find_element(By.ID, "compare-b")).first_selected_option \
            .get_attribute("value") == b
        browser.find_element(By.ID, "compare-button").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#compare-result .badge"))
        verdicts = {row.get_attribute("data-metric"): row.find_element(By.CLASS_NAME, "badge").text
                    for row in browser.find_elements(By.CSS_SELECTOR,
                                                     "#compare-result tbody tr")}
        assert {"map_at_r", "precision_at_1"} <= set(verdicts)
        assert set(verdicts.values()) <= {"better", "worse", "no detectable difference"}
        assert verdicts["map_at_r"] in browser.find_element(By.ID, "compare-status").text
        # The comparison evaluated both: their last MAP@R is shown.
        wait.until(lambda d: row_text(a, 6).startswith(("0.", "1.")) and
                   row_text(b, 6).startswith(("0.", "1.")))

        # A gated activation: refused with the API's reason unless B is better on MAP@R.
        Select(browser.find_element(By.ID, "gate-require")).select_by_value("better")
        Select(browser.find_element(By.ID, "gate-query-set")).select_by_value("holdout")
        activate_b = f"#models-table tr[data-version='{b}'] .actions button:last-child"
        if verdicts["map_at_r"] != "better":
            browser.find_element(By.CSS_SELECTOR, activate_b).click()
            wait.until(lambda d: "refused" in d.find_element(By.ID, "models-status").text)
            status = browser.find_element(By.ID, "models-status")
            assert "require=better" in status.text and "error" in status.get_attribute("class")
            assert "active" in row_text(a, 0)
        Select(browser.find_element(By.ID, "gate-require")).select_by_value("")
        browser.find_element(By.CSS_SELECTOR, activate_b).click()
        wait.until(lambda d: "active" in (row_text(b, 0) or "") and "active" not in row_text(a, 0))
        assert f"active: {b} (was {a})" in browser.find_element(By.ID, "models-status").text
        wait.until(lambda d: f"model {b}" in d.find_element(By.ID, "health").text)
        assert httpx.get(f"{server.url}/models").json()["active"] == b
        _screenshot(browser, tmp_path, "screenshot_models.png")

        browser.find_element(By.ID, "rollback-button").click()
        wait.until(lambda d: "active" in (row_text(a, 0) or "") and "active" not in row_text(b, 0))
        assert f"rolled back: active {a} (was {b})" in browser.find_element(
            By.ID, "models-status").text


def test_open_set_plots_slider_and_calibration(
    browser, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    env = {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_MODEL": str(tiny_checkpoint),
           "IMGRET_DEVICE": TEST_DEVICE}
    _ingest_query_set(env, tmp_path / "queries", "with-unknowns", unknown=UNKNOWN)
    with running_server(env, log_path=tmp_path / "server.log") as server:
        _fill_gallery(server.url, tmp_path / "gallery")
        active = httpx.get(f"{server.url}/models").json()["active"]

        browser.get(server.url + "/#evaluate")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: d.execute_script(
            "return document.getElementById('eval-query-set').value") == "with-unknowns")
        browser.find_element(By.ID, "evaluate-button").click()
        wait.until(lambda d: d.find_elements(By.ID, "det-chart"))

        # The DET curve: a step line over the thresholds, and each resolved operating point
        # with its FPIR and FNIR intervals as error bars (3 lines per bar).
        det = browser.execute_script(
            "const c = document.getElementById('det-chart');"
            " return [c.querySelector('.det-line').getAttribute('d').split(' ').length,"
            " [...c.querySelectorAll('.op-point')].map(g => g.querySelectorAll('.whisker')"
            ".length)]")
        thresholds = int(browser.find_element(By.ID, "threshold-slider").get_attribute("max"))
        assert det[0] == thresholds + 1 > 2
        assert det[1] and all(whiskers == 6 for whiskers in det[1])
        assert browser.find_elements(By.CSS_SELECTOR, "#tar-chart .tar-point .whisker")
        # The table: one row per target FPIR; the resolved ones show value [low, high].
        rows = {row.get_attribute("data-fpir"): [td.text for td in
                                                 row.find_elements(By.TAG_NAME, "td")]
                for row in browser.find_elements(By.CSS_SELECTOR, ".op-table tbody tr")}
        assert set(rows) == {"0.1", "0.01", "0.001"}
        threshold, fnir = rows["0.1"][0], rows["0.1"][1]
        value, low, high = _numbers(fnir)
        assert _numbers(threshold) and low <= value <= high
        assert "non-mated searches" in rows["0.001"][-1]  # 20 unknowns cannot resolve 0.001

        # The slider starts at the 0.1 operating point; at its ends the decisions flip.
        readout = browser.find_element(By.ID, "threshold-readout")
        start = readout.text
        assert f"threshold {_numbers(threshold)[0]:.4f}" in start
        slider = browser.find_element(By.ID, "threshold-slider")

        def outcomes(kind: str) -> set[str]:
            return set(browser.execute_script(
                "return [...document.querySelectorAll('.decision-table tr[data-kind=\"'"
                " + arguments[0] + '\"] td:last-child')].map(td => td.textContent)", kind))

        slider.send_keys(Keys.HOME)
        wait.until(lambda d: readout.text != start)
        assert "above every score" in readout.text
        assert (float(readout.get_attribute("data-fpir")),
                float(readout.get_attribute("data-fnir"))) == (0.0, 1.0)
        assert outcomes("non-mated") == {"correct rejection"} and outcomes("mated") == {"miss"}
        slider.send_keys(Keys.END)
        wait.until(lambda d: float(readout.get_attribute("data-fpir")) == 1.0)
        assert outcomes("non-mated") == {"false alarm"}
        assert len(browser.find_elements(By.CSS_SELECTOR, ".decision-table tbody tr")) == \
            UNKNOWN * PER_UNKNOWN + CLASSES * QUERIES_PER_CLASS
        for _ in range(thresholds // 2):
            slider.send_keys(Keys.ARROW_LEFT)
        assert 0.0 < float(readout.get_attribute("data-fpir")) < 1.0
        _screenshot(browser, tmp_path, "screenshot_open_set.png",
                    browser.find_element(By.ID, "open-set"))

        # Other operating points from the form; an out-of-range one is the server's 422.
        status = browser.find_element(By.ID, "eval-status")
        fpirs = browser.find_element(By.ID, "eval-fpirs")
        fpirs.send_keys("0.2, 0.05")
        browser.find_element(By.ID, "evaluate-button").click()
        wait.until(lambda d: {row.get_attribute("data-fpir") for row in d.find_elements(
            By.CSS_SELECTOR, ".op-table tbody tr")} == {"0.2", "0.05"})
        fpirs.clear()
        fpirs.send_keys("0.1, 1.5")
        browser.find_element(By.ID, "evaluate-button").click()
        wait.until(lambda d: "fpirs must each lie in (0, 1)" in status.text)
        assert {row.get_attribute("data-fpir") for row in browser.find_elements(
            By.CSS_SELECTOR, ".op-table tbody tr")} == {"0.2", "0.05"}  # the last report stays
        fpirs.clear()

        # Models: not calibrated, then calibrated through the API and shown with its figures.
        browser.get(server.url + "/#models")

        def calibration_text() -> str | None:
            return browser.execute_script(
                "const r = [...document.querySelectorAll('#models-table tbody tr')]"
                ".find(r => r.dataset.version === arguments[0]);"
                " const c = r && r.querySelector('.calibration');"
                " return c ? c.textContent : null", active)

        wait.until(lambda d: calibration_text() is not None)
        assert calibration_text() == "not calibrated: serves no decisions"
        calibrated = httpx.post(f"{server.url}/models/{active}/calibrate", timeout=120,
                                json={"query_set": "with-unknowns", "target_fpir": 0.1})
        assert calibrated.status_code == 200, calibrated.text
        calibration = calibrated.json()
        browser.refresh()
        wait.until(lambda d: (calibration_text() or "").startswith("threshold"))
        shown = calibration_text()
        assert f"threshold {calibration['threshold']:.4f}" in shown
        assert f"target FPIR {calibration['target_fpir']:g}" in shown
        assert f"FNIR {calibration['fnir']:.3f}" in shown and "on with-unknowns" in shown


def _numbers(text: str) -> list[float]:
    import re

    return [float(n) for n in re.findall(r"-?\d+\.\d+", text)]


def _screenshot(browser, tmp_path: Path, name: str, element=None) -> None:
    """The whole page (the window grown to its height), or only ``element`` of it; also
    into docs/ when asked."""
    height, chrome = browser.execute_script(
        "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]")
    browser.set_window_size(1280, max(900, min(int(height) + int(chrome), 4000)))
    save = element.screenshot if element is not None else browser.save_screenshot
    save(str(tmp_path / name))
    assert (tmp_path / name).stat().st_size > 10_000
    if os.environ.get("IMGRET_SAVE_SCREENSHOT") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        save(str(ROOT / "docs" / name))


def _ingest_query_set(env: dict[str, str], folder: Path, name: str, unknown: int = 0) -> None:
    """Store a labelled query set the way a user does: `imgret ingest FOLDER --query-set`.

    Query i of class c is blended with class c + 1 (weight BLEND[i]): some queries are hard,
    so the metrics, intervals and confusions are not all trivial. ``unknown`` more classes
    (PER_UNKNOWN queries each) have no gallery item: the non-mated queries of open-set
    decisions.
    """
    for c in range(CLASSES):
        (folder / f"class-{c}").mkdir(parents=True, exist_ok=True)
        for i in range(QUERIES_PER_CLASS):
            image = Image.blend(class_image(c, 500 + i, size=SIZE),
                                class_image((c + 1) % CLASSES, 700 + i, size=SIZE), BLEND[i])
            image.save(folder / f"class-{c}" / f"{i}.png")
    for c in range(CLASSES, CLASSES + unknown):
        (folder / f"class-{c}").mkdir(parents=True, exist_ok=True)
        for i in range(PER_UNKNOWN):
            class_image(c, 500 + i, size=SIZE).save(folder / f"class-{c}" / f"{i}.png")
    done = subprocess.run(
        [sys.executable, "-c", "from imgret.cli.main import main; main()", "ingest", str(folder),
         "--query-set", name, "--no-progress"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _fill_gallery(base: str, folder: Path, headers: dict[str, str] | None = None) -> None:
    files, labels = [], []
    for c in range(CLASSES):
        for i in range(PER_CLASS):
            image = class_image(c, i, size=SIZE)
            path = folder / f"{c}_{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            image.save(path)
            files.append(("images", (path.name, path.read_bytes(), "image/png")))
            labels.append(f"class-{c}")
    response = httpx.post(f"{base}/gallery", files=files, data={"labels": labels}, headers=headers,
                          timeout=60)
    assert response.status_code == 201, response.text


def test_the_collection_picker_searches_the_chosen_collection(
    browser, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    """Two collections with other labels: picking one in the header makes the search, its
    thumbnails and the status line that collection's."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    env = {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_MODEL": str(tiny_checkpoint),
           "IMGRET_DEVICE": TEST_DEVICE}
    with running_server(env, log_path=tmp_path / "server.log") as server:
        _fill_gallery(server.url, tmp_path / "gallery")
        created = httpx.post(f"{server.url}/collections", json={"name": "shop"}, timeout=60)
        assert created.status_code == 201, created.text
        files = [("images", (f"{c}.png", _png_bytes(c), "image/png")) for c in range(3)]
        added = httpx.post(f"{server.url}/collections/shop/gallery", files=files, timeout=60,
                           data={"labels": [f"shop-{c}" for c in range(3)]})
        assert added.status_code == 201, added.text
        query = tmp_path / "query.png"
        class_image(1, 999, size=SIZE).save(query)

        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 30)
        wait.until(lambda d: len(Select(d.find_element(By.ID, "collection")).options) == 2)
        Select(browser.find_element(By.ID, "collection")).select_by_value("shop")
        wait.until(ec.text_to_be_present_in_element((By.ID, "health"), "3 images in shop"))
        browser.find_element(By.ID, "file-input").send_keys(str(query))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .result")) == 3)
        labels = browser.execute_script(
            "return [...document.querySelectorAll('#results .result .label')]"
            ".map(l => l.textContent)")
        assert sorted(labels) == ["shop-0", "shop-1", "shop-2"]
        wait.until(lambda d: d.execute_script(
            "return [...document.querySelectorAll('#results img')]"
            ".every(i => i.complete && i.naturalWidth > 0 && "
            "i.src.includes('/collections/shop/gallery/'))"))
        # Back to default: its gallery again.
        Select(browser.find_element(By.ID, "collection")).select_by_value("default")
        wait.until(ec.text_to_be_present_in_element((By.ID, "health"), "images indexed"))
        browser.find_element(By.ID, "file-input").send_keys(str(query))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results .result")) == 12)


def _png_bytes(c: int) -> bytes:
    import io

    buffer = io.BytesIO()
    class_image(c, 500, size=SIZE).save(buffer, format="PNG")
    return buffer.getvalue()


def test_identities_view_merges_names_a_cluster_undoes_and_erases(
    browser, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    """The Identities view with a key: the gallery grouped by label, a merge from the form, a
    cluster of unknowns named (its images fetched with the key), the merge undone from the
    audit log, and an erase with its receipt."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from imgret.gallery.storage.db import make_engine, make_sessionmaker
    from imgret.gallery.versions import version_store
    from imgret.settings import Settings

    key = "identities-view-key"
    headers = {"X-API-Key": key}
    env = {"IMGRET_DATA_DIR": str(tmp_path / "data"), "IMGRET_MODEL": str(tiny_checkpoint),
           "IMGRET_DEVICE": TEST_DEVICE, "IMGRET_API_KEY": key}
    with running_server(env, log_path=tmp_path / "server.log") as server, \
            httpx.Client(base_url=server.url, timeout=60, headers=headers) as http:
        pairs = [("alice", 0), ("alice", 1), ("bob", 2), ("bob", 3)]
        added = http.post("/gallery", data={"labels": [label for label, _ in pairs]},
                          files=[("images", (f"{i}.png", _png_bytes(i), "image/png"))
                                 for _, i in pairs])
        assert added.status_code == 201, added.text
        # A calibration every score is below: /identify calls everyone unknown.
        version = http.get("/health").json()["model_version"]
        engine = make_engine(Settings(data_dir=tmp_path / "data").db_url)
        with make_sessionmaker(engine).begin() as session:
            version_store.add_calibration(
                version_store.get_version(version, session=session), session=session,
                query_set="cal", query_set_sha256="0" * 64, target_fpir=0.01, threshold=1.5,
                threshold_low=None, threshold_high=None, fpir=0.0, fnir=0.0, rerank=None,
                details={})
        engine.dispose()
        assert http.patch("/collections/default", json={"unknowns_days": 7}).status_code == 200

        def identify(c: int) -> dict:
            return http.post("/identify", files={"image": ("q.png", _png_bytes(c), "image/png")}
                             ).json()

        # Until the follower serves the calibration (at once: the next poll), nothing decides.
        deadline = time.monotonic() + 120  # turns a hang into a failure; never reached
        while identify(7).get("unknown_id") is None:
            assert time.monotonic() < deadline, "the calibration was never served"
            time.sleep(0.05)
        identify(8)

        browser.get(server.url + "/#identities")
        key_input = browser.find_element(By.ID, "api-key")
        key_input.send_keys(key)
        # Entering the key shows the open view again, now with what the key may see.
        browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key_input)
        wait = WebDriverWait(browser, 30)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#identity-grid .identity")) == 2)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#clusters .cluster")) >= 2)
        wait.until(lambda d: d.execute_script(
            "return [...document.querySelectorAll('#clusters img')]"
            ".every(i => i.complete && i.naturalWidth > 0 && i.src.startsWith('blob:'))"))

        # Merge bob into alice from the form.
        Select(browser.find_element(By.ID, "merge-source")).select_by_value("bob")
        browser.find_element(By.ID, "merge-target").send_keys("alice")
        browser.find_element(By.ID, "merge-button").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                             "#audit-table tr[data-action=merge]"))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#identity-grid .identity")) == 1)

        # Name the first cluster.
        cluster = browser.find_element(By.CSS_SELECTOR, "#clusters .cluster")
        cluster.find_element(By.CSS_SELECTOR, "input").send_keys("carol")
        cluster.find_element(By.XPATH, ".//button[text()='Enroll']").click()
        wait.until(lambda d: "carol" in [e.text for e in d.find_elements(
            By.CSS_SELECTOR, "#identity-grid .label")])
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                             "#audit-table tr[data-action=enroll]"))
        _screenshot(browser, tmp_path, "screenshot_identities.png")

        # Undo the merge from the audit log: bob is back.
        merge_row = browser.find_element(By.CSS_SELECTOR, "#audit-table tr[data-action=merge]")
        merge_row.find_element(By.XPATH, ".//button[text()='Undo']").click()
        wait.until(lambda d: sorted(e.text for e in d.find_elements(
            By.CSS_SELECTOR, "#identity-grid .label")) == ["alice", "bob", "carol"])

        # Erase carol, confirming the dialog: the receipt shows what went.
        Select(browser.find_element(By.ID, "erase-label")).select_by_value("carol")
        browser.find_element(By.ID, "erase-button").click()
        wait.until(ec.alert_is_present())
        browser.switch_to.alert.accept()
        wait.until(ec.text_to_be_present_in_element((By.ID, "receipt"), "Erased: carol"))
        receipt = browser.find_element(By.ID, "receipt").text
        assert "gallery items\n1" in receipt or "gallery items 1" in receipt
        wait.until(lambda d: sorted(e.text for e in d.find_elements(
            By.CSS_SELECTOR, "#identity-grid .label")) == ["alice", "bob"])
        assert http.get("/identities").json()["count"] == 2
