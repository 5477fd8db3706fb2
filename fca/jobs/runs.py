"""Saved replay runs: a condition spec and its results, written beside the cache they replayed.

Runs live in `<cache>.runs/<created>-<spec hash>.json`, never inside the cache itself, so a cache's
contents and hashes never change. The CLI (`python -m fca replay`) and the dashboard's Replay lab both
call `run_replay`, so the same settings give the same numbers from either.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from fca.jobs.audit import summarize_conditions
from fca.tables.conditions import parse_condition
from fca.tables.environment import model_dtype_name
from fca.engine.loading import fingerprint_state, load_model
from fca.tables.profiles import Profiles, calibration_profiles
from fca.engine.replay import check_exactness, run_conditions
from fca.tables.store import open_cache


def runs_dir(cache_dir: str | Path) -> Path:
    cache_dir = Path(cache_dir)
    return cache_dir.with_name(cache_dir.name + ".runs")


def run_replay(
    model_dir: str | Path,
    cache_dir: str | Path,
    calibration_dir: str | Path,
    conditions: Sequence[str],
    num_seqs: int = 32,
    seed: int = 0,
    device: str = "auto",
    batch_size: int = 16,
    save: bool = True,
    model: nn.Module | None = None,
    profiles: Profiles | None = None,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    show_progress: bool = False,
) -> dict:
    """Replay `conditions` (spec strings, `correct` added if missing) on the first `num_seqs` sequences."""
    specs = list(dict.fromkeys(["correct", *conditions]))
    parsed = [parse_condition(c, seed) for c in specs]
    model = load_model(model_dir, device=device) if model is None else model
    evaluated, calibration = open_cache(cache_dir), open_cache(calibration_dir)
    fingerprint = fingerprint_state(model)
    dtype = model_dtype_name(model)
    evaluated.check_model(fingerprint, dtype)
    calibration.check_model(fingerprint, dtype)
    if profiles is None and any(c.needs_profiles for c in parsed):
        profiles = calibration_profiles(calibration)
    seqs = list(range(min(num_seqs, evaluated.num_seqs)))
    bar = None
    if show_progress and progress is None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seqs), desc="replay", unit="seq")
        progress = lambda done, total: bar.update(done - bar.n)  # noqa: E731
    try:
        results = run_conditions(model, evaluated, parsed, profiles, seqs=seqs, batch_size=batch_size, cross_seed=seed,
                                 progress=progress, should_stop=should_stop)
    finally:
        if bar is not None:
            bar.close()
    spec = {"model": Path(model_dir).name, "model_fingerprint": fingerprint, "cache": evaluated.path.name, "cache_fingerprint": evaluated.fingerprint,
            "calibration": calibration.path.name, "conditions": specs, "num_seqs": len(seqs), "seed": seed, "batch_size": batch_size}
    record = {
        "spec": spec,
        "results": {"exactness": check_exactness(results), "conditions": summarize_conditions(results, seed),
                    "per_sequence_nll": {k: v.tolist() for k, v in results.per_seq_nll.items()}},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": str(next(model.parameters()).device),
    }
    if save:
        record["path"] = str(save_run(cache_dir, record))
    return record


def save_run(cache_dir: str | Path, record: dict) -> Path:
    folder = runs_dir(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(json.dumps(record["spec"], sort_keys=True).encode()).hexdigest()[:10]
    path = folder / f"{record['created'].replace(':', '').replace('-', '')}-{digest}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: v for k, v in record.items() if k != "path"}, indent=1))
    tmp.replace(path)
    return path


def list_runs(cache_dir: str | Path) -> list[dict]:
    """Saved runs of a cache, newest first; unreadable files are skipped."""
    runs = []
    for path in sorted(runs_dir(cache_dir).glob("*.json"), reverse=True):
        try:
            runs.append({**json.loads(path.read_text()), "path": str(path)})
        except (OSError, json.JSONDecodeError):
            continue
    return runs
