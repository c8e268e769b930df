"""The API reference at /docs is served by the control plane itself: its page names only
assets under /docs/assets, those assets are served, and Swagger UI renders the API in a real
browser with nothing fetched from elsewhere (an air-gapped cluster has no CDN)."""

from __future__ import annotations

import re

import pytest

from tests.support.browser import console_errors, start_chromium, wait_for


def test_the_docs_page_names_only_its_own_assets(client):
    page = client.get("/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(source.startswith("/docs/assets/") for source in sources), sources
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    for source in sources:
        asset = client.get(source)
        assert asset.status_code == 200 and len(asset.content) > 100, source
    assert client.get("/redoc").status_code == 404  # its page would need a CDN


@pytest.mark.slow
@pytest.mark.browser
def test_swagger_ui_renders_the_api_offline(live_server):
    driver = start_chromium()
    try:
        driver.get(f"{live_server.url}/docs")
        title = wait_for(driver, ".swagger-ui .info .title")
        assert "exitplane control plane" in title.text
        wait_for(driver, ".opblock-tag")  # the operations, grouped by tag
        assert console_errors(driver) == []
    finally:
        driver.quit()
