"""Every chart legible in both themes, in a real browser (as tests/test_browser.py), over the shipped demo: the
sidebar's Theme switch turns the page light or dark, and on every page, in each theme, all chart text stands
out from its background at a WCAG contrast of 4.5:1 or more, at 12 px or more, and every chart title is one
line inside its chart at 1024 px (sidebar open). Each page is screenshotted (pytest's tmp folder) to be
looked at when the test fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.browser import CHROMIUM, CHROMIUM_ARGS, new_page, start_server, stop_server, wait_settled

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
]

MIN_CONTRAST = 4.5  # WCAG AA for text
MIN_TEXT_PX = 12

# Page (its name in the sidebar) -> what to open after the page itself: a lazy tab (its name), or "next" (the
# Lecture's next step). Pages are opened from the sidebar, as a reader moves between them (in one document).
PAGES = {
    "Overview": [],
    "Lecture": ["next"] * 5,
    "Variance": ["Distributions per site", "One sequence: token x layer"],
    "Profiles": ["Every token: deviation heatmap"],
    "Token text": [],
    "Replay lab": [],
    "Execution": [],
    "Study": [],
}
TAB_CHARTS = {  # a lazy tab -> the start of the title of the chart it draws
    "Distributions per site": "Coefficients per site",
    "One sequence: token x layer": "Sequence 0",
    "Every token: deviation heatmap": "Sequence 0",
}
NO_CHART_FIRST = {"Token text", "Replay lab", "Study"}  # (the study's chart waits for its data grid too)

# Every chart text's colour against the chart's background (the page's where the chart's is transparent),
# alpha-blended as drawn, with its WCAG contrast ratio and size.
CHART_TEXT = """() => {
  const rgba = c => { const m = /rgba?\\(([^)]+)\\)/.exec(c || ''); if (!m) return null;
    const p = m[1].split(',').map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  const over = (fg, bg) => [0, 1, 2].map(i => fg[i] * fg[3] + bg[i] * (1 - fg[3])).concat(1);
  const lum = c => { const f = v => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
  const ratio = (a, b) => (Math.max(lum(a), lum(b)) + 0.05) / (Math.min(lum(a), lum(b)) + 0.05);
  const page = rgba(getComputedStyle(document.querySelector('[data-testid="stApp"]')).backgroundColor);
  const out = [];
  document.querySelectorAll('.js-plotly-plot').forEach(plot => {
    const own = rgba(plot.querySelector('.main-svg').style.background);
    const bg = own && own[3] > 0 ? over(own, page) : page;
    const chart = (plot.querySelector('.gtitle')?.textContent || 'untitled').slice(0, 60);
    plot.querySelectorAll('.main-svg text').forEach(t => {
      if (!t.textContent.trim() || !t.getClientRects().length) return;
      const s = getComputedStyle(t), fg = rgba(s.fill);
      if (!fg) return;
      fg[3] *= parseFloat(s.fillOpacity) * parseFloat(s.opacity);
      out.push({chart, text: t.textContent.slice(0, 40), ratio: ratio(over(fg, bg), bg),
                size: parseFloat(s.fontSize), fill: s.fill});
    });
  });
  return out;
}"""

# Every chart title: its number of lines and whether it runs past its chart's edges.
TITLE_LINES = """() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(plot => {
  const title = plot.querySelector('.gtitle');
  if (!title || !title.textContent.trim()) return [];
  const box = plot.querySelector('.main-svg').getBoundingClientRect(), r = title.getBoundingClientRect();
  return [{title: title.textContent, lines: Math.max(1, title.querySelectorAll('tspan.line').length),
           overflow: r.left < box.left - 1 || r.right > box.right + 1}];
})"""

PAGE_BACKGROUND = """() => getComputedStyle(document.querySelector('[data-testid="stApp"]')).backgroundColor"""


def open_page(page, name: str, then: str | None) -> None:
    """Open the page `name` from the sidebar (then = None), its lazy tab `then`, or the Lecture's next step, and
    wait until what it draws is there (a heading other than the one before, the tab's chart) and laid out."""
    heading = "() => document.querySelector('h1')?.innerText"
    before = page.evaluate(heading)
    if then is None or then == "next":
        if then is None:
            page.locator('[data-testid="stSidebarNav"] a').filter(has_text=name).first.click()
        else:
            page.get_by_role("button", name="Next").click()
        page.wait_for_function(f"before => ({heading})() !== before", arg=before, timeout=30_000)
        if name not in NO_CHART_FIRST:
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
    else:
        page.get_by_role("tab", name=then).click()
        page.wait_for_function(
            "t => [...document.querySelectorAll('.gtitle')].some(e => e.textContent.startsWith(t) && e.getClientRects().length)",
            arg=TAB_CHARTS[then],
            timeout=30_000,
        )
    wait_settled(page, (-1.0, 0))
    page.wait_for_timeout(300)  # plotly lays out after the run has been drawn


def switch_theme(page, url: str, theme: str) -> None:
    """Pick `theme` in the sidebar's Theme switch and wait for the page to take it."""
    page.goto(url)
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
    wait_settled(page)
    page.locator('[data-testid="stSidebar"]').get_by_role("radio", name=theme).click()
    dark = "() => { const c = getComputedStyle(document.querySelector('[data-testid=\"stApp\"]')).backgroundColor;"
    dark += " const v = c.match(/\\d+/g).slice(0, 3).map(Number); return v.reduce((a, b) => a + b) < 200; }"
    page.wait_for_function(dark if theme == "dark" else f"!({dark})()", timeout=20_000)
    wait_settled(page, (-1.0, 0))


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_every_chart_is_legible_in_both_themes(theme, tmp_path):
    from playwright.sync_api import sync_playwright

    proc, url, _ = start_server()  # the shipped demo, its report and study: every page has its charts
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            outside: list[str] = []
            try:
                # The browser prefers the other theme: the switch, not the system's setting, decides.
                page = new_page(browser, width=1024, height=3000, outside=outside)
                page.emulate_media(color_scheme="dark" if theme == "light" else "light")
                switch_theme(page, url, theme)
                switched = page.evaluate(PAGE_BACKGROUND)
                texts, titles, shots = [], [], 0
                for name, steps in PAGES.items():
                    for then in [None, *steps]:
                        if (name, then) != ("Overview", None):  # (the switch was used on the Overview)
                            open_page(page, name, then)
                        page.screenshot(path=tmp_path / f"{theme}-{shots:02d}-{name}.png", full_page=True)
                        shots += 1
                        texts += [dict(t, page=name) for t in page.evaluate(CHART_TEXT)]
                        titles += [dict(t, page=name) for t in page.evaluate(TITLE_LINES)]
                assert page.evaluate(PAGE_BACKGROUND) == switched, "the theme changed on the way"
                assert len({t["chart"] for t in texts}) >= 15, "fewer charts drawn than the pages have"
                faint = [t for t in texts if t["ratio"] < MIN_CONTRAST]
                assert not faint, f"{len(faint)} chart texts below {MIN_CONTRAST}:1 in {theme}: {faint[:8]}"
                small = [t for t in texts if t["size"] < MIN_TEXT_PX]
                assert not small, f"{len(small)} chart texts under {MIN_TEXT_PX} px: {small[:8]}"
                wrapped = [t for t in titles if t["lines"] > 1 or t["overflow"]]
                assert not wrapped, f"titles not on one line inside their chart at 1024 px: {wrapped}"
                assert not outside, f"requests left loopback: {outside}"
            finally:
                browser.close()
    finally:
        stop_server(proc)


# The x tick labels of each heatmap of upright token labels: how many touch the next one.
TOKEN_LABELS_OVERLAPPING = """() => [...document.querySelectorAll('.js-plotly-plot')]
  .filter(plot => plot.querySelector('.heatmaplayer') && plot.getClientRects().length
    && /decoded token/.test(plot.querySelector('.xtitle')?.textContent || ''))
  .map(plot => { const boxes = [...plot.querySelectorAll('.xtick text')].map(t => t.getBoundingClientRect())
      .filter(r => r.width).sort((a, b) => a.left - b.left);
    return [plot.querySelector('.gtitle').textContent, boxes.length,
            boxes.slice(1).filter((r, i) => r.left < boxes[i].right - 0.5).length]; })"""


def test_token_axes_fit_an_800px_screen():
    """At 800 px (sidebar open) the One-sequence and Every-token heatmaps label only the tokens whose labels fit:
    no label runs into the next (31 of 32 did)."""
    from playwright.sync_api import sync_playwright

    proc, url, _ = start_server()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = new_page(browser, width=800, height=2000)
                page.goto(f"{url}/variance")
                page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
                wait_settled(page)
                found = []
                for name, tab in (
                    ("Variance", "One sequence: token x layer"),
                    ("Profiles", "Every token: deviation heatmap"),
                ):
                    if name != "Variance":
                        open_page(page, name, None)
                    open_page(page, name, tab)
                    found += page.evaluate(TOKEN_LABELS_OVERLAPPING)
                assert len(found) == 2, found
                assert all(labels >= 8 and overlapping == 0 for _, labels, overlapping in found), found
            finally:
                browser.close()
    finally:
        stop_server(proc)
