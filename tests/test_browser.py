"""The dashboard in a real browser: `streamlit run` on a loopback port, headless Debian Chromium driven
by Playwright, every page opened; no exception box, and the plotly charts are drawn."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
# url path ("" is the default page, the overview) -> does the page draw a chart before any interaction (the replay lab draws after a run)
PAGES = {"": True, "variance": True, "profiles": True, "replay_lab": False, "execution": True}

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is absent (apt-get install chromium; .ci/run does)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_demo):
    port = _free_port()
    env = {**os.environ, "FCA_CACHE_ROOTS": str(tiny_demo), "FCA_DEFAULT_CACHE": str(tiny_demo / "eval")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app/main.py", "--server.port", str(port), "--server.address", "127.0.0.1",
         "--server.headless", "true", "--browser.gatherUsageStats", "false"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=1).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"streamlit did not start: {proc.stdout.read().decode()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def wait_until_idle(page, timeout_ms: int = 45_000) -> None:
    """Until the script has finished (Streamlit's running indicator is gone)."""
    page.wait_for_selector('[data-testid="stApp"]', timeout=timeout_ms)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout_ms)


def test_every_page_in_chromium(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for path, has_chart in PAGES.items():
                page.goto(f"{server}/{path}")
                if has_chart:
                    page.wait_for_selector(".js-plotly-plot", timeout=45_000)
                else:
                    page.get_by_role("button", name="Run", exact=True).wait_for(timeout=45_000)
                wait_until_idle(page)
                assert page.locator('[data-testid="stException"]').count() == 0, f"{path}: {page.locator('[data-testid=stException]').first.inner_text()}"
                if has_chart:
                    assert page.locator(".js-plotly-plot").count() >= 1, path
                assert page.locator('[data-testid="stSidebar"]').count() == 1
                assert "Page not found" not in page.inner_text("body"), path
            # Profiles: clicking a token in the strip chart selects it (Streamlit's plotly selection event).
            page.goto(f"{server}/profiles")
            page.wait_for_selector(".js-plotly-plot .scatterlayer .point", timeout=45_000)
            wait_until_idle(page)
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
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server)
            page.wait_for_selector(".js-plotly-plot", timeout=45_000)
            wait_until_idle(page)
            sidebar = page.locator('[data-testid="stSidebar"]')

            def type_cache(path: Path) -> None:
                box = sidebar.get_by_role("combobox", name="Cache")
                box.click()
                box.press("Control+A")
                box.press("Backspace")
                box.press_sequentially(str(path))
                box.press("Enter")
                page.wait_for_timeout(300)
                wait_until_idle(page)

            type_cache(tiny_demo / "featuregate")
            assert "outside the configured roots" not in sidebar.inner_text()
            assert "This cache cannot be used" in page.inner_text("body") and "manifest.json" in page.inner_text("body")
            type_cache(tiny_demo.parent)
            assert "outside the configured roots" in sidebar.inner_text()
            assert page.locator('[data-testid="stException"]').count() == 0
        finally:
            browser.close()
