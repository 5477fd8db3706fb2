"""The coefficient cache on disk: Parquet schema, atomic resumable writer, manifest, streaming reader.

Layout of one cache directory (see DESIGN.md):
    manifest.json       what the cache is: model and tokenizer fingerprints, split, sites, part hashes
    part-00000.parquet  one row per (sequence, position); one FixedSizeList<float32>[K_s] column per site

A build writes into `<name>.partial/` next to the destination; complete parts are renamed from
`*.tmp` and listed in `progress.json`, so an interrupted build can resume. Only the final step writes
`manifest.json` and renames the directory into place: a directory with a manifest is a finished cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import CacheError
from .spec import SiteSpec

SCHEMA_VERSION = 1
KEY_COLUMNS = ("seq", "pos", "token", "target", "live_nll")
MANIFEST = "manifest.json"
PROGRESS = "progress.json"


def cache_schema(specs: dict[str, SiteSpec], coefficient_type: pa.DataType = pa.float32()) -> pa.Schema:
    fields = [
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("token", pa.int32(), nullable=False),
        pa.field("target", pa.int32(), nullable=False),
        pa.field("live_nll", pa.float32(), nullable=False),
    ]
    fields += [pa.field(name, pa.list_(coefficient_type, spec.num_channels), nullable=False) for name, spec in specs.items()]
    return pa.schema(fields)


COEFFICIENT_DTYPES = {"float32": pa.float32(), "float16": pa.float16()}


def coefficient_arrow_type(name: str) -> pa.DataType:
    if name not in COEFFICIENT_DTYPES:
        raise CacheError(f"coefficient dtype {name!r} is not supported (choose {', '.join(COEFFICIENT_DTYPES)})")
    return COEFFICIENT_DTYPES[name]


def spec_to_json(spec: SiteSpec) -> dict:
    out = {"shape": [spec.num_channels], "axes": [[a, n] for a, n in spec.axes], "family": spec.family, "dtype": "float32"}
    for key in ("channel_labels", "channel_families"):
        if getattr(spec, key) is not None:
            out[key] = list(getattr(spec, key))
    if spec.coefficient:
        out["coefficient"] = spec.coefficient
    return out


def spec_from_json(d: dict) -> SiteSpec:
    return SiteSpec(
        axes=tuple((a, int(n)) for a, n in d["axes"]),
        family=d["family"],
        channel_labels=tuple(d["channel_labels"]) if d.get("channel_labels") is not None else None,
        channel_families=tuple(d["channel_families"]) if d.get("channel_families") is not None else None,
        coefficient=d.get("coefficient", ""),
    )


def cache_plan(specs: dict[str, SiteSpec], seq_len: int, num_seqs: int, model: dict, corpus: dict,
               coefficient_dtype: str = "float32", **extra) -> dict:
    """The manifest draft of a cache (everything but the part list and creation time)."""
    return {"schema_version": SCHEMA_VERSION, "model": model, "corpus": corpus, "seq_len": seq_len, "num_seqs": num_seqs,
            "num_tokens": num_seqs * seq_len, "coefficient_dtype": coefficient_dtype,
            "sites": {name: spec_to_json(spec) for name, spec in specs.items()}, **extra}


def record_batch(
    schema: pa.Schema, seq: np.ndarray, tokens: np.ndarray, targets: np.ndarray, live_nll: np.ndarray, coefficients: dict[str, np.ndarray]
) -> pa.RecordBatch:
    """Columns straight from numpy. seq: [n]; tokens, targets, live_nll: [n, T]; coefficients: site -> [n, T, K]."""
    n, T = tokens.shape
    columns = [
        pa.array(np.repeat(seq.astype(np.int32), T)),
        pa.array(np.tile(np.arange(T, dtype=np.int32), n)),
        pa.array(tokens.reshape(-1).astype(np.int32)),
        pa.array(targets.reshape(-1).astype(np.int32)),
        pa.array(live_nll.reshape(-1).astype(np.float32)),
    ]
    for field in schema:
        if field.name in KEY_COLUMNS:
            continue
        values = coefficients[field.name]
        K = field.type.list_size
        if values.shape != (n, T, K):
            raise CacheError(f"site {field.name}: coefficients of shape {values.shape}, expected {(n, T, K)}")
        flat = pa.array(np.ascontiguousarray(values, dtype=field.type.value_type.to_pandas_dtype()).reshape(-1))
        columns.append(pa.FixedSizeListArray.from_arrays(flat, K))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class CacheWriter:
    """Writes a cache into `<out>.partial/`, part by part; `finish()` renames it into place.

    `plan` is the manifest draft (everything but the part list). If a `.partial` directory with the
    same plan exists, the writer resumes after its last complete part (`done_seqs`).
    """

    def __init__(self, out: str | Path, plan: dict, schema: pa.Schema, seqs_per_part: int, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.schema = schema
        self.plan = plan
        self.seqs_per_part = seqs_per_part
        if self.out.exists():
            if not overwrite:
                raise CacheError(f"{self.out}: already exists (pass --overwrite to replace it)")
        progress_path = self.partial / PROGRESS
        self.parts: list[dict] = []
        if progress_path.is_file():
            progress = json.loads(progress_path.read_text())
            if progress.get("plan") == plan:
                self.parts = progress["parts"]
            else:
                shutil.rmtree(self.partial)
        elif self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True, exist_ok=True)
        for stale in self.partial.glob("*.tmp"):
            stale.unlink()
        self._writer: pq.ParquetWriter | None = None
        self._current: dict | None = None

    @property
    def done_seqs(self) -> int:
        return sum(p["num_seqs"] for p in self.parts)

    def _open_part(self) -> None:
        name = f"part-{len(self.parts):05d}.parquet"
        self._current = {"file": name, "num_seqs": 0, "rows": 0}
        self._writer = pq.ParquetWriter(
            self.partial / (name + ".tmp"), self.schema, compression="zstd", compression_level=3,
            use_dictionary=False, use_byte_stream_split=[f.name for f in self.schema if f.name not in ("seq", "pos", "token", "target")],
            write_statistics=["seq"],
        )

    def _close_part(self) -> None:
        self._writer.close()
        tmp = self.partial / (self._current["file"] + ".tmp")
        final = self.partial / self._current["file"]
        os.replace(tmp, final)
        self._current["sha256"] = file_sha256(final)
        self._current["bytes"] = final.stat().st_size
        self.parts.append(self._current)
        self._writer, self._current = None, None
        _write_json_atomic(self.partial / PROGRESS, {"plan": self.plan, "parts": self.parts})

    def write(self, batch: pa.RecordBatch, num_seqs: int) -> None:
        """Append whole sequences as one row group; a part closes after `seqs_per_part` sequences."""
        if self._writer is None:
            self._open_part()
        self._writer.write_batch(batch)
        self._current["num_seqs"] += num_seqs
        self._current["rows"] += batch.num_rows
        if self._current["num_seqs"] >= self.seqs_per_part:
            self._close_part()

    def finish(self, extra: dict | None = None) -> Path:
        if self._writer is not None:
            self._close_part()
        manifest = {**self.plan, **(extra or {}), "parts": self.parts}
        (self.partial / PROGRESS).unlink(missing_ok=True)
        _write_json_atomic(self.partial / MANIFEST, manifest)
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.partial, self.out)
        return self.out

    def abort(self) -> None:
        """Close an open part without marking it complete (the partial directory stays resumable)."""
        if self._writer is not None:
            self._writer.close()
            (self.partial / (self._current["file"] + ".tmp")).unlink(missing_ok=True)
            self._writer, self._current = None, None


@dataclass
class Cache:
    """A finished cache opened for reading. Nothing but the manifest and part footers is read here."""

    path: Path
    manifest: dict

    @property
    def site_specs(self) -> dict[str, SiteSpec]:
        return {name: spec_from_json(d) for name, d in self.manifest["sites"].items()}

    @property
    def sites(self) -> list[str]:
        return list(self.manifest["sites"])

    @property
    def num_seqs(self) -> int:
        return int(self.manifest["num_seqs"])

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def fingerprint(self) -> str:
        """Identity of the cache contents: the hash of its part hashes."""
        return hashlib.sha256("".join(p["sha256"] for p in self.manifest["parts"]).encode()).hexdigest()

    def part_paths(self) -> list[Path]:
        return [self.path / p["file"] for p in self.manifest["parts"]]

    def dataset(self):
        """A pyarrow Dataset over the part files. pyarrow.dataset is imported here, not with this
        module: it pulls in pandas (~0.25 s), which opening a cache and reading its footers never need
        and which would delay the dashboard's first page."""
        import pyarrow.dataset as ds

        return ds.dataset([str(p) for p in self.part_paths()], format="parquet")

    def iter_batches(self, columns: Sequence[str] | None = None, batch_size: int = 65536) -> Iterator[pa.RecordBatch]:
        """Stream record batches (one part file, one row group at a time); memory stays bounded."""
        for path in self.part_paths():
            try:
                yield from pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=list(columns) if columns else None)
            except (pa.ArrowInvalid, OSError) as err:
                raise CacheError(f"{path}: unreadable part file ({str(err).splitlines()[0]})") from None

    def read_seqs(self, seqs: Sequence[int], sites: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Tokens, targets, live NLL ([n, T]) and coefficients ([n, T, K_s]) of the given sequences, in the
        order given. Only the row groups holding them are read."""
        seqs = [int(s) for s in seqs]
        bad = [s for s in seqs if not 0 <= s < self.num_seqs]
        if bad:
            raise CacheError(f"{self.path}: sequences {bad[:5]} are out of range (cache has {self.num_seqs})")
        sites = self.sites if sites is None else list(sites)
        unknown = sorted(set(sites) - set(self.sites))
        if unknown:
            raise CacheError(f"{self.path}: no site column(s) {unknown}")
        wanted = sorted(set(seqs))
        import pyarrow.dataset as ds  # not at module level: see dataset()

        try:
            table = self.dataset().to_table(columns=["seq", "pos", "token", "target", "live_nll", *sites], filter=ds.field("seq").isin(wanted))
        except (pa.ArrowInvalid, OSError) as err:
            raise CacheError(f"{self.path}: unreadable part file ({str(err).splitlines()[0]})") from None
        T = self.seq_len
        if table.num_rows != len(wanted) * T:
            raise CacheError(f"{self.path}: expected {len(wanted) * T} rows for {len(wanted)} sequences, found {table.num_rows}")
        order = np.lexsort((table.column("pos").to_numpy(), table.column("seq").to_numpy()))
        row_of = {s: i for i, s in enumerate(wanted)}
        pick = np.array([row_of[s] for s in seqs])
        out: dict[str, np.ndarray] = {}
        for key in ("token", "target", "live_nll"):
            out[key] = table.column(key).to_numpy()[order].reshape(len(wanted), T)[pick]
        for name in sites:
            column = table.column(name).combine_chunks()
            K = column.type.list_size
            values = column.flatten().to_numpy().astype(np.float32, copy=False).reshape(-1, K)[order].reshape(len(wanted), T, K)[pick]
            if not np.isfinite(values).all():
                raise CacheError(f"{self.path}: site {name} holds non-finite coefficients (NaN or inf)")
            out[name] = values
        return out

    def coefficients(self, seqs: Sequence[int], sites: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        data = self.read_seqs(seqs, sites)
        return {name: data[name] for name in (self.sites if sites is None else sites)}

    def check_model(self, model_fingerprint: str) -> None:
        if self.manifest["model"]["fingerprint"] != model_fingerprint:
            raise CacheError(
                f"{self.path / MANIFEST}: made by a different model (fingerprint {self.manifest['model']['fingerprint'][:12]}, "
                f"this model {model_fingerprint[:12]})"
            )

    def verify(self) -> None:
        """Recompute every part's sha256 against the manifest."""
        for part in self.manifest["parts"]:
            path = self.path / part["file"]
            if not path.is_file():
                raise CacheError(f"{path}: part file missing")
            if file_sha256(path) != part["sha256"]:
                raise CacheError(f"{path}: contents do not match the manifest's sha256 (corrupt or modified)")


def open_cache(path: str | Path, verify: bool = False) -> Cache:
    """Open a finished cache: checks the manifest, the part files' footers and schemas (and with
    `verify=True` their hashes). Raises `CacheError` with a one-line reason."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CacheError(f"{path}: cache directory not found")
    if not manifest_path.is_file():
        hint = " (an unfinished build: rerun build-cache to resume)" if path.with_name(path.name + ".partial").exists() or path.name.endswith(".partial") else ""
        raise CacheError(f"{manifest_path}: missing; not a finished cache{hint}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CacheError(f"{manifest_path}: not valid JSON ({err})") from None
    for key in ("schema_version", "sites", "parts", "num_seqs", "seq_len", "model"):
        if key not in manifest:
            raise CacheError(f"{manifest_path}: no {key!r} entry")
    if manifest["schema_version"] != SCHEMA_VERSION:
        raise CacheError(f"{manifest_path}: schema version {manifest['schema_version']}, this FCA reads {SCHEMA_VERSION}")
    cache = Cache(path, manifest)
    expected = cache_schema(cache.site_specs, coefficient_arrow_type(manifest.get("coefficient_dtype", "float32")))
    for part in cache.part_paths():
        if not part.is_file():
            raise CacheError(f"{part}: part file missing")
        try:
            schema = pq.read_schema(part)
        except (pa.ArrowInvalid, OSError) as err:
            raise CacheError(f"{part}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
        for field in expected:
            if field.name not in schema.names:
                raise CacheError(f"{part}: column {field.name!r} is missing")
            if not schema.field(field.name).type.equals(field.type):
                raise CacheError(f"{part}: column {field.name!r} has type {schema.field(field.name).type}, expected {field.type}")
    if verify:
        cache.verify()
    return cache
