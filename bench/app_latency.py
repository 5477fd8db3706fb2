"""Dashboard speed as a user meets it: cold start to the first chart, then interactions, in headless
Chromium (Debian's `chromium`) against `streamlit run app/main.py` on a loopback port.

    python -m bench.app_latency [--cache cache/demo/eval] [--runs 3]

Prints seconds: server start, first session to first chart, a second session to first chart (warm
server), page switches, and changing the sequence on the Variance page.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cache: Path) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    env = {**os.environ, "FCA_DEFAULT_CACHE": str(cache.resolve())}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app/main.py", "--server.port", str(port), "--server.address", "127.0.0.1",
                             "--server.headless", "true"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=1).read() == b"ok":
                return proc, url, time.perf_counter() - started
        except OSError:
            time.sleep(0.05)


def idle(page) -> None:
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)


def first_chart(page, url: str) -> float:
    t = time.perf_counter()
    page.goto(url)
    page.wait_for_selector(".js-plotly-plot", timeout=60_000)
    return time.perf_counter() - t


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="cache/demo/eval", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        for _ in range(args.runs):
            proc, url, start = start_server(args.cache)
            try:
                results.setdefault("server_start_s", []).append(start)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                results.setdefault("cold_first_chart_s", []).append(first_chart(page, url))
                idle(page)
                results.setdefault("warm_new_session_first_chart_s", []).append(first_chart(browser.new_page(), url))
                for name in ("variance", "profiles", "execution"):
                    t = time.perf_counter()
                    page.goto(f"{url}/{name}")
                    page.wait_for_selector('[data-testid="stMain"]', timeout=60_000)
                    page.wait_for_timeout(100)
                    idle(page)
                    results.setdefault(f"open_{name}_s", []).append(time.perf_counter() - t)
                page.goto(f"{url}/variance")
                page.wait_for_selector(".js-plotly-plot", timeout=60_000)
                idle(page)
                box = page.get_by_role("spinbutton", name="Sequence")
                t = time.perf_counter()
                box.fill("3")
                box.press("Enter")
                page.wait_for_timeout(50)
                idle(page)
                results.setdefault("change_sequence_s", []).append(time.perf_counter() - t)
                page.close()
            finally:
                proc.terminate()
                proc.wait(10)
        browser.close()
    print(json.dumps({k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)} for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
