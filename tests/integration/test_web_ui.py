"""The web page in headless Chromium (selenium + chromedriver) against a real server.

Set IMGRET_SAVE_SCREENSHOT=1 to also write docs/screenshot.png (the README's picture).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import running_server
from tests.conftest import TEST_DEVICE, require
from tests.support.images import class_image

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
CLASSES, PER_CLASS, SIZE = 4, 6, 64


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

        # Click a neighbour of another class: its own image becomes the query, it is rank 1.
        other = next(card for card, label in zip(cards, labels, strict=True)
                     if label != "class-2")
        other_id, other_label = other.get_attribute("data-id"), labels[cards.index(other)]
        other.click()
        # Read through JS: the grid is replaced while we poll (no stale element handles).
        first = "const c = document.querySelector('#results .result'); "
        wait.until(lambda d: d.execute_script(first + "return c && c.dataset.id") == other_id)
        label = browser.execute_script(first + "return c.querySelector('.label').textContent")
        assert label == other_label

        # A file that is not an image: the page shows the API's message, no results crash.
        bad = tmp_path / "notes.png"
        bad.write_bytes(b"not an image")
        browser.find_element(By.ID, "file-input").send_keys(str(bad))
        wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "not a recognised image"))
        assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    assert (tmp_path / "screenshot.png").stat().st_size > 10_000


def _fill_gallery(base: str, folder: Path) -> None:
    files, labels = [], []
    for c in range(CLASSES):
        for i in range(PER_CLASS):
            image = class_image(c, i, size=SIZE)
            path = folder / f"{c}_{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            image.save(path)
            files.append(("images", (path.name, path.read_bytes(), "image/png")))
            labels.append(f"class-{c}")
    response = httpx.post(f"{base}/gallery", files=files, data={"labels": labels}, timeout=60)
    assert response.status_code == 201, response.text
