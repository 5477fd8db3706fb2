"""Saved replay runs, as records: where they live, how they are named, tabulated and re-run.

Runs live in `<cache>.runs/<created>-<spec hash>.json`, never inside the cache itself, so a cache's
contents and hashes never change. Torch-free (the dashboard draws the Replay lab's form and saved runs
with it); the replay itself is `fca.jobs.runs.run_replay`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from fca.tables import audit_report as field
from fca.tables.conditions import Condition, parse_condition
from fca.tables.errors import CacheError
from fca.tables.jsonfile import read_json_object
from fca.tables.manifest import read_manifest
from fca.tables.outputs import atomic_write_text, strict_json
from fca.tables.report import DAMAGED_FIELD_ERRORS
from fca.tables.scoring import BOOTSTRAP_RESAMPLES, gap_retention
from fca.tables.stats import paired_bootstrap_ci


def runs_dir(cache_dir: str | Path) -> Path:
    cache_dir = Path(cache_dir)
    return cache_dir.with_name(cache_dir.name + ".runs")


def runs_writable(cache_dir: str | Path) -> bool:
    """Whether runs of this cache can be saved: its runs folder, or the folder it would be made in, is
    writable (a cache on a read-only mount, or copied read-only, is replayed without saving)."""
    folder = runs_dir(cache_dir)
    if folder.exists():  # (a file of that name is writable, and no folder can be made there)
        return folder.is_dir() and os.access(folder, os.W_OK)
    return os.access(folder.parent, os.W_OK)


def check_runs_writable(cache_dir: str | Path) -> None:
    """OSError with what to do unless runs of this cache can be saved: checked before a replay, so that
    minutes of it are not lost to a failed save."""
    folder = runs_dir(cache_dir)
    if folder.exists() and not folder.is_dir():
        raise OSError(f"{folder}: a file, where the cache's runs folder belongs; move it, or replay with --no-save")
    if not runs_writable(cache_dir):
        raise OSError(
            f"{folder if folder.exists() else folder.parent}: not writable, so the run could not be saved beside "
            "the cache; replay with --no-save, or copy the cache somewhere writable"
        )


def save_run(cache_dir: str | Path, record: dict) -> Path:
    folder = runs_dir(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(json.dumps(record["spec"], sort_keys=True).encode()).hexdigest()[:10]
    path = folder / f"{record['created'].replace(':', '').replace('-', '')}-{digest}.json"
    return atomic_write_text(path, strict_json({k: v for k, v in record.items() if k != "path"}))


def list_runs(cache_dir: str | Path) -> list[dict]:
    """Saved runs of a cache, newest first by their creation time (to the millisecond; records of earlier
    versions, to the second, sort as at its start); files that are not readable run records are skipped,
    and so are runs of other contents than the cache's now (its runs folder outlives a cache replaced by
    `build-cache --overwrite`: those runs' figures are the old cache's). They stay on disk, unlisted."""
    contents = _contents_fingerprint(cache_dir)
    runs = []
    for path in sorted(runs_dir(cache_dir).glob("*.json"), reverse=True):
        record = read_json_object(path)  # (None, which is no run record, where it cannot be read)
        if is_run_record(record) and _of_contents(record, contents):
            runs.append({**record, "path": str(path)})
    return sorted(runs, key=lambda r: _created_at(r.get("created", "")), reverse=True)  # (stable: name breaks ties)


def _contents_fingerprint(cache_dir: str | Path) -> str | None:
    """The cache's contents fingerprint (what a run's `spec.cache_fingerprint` records), or None where no
    readable manifest says it: every run is then listed, as none can be told to be another cache's."""
    try:
        return read_manifest(cache_dir).contents_fingerprint
    except (OSError, CacheError):
        return None


def _of_contents(record: dict, contents: str | None) -> bool:
    """Whether a run may be of the cache whose contents fingerprint is `contents`: it records these contents,
    or either side is unknown (a run saved without its cache's fingerprint, a cache without a manifest)."""
    recorded = record["spec"].get("cache_fingerprint")
    return contents is None or recorded is None or recorded == contents


def _created_at(created: str) -> datetime:
    try:
        at = datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:  # not a time: listed last
        return datetime.min.replace(tzinfo=timezone.utc)
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)  # (ours are UTC)


def is_run_record(record: object) -> bool:
    """Whether `record` has what the run views read: its spec (conditions, sizes) and, for each condition,
    a numeric NLL and penalty with a two-sided CI (null ends allowed: a run of too few sequences has none)."""
    try:  # (a field missing or of another kind is a WrongField, one of DAMAGED_FIELD_ERRORS)
        spec = field.obj(field.obj(record, "record").get("spec"), "spec")
        results = field.obj(record.get("results"), "results")
        field.listing(field.text)(spec.get("conditions"), "spec.conditions")
        field.number(spec.get("num_seqs"), "spec.num_seqs")
        if field.whole(spec.get("seed"), "spec.seed") < 0:
            return False
        for name, row in field.mapping(field.obj)(results.get("conditions"), "results.conditions").items():
            field.number(row.get("nll"), name)
            field.number(row.get("penalty"), name)
            field.interval(row.get("penalty_ci95"), name)
        field.mapping(field.listing(field.number))(results.get("per_sequence_nll", {}), "results.per_sequence_nll")
        field.text(record.get("created", ""), "created")
        # What the run views read of it, read once here; without its per-sequence values (checked above), whose
        # bootstrap intervals are the costly part of a row and are the views' to compute.
        saved_run_rows([{**record, "results": {**results, "per_sequence_nll": {}}}])
    except DAMAGED_FIELD_ERRORS:
        return False
    return True


# ------------------------------------------------------------------ runs as people read them
# Torch-free helpers over run records (and the settings given to `run_replay`), shared by the Replay
# lab and anyone listing runs: a run is named by what it ran, and tables use plain column names.

SWEEP_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)  # 0 = static profile, 1 = each token's own coefficients


def sweep_conditions(sites: Sequence[str] | None = None, seed: int = 0) -> list[Condition]:
    """`interpolate:alpha` at every SWEEP_ALPHAS (freezing only `sites`, or all when None): one run."""
    return [Condition("interpolate", a, tuple(sites) if sites else None, seed=seed) for a in SWEEP_ALPHAS]


def run_label(spec: dict, show: Callable[[str], str] = str) -> str:
    """What a run ran, e.g. "static_layer + global_mean, n=16, seed 3". Correct always runs and is left
    out unless it ran alone; interpolations of the same sites are listed as one sweep of alphas. `show`
    formats each condition (Markdown: `fca.tables.report.condition_cell`, else `x@y.z` reads as an e-mail)."""
    names = [c for c in spec.get("conditions", []) if c != "correct"] or ["correct"]
    parts: list[str] = []
    sweeps: dict[str, list[str]] = {}  # interpolations at the same sites -> their alphas
    for name in names:
        try:
            c = parse_condition(name)
        except ValueError:  # a record written by another version: show its text as it is
            parts.append(name)
            continue
        if c.kind != "interpolate":
            parts.append(name)
            continue
        key = "" if c.sites is None else "@" + ",".join(c.sites)
        if key not in sweeps:
            sweeps[key] = []
            parts.append(f"\0{key}")  # placeholder: keeps the sweep where its first alpha was
        sweeps[key].append(f"{c.alpha:g}")
    text = " + ".join(show(f"interpolate:{','.join(sweeps[p[1:]])}{p[1:]}" if p.startswith("\0") else p) for p in parts)
    return f"{text}, n={spec.get('num_seqs', '?')}, seed {spec.get('seed', '?')}"


def run_labels(records: Sequence[dict]) -> list[str]:
    """`run_label` of each record; runs of the same settings are told apart by their creation time."""
    labels = [run_label(r.get("spec", {})) for r in records]
    repeated = {x for x in labels if labels.count(x) > 1}
    labels = [f"{x} ({r.get('created', '')[11:19]})" if x in repeated else x for x, r in zip(labels, records)]
    seen: dict[str, int] = {}
    for i, x in enumerate(labels):  # same settings in the same second: number them
        seen[x] = seen.get(x, 0) + 1
        labels[i] = x if seen[x] == 1 else f"{x} #{seen[x]}"
    return labels


def _bound(value: float | None) -> float:
    """A saved CI bound as a number: null (too few sequences have no interval) is NaN, so columns stay numeric."""
    return float("nan") if value is None else float(value)


def condition_rows(record: dict) -> list[dict]:
    """One row per condition of a run, in plain words: mean NLL with the 95% bootstrap CI of the mean over
    sequences, the penalty vs correct with its 95% paired bootstrap CI (the same resampling as the
    audit's, `fca.tables.scoring`), when global_mean ran each condition's gap retention, and for a model
    with routers its routing agreement (`fca.tables.scoring.summarize_routing`). A bound
    that too few sequences cannot give (`MIN_BOOTSTRAP_VALUES`) is NaN, never a zero-width interval."""
    per_seq = record["results"].get("per_sequence_nll", {})
    seed = int(record.get("spec", {}).get("seed", 0))
    retention = gap_retention(record["results"]["conditions"])  # {} unless global_mean ran
    routing = (record["results"].get("routing") or {}).get("conditions", {})  # {} unless the model routes
    rows = []
    for name, row in record["results"]["conditions"].items():
        values = np.asarray(per_seq.get(name, []), dtype=np.float64)
        lo, hi = paired_bootstrap_ci(values, BOOTSTRAP_RESAMPLES, seed)  # NaN from too few sequences: no interval
        rows.append(
            {
                "condition": name,
                "NLL (nats/token)": row["nll"],
                "NLL 95% CI low": lo,
                "NLL 95% CI high": hi,
                "penalty (nats/token)": row["penalty"],
                "penalty 95% CI low": _bound(row["penalty_ci95"][0]),
                "penalty 95% CI high": _bound(row["penalty_ci95"][1]),
                # resampling whole documents, where the cache records them (`summarize_conditions`)
                **(
                    {
                        "penalty 95% CI low (documents)": _bound(row["penalty_ci95_documents"][0]),
                        "penalty 95% CI high (documents)": _bound(row["penalty_ci95_documents"][1]),
                    }
                    if "penalty_ci95_documents" in row
                    else {}
                ),
                **({"gap retention": retention.get(name)} if retention else {}),
                **(
                    {"gap retention 95% CI low": interval[0], "gap retention 95% CI high": interval[1]}
                    if (interval := (record["results"].get("gap_retention_ci95") or {}).get(name))
                    else {}
                ),
                **(
                    {
                        "same experts": routing[name]["same_experts"],
                        "experts kept": routing[name]["expert_overlap"],
                        "weight kept": routing[name].get("weight_kept"),  # (runs saved before it: none)
                    }
                    if name in routing
                    else {}
                ),
            }
        )
    return rows


def saved_run_rows(records: Sequence[dict], labels: Sequence[str] | None = None) -> list[dict]:
    """Rows of `saved_runs.csv`: one per (run, condition), each with the run's name and settings."""
    labels = run_labels(records) if labels is None else labels
    rows = []
    for label, r in zip(labels, records):
        spec = r.get("spec", {})
        settings = {
            "run": label,
            "created": r.get("created"),
            "sequences": spec.get("num_seqs"),
            "seed": spec.get("seed"),
            "batch size": spec.get("batch_size"),
            "device": r.get("device"),
        }
        rows += [{**settings, **row} for row in condition_rows(r)]
    return rows


def sweep_points(conditions: dict) -> list[dict]:
    """The interpolation sweep in a run's `results.conditions` {spec: row}: the `interpolate:alpha` rows of
    the sites most of them share, each with its alpha, by alpha; [] when the run has none."""
    by_sites: dict[tuple[str, ...] | None, list[dict]] = {}
    for name, row in conditions.items():
        try:
            condition = parse_condition(name)
        except ValueError:
            continue
        if condition.kind == "interpolate":
            by_sites.setdefault(condition.sites, []).append({**row, "alpha": condition.alpha})
    return sorted(max(by_sites.values(), key=len, default=[]), key=lambda row: row["alpha"])


def replay_command(settings: dict, relative_to: str | Path | None = None, one_option_per_line: bool = False) -> str:
    """The `python -m fca replay` command for `run_replay`'s keyword arguments (`settings`: model,
    cache, calibration, conditions, num_seqs, seed, batch_size, device); paths are shown relative to
    `relative_to` when they lie inside it. `one_option_per_line`: continued lines (`\\`), every option on
    its own, the first too, for a narrow screen, where a wrapped line broke inside the options' names."""

    def rel(p: str | Path) -> str:
        if relative_to is not None:
            try:
                return str(Path(p).resolve().relative_to(Path(relative_to).resolve()))
            except ValueError:
                pass
        return str(p)

    conditions = [c if isinstance(c, str) else c.spec for c in settings["conditions"]]
    conditions = list(dict.fromkeys(["correct", *conditions]))
    parts = [
        *(f"--{key} {shlex.quote(rel(settings[key]))}" for key in ("model", "cache", "calibration")),
        "--conditions " + " ".join(shlex.quote(s) for s in conditions),
        f"--num-seqs {settings['num_seqs']}",
        f"--seed {settings['seed']}",
        f"--batch {settings['batch_size']}",
        f"--device {settings.get('device', 'auto')}",
        *([] if settings.get("save", True) else ["--no-save"]),
    ]
    if one_option_per_line:
        return "python -m fca replay \\\n    " + " \\\n    ".join(parts)
    return "python -m fca replay " + " ".join(parts)
