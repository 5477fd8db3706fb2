"""A cache's `manifest.json`, read once into typed records (`Manifest.from_json`), strictly: a field of the
wrong type or counts that disagree are a one-line `CacheError` naming the field."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from fca.tables.environment import check_environment
from fca.tables.errors import CacheError
from fca.tables.jsonfile import read_json
from fca.tables.schema import COEFFICIENT_BYTES, MANIFEST, SCHEMA_VERSION, spec_from_json
from fca.tables.spec import SiteSpec

# ------------------------------------------------------------------------------------------ manifest
# The manifest is read once into typed records; `Manifest.raw` keeps the JSON as written, for writing
# copies and for keys a later FCA adds. Writers (`cache_plan`, `CacheWriter`) still write plain JSON.

REQUIRED_KEYS = ("schema_version", "sites", "parts", "num_seqs", "seq_len", "model")


def _record(raw: dict, key: str, where: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise CacheError(f"{where}: {key!r} is not an object")
    return value


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


_TYPE_NAMES = {int: "a whole number", str: "text", dict: "an object", list: "a list"}
MAX_CHANNELS = 2**31 - 1  # the most a Parquet fixed-size list (a site's column) holds
PART_FILE = re.compile(r"part-\d+\.parquet")  # a part is a file of the cache's own folder, by this name


def _typed(value, kind: type, what: str, where: str, optional: bool = False):
    """`value` if it is a `kind` (a whole number for int: not a bool, a float or text), or None when
    `optional`; else a one-line CacheError naming the field."""
    if value is None and optional:
        return None
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise CacheError(
        f"{where}: malformed manifest: {what} is {json.dumps(value)[:40]}, not {_TYPE_NAMES.get(kind, kind.__name__)}"
    )


def _part_record(p: object, where: str) -> PartRecord:
    p = _typed(p, dict, "a part record", where)
    file = _typed(p.get("file"), str, "a part's file", where)
    if not PART_FILE.fullmatch(file):
        raise CacheError(f"{where}: malformed manifest: part file {file!r} is not a part-NNNNN.parquet of this folder")
    kinds = {"num_seqs": int, "rows": int, "sha256": str, "bytes": int, "index": int, "first_seq": int}
    return PartRecord(
        file=file, **{key: _typed(p.get(key), kind, f"{file}'s {key}", where) for key, kind in kinds.items()}
    )


def _site_spec(name: str, d: object, where: str) -> SiteSpec:
    """A site's spec, its recorded `shape` held to its axes: [K], K the product of the axes' sizes. Readers
    size the coefficients by the axes; a shape edited or damaged apart from them is said, not trusted."""
    spec = spec_from_json(_typed(d, dict, f"site {name}", where))
    sizes = [size for _, size in spec.axes]
    if min(sizes, default=1) < 1 or math.prod(sizes) > MAX_CHANNELS:  # no axes: one scalar per token
        raise CacheError(
            f"{where}: malformed manifest: site {name}'s axes ({' x '.join(map(str, sizes)) or 'none'}) are not "
            f"1 to {MAX_CHANNELS:,} channels"
        )
    shape = d.get("shape", [spec.num_channels])  # (recorded by every writer; not needed to read a cache)
    if shape != [spec.num_channels] or not all(type(n) is int for n in shape):
        axes = " x ".join(str(size) for _, size in spec.axes)
        raise CacheError(
            f"{where}: malformed manifest: site {name}'s shape is {json.dumps(shape)[:40]}, but its axes "
            f"({axes}) give [{spec.num_channels}]"
        )
    return spec


@dataclass(frozen=True)
class ModelRecord:
    """The model that computed the coefficients. `path` is its directory's name (caches sit beside it)."""

    path: str | None
    model_type: str | None
    fingerprint: str
    config: dict  # the model's config.json, {} when not recorded
    dtype: str | None  # the model's parameter dtype when recorded; see `Manifest.model_dtype`


@dataclass(frozen=True)
class TokenizerRecord:
    fingerprint: str | None
    vocab_size: int | None
    # The id that ends each document in a corpus build's token stream (None in other caches and older ones):
    # where the windows' documents begin and end, which resampling by document needs.
    end_of_document: int | None = None


@dataclass(frozen=True)
class CorpusRecord:
    """Which windows the cache holds: corpus file, split and how it was drawn (None when not recorded)."""

    name: str | None
    fingerprint: str | None
    split: str | None
    split_seed: int | None
    text_column: str | None


@dataclass(frozen=True)
class PartRecord:
    """One part file. Part `index` holds sequences from `first_seq` on."""

    file: str
    num_seqs: int
    rows: int
    sha256: str
    bytes: int
    index: int
    first_seq: int


def _environment(env: object, where: str) -> dict | None:
    try:
        check_environment(env)
    except ValueError as err:
        raise CacheError(f"{where}: malformed manifest: {err}") from None
    return env


@dataclass(frozen=True)
class Manifest:
    """A cache's `manifest.json`, typed. Built once by `Manifest.from_json` (which `open_cache` and the
    catalog call), so every reader agrees on defaults and on what is required."""

    schema_version: int
    model: ModelRecord
    tokenizer: TokenizerRecord
    corpus: CorpusRecord
    seq_len: int
    num_seqs: int
    num_tokens: int
    coefficient_dtype: str
    sites: dict[str, SiteSpec]  # in execution order
    parts: tuple[PartRecord, ...]
    seqs_per_part: int
    environment: dict | None  # fca.tables.environment's record; None where the writer did not know it
    created: str | None
    library_versions: dict
    raw: dict  # the JSON as read: for writing copies and for extra keys (e.g. `raw_bytes_per_token`)

    @classmethod
    def from_json(cls, raw: dict, where: str = MANIFEST) -> Manifest:
        """Parse a manifest's JSON object; `CacheError` naming `where` if it is not a readable manifest."""
        if not isinstance(raw, dict):
            raise CacheError(f"{where}: not a JSON object")
        for key in REQUIRED_KEYS:
            if key not in raw:
                raise CacheError(f"{where}: no {key!r} entry")
        if _typed(raw["schema_version"], int, "schema_version", where) != SCHEMA_VERSION:
            raise CacheError(f"{where}: schema version {raw['schema_version']}, this FCA reads {SCHEMA_VERSION}")
        model, tokenizer, corpus = (_record(raw, key, where) for key in ("model", "tokenizer", "corpus"))
        try:
            num_seqs = _typed(raw["num_seqs"], int, "num_seqs", where)
            seq_len = _typed(raw["seq_len"], int, "seq_len", where)
            vocab_size = _optional_int(tokenizer.get("vocab_size"))
            end_of_document = _typed(
                tokenizer.get("end_of_document"), int, "tokenizer.end_of_document", where, optional=True
            )
            if end_of_document is not None and not 0 <= end_of_document < (vocab_size or 2**31):
                # (an id no window can hold would make every window one document, said as such)
                ids = f"[0, {vocab_size})" if vocab_size else "[0, 2^31)"
                raise CacheError(f"{where}: tokenizer.end_of_document {end_of_document} is not a token id in {ids}")
            manifest = cls(
                schema_version=raw["schema_version"],
                model=ModelRecord(
                    path=_typed(model.get("path"), str, "model.path", where, optional=True),
                    model_type=_typed(model.get("model_type"), str, "model.model_type", where, optional=True),
                    fingerprint=_typed(model.get("fingerprint", ""), str, "model.fingerprint", where),
                    config=_typed(model.get("config") or {}, dict, "model.config", where),
                    dtype=_typed(model.get("dtype"), str, "model.dtype", where, optional=True),
                ),
                tokenizer=TokenizerRecord(
                    fingerprint=tokenizer.get("fingerprint"), vocab_size=vocab_size, end_of_document=end_of_document
                ),
                corpus=CorpusRecord(
                    name=corpus.get("name"),
                    fingerprint=corpus.get("fingerprint"),
                    split=corpus.get("split"),
                    split_seed=_optional_int(corpus.get("split_seed")),
                    text_column=corpus.get("text_column"),
                ),
                seq_len=seq_len,
                num_seqs=num_seqs,
                num_tokens=int(raw.get("num_tokens", num_seqs * seq_len)),
                coefficient_dtype=_typed(raw.get("coefficient_dtype", "float32"), str, "coefficient_dtype", where),
                sites={
                    name: _site_spec(name, d, where) for name, d in _typed(raw["sites"], dict, "sites", where).items()
                },
                parts=tuple(_part_record(p, where) for p in _typed(raw["parts"], list, "parts", where)),
                seqs_per_part=_typed(raw.get("seqs_per_part"), int, "seqs_per_part", where),
                environment=_environment(raw.get("environment"), where),
                created=raw.get("created"),
                library_versions=_typed(raw.get("library_versions") or {}, dict, "library_versions", where),
                raw=raw,
            )
        except CacheError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            raise CacheError(f"{where}: malformed manifest ({type(err).__name__}: {err})") from None
        manifest.check_sizes(where)
        return manifest

    def check_sizes(self, where: str) -> None:
        """The manifest's counts must agree with one another (a hand-edited or damaged manifest would
        otherwise be read with wrong shapes, or fail far from the cause)."""
        T, N = self.seq_len, self.num_seqs
        problem = None
        if T < 1 or N < 1:
            problem = f"{N} sequences of {T} tokens"
        elif not self.sites:
            problem = "no sites"
        elif self.seqs_per_part < 1:
            problem = f"seqs_per_part {self.seqs_per_part}"
        elif self.coefficient_dtype not in COEFFICIENT_BYTES:
            problem = f"coefficient dtype {self.coefficient_dtype!r} (known: {', '.join(COEFFICIENT_BYTES)})"
        elif self.num_tokens != N * T:
            problem = f"num_tokens {self.num_tokens}, but {N} sequences x {T} tokens"
        elif self.model.dtype and (self.environment or {}).get("model_dtype") not in (None, self.model.dtype):
            problem = f"model dtype {self.model.dtype}, but its environment says {self.environment['model_dtype']}"
        elif sum(p.num_seqs for p in self.parts) != N:
            problem = f"its parts hold {sum(p.num_seqs for p in self.parts)} sequences, not num_seqs {N}"
        else:
            bad = next((p for p in self.parts if p.num_seqs < 1 or p.rows != p.num_seqs * T), None)
            files = [p.file for p in self.parts]
            twice = next((f for f in files if files.count(f) > 1), None)
            # Parts are listed in sequence order, each beginning where the one before ends (readers find a
            # sequence's part by arithmetic on these).
            ends = itertools.accumulate((p.num_seqs for p in self.parts), initial=0)
            misplaced = next(((p, end) for p, end in zip(self.parts, ends) if p.first_seq != end), None)
            if bad is not None:
                problem = f"part {bad.file} has {bad.rows} rows for {bad.num_seqs} sequences of {T} tokens"
            elif twice is not None:
                problem = f"part {twice} is listed more than once"
            elif misplaced is not None:
                part, follows = misplaced
                problem = (
                    f"part {part.file} begins at sequence {part.first_seq}, but the parts before it end at {follows}"
                )
        if problem is not None:
            raise CacheError(f"{where}: inconsistent manifest: {problem}")

    @property
    def vocab_size(self) -> int | None:
        """The one vocabulary rule: the tokenizer record, else the model config's `vocab_size`, else None
        (unknown: statistics then skip the token-id factor; callers that need a size choose their own)."""
        size = self.tokenizer.vocab_size or self.model.config.get("vocab_size")
        return int(size) if size else None

    @property
    def model_dtype(self) -> str:
        """The model dtype the coefficients were computed in; float32 for caches that predate the record."""
        return self.model.dtype or (self.environment or {}).get("model_dtype") or "float32"

    @property
    def total_bytes(self) -> int:
        """Bytes of all part files on disk."""
        return sum(p.bytes for p in self.parts)

    @property
    def contents_fingerprint(self) -> str:
        """Identity of the cache contents: the hash of its part hashes."""
        return hashlib.sha256("".join(p.sha256 for p in self.parts).encode()).hexdigest()


def read_manifest(cache_dir: str | Path) -> Manifest:
    """The typed manifest of a cache directory (only `manifest.json` is read; parts are not checked)."""
    path = Path(cache_dir) / MANIFEST
    return Manifest.from_json(read_json(path, CacheError), str(path))
