"""Dashboard speed as a user meets it, in headless Chromium (Debian's `chromium`) against
`streamlit run app/main.py` on a loopback port.

    python -m bench.app_latency [--cache cache/demo/eval] [--runs 5]

Each run starts a fresh server. Prints medians (and ranges) in seconds of: server start; cold start to
the first chart and to the finished Overview; the same for a new session on the running server; every
page opened from the sidebar, first (statistics computed) and again (served from the caches); and
interactions on the Variance, Profiles and Replay-lab pages. A page or interaction counts as done when
its script run has finished and the browser has drawn the next frame (bench/browser.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.browser import CHROMIUM, CHROMIUM_ARGS, finished_runs, new_page, start_server, stop_server, wait_settled

PAGES = {"variance": "Variance", "profiles": "Profiles", "replay_lab": "Replay lab", "execution": "Execution", "overview": "Overview"}


def timed(page, action) -> float:
    """Seconds from `action()` until the script run it causes has finished and been drawn."""
    before = finished_runs(page)
    started = time.perf_counter()
    action()
    wait_settled(page, after=before)
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


def one_server(browser, cache: Path) -> dict[str, float]:
    proc, url, start = start_server({"FCA_DEFAULT_CACHE": str(cache.resolve())})
    out = {"server_start_s": start}
    try:
        out["cold_first_chart_s"], out["cold_overview_done_s"] = cold_start(browser, url)
        out["warm_session_first_chart_s"], out["warm_session_overview_done_s"] = cold_start(browser, url)
        page = new_page(browser)
        page.goto(url)
        wait_settled(page)
        nav = page.locator('[data-testid="stSidebarNav"]')
        for visit in ("first", "again"):
            for name, label in PAGES.items():
                out[f"{visit}_open_{name}_s"] = timed(page, lambda label=label: nav.get_by_role("link", name=label, exact=True).click())
        nav.get_by_role("link", name="Variance", exact=True).click()
        wait_settled(page, after=finished_runs(page) - 1)
        box = page.get_by_role("spinbutton", name="Sequence")
        out["variance_change_sequence_s"] = timed(page, lambda: (box.fill("3"), box.press("Enter")))
        out["variance_change_quantity_s"] = timed(page, lambda: page.get_by_text("standard deviation", exact=True).click())
        nav.get_by_role("link", name="Profiles", exact=True).click()
        wait_settled(page, after=finished_runs(page) - 1)
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
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for _ in range(args.runs):
                for key, value in one_server(browser, args.cache).items():
                    results.setdefault(key, []).append(value)
        finally:
            browser.close()
    print(json.dumps({k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
                      for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
