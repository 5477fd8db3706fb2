"""Where things are: caches under configured roots, and the model, calibration cache, Dense twin and
audit report that belong to each. Only manifests and config files are read (never part files), so a
fresh scan is cheap enough to run on every interaction and caches built later simply appear.

Layout convention (README, "Cache layout"): a cache's manifest names its model by directory name
(`Manifest.model.path`) and weights fingerprint; model directories sit beside their caches,
and the audit report `audit.json` sits beside the caches it describes:

    cache/demo/featuregate/   model (config.json, weights, tokenizer.json)
    cache/demo/dense/         its Dense twin
    cache/demo/eval/          evaluated cache (manifest.json + part-*.parquet)
    cache/demo/calibration/   calibration cache
    cache/demo/audit.json     the audit report of eval against calibration
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fca.tables.errors import CacheError
from fca.tables.jsonfile import MAX_JSON_BYTES, parse_json, read_json_object
from fca.tables.manifest import Manifest, read_manifest
from fca.tables.schema import MANIFEST

REPORT = "audit.json"
# A model directory's weights files, in the order a load tries them (`weights_path` names the one read).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
ROOTS_ENV = "FCA_CACHE_ROOTS"


@dataclass(frozen=True)
class DenseTwin:
    """How a family's Dense twin differs from the dynamic model, in its config: `switch` (and every key
    in `also_off`) set to false. The same sizes otherwise (see `is_dense_twin`)."""

    switch: str
    also_off: tuple[str, ...] = ()

    def config(self, config: dict) -> dict:
        """The twin's config dict of a dynamic model's config dict."""
        return {**config, **{key: False for key in (self.switch, *self.also_off)}}


# model_type -> its Dense twin, per family. Kept here, free of torch, so the dashboard finds twins
# without importing the models; `fca.engine.families` reads the built-in entries from this table and
# adds those of families registered later, so there is one source. FeatureGate's switch is `gated`,
# MUDDPythia's `dense` (the public config's own switch; its twin also drops `dynamic_dense`), mixture of
# depths' `routed`.
DENSE_TWINS: dict[str, DenseTwin] = {
    "featuregate": DenseTwin("gated"),
    "muddpythia": DenseTwin("dense", ("dynamic_dense",)),
    "mixture_of_depths": DenseTwin("routed"),
}
# Integer config keys that say nothing about a model's size (seeds, controller internals), ignored
# when checking that a Dense twin has the same sizes.
_NOT_SIZES = ("seed", "controller", "dense", "gate", "expert", "router", "mlp_groups")  # (gate granularity)


@dataclass(frozen=True)
class CacheEntry:
    """One cache found under a root; `error` is set (and the rest may be empty) when its manifest
    cannot be read, so the catalog can list a broken cache with the reason instead of hiding it."""

    path: Path
    label: str  # path relative to its root, e.g. "demo/eval"
    split: str | None = None
    split_seed: int | None = None
    corpus_fingerprint: str | None = None
    model_name: str | None = None
    model_fingerprint: str | None = None
    num_seqs: int = 0
    seq_len: int = 0
    num_sites: int = 0
    manifest_hash: str = ""  # sha256 of manifest.json: changes whenever the cache is rebuilt
    error: str | None = None


def user_path(text: str | Path) -> Path:
    """A path as a person typed or configured it: `~` expanded where it names a user (`~nobody/x`, with no
    such user, stays as typed: a folder that is not there, not a RuntimeError), then resolved."""
    path = Path(text)
    try:
        path = path.expanduser()
    except RuntimeError:
        pass
    return path.resolve()


def is_folder(path: Path) -> bool:
    """`path.is_dir()`, False also for a path the system cannot look up (a name too long, a NUL byte)."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def configured_roots(repo_root: str | Path, environ: dict | None = None) -> list[Path]:
    """`<repo>/cache` plus every directory in `FCA_CACHE_ROOTS` (os.pathsep-separated)."""
    environ = os.environ if environ is None else environ
    roots = [Path(repo_root) / "cache"]
    roots += [Path(p) for p in environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    return list(dict.fromkeys(user_path(root) for root in roots))  # (each once, in order)


def read_entry(cache_dir: str | Path, root: str | Path | None = None) -> CacheEntry:
    """A catalog entry from one cache directory's manifest (nothing else is read)."""
    cache_dir = Path(cache_dir)
    label = str(cache_dir.relative_to(root)) if root is not None and cache_dir.is_relative_to(root) else str(cache_dir)
    try:
        raw = (cache_dir / MANIFEST).read_bytes()
        if len(raw) > MAX_JSON_BYTES:
            raise CacheError(f"larger than {MAX_JSON_BYTES:,} bytes")
        manifest = Manifest.from_json(parse_json(raw, str(cache_dir / MANIFEST), CacheError), str(cache_dir / MANIFEST))
        return CacheEntry(
            path=cache_dir,
            label=label,
            split=manifest.corpus.split,
            split_seed=manifest.corpus.split_seed,
            corpus_fingerprint=manifest.corpus.fingerprint,
            model_name=manifest.model.path,
            model_fingerprint=manifest.model.fingerprint or None,
            num_seqs=manifest.num_seqs,
            seq_len=manifest.seq_len,
            num_sites=len(manifest.sites),
            manifest_hash=hashlib.sha256(raw).hexdigest(),
        )
    except (OSError, ValueError, CacheError) as err:
        said = str(err).removeprefix(f"{cache_dir / MANIFEST}: ")  # (a CacheError names the file already)
        return CacheEntry(
            path=cache_dir, label=label, error=f"{cache_dir / MANIFEST}: not a readable manifest ({said})"
        )


def discover_caches(roots: Iterable[str | Path]) -> list[CacheEntry]:
    """Every directory holding a manifest.json under `roots`, sorted by label. Unfinished builds
    (`*.partial`) and saved-run folders (`*.runs`) are skipped."""
    entries: dict[Path, CacheEntry] = {}
    for root in roots:
        root = Path(root).resolve()
        if not is_folder(root):
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            # Prune hidden folders, unfinished builds and saved runs; nothing below them is a cache.
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not d.endswith((".partial", ".runs")))
            if MANIFEST in filenames:
                path = Path(dirpath)
                entries.setdefault(path, read_entry(path, root))
                dirnames[:] = []  # a cache holds part files, not further caches
    return sorted(entries.values(), key=lambda e: e.label)


def path_allowed(path: str | Path, roots: Iterable[str | Path]) -> bool:
    """True when `path` (after resolving `..` and symbolic links) lies inside one of `roots`."""
    resolved = user_path(path)
    return any(resolved.is_relative_to(user_path(root)) for root in roots)


def weights_path(model_dir: Path) -> Path:
    """The file a model directory's weights are read from (for the sharded form, the index)."""
    for name in WEIGHT_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    return model_dir


def find_model_dir(cache_path: str | Path) -> Path | None:
    """The model directory the cache's manifest names, looked up beside the cache; None if absent."""
    try:
        name = read_manifest(cache_path).model.path
    except CacheError:  # (also a manifest that is missing or not JSON)
        return None
    if not name:
        return None
    candidate = Path(cache_path).parent / Path(name).name
    return candidate if (candidate / "config.json").is_file() else None


def model_dirs_beside(cache_path: str | Path) -> list[Path]:
    """Every model directory (a folder with config.json) beside the cache, for a manual choice."""
    parent = Path(cache_path).parent
    return sorted(p for p in parent.iterdir() if (p / "config.json").is_file()) if parent.is_dir() else []


def find_calibration(entry: CacheEntry, entries: Sequence[CacheEntry]) -> CacheEntry | None:
    """The calibration cache of the same model (fingerprint) from a different split than `entry`'s, and
    not of the same corpus drawn with another split seed (its documents overlap: `check_independent`);
    one in the same folder is preferred. None when there is none."""
    candidates = [
        e
        for e in entries
        if e.error is None
        and e.path != entry.path
        and e.split == "calibration"
        and e.split != entry.split
        and e.model_fingerprint is not None
        and e.model_fingerprint == entry.model_fingerprint
        and not (
            e.corpus_fingerprint is not None
            and e.corpus_fingerprint == entry.corpus_fingerprint
            and e.split_seed != entry.split_seed
        )
    ]
    candidates.sort(key=lambda e: (e.path.parent != entry.path.parent, e.label))
    return candidates[0] if candidates else None


def _sizes(config: dict) -> dict:
    return {
        k: v
        for k, v in config.items()
        if isinstance(v, int) and not isinstance(v, bool) and not any(w in k for w in _NOT_SIZES)
    }


def is_dense_twin(config: dict, dense_config: dict) -> bool:
    """Same family and sizes, with the family's dynamic switch (`DENSE_TWINS`) off in `dense_config` and on
    in `config`. A family without a Dense twin has none."""
    twin = DENSE_TWINS.get(config.get("model_type"))
    if twin is None or config.get("model_type") != dense_config.get("model_type"):
        return False
    switched = dense_config.get(twin.switch) is False and config.get(twin.switch, True) is not False
    return switched and _sizes(config) == _sizes(dense_config)


def find_dense_twin(model_dir: str | Path) -> Path | None:
    """A sibling model directory that is the Dense twin of `model_dir` (see `is_dense_twin`)."""
    model_dir = Path(model_dir)
    config = read_json_object(model_dir / "config.json")
    if config is None or not model_dir.parent.is_dir():
        return None
    for sibling in sorted(model_dir.parent.iterdir()):
        if sibling == model_dir:
            continue
        other = read_json_object(sibling / "config.json")
        if other is not None and is_dense_twin(config, other):
            return sibling
    return None


def find_report(cache_path: str | Path) -> Path | None:
    """The audit report beside the cache that describes a cache of this directory name: `audit.json`,
    else one of the `audit-<name>[-n].json` that `free_report_path` suggests. Whether its fingerprints
    still match the cache is for the caller to show (a stale report is worth seeing)."""
    cache_path = Path(cache_path)
    folder, name = cache_path.parent, cache_path.name
    candidates = [folder / REPORT, folder / f"audit-{name}.json"]
    candidates += sorted(folder.glob(f"audit-{glob.escape(name)}-*.json"), key=_report_number)
    damaged = None
    for path in candidates:
        report = read_json_object(path)
        if report is None:
            if damaged is None and path.is_file():
                damaged = path
            continue
        section = report.get("cache")
        described = section.get("path") if isinstance(section, dict) else None
        if not isinstance(described, str) or Path(described).name == name:  # (a damaged one: said when read)
            return path
    # A report-named file that cannot be read (cut short, say) is shown when no other is found, so the page
    # says why it cannot be read; it had been passed over, as if there were no report.
    return damaged


def _report_number(path: Path) -> int:
    """n of `audit-<name>-n.json` (0 when the tail is not a number), so -10 sorts after -9."""
    tail = path.stem.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def free_report_path(folder: Path, name: str) -> Path:
    """Where an audit of the cache `folder/name` should write its report: `audit.json` unless a file is
    there (a shipped report, or another cache's), then the first free `audit-<name>[-n].json`; so a
    suggested command never overwrites a report, and `find_report` finds what it writes."""
    path = folder / REPORT
    n = 1
    while path.exists():
        path = folder / (f"audit-{name}.json" if n == 1 else f"audit-{name}-{n}.json")
        n += 1
    return path
