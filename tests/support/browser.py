"""Headless Chromium (Debian's chromium + chromium-driver) driven by Selenium, with helpers for
screenshots at phone and desktop widths and page-quality checks (labels, contrast, overflow)."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
WIDTHS = (1280, 390)
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def start_chromium() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1280,900", "--force-device-scale-factor=1",
                 f"--user-data-dir={tempfile.mkdtemp(prefix='exitplane-chromium-')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(90)  # a loaded 2-core machine renders slowly
    return driver


def wait(driver, seconds: float = 45) -> WebDriverWait:
    return WebDriverWait(driver, seconds)


def wait_for(driver, css: str, seconds: float = 45):
    return wait(driver, seconds).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css)))


def navigate(driver, element, seconds: float = 45) -> None:
    """Click a link or submit button and wait until the browser has left the page: waiting for an
    element right after a click could otherwise find it on the old page, about to go stale."""
    page = driver.find_element(By.TAG_NAME, "html")
    element.click()
    wait(driver, seconds).until(lambda _: _gone(page))


def _gone(element) -> bool:
    """Whether element has left the document. While the old document is being replaced,
    chromedriver may answer a query about its node with a generic error ("Node with given id
    does not belong to the document") instead of a stale-element one; both mean it is gone."""
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as error:
        if "does not belong to the document" in str(error):
            return True
        raise
    return False


def set_width(driver, width: int, height: int = 900) -> None:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})


def screenshot(driver, name: str) -> list[Path]:
    """Full-page PNGs of the current page at each width in WIDTHS; returns their paths."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    paths = []
    for width in WIDTHS:
        set_width(driver, width)
        driver.execute_script("window.dispatchEvent(new Event('resize'))")
        driver.execute_script("return new Promise(r => setTimeout(r, 250))")
        height = driver.execute_script(
            "return Math.ceil(document.documentElement.scrollHeight)")
        # Against the device width: a phone widens its layout viewport to fit overflow.
        layout = driver.execute_script(
            "return [document.documentElement.scrollWidth, window.innerWidth]")
        assert max(layout) <= width + 1, f"{name} is {max(layout)}px wide at {width}px"
        set_width(driver, width, min(height, 6000))
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True})
        path = SCREENSHOTS / f"{name}-{width}.png"
        path.write_bytes(base64.b64decode(shot["data"]))
        paths.append(path)
    set_width(driver, WIDTHS[0])
    return paths


def console_errors(driver) -> list[str]:
    """Errors the page logged (script errors, CSP violations, failed fetches)."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and "favicon.ico" not in entry["message"]]


UNLABELLED_FIELDS = """
return Array.from(document.querySelectorAll('input, select, textarea'))
  .filter(el => el.type !== 'hidden')
  .filter(el => el.labels.length === 0 && !el.getAttribute('aria-label'))
  .map(el => el.outerHTML.slice(0, 120));
"""

LOW_CONTRAST = (Path(__file__).parent / "contrast.js").read_text()


def check_page_quality(driver, name: str) -> None:
    """Every field labelled, every text readable (WCAG AA), no script or CSP errors."""
    assert driver.execute_script(UNLABELLED_FIELDS) == [], f"{name}: fields without a label"
    assert driver.execute_script(LOW_CONTRAST) == [], f"{name}: text below WCAG AA contrast"
    assert console_errors(driver) == [], f"{name}: the browser console shows errors"
