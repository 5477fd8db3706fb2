"""The smaller defects of the pages that only a browser shows, on the shipped demo (as tests/test_browser.py):
at 800 px the Overview's gap retention in sight and the Token text's options on one line each; keyboard focus
in the sidebar unlike the current page's mark; the Variance quantity chosen with the first click."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.browser import CHROMIUM, CHROMIUM_ARGS, new_page, run_mark, start_server, stop_server, wait_settled

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo_server():
    proc, url, _ = start_server({"FCA_DEFAULT_CACHE": str(REPO / "cache" / "demo" / "eval")})
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield browser, url
            finally:
                browser.close()
    finally:
        stop_server(proc)


def test_the_overviews_gap_retention_is_in_sight_at_800_px(demo_server):
    browser, url = demo_server
    page = new_page(browser, width=800, height=900)
    page.goto(url)
    page.wait_for_selector('[data-testid="stMarkdownContainer"] table', timeout=45_000)
    wait_settled(page)
    table, header = page.evaluate(
        """() => { const t = document.querySelector('[data-testid="stMarkdownContainer"] table');
        const h = [...t.querySelectorAll('th')].find(th => th.innerText.startsWith('gap retention'));
        return [t.getBoundingClientRect().right, h.getBoundingClientRect().right]; }"""
    )
    assert header <= table + 1, f"the gap retention column ends at {header} px, the table's view at {table} px"
    page.close()


def test_the_token_text_options_sit_on_one_line_at_800_px(demo_server):
    browser, url = demo_server
    page = new_page(browser, width=800, height=900)
    page.goto(f"{url}/token_text")
    page.get_by_text("Colour by").first.wait_for(timeout=45_000)
    wait_settled(page)
    options = page.evaluate(
        """() => [...document.querySelectorAll('[data-testid="stRadio"] [role="radiogroup"] label')].map(l =>
        [l.innerText, l.getBoundingClientRect().height, parseFloat(getComputedStyle(l).lineHeight) || 24])"""
    )
    assert len(options) == 2
    assert all(height < 1.5 * line for _, height, line in options), options
    page.close()


def test_keyboard_focus_in_the_sidebar_is_not_the_current_pages_mark(demo_server):
    browser, url = demo_server
    page = new_page(browser, width=1400, height=900)
    page.goto(url)
    wait_settled(page)
    links = page.locator('[data-testid="stSidebarNav"] a')
    links.nth(2).focus()  # (a page other than the current one: Variance)
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Tab")  # reached with the keyboard: its focus is visible
    focused, current = page.evaluate(
        """() => { const style = a => { const s = getComputedStyle(a); return [s.backgroundColor, s.outlineStyle]; };
        const nav = document.querySelector('[data-testid="stSidebarNav"]');
        return [style(document.activeElement), style(nav.querySelector('a[aria-current="page"]'))]; }"""
    )
    assert page.evaluate("() => document.activeElement.getAttribute('aria-current')") is None
    assert focused[1] != "none", "no focus ring"
    assert focused[0] != current[0] and focused[0] in ("rgba(0, 0, 0, 0)", "transparent"), (focused, current)
    page.close()


def test_the_variance_quantity_is_chosen_with_the_first_click(demo_server):
    """Below the fold of a 1400 x 1000 screen: the click scrolls it into view, and a select box's list
    closed again as the page scrolled (the first click did nothing)."""
    browser, url = demo_server
    page = new_page(browser, width=1400, height=1000)
    page.goto(f"{url}/variance")
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=45_000)
    wait_settled(page)
    before = run_mark(page)
    page.get_by_text("standard deviation", exact=True).click(timeout=5_000)
    wait_settled(page, after=before)
    page.wait_for_function(
        """() => [...document.querySelectorAll('.js-plotly-plot .gtitle')]
        .some(t => t.textContent.startsWith('Standard deviation of each'))""",
        timeout=20_000,
    )
    page.close()
