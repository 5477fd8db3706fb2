"""The Lecture page and a figure download in a real browser (as tests/test_browser.py): the arrow keys move
between steps, a chart's SVG download carries its caption, and no request leaves loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.browser import CHROMIUM, CHROMIUM_ARGS, new_page, start_server, stop_server, wait_settled

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]


def heading(page) -> str:
    return page.locator("h1").first.inner_text()


def test_lecture_arrow_keys_and_an_svg_download(tiny_demo):
    from playwright.sync_api import sync_playwright

    proc, url, _ = start_server({"FCA_CACHE_ROOTS": str(tiny_demo), "FCA_DEFAULT_CACHE": str(tiny_demo / "eval")})
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            outside: list[str] = []
            try:
                page = new_page(browser, outside=outside)
                page.goto(f"{url}/lecture")
                page.wait_for_selector(".js-plotly-plot .main-svg", timeout=45_000)
                wait_settled(page)
                assert heading(page).startswith("1. Coefficients vary from token to token")
                page.locator("h1").first.click()  # the page, not a widget, has the focus
                page.keyboard.press("ArrowRight")
                page.wait_for_function(
                    "() => document.querySelector('h1')?.innerText.startsWith('2. ')", timeout=20_000
                )
                page.keyboard.press("ArrowLeft")
                page.wait_for_function(
                    "() => document.querySelector('h1')?.innerText.startsWith('1. ')", timeout=20_000
                )
                wait_settled(page)
                page.get_by_role("button", name="Figure for slides").first.click()
                with page.expect_download(timeout=60_000) as download:
                    page.get_by_role("button", name="SVG").first.click()
                assert download.value.suggested_filename == "lecture_variation.svg"
                svg = Path(download.value.path()).read_text()
                assert "<svg" in svg[:200]
                assert "16 sequences x 16 tokens" in svg or "sequences x 16 tokens" in svg  # its caption line
                assert "Sequence 0: mean coefficient per site and token" in svg
                # Presenter view: every chart text at 16 px or more, the explanations hidden.
                page.keyboard.press("Escape")  # (the popover closed)
                page.get_by_role("radio", name="presenter").first.click()
                page.wait_for_function("() => !document.body.innerText.includes('step 1 of 7')", timeout=20_000)
                page.wait_for_function(
                    "() => [...document.querySelectorAll('.js-plotly-plot .main-svg text')].length > 0", timeout=20_000
                )
                wait_settled(page)
                sizes = page.evaluate(
                    """() => [...document.querySelectorAll('.js-plotly-plot .main-svg text')]
                    .filter(t => t.textContent.trim()).map(t => [t.textContent, parseFloat(getComputedStyle(t).fontSize)])"""
                )
                assert sizes and all(size >= 16 for _, size in sizes), [s for s in sizes if s[1] < 16][:5]
                # Folded away: no box, no width, or slid off the left edge (it slides out over a moment).
                folded = """() => { const s = document.querySelector('[data-testid="stSidebar"]');
                    const b = s && s.getBoundingClientRect(); return !b || b.width < 10 || b.right <= 1; }"""
                try:
                    page.wait_for_function(folded, timeout=10_000)
                except Exception:
                    box = page.locator('[data-testid="stSidebar"]').bounding_box()
                    raise AssertionError(f"the sidebar is not folded away: {box}") from None
                assert "step 1 of 7" not in page.inner_text("body")  # (a caption: hidden)
                assert not outside, f"requests left loopback: {outside}"
            finally:
                browser.close()
    finally:
        stop_server(proc)
