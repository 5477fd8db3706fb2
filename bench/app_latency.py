"""Dashboard speed as a user meets it, in headless Chromium (Debian's `chromium`) against
`streamlit run app/main.py` on a loopback port.

    python -m bench.app_latency [--cache cache/demo/eval] [--runs 5] [--pause 0] [--compare DIR]

Each run starts a fresh server. Prints medians (and ranges) in seconds of: server start; cold start to
the first chart and to the finished Overview; the same for a new session on the running server; every
page opened from the sidebar, first (statistics computed) and again (served from the caches); and
interactions on the Variance (its lazy sections: a tab opened runs only that section) and Profiles
pages. `--pause S`: seconds spent on the Overview before the
first page is opened (0, the default, clicks at once: the worst case; a reader gives the background
warm-up, app/resources.py, time to fill the caches). A page or interaction counts as done when
its script run has finished and the browser has drawn the next frame (bench/browser.py).
`--compare DIR`: also time the app of another checkout (e.g. a copy of the tree before a change),
alternating servers run by run so both see the same machine load; prints {"this": ..., "DIR": ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import bench.browser as browser_module
from bench.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    new_page,
    run_mark,
    start_server,
    stop_server,
    wait_settled,
)

PAGES = {
    "variance": "Variance",
    "profiles": "Profiles",
    "replay_lab": "Replay lab",
    "execution": "Execution",
    "overview": "Overview",
}


def timed(page, action) -> float:
    """Seconds from `action()` until the script run it causes has finished and been drawn; NaN (not
    counted) in the rare case where the page never shows the run's state change (see bench/browser.py)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    before = run_mark(page)
    started = time.perf_counter()
    action()
    try:
        wait_settled(page, after=before, timeout_ms=20_000)
    except PlaywrightTimeout:
        return float("nan")
    return time.perf_counter() - started


def cold_start(browser, url: str) -> tuple[float, float]:
    """(first chart, Overview finished) in seconds after opening the app in a fresh browser context."""
    page = new_page(browser)
    started = time.perf_counter()
    page.goto(url)
    page.wait_for_selector(".js-plotly-plot", timeout=60_000)
    chart = time.perf_counter() - started
    wait_settled(page)
    page.close()
    return chart, time.perf_counter() - started


def one_server(browser, cache: Path, pause_s: float = 0.0) -> dict[str, float]:
    proc, url, start = start_server({"FCA_DEFAULT_CACHE": str(cache.resolve())})
    out = {"server_start_s": start}
    try:
        out["cold_first_chart_s"], out["cold_overview_done_s"] = cold_start(browser, url)
        out["warm_session_first_chart_s"], out["warm_session_overview_done_s"] = cold_start(browser, url)
        page = new_page(browser)
        page.goto(url)
        wait_settled(page)
        page.wait_for_timeout(1000 * pause_s)
        nav = page.locator('[data-testid="stSidebarNav"]')

        def open_page(label: str) -> float:
            return timed(page, lambda: nav.get_by_role("link", name=label, exact=True).click())

        for visit in ("first", "again"):
            for name, label in PAGES.items():
                out[f"{visit}_open_{name}_s"] = open_page(label)
        open_page("Variance")
        quantity = page.get_by_role("combobox", name="Show per slot")
        if quantity.count():  # an older checkout, timed against this one, draws a select box
            quantity.click()  # opening the list is drawn by the browser alone; choosing reruns the chart
            option = page.get_by_role("option", name="standard deviation", exact=True)
            out["variance_change_quantity_s"] = timed(page, option.click)
        else:  # radio buttons: one click chooses
            out["variance_change_quantity_s"] = timed(
                page, lambda: page.get_by_text("standard deviation", exact=True).click()
            )
        section = page.get_by_role("tab", name="One sequence: token x layer")
        if section.count():  # (a checkout from before the lazy sections: the sequence view is on the page)
            out["variance_open_section_s"] = timed(page, section.click)
        box = page.get_by_role("spinbutton", name="Sequence")
        out["variance_change_sequence_s"] = timed(page, lambda: (box.fill("3"), box.press("Enter")))
        open_page("Profiles")
        box = page.get_by_role("spinbutton", name="Token index (or click a point below)")
        out["profiles_change_token_s"] = timed(page, lambda: (box.fill("5"), box.press("Enter")))
        page.close()
    finally:
        stop_server(proc)
    return out


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="cache/demo/eval", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--pause", type=float, default=0.0, help="seconds on the Overview before opening the other pages"
    )
    parser.add_argument("--compare", type=Path, help="another checkout's root: its app is timed too, interleaved")
    args = parser.parse_args()
    trees = {"this": browser_module.REPO}
    if args.compare is not None:
        trees[str(args.compare)] = args.compare.resolve()
    results: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for _ in range(args.runs):
                for name, root in trees.items():  # interleaved: each run times every tree once
                    browser_module.REPO = root  # start_server runs `streamlit run app/main.py` here
                    cache = args.cache if args.cache.is_absolute() else root / args.cache
                    for key, value in one_server(browser, cache, args.pause).items():
                        results[name].setdefault(key, []).append(value)
        finally:
            browser.close()
    summaries = {name: summarise(values) for name, values in results.items()}
    print(json.dumps(summaries if args.compare is not None else summaries["this"], indent=1))


def summarise(results: dict[str, list[float]]) -> dict[str, dict]:
    summary = {}
    for key, values in results.items():
        measured = [v for v in values if not math.isnan(v)]
        summary[key] = (
            {
                "median": round(statistics.median(measured), 3),
                "min": round(min(measured), 3),
                "max": round(max(measured), 3),
            }
            if measured
            else {}
        )
        if len(measured) < len(values):
            summary[key]["unmeasured"] = len(values) - len(measured)
    return summary


if __name__ == "__main__":
    main()
