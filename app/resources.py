"""Every Streamlit cache of the dashboard, and nothing else.

Keys are content identities, never just paths: a cache by its manifest hash / `Cache.fingerprint`,
a model by its weights file's size and modification time, a report by its modification time. So a
rebuilt cache or retrained model is picked up without a restart, and an unchanged one is computed
once per server process. `st.cache_resource` holds shared read-only objects (models, moments);
`st.cache_data` holds small results that are copied per caller.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import streamlit as st

from fca.tables import catalog
from fca.tables.audit_report import AuditReport
from fca.tables.catalog import weights_path
from fca.tables.data import load_tokenizer
from fca.tables.errors import CacheError
from fca.tables.jsonfile import read_json
from fca.tables.profiles import cache_moments, profiles_from_moments, quantile_band
from fca.tables.report import read_report
from fca.tables.runs import list_runs, runs_dir
from fca.tables.stats import variance_decomposition
from fca.tables.store import Cache
from fca.tables.store import open_cache as _open_cache
from fca.tables.study import load_study

if TYPE_CHECKING:  # pandas is imported where a DataFrame is built (the sidebar and Overview do without it)
    import pandas as pd

# Sequences sampled for per-site distributions: quantiles need the values, not mergeable sums, so a
# fixed-size sample keeps them bounded on caches of any size.
SAMPLE_TOKENS = 65_536
# The calibration band the Profiles page shows first (quantiles of the calibration coefficients).
DEFAULT_BAND = (0.05, 0.95)
BAND_SEQS = 64  # the calibration band's quantiles are over the tokens of this many sequences


def file_stamp(path: str | Path) -> str:
    """Size and modification time: changes when a file is rewritten."""
    try:
        st_ = Path(path).stat()
        return f"{st_.st_size}-{st_.st_mtime_ns}"
    except OSError:
        return "missing"


@st.cache_resource(show_spinner=False, max_entries=32)
def open_cache(path: str, manifest_hash: str) -> Cache:
    """Manifest and part schemas checked (CacheError otherwise); no part data read."""
    return _open_cache(path)


@st.cache_resource(show_spinner="Streaming over the cache once for its statistics...", max_entries=8)
def moments(path: str, fingerprint: str):
    """(Moments, SlotLayout) of one streaming pass: shared, read-only, computed once per cache."""
    return cache_moments(_open_cache(path))


@st.cache_data(show_spinner=False, max_entries=16)
def cache_stats(path: str, fingerprint: str) -> dict:
    """The variance decomposition and per-slot summaries of a cache (small: arrays of C or T x C)."""
    m, layout = moments(path, fingerprint)
    return {
        "decomposition": variance_decomposition(m, layout),
        "slot_mean": m.slot_mean,
        "slot_sd": np.sqrt(m.slot_var),
        "minimum": m.minimum,
        "maximum": m.maximum,
        "position_mean": m.position_mean,
        "sites": layout.sites,
        "widths": layout.widths,
        "site_slots": {site: layout.site_slice(site) for site in layout.sites},  # its columns of the slot arrays
        "families": layout.families,
        "num_tokens": m.count,
    }


@st.cache_resource(show_spinner=False, max_entries=8)
def profiles(path: str, fingerprint: str):
    """Calibration profiles from the same moments (identical numbers to `calibration_profiles`)."""
    return profiles_from_moments(*moments(path, fingerprint))


@st.cache_data(show_spinner="Sampling coefficients for the distributions...", max_entries=16)
def site_quantiles(path: str, fingerprint: str) -> pd.DataFrame:
    """Per-site quantiles over the tokens of the first sequences (at most SAMPLE_TOKENS tokens)."""
    import pandas as pd  # here, not at the top: the sidebar imports this module on every page

    cache = _checked_reader(path, fingerprint)
    seqs = list(range(min(cache.num_seqs, max(2, SAMPLE_TOKENS // cache.seq_len))))
    cache.verify(range(len(seqs)))  # the parts read, against their hashes, as every other reader
    values = cache.coefficients(seqs)
    rows = []
    for site, v in values.items():
        q = np.quantile(v, [0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99])
        rows.append(
            {
                "site": site,
                **{f"q{int(round(p * 100)):02d}": x for p, x in zip([0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99], q)},
                "mean": float(v.mean()),
                "sampled_tokens": v.shape[0] * v.shape[1],
            }
        )
    return pd.DataFrame(rows)


@st.cache_resource(show_spinner=False, max_entries=8)
def _checked_reader(path: str, fingerprint: str) -> Cache:
    """A reader that hashes each part against the manifest before its first read (`Cache.verify` remembers
    what it hashed), so a part changed in place is refused here as on every other page."""
    return _open_cache(path)


@st.cache_data(show_spinner=False, max_entries=64)
def sequence(path: str, fingerprint: str, seq: int) -> dict[str, np.ndarray]:
    """Tokens, targets, live NLL [T] and coefficients [T, K_s] of one sequence (its row group only)."""
    cache = _checked_reader(path, fingerprint)
    cache.verify(range(seq, seq + 1))
    return {k: v[0] for k, v in cache.read_seqs([seq]).items()}


@st.cache_data(show_spinner=False, max_entries=16)
def calibration_band(path: str, fingerprint: str, lo: float, hi: float) -> dict[str, np.ndarray]:
    cache = _checked_reader(path, fingerprint)
    cache.verify(range(min(cache.num_seqs, BAND_SEQS)))
    return quantile_band(cache, (lo, hi), BAND_SEQS)


@st.cache_resource(show_spinner=False, max_entries=8)
def tokenizer(model_dir: str, stamp: str):
    return load_tokenizer(model_dir)


@st.cache_data(show_spinner=False, max_entries=64)
def decode_tokens(model_dir: str, ids: tuple[int, ...]) -> list[str]:
    """Each id decoded alone (so a label shows exactly one token); None model dir: the ids as text."""
    if not model_dir or not (Path(model_dir) / "tokenizer.json").is_file():
        return [str(i) for i in ids]
    tok = tokenizer(model_dir, file_stamp(Path(model_dir) / "tokenizer.json"))
    return [tok.decode([i]).replace("\n", "\\n") or f"<{i}>" for i in ids]


_opened: set[tuple[str, ...]] = set()  # keys of `_experiment` loaded so far (a hint: it may have evicted one)


@st.cache_resource(show_spinner="Loading the model...", max_entries=4)
def _experiment(
    model_dir: str,
    device: str,
    model_stamp: str,
    cache: str,
    cache_fingerprint: str,
    calibration: str,
    calibration_fingerprint: str,
    dense_dir: str,
):
    """(experiment, lock), keyed on the weights' file stamp and both caches' fingerprints. The lock
    serialises uses of one model object, since a replay changes its site modes for a forward."""
    from fca.jobs.experiment import (
        Experiment,  # torch: only when a page needs the model
    )

    experiment = Experiment.open(model_dir, cache, calibration or None, dense=dense_dir or None, device=device)
    settle_heap()  # torch and the model: the largest part of the heap
    _opened.add(
        (model_dir, device, model_stamp, cache, cache_fingerprint, calibration, calibration_fingerprint, dense_dir)
    )
    return experiment, threading.Lock()


def model_bytes(model_dir: str | Path) -> int:
    """Size of a model's weights on disk (a sharded checkpoint: the total its index states)."""
    path = weights_path(Path(model_dir))
    if path.name.endswith(".index.json"):
        index = read_json(path, CacheError)
        total = (index.get("metadata") or {}).get("total_size") if isinstance(index, dict) else None
        return total if type(total) is int and total >= 0 else 1 << 62
    return path.stat().st_size


def family_files() -> list[str]:
    """The family files FCA_FAMILIES names (os.pathsep-separated; `python -m fca dashboard --family FILE`
    sets it), read here without importing torch."""
    return [p.strip() for p in os.environ.get("FCA_FAMILIES", "").split(os.pathsep) if p.strip()]


def _experiment_key(
    model_dir: str | Path, device: str, cache: Cache, calibration: Cache | None, dense_dir: str | Path | None
) -> tuple[str, ...]:
    return (
        str(model_dir),
        device,
        # (an edited family file may load the model another way: the model is loaded again)
        ":".join([file_stamp(weights_path(Path(model_dir))), *map(file_stamp, family_files())]),
        str(cache.path),
        cache.fingerprint,
        str(calibration.path) if calibration else "",
        calibration.fingerprint if calibration else "",
        str(dense_dir or ""),
    )


def experiment(
    model_dir: str | Path, device: str, cache: Cache, calibration: Cache | None, dense_dir: str | Path | None
):
    """The selection as one opened and checked experiment (model, caches, Dense twin loaded when needed)."""
    return _experiment(*_experiment_key(model_dir, device, cache, calibration, dense_dir))


def experiment_ready(
    model_dir: str | Path, device: str, cache: Cache, calibration: Cache | None, dense_dir: str | Path | None
) -> bool:
    """Whether `experiment(...)` is loaded already (in this server process), so a page can show it at
    once instead of loading it; the Replay lab loads it as a run's first step otherwise."""
    return _experiment_key(model_dir, device, cache, calibration, dense_dir) in _opened


_preloading: set[tuple[str, ...]] = set()


def preload_experiment(
    model_dir: str | Path, device: str, cache: Cache, calibration: Cache | None, dense_dir: str | Path | None
) -> None:
    """Start loading `experiment(...)` in a background thread now, once per selection and server process:
    for a page that will need the model (the Replay lab), without waiting for the warm-up's quiet spell.
    A run started meanwhile waits for the same cache entry instead of loading it twice; an error is left
    to the run, which meets it again. Not in the tests (WARM_UP_DELAY_S None)."""
    if WARM_UP_DELAY_S is None:
        return
    key = _experiment_key(model_dir, device, cache, calibration, dense_dir)
    with _warm_guard:
        if key in _opened or key in _preloading:
            return
        _preloading.add(key)

    def load() -> None:
        try:
            _experiment(*key)
        except Exception:  # noqa: BLE001 (see the docstring: the run shows it)
            pass

    thread = threading.Thread(target=load, name=WARM_UP_THREAD, daemon=True)
    thread.start()


def saved_runs(cache_path: str | Path) -> list[dict]:
    """`fca.tables.runs.list_runs`, read again only when a run file or the cache's manifest changes: checking
    a run reads it as the lab's views would (its CIs included), which every rerun of the lab would repeat."""
    folder = runs_dir(cache_path)
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    stamp = "|".join([file_stamp(Path(cache_path) / "manifest.json"), *(f"{f.name}:{file_stamp(f)}" for f in files)])
    return _saved_runs(str(cache_path), stamp)


@st.cache_data(show_spinner=False, max_entries=8)
def _saved_runs(cache_path: str, stamp: str) -> list[dict]:
    return list_runs(cache_path)


@st.cache_data(show_spinner=False, max_entries=16)
def report(path: str, stamp: str) -> AuditReport:
    """An audit report, checked whole (`read_report`): a damaged one is refused here, not halfway down a page."""
    return read_report(path)


@st.cache_data(show_spinner=False, max_entries=4)
def study(path: str, stamp: str) -> dict:
    return load_study(path)


@st.cache_data(show_spinner=False, ttl=2, max_entries=4)
def caches(roots: tuple[str, ...]) -> list[catalog.CacheEntry]:
    """The catalog, re-scanned at most every 2 s (so caches built later appear within a rerun or two)."""
    return catalog.discover_caches(roots)


def cuda_may_be_present() -> bool:
    """Whether a CUDA device may be present, without importing torch to ask (the first page would wait
    for it). Once torch is loaded it is asked; before, a Linux machine without NVIDIA's driver has none.
    While the warm-up thread is importing torch, `sys.modules` already holds the half-made module, which
    has no `torch.cuda` yet (asked then, a page failed with AttributeError): that counts as not loaded."""
    torch = sys.modules.get("torch")
    if torch is not None and not getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return torch.cuda.is_available()
    return not sys.platform.startswith("linux") or Path("/proc/driver/nvidia").exists()


# The warm-up starts this long after a page was sent, so that the browser has the page (and asks for
# plotly.js) first. Its first steps (statistics, a sequence, a band: numpy and Arrow, mostly without the
# GIL) then run while the browser evaluates plotly.js and draws; measured against 3 s, first visits of
# Variance and Profiles went from 0.65-0.68 s to 0.41-0.50 s, and the first chart came no later.
WARM_UP_DELAY_S: float | None = 1.0  # None: no warm-up (the tests, which run many apps in one process)
# Each warm-up step waits until no page has run for this long: a step started while a reader clicks
# through the pages made each of those page switches slow.
WARM_UP_IDLE_S = 1.5
# Loading the model waits for a longer quiet spell: importing torch holds the GIL for about a second,
# and started this early it delayed a new session's first chart (2.5 s -> 3.4 s).
WARM_UP_MODEL_IDLE_S = 3.0
# The model is preloaded only below this size: a larger one (MUDDPythia-1.4B in float32 is ~5.7 GB)
# loads when a page asks for it, not merely because its cache was looked at.
WARM_UP_MAX_MODEL_BYTES = 1 << 30
_warm_started: set[tuple[str, ...]] = set()
_warm_guard = threading.Lock()
WARM_UP_THREAD = "fca-warm-up"


class _WarmUpWithoutContext(logging.Filter):
    """The warm-up fills Streamlit's caches outside any page's run, which is what it is for; Streamlit
    logged two "missing ScriptRunContext" warnings each time it did."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (threading.current_thread().name == WARM_UP_THREAD and "ScriptRunContext" in record.getMessage())


logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").addFilter(_WarmUpWithoutContext())
_last_page_run = [time.monotonic()]


def settle_heap() -> None:
    """Collect, then move every object alive now out of the garbage collector's sight (`gc.freeze`).
    The server's heap (streamlit, plotly, pandas, torch and a model: millions of objects) was traversed
    by every full collection, and page runs set those off: they cost each page switch about 0.2 s
    (measured: 0.45 s -> 0.17 s). Called by the warm-up, and after a model loads, in a server only (the
    tests run many apps in one process, where frozen garbage would pile up)."""
    if WARM_UP_DELAY_S is None:
        return
    gc.collect()
    gc.freeze()


def page_ran() -> None:
    """Called by every script run: the warm-up keeps out of the way while pages are being opened."""
    _last_page_run[0] = time.monotonic()


def _wait_until_idle(idle_s: float = WARM_UP_IDLE_S) -> None:
    while (quiet := time.monotonic() - _last_page_run[0]) < idle_s:
        time.sleep(idle_s - quiet)


def warm_up(
    cache: Cache, model_dir: Path | None, device: str, calibration: Cache | None, dense_dir: Path | None = None
) -> None:
    """Fill, in a background thread, the caches that the other pages will ask for: the statistics of the
    selected cache and of its calibration cache (Variance, Profiles), the first sequence with its decoded
    tokens and the default calibration band (what those pages draw first), the saved runs, and the model (Replay lab,
    Execution; importing torch and loading it is the slowest step of a first visit). Started once per
    selection and server process, a second after a page has been sent (WARM_UP_DELAY_S), each step when
    no page has run for WARM_UP_IDLE_S (the model: WARM_UP_MODEL_IDLE_S). The thread shows nothing: a
    resource that fails here fails again on the page that needs it, which shows the error. Cache keys are
    shared, so a page asking for a value while it is being filled waits for it instead of computing it twice."""
    if WARM_UP_DELAY_S is None:
        return
    key = (str(cache.path), cache.fingerprint, str(model_dir), device, str(calibration.path) if calibration else "")
    with _warm_guard:
        if key in _warm_started:
            return
        _warm_started.add(key)
    reference = calibration or cache  # where the Profiles page takes its profile and band from
    model = str(model_dir) if model_dir else ""

    def first_sequence() -> None:
        ids = sequence(str(cache.path), cache.fingerprint, 0)["token"]
        decode_tokens(model, tuple(int(t) for t in ids))

    steps = [
        lambda: cache_stats(str(cache.path), cache.fingerprint),
        lambda: cache_stats(str(reference.path), reference.fingerprint),
        first_sequence,
        lambda: site_quantiles(str(cache.path), cache.fingerprint),
        lambda: calibration_band(str(reference.path), reference.fingerprint, *DEFAULT_BAND),
        lambda: saved_runs(cache.path),  # the Replay lab's list
    ]
    if calibration is not None:
        steps.append(lambda: profiles(str(calibration.path), calibration.fingerprint))
    loads_model = set()  # the steps that wait for WARM_UP_MODEL_IDLE_S
    if model_dir is not None:

        def small_model() -> None:
            if model_bytes(model_dir) <= WARM_UP_MAX_MODEL_BYTES:
                experiment(model_dir, device, cache, calibration, dense_dir)

        steps.append(small_model)
        loads_model.add(small_model)

    def fill() -> None:
        # Normal priority: a page that needs a value this thread is filling waits for it, and at the
        # lowest priority (tried) this thread then lost the CPU to the browser and made that page slower.
        settle_heap()  # what the first pages imported (streamlit, plotly, pandas)
        for step in steps:
            _wait_until_idle(WARM_UP_MODEL_IDLE_S if step in loads_model else WARM_UP_IDLE_S)
            try:
                step()
            except Exception:  # noqa: BLE001 (see the docstring: the page shows it)
                pass
        settle_heap()

    timer = threading.Timer(WARM_UP_DELAY_S, fill)
    timer.name, timer.daemon = WARM_UP_THREAD, True
    timer.start()
