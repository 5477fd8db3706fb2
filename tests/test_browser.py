"""The dashboard in a real browser: `streamlit run` on a loopback port, headless Debian Chromium driven
by Playwright, every page opened; no exception box, and the plotly charts are drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    new_page,
    start_server,
    stop_server,
    wait_settled,
)

# url path ("" is the default page, the overview) -> does the page draw a chart before any interaction (the replay lab draws after a run)
PAGES = {"": True, "variance": True, "profiles": True, "replay_lab": False, "execution": True}

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is absent (apt-get install chromium; .ci/run does)"
)


@pytest.fixture(scope="module")
def server(tiny_demo):
    proc, url, _ = start_server({"FCA_CACHE_ROOTS": str(tiny_demo), "FCA_DEFAULT_CACHE": str(tiny_demo / "eval")})
    try:
        yield url
    finally:
        stop_server(proc)


def test_every_page_in_chromium(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = new_page(browser)
            for path, has_chart in PAGES.items():
                page.goto(f"{server}/{path}")
                if has_chart:
                    page.wait_for_selector(".js-plotly-plot", timeout=45_000)
                else:
                    page.get_by_role("button", name="Run", exact=True).wait_for(timeout=45_000)
                wait_settled(page)
                assert page.locator('[data-testid="stException"]').count() == 0, (
                    f"{path}: {page.locator('[data-testid=stException]').first.inner_text()}"
                )
                if has_chart:
                    assert page.locator(".js-plotly-plot").count() >= 1, path
                assert page.locator('[data-testid="stSidebar"]').count() == 1
                assert "Page not found" not in page.inner_text("body"), path
            # Profiles: clicking a token in the strip chart selects it (Streamlit's plotly selection event).
            page.goto(f"{server}/profiles")
            page.wait_for_selector(".js-plotly-plot .scatterlayer .point", timeout=45_000)
            wait_settled(page)
            page.locator(".js-plotly-plot").first.locator(".scatterlayer .point").nth(3).click(force=True)
            page.wait_for_function("() => document.body.innerText.includes('live: position 3 ')", timeout=20_000)
        finally:
            browser.close()


def test_typed_cache_path_in_chromium(server, tiny_demo):
    """The Cache box takes a typed path: one inside the configured roots is opened (a model folder there
    is refused as a cache, with the reason), one outside them is refused before anything is read."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = new_page(browser)
            page.goto(server)
            page.wait_for_selector(".js-plotly-plot", timeout=45_000)
            wait_settled(page)
            sidebar = page.locator('[data-testid="stSidebar"]')

            def type_cache(path: Path, expected: str) -> None:
                """Type `path` into the Cache box, pick it, and wait for `expected` on the page."""
                box = sidebar.get_by_role("combobox", name="Cache")
                box.click()
                box.press("Control+A")
                box.press("Backspace")
                box.press_sequentially(str(path))
                page.get_by_role("option", name=f"Add: {path}", exact=True).click()
                page.wait_for_function("text => document.body.innerText.includes(text)", arg=expected, timeout=30_000)

            type_cache(tiny_demo / "featuregate", "This cache cannot be used")
            assert "outside the configured roots" not in sidebar.inner_text() and "manifest.json" in page.inner_text(
                "body"
            )
            type_cache(tiny_demo.parent, "outside the configured roots")
            assert "outside the configured roots" in sidebar.inner_text()
            assert page.locator('[data-testid="stException"]').count() == 0
        finally:
            browser.close()
