"""The Replay lab's quick mode as a lecturer meets it: a freshly started server, the lab opened, Quick, Run.

    python -m bench.lab_quick [--cache cache/demo/eval] [--runs 3] [--pause 0]

Each run starts a fresh server (so the model is not loaded yet: the run loads it as its first step) and
prints, in seconds after the click on Run: the first progress line, the longest wait between two changes
of what the progress line says (its elapsed-seconds counter left out), and the result drawn. `--pause S`:
seconds spent on the lab before Quick is clicked (0: at once, the worst case; the background warm-up
loads the model during a longer pause).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from app.jobs import QUICK_BATCH
from bench.browser import CHROMIUM, CHROMIUM_ARGS, NEXT_FRAME, new_page, start_server, stop_server, wait_settled

PROGRESS_TEXT = """() => { const p = document.querySelector('[data-testid="stProgress"]');
  return p ? p.innerText : null; }"""
RESULT_SHOWN = "() => [...document.querySelectorAll('h3')].some(h => h.innerText.startsWith('Result:'))"
ELAPSED = re.compile(r"\(\d+ s\)")


def one_run(browser, cache: Path, pause_s: float, verbose: bool = False) -> dict[str, float]:
    proc, url, _ = start_server({"FCA_DEFAULT_CACHE": str(cache.resolve())})
    try:
        page = new_page(browser)
        page.goto(f"{url}/replay_lab")
        page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
        wait_settled(page)
        page.wait_for_timeout(1000 * pause_s)
        page.get_by_role("button", name=re.compile(r"^Quick")).click()
        batch = page.get_by_role("spinbutton", name="Batch size")
        page.wait_for_function(
            "b => b.value === String(b_expected)".replace("b_expected", str(QUICK_BATCH)),
            arg=batch.element_handle(),
            timeout=30_000,
        )
        page.evaluate(NEXT_FRAME)
        run = page.get_by_role("button", name="Run", exact=True)
        started = time.perf_counter()
        run.click()
        first, last_change, longest, seen = None, None, 0.0, None
        timeline: list[tuple[float, str]] = []  # (seconds after Run, what the progress line said)
        while True:
            now = time.perf_counter() - started
            text = page.evaluate(PROGRESS_TEXT)
            if text is not None:
                said = ELAPSED.sub("", text).strip()
                if first is None:
                    first, last_change, seen = now, now, said
                    timeline.append((round(now, 2), said))
                elif said != seen:
                    longest, last_change, seen = max(longest, now - last_change), now, said
                    timeline.append((round(now, 2), said))
            if page.evaluate(RESULT_SHOWN):
                done = now
                break
            if now > 120:
                raise RuntimeError("no result within 120 s")
            time.sleep(0.05)
        longest = max(longest, done - (last_change if last_change is not None else 0.0))
        page.close()
        if verbose:
            print(json.dumps(timeline), flush=True)
        return {
            "first_progress_s": first if first is not None else float("nan"),
            "longest_still_s": longest,
            "result_s": done,
        }
    finally:
        stop_server(proc)


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="cache/demo/eval", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds on the lab before Quick is clicked")
    parser.add_argument("--verbose", action="store_true", help="print each run's progress lines with their times")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for _ in range(args.runs):
                for key, value in one_run(browser, args.cache, args.pause, args.verbose).items():
                    runs.setdefault(key, []).append(round(value, 2))
        finally:
            browser.close()
    print(json.dumps({k: {"median": statistics.median(v), "each": v} for k, v in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
