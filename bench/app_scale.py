"""What opening a cache costs the dashboard, for a cache and one 100x larger.

Two synthetic caches with the shipped demo's shapes (its sites and channels, 256-token sequences) are
written through the real `CacheWriter`: N sequences and `--factor` x N. For each, the work the dashboard
does when a cache is selected and its pages are first drawn is timed, calling the same functions the
app's resources call (app/resources.py): open the cache (manifest, part sizes, one schema), its stored
moments and the variance decomposition (Overview, Variance), the per-site quantiles of the first
sequences (Variance), one sequence (Variance, Profiles, Token text). With `--browser`, the app is also
started on each cache and timed in headless Chromium to its first chart and to Variance drawn.

    python -m bench.app_scale [--seqs 256] [--factor 100] [--repeats 5] [--browser] [--json PATH]

Disk: the two caches in a temporary directory (about 2 GB at the defaults), removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.output import emit
from fca.engine.capture import bytes_per_token, num_slots, seqs_per_part
from fca.tables.profiles import cache_moments
from fca.tables.schema import cache_plan, cache_schema, record_batch
from fca.tables.stats import variance_decomposition
from fca.tables.store import open_cache
from fca.tables.writer import CacheWriter

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 256
BATCH = 64  # sequences per record batch
SAMPLE_TOKENS = 65_536  # as app/resources.py samples for the distributions


def write_synthetic(out: Path, num_seqs: int, seed: int = 0) -> Path:
    """A cache of `num_seqs` sequences with the demo's sites: per-channel offsets plus noise."""
    specs = open_cache(REPO / "cache" / "demo" / "eval").site_specs
    rng = np.random.default_rng(seed)
    schema = cache_schema(specs)
    plan = cache_plan(
        specs, SEQ_LEN, num_seqs, model={"path": "synthetic", "fingerprint": "0" * 64}, corpus={"split": "eval"}
    )
    offsets = {k: rng.standard_normal(s.num_channels).astype(np.float32) for k, s in specs.items()}
    part_seqs = seqs_per_part(bytes_per_token(specs), SEQ_LEN, BATCH, num_slots=num_slots(specs))  # as a CPU build
    writer = CacheWriter(out, plan, schema, part_seqs, overwrite=True, workers=2)
    for lo in range(0, num_seqs, BATCH):
        n = min(BATCH, num_seqs - lo)
        tokens = rng.integers(0, 4096, (n, SEQ_LEN))
        values = {
            k: offsets[k] + 0.3 * rng.standard_normal((n, SEQ_LEN, s.num_channels), dtype=np.float32)
            for k, s in specs.items()
        }
        nll = rng.random((n, SEQ_LEN), dtype=np.float32)
        writer.write(record_batch(schema, np.arange(lo, lo + n), tokens, tokens, nll, values), n)
    writer.finish()
    return out


def open_steps(path: Path) -> dict[str, float]:
    """Seconds of each step the dashboard takes on a newly selected cache (fresh objects, no caching)."""
    times = {}
    start = time.perf_counter()
    cache = open_cache(path)
    times["open_cache_s"] = time.perf_counter() - start
    start = time.perf_counter()
    moments, layout = cache_moments(cache)
    variance_decomposition(moments, layout)
    times["moments_and_decomposition_s"] = time.perf_counter() - start
    start = time.perf_counter()
    values = cache.coefficients(list(range(min(cache.num_seqs, SAMPLE_TOKENS // cache.seq_len))))
    for v in values.values():
        np.quantile(v, [0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99])
    times["distributions_sample_s"] = time.perf_counter() - start
    start = time.perf_counter()
    cache.read_seqs([cache.num_seqs // 2])
    times["one_sequence_s"] = time.perf_counter() - start
    times["total_s"] = sum(times.values())
    return times


def browser_times(path: Path) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    from bench.app_latency import cold_start, timed
    from bench.browser import CHROMIUM, CHROMIUM_ARGS, new_page, start_server, stop_server, wait_settled

    proc, url, _ = start_server({"FCA_CACHE_ROOTS": str(path.parent), "FCA_DEFAULT_CACHE": str(path)})
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                first_chart, overview_done = cold_start(browser, url)
                page = new_page(browser)
                page.goto(url)
                wait_settled(page)
                nav = page.locator('[data-testid="stSidebarNav"]')
                variance = timed(page, lambda: nav.get_by_role("link", name="Variance", exact=True).click())
            finally:
                browser.close()
    finally:
        stop_server(proc)
    return {"first_chart_s": first_chart, "overview_done_s": overview_done, "first_open_variance_s": variance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256, help="sequences of the smaller cache")
    parser.add_argument("--factor", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--browser", action="store_true", help="also time the app in headless Chromium")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fca-app-scale-"))
    try:
        sizes = {"small": args.seqs, "large": args.seqs * args.factor}
        paths = {name: write_synthetic(work / name, n) for name, n in sizes.items()}
        result: dict = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "seq_len": SEQ_LEN}
        for name, path in paths.items():
            cache = open_cache(path)
            result[name] = {
                "num_seqs": cache.num_seqs,
                "parts": len(cache.manifest.parts),
                "bytes": cache.manifest.total_bytes,
            }
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        for _ in range(args.repeats):  # interleaved, so both see the same machine
            for name, path in paths.items():
                runs[name].append(open_steps(path))
        for name in paths:
            for key in runs[name][0]:
                result[name][key] = statistics.median(r[key] for r in runs[name])
        result["large_over_small_total"] = result["large"]["total_s"] / result["small"]["total_s"]
        if args.browser:
            for name, path in paths.items():
                result[name]["browser"] = browser_times(path)
            result["large_over_small_first_chart"] = (
                result["large"]["browser"]["first_chart_s"] / result["small"]["browser"]["first_chart_s"]
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.json)


if __name__ == "__main__":
    main()
