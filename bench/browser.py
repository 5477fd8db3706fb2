"""The dashboard in headless Chromium, for the latency bench and the browser test: start
`streamlit run app/main.py` on a loopback port, and tell when a script run has finished.

When a run has finished: Streamlit writes the script's state on its root element
(`data-test-script-state`: initial, rerunRequested, running, notRunning). An init script counts the
changes into `notRunning` (a fast run may skip showing `running`); a page is settled when that count
has grown, the state reads `notRunning`, no element is still a loading placeholder (`stSkeleton`: the
chart component, fetched on first use, and plotly.js load after the run has finished) and every plotly
chart has drawn its SVG. Streamlit's status widget is no signal: it shows only for
runs longer than a delay. Now and then (about one sidebar click in 30 here) a run goes by without the
attribute changing at all, so callers that can wait for content instead should.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

COUNT_FINISHED_RUNS = """
window.__fcaFinishedRuns = 0;
new MutationObserver(records => records.forEach((r, i) => {
  // a record holds the old value; the new one is the next record's old value, or the current one
  const now = i + 1 < records.length ? records[i + 1].oldValue : r.target.getAttribute('data-test-script-state');
  if (now === 'notRunning' && r.oldValue !== 'notRunning') window.__fcaFinishedRuns++;
})).observe(document,
  {subtree: true, attributes: true, attributeOldValue: true, attributeFilter: ['data-test-script-state']});
"""
SETTLED = """([origin, n]) => (performance.timeOrigin === origin
    ? window.__fcaFinishedRuns > n : window.__fcaFinishedRuns > 0)
  && document.querySelector('[data-testid="stApp"]')?.getAttribute('data-test-script-state') === 'notRunning'
  && !document.querySelector('[data-testid="stSkeleton"]')
  && [...document.querySelectorAll('.js-plotly-plot')].every(plot => plot.querySelector('.main-svg'))"""
NEXT_FRAME = "() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(env: dict[str, str] | None = None, timeout_s: float = 60) -> tuple[subprocess.Popen, str, float]:
    """(process, url, seconds until healthy) of `streamlit run app/main.py` on a free loopback port."""
    port = free_port()
    log = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the server runs
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            "app/main.py",
            "--server.port",
            str(port),
            "--server.address",
            "127.0.0.1",
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
        ],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=1).read() == b"ok":
                return proc, url, time.perf_counter() - started
        except OSError:
            pass
        if proc.poll() is not None or time.perf_counter() - started > timeout_s:
            proc.kill()
            proc.wait(10)
            log.seek(0)
            raise RuntimeError(f"streamlit did not start: {log.read().decode(errors='replace')[-2000:]}")
        time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def is_loopback(url: str) -> bool:
    """Inline data and the page's own objects never leave the machine; anything else must be loopback."""
    return url.startswith(("data:", "blob:", "about:")) or urlsplit(url).hostname in LOOPBACK_HOSTS


def new_page(browser, width: int = 1400, height: int = 1000, outside: list[str] | None = None):
    """A page in a fresh context (no cache shared with other pages) that counts finished runs. Given a
    list `outside`, every request (and websocket) that would leave loopback is blocked and its URL
    appended there, so a test can fail on it (the app must serve all its assets itself). The bench
    passes none: routing every request through Python would add to the latencies it measures."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.add_init_script(COUNT_FINISHED_RUNS)
    if outside is not None:

        def route(r) -> None:
            if is_loopback(r.request.url):
                r.continue_()
            else:
                outside.append(r.request.url)
                r.abort()

        page.context.route("**/*", route)
        page.on("websocket", lambda ws: None if is_loopback(ws.url) else outside.append(ws.url))
    return page


def run_mark(page) -> tuple[float, int]:
    """(this document's time origin, runs finished in it): what `wait_settled` waits to see pass."""
    return tuple(page.evaluate("() => [performance.timeOrigin, window.__fcaFinishedRuns]"))


def wait_settled(page, after: tuple[float, int] | None = None, timeout_ms: int = 60_000) -> None:
    """Until a script run that finished after the `after` mark (None: in a freshly opened document)
    has left the page idle, and the browser has drawn the next frame. A click that reloads the whole
    document (it happens now and then with Streamlit's page links) counts from the new document."""
    page.wait_for_function(SETTLED, arg=list(after or (-1.0, 0)), timeout=timeout_ms)
    page.evaluate(NEXT_FRAME)
