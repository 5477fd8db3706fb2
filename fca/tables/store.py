"""Reading a cache: `open_cache` checks a finished cache; `Cache` reads sequences by row group, streams
batches, and hashes parts against the manifest."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fca.tables.errors import CacheError
from fca.tables.fidelity import check_dtype
from fca.tables.manifest import Manifest, read_manifest
from fca.tables.schema import (
    KEY_COLUMNS,
    MANIFEST,
    cache_schema,
    check_part_schema,
    coefficient_arrow_type,
    coefficient_values,
    decoded_batch,
    file_sha256,
)
from fca.tables.spec import SiteSpec

SPAN_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)  # an odd 64-bit multiplier (the golden ratio's bits)


def span_hashes(windows: np.ndarray, span: int) -> np.ndarray:
    """[n, L] token ids -> [n * (L - span + 1)] 64-bit polynomial hashes (wrapping) of every `span`-token
    stretch of each row, for finding shared text between caches."""
    windows = windows.astype(np.uint64)
    starts = windows.shape[1] - span + 1
    hashes = np.zeros((windows.shape[0], starts), np.uint64)
    with np.errstate(over="ignore"):
        for offset in range(span):  # span vectorised passes: no [n, starts, span] temporary
            hashes = hashes * SPAN_HASH_BASE + windows[:, offset : offset + starts]
    return hashes.ravel()


@contextmanager
def _arrow_errors(path: Path, what: str = "unreadable part file") -> Iterator[None]:
    """Arrow's errors reading the part file `path`, as a one-line CacheError naming it."""
    try:
        yield
    except (pa.ArrowInvalid, OSError) as err:
        raise CacheError(f"{path}: {what} ({str(err).splitlines()[0]})") from None


def _some(names: list[str], shown: int = 3) -> str:
    """A few of `names` for a one-line message: "none", "['a', 'b']" or "['a', 'b', 'c'] and 5 more"."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


@dataclass
class Cache:
    """A finished cache opened for reading. Opening reads the manifest, every part's row count and one
    part's schema; the rest of a part's footer (its schema, checked, and its row groups' `seq` ranges) is
    read when a read first needs it."""

    path: Path
    manifest: Manifest
    _footers: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _read_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _verified: set = field(default_factory=set, init=False, repr=False, compare=False)  # part positions

    def __repr__(self) -> str:
        # (the dataclass's would print the whole manifest, every part's record and hash included)
        return (
            f"Cache({str(self.path)!r}: {self.num_seqs} x {self.seq_len} tokens, {len(self.sites)} sites, "
            f"{self.coefficient_dtype} coefficients of a {self.model_dtype} model, {len(self.manifest.parts)} "
            f"part{'s' if len(self.manifest.parts) != 1 else ''})"
        )

    @property
    def site_specs(self) -> dict[str, SiteSpec]:
        return dict(self.manifest.sites)  # a copy: callers may reorder or filter it

    @property
    def sites(self) -> list[str]:
        return list(self.manifest.sites)

    # The manifest's own figures, read through (`Manifest` says what each is).
    num_seqs = property(attrgetter("manifest.num_seqs"))
    seq_len = property(attrgetter("manifest.seq_len"))
    fingerprint = property(attrgetter("manifest.contents_fingerprint"))  # the hash of the part hashes
    environment = property(attrgetter("manifest.environment"))  # None where the writer did not know it
    model_dtype = property(attrgetter("manifest.model_dtype"))
    coefficient_dtype = property(attrgetter("manifest.coefficient_dtype"))
    vocab_size = property(attrgetter("manifest.vocab_size"))  # the tokenizer record, else the model config, else None

    def part_paths(self) -> list[Path]:
        return [self.path / p.file for p in self.manifest.parts]

    def dataset(self):
        """A pyarrow Dataset over the part files. pyarrow.dataset is imported here, not with this
        module: it pulls in pandas, which opening a cache and reading its footers never need
        and which would delay the dashboard's first page."""
        import pyarrow.dataset as ds

        return ds.dataset([str(p) for p in self.part_paths()], format="parquet")

    @cached_property
    def _part_starts(self) -> np.ndarray:
        """[parts + 1] first sequence of every part in manifest order, and the end (as the manifest's part
        records say)."""
        return np.array([*(p.first_seq for p in self.manifest.parts), self.num_seqs], dtype=np.int64)

    def _footer(self, position: int) -> tuple[Path, pq.ParquetFile, list[tuple[int, int, int]]]:
        """(path, open part file, [(row group, first seq, last seq)]) of the part at `position` in the
        manifest, its schema checked: read once per opened cache, on the first read that needs it."""
        with self._read_lock:  # the prefetch thread and the caller's may ask for the same part at once
            if position not in self._footers:
                self._footers[position] = self._read_footer(position)
            return self._footers[position]

    def _read_footer(self, position: int) -> tuple[Path, pq.ParquetFile, list[tuple[int, int, int]]]:
        path = self.path / self.manifest.parts[position].file
        with _arrow_errors(path):
            part = pq.ParquetFile(path)
            check_part_schema(path, part.schema_arrow, self.expected_schema)
            groups = []
            for i in range(part.metadata.num_row_groups):
                stats = part.metadata.row_group(i).column(0).statistics
                if stats is None or not stats.has_min_max:
                    raise CacheError(f"{path}: row group {i} has no `seq` statistics")
                groups.append((i, int(stats.min), int(stats.max)))
        first, end = (int(s) for s in self._part_starts[position : position + 2])
        held = (min(g[1] for g in groups), max(g[2] for g in groups)) if groups else None
        if held is not None and not (first <= held[0] and held[1] < end):
            raise CacheError(
                f"{path}: holds sequences {held[0]}-{held[1]}, but the manifest places sequences {first}-{end - 1} "
                "in it (a part copied over or exchanged with another)"
            )
        return path, part, groups

    @cached_property
    def expected_schema(self) -> pa.Schema:
        """The part schema the manifest implies (what every part's footer is checked against)."""
        return cache_schema(self.site_specs, coefficient_arrow_type(self.coefficient_dtype))

    def _read_rows(self, wanted: list[int], columns: list[str]) -> pa.Table:
        """The rows of the sorted sequences `wanted`: only the parts holding them (found from the manifest
        by arithmetic) and in those only the row groups whose `seq` range meets them are read (a row
        group holds whole sequences), then rows of other sequences are dropped."""
        w = np.asarray(wanted)
        starts = self._part_starts
        positions = np.unique(np.searchsorted(starts, w, side="right") - 1)
        pieces = []
        for position in positions:
            path, part, groups = self._footer(int(position))
            lo, hi = np.array([g[1] for g in groups]), np.array([g[2] for g in groups])
            # a row group is needed when some wanted seq lies in [first, last]
            needed = np.searchsorted(w, lo, side="left") < np.searchsorted(w, hi, side="right")
            for (i, _, _), need in zip(groups, needed):
                if not need:
                    continue
                # (one open file, read from the prefetch thread and the caller's)
                with _arrow_errors(path), self._read_lock:
                    pieces.append(part.read_row_group(i, columns=columns))
        if not pieces:
            return pa.schema([pa.field("seq", pa.int32())]).empty_table()
        table = pa.concat_tables(pieces)
        seq = table.column("seq").to_numpy()
        keep = np.isin(seq, w)
        return table if keep.all() else table.filter(pa.array(keep))

    def iter_batches(self, columns: Sequence[str] | None = None, batch_size: int = 65536) -> Iterator[pa.RecordBatch]:
        """Stream record batches (one part file, one row group at a time); memory stays bounded. Site columns
        come as FixedSizeList<float32> whatever the stored type (bfloat16 bits are widened exactly)."""
        for path in self.part_paths():
            with _arrow_errors(path):
                batches = pq.ParquetFile(path).iter_batches(
                    batch_size=batch_size, columns=list(columns) if columns else None
                )
                for batch in batches:
                    yield decoded_batch(batch)

    def read_seqs(self, seqs: Sequence[int], sites: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Tokens, targets, live NLL ([n, T]) and coefficients ([n, T, K_s]) of the given sequences, in the
        order given. Only the row groups holding them are read."""
        if isinstance(seqs, (str, bytes)) or not all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in seqs
        ):  # "12" would read sequences 1 and 2, and 0.7 sequence 0
            raise TypeError(f"{self.path}: sequences are given as whole numbers, not {seqs!r}"[:200])
        seqs = [int(s) for s in seqs]
        if not seqs:
            raise ValueError(f"{self.path}: no sequences asked for")
        bad = [s for s in seqs if not 0 <= s < self.num_seqs]
        if bad:
            raise CacheError(f"{self.path}: sequences {bad[:5]} are out of range (cache has {self.num_seqs})")
        sites = self.sites if sites is None else list(sites)
        unknown = sorted(set(sites) - set(self.sites))
        if unknown:
            raise CacheError(f"{self.path}: no site column(s) {unknown}")
        wanted = sorted(set(seqs))
        table = self._read_rows(wanted, [*KEY_COLUMNS, *sites])
        T = self.seq_len
        if table.num_rows != len(wanted) * T:
            raise CacheError(
                f"{self.path}: expected {len(wanted) * T} rows for {len(wanted)} sequences, found {table.num_rows}"
            )
        # (a null row would be dropped from a site's values or read as NaN in an integer column: refused here)
        nulls = [name for name in table.column_names if table.column(name).null_count]
        if nulls:
            raise CacheError(f"{self.path}: column(s) {', '.join(nulls)} hold missing (null) values")
        order = np.lexsort((table.column("pos").to_numpy(), table.column("seq").to_numpy()))
        pick = np.searchsorted(wanted, seqs)  # each asked-for sequence's row among the sorted distinct ones
        out: dict[str, np.ndarray] = {}
        for key in KEY_COLUMNS[2:]:  # (seq and pos: the order itself)
            out[key] = table.column(key).to_numpy()[order].reshape(len(wanted), T)[pick]
        for name in sites:
            column = table.column(name)
            K = column.type.list_size
            values = coefficient_values(column)[order].reshape(len(wanted), T, K)[pick]
            if not np.isfinite(values).all():
                raise CacheError(f"{self.path}: site {name} holds non-finite coefficients (NaN or inf)")
            out[name] = values
        return out

    def coefficients(self, seqs: Sequence[int], sites: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        data = self.read_seqs(seqs, sites)
        return {name: data[name] for name in (self.sites if sites is None else sites)}

    def prefetch(
        self, batches: Sequence[Sequence[int]], sites: Sequence[str] | None = None, depth: int = 1
    ) -> Iterator[dict[str, np.ndarray]]:
        """`read_seqs(batch, sites)` for each batch in order, read and decoded on a background thread
        while the caller works on the previous result: up to `depth` results wait ready.

        Results are those of calling `read_seqs` in order; a reading error is raised in the caller at
        the batch it concerns. Closing the iterator early (break, `close()`, garbage collection) stops
        the thread."""
        return _prefetch(self, [list(b) for b in batches], None if sites is None else list(sites), max(1, int(depth)))

    def build_batches(self) -> set[tuple[int, int]] | None:
        """The (first, last + 1) sequence ranges of the record passes that wrote this cache, if recorded."""
        batch = (self.environment or {}).get("batch_size")
        if not batch:
            return None
        return {(lo, min(self.num_seqs, lo + batch)) for lo in range(0, self.num_seqs, batch)}

    def check_model(self, model_fingerprint: str, model_dtype: str | None = None) -> None:
        """Refuse a cache made by another model, or recorded with another model dtype (checked first: a model
        loaded in another dtype also has another fingerprint, and the dtype is what the user must change)."""
        if model_dtype is not None:
            check_dtype(str(self.path / MANIFEST), self.model_dtype, model_dtype)
        if self.manifest.model.fingerprint != model_fingerprint:
            raise CacheError(
                f"{self.path / MANIFEST}: made by a different model (fingerprint "
                f"{self.manifest.model.fingerprint[:12]}, this model {model_fingerprint[:12]})"
            )

    def check_sites(self, model_sites: Mapping[str, SiteSpec]) -> None:
        """Refuse a model whose controller sites are not the cache's, by name and channel count: a cached
        site the model does not declare would run live in every condition (its controller never removed),
        and a site the model has beyond the cache's would have no coefficients to replay."""
        cached = self.manifest.sites
        lacking = [name for name in cached if name not in model_sites]
        beyond = [name for name in model_sites if name not in cached]
        if lacking or beyond:
            raise CacheError(
                f"{self.path / MANIFEST}: its sites are not the model's: the model lacks {_some(lacking)} and has "
                f"{_some(beyond)} beyond the cache's {len(cached)}; declare the sites the cache was built with"
            )
        for name, spec in model_sites.items():
            if spec.num_channels != cached[name].num_channels:
                raise CacheError(
                    f"{self.path / MANIFEST}: site {name!r} has {cached[name].num_channels} channels here and "
                    f"{spec.num_channels} in the model"
                )

    def span_hashes(self, span: int) -> np.ndarray:
        """The distinct hashes of every `span`-token stretch of every sequence's window (its T tokens and
        last target), read a chunk of sequences at a time: what two caches' text shares, wherever the window
        boundaries fall and whatever their manifests say of where it came from."""
        hashes = [np.unique(span_hashes(windows, span)) for windows in self._windows(self.num_seqs)]
        return np.unique(np.concatenate(hashes)) if hashes else np.zeros(0, np.uint64)

    def _windows(self, num_seqs: int, chunk: int = 1024) -> Iterator[np.ndarray]:
        """The token windows [n, T + 1] (each sequence's T tokens and last target) of the first `num_seqs`
        sequences, `chunk` sequences at a time."""
        for lo in range(0, num_seqs, chunk):
            rows = self.read_seqs(range(lo, min(num_seqs, lo + chunk)), sites=[])
            yield np.concatenate([rows["token"], rows["target"][:, -1:]], axis=1)

    def window_documents(self, num_seqs: int) -> np.ndarray | None:
        """[n]: the document each of the first `num_seqs` windows begins in, counted from the first window's
        (0). A corpus build cuts its windows one after another from the split's text, each document ended by
        the tokenizer's end-of-document id, which the manifest records; None for caches that do not say so
        (windows built in memory, or before the id was recorded), whose windows' order in the text is unknown.
        An end-of-document id inside a document's text (a tokenizer that parses special tokens in text) would
        split it in two here, which makes the CI over documents a little narrower than it should be."""
        eos = self.manifest.tokenizer.end_of_document
        if eos is None or self.manifest.corpus.split is None:
            return None
        ended, opens = [], []  # per window: the documents it ends, and whether it opens on an end id
        for windows in self._windows(num_seqs):
            ended.append((windows == eos).sum(1))
            opens.append(windows[:, 0] == eos)
        before = np.concatenate([[0], np.cumsum(np.concatenate(ended))[:-1]])  # documents ended before it begins
        # A window opening on the previous document's end id predicts the next document's text: it is that one's.
        return before + np.concatenate(opens)

    def verify(self, seqs: range | None = None) -> None:
        """Recompute the sha256 of every part (or of those holding `seqs`) against the manifest; a part is
        hashed once per opened cache."""
        starts = self._part_starts
        for position, part in enumerate(self.manifest.parts):
            if position in self._verified:
                continue
            if seqs is not None and not (starts[position] < seqs.stop and seqs.start < starts[position + 1]):
                continue
            path = self.path / part.file
            if not path.is_file():
                raise CacheError(f"{path}: part file missing")
            if path.stat().st_size != part.bytes:  # (said as such: more telling than a hash that differs)
                raise CacheError(_size_mismatch(path, part.bytes))
            if file_sha256(path) != part.sha256:
                raise CacheError(f"{path}: contents do not match the manifest's sha256 (corrupt or modified)")
            self._footer(position)  # its schema, and the sequences it holds, against the manifest
            self._verified.add(position)


def _prefetch(
    cache: Cache, batches: list[list[int]], sites: list[str] | None, depth: int
) -> Iterator[dict[str, np.ndarray]]:
    """The generator behind `Cache.prefetch`: its `finally` runs when the caller closes it, and stops the reader."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(item: tuple) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        for seqs in batches:
            if stop.is_set():
                return
            try:
                item = ("ok", cache.read_seqs(seqs, sites))
            except BaseException as err:  # handed to the caller, raised there
                offer(("error", err))
                return
            if not offer(item):
                return

    reader = threading.Thread(target=read, name="fca-cache-prefetch", daemon=True)
    reader.start()
    try:
        for _ in batches:
            kind, value = ready.get()
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        reader.join()


def _resume_hint(path: Path) -> str:
    """For a path that is no finished cache: say so when it is a build under way or stopped (asked only
    then: opening a cache is on every dashboard page's path)."""
    unfinished = path.name.endswith(".partial") or path.with_name(path.name + ".partial").exists()
    return " (an unfinished build: rerun build-cache to resume)" if unfinished else ""


def _size_mismatch(part: Path, recorded: int) -> str:
    return (
        f"{part}: not the part the manifest records ({part.stat().st_size:,} bytes, recorded {recorded:,}: "
        "truncated or overwritten)"
    )


def open_cache(path: str | Path, verify: bool = False) -> Cache:
    """Open a finished cache: checks the manifest, that every part file is there with its recorded
    size and row count (its footer's), and the first part's schema (the others' when first read; `verify=True` checks every part's
    hash). Raises `CacheError` with a one-line reason."""
    path = Path(path).resolve() if str(path) in ("", ".") else Path(path)  # ("" and "." name no folder)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        what = "a file, not a cache directory" if path.exists() else "cache directory not found"
        raise CacheError(f"{path}: {what}{_resume_hint(path)}")
    if not manifest_path.is_file():
        raise CacheError(f"{manifest_path}: missing; not a finished cache{_resume_hint(path)}")
    cache = Cache(path, read_manifest(path))
    # Every part must be there with the size and the rows the manifest records (a stat and a footer each,
    # cheap beside a read: truncated, overwritten or overclaimed parts are refused here); one part's schema is read
    # now, each other's when a read first needs it (`Cache._footer`).
    for record in cache.manifest.parts:
        part = path / record.file
        try:
            size = part.stat().st_size
        except FileNotFoundError:
            raise CacheError(f"{part}: part file missing") from None
        if size != record.bytes:
            if verify:
                cache.verify()  # names the first part that differs, by its hash or its size
            raise CacheError(_size_mismatch(part, record.bytes))
        # The manifest's counts, which readers size arrays and batch lists by, against the rows the part's
        # footer holds (a manifest claiming 10^12 sequences of the parts of 256 is refused here, not in a
        # MemoryError): only the footer is read.
        with _arrow_errors(part, "not a readable Parquet file"):
            rows = pq.read_metadata(part).num_rows
        if rows != record.rows:
            raise CacheError(
                f"{part}: holds {rows:,} rows, but the manifest records {record.rows:,} ({record.num_seqs:,} "
                f"sequences of {cache.seq_len:,} tokens): an edited manifest or another cache's part"
            )
    if cache.manifest.parts:
        first = path / cache.manifest.parts[0].file
        with _arrow_errors(first, "not a readable Parquet file"):
            schema = pq.read_schema(first)
        check_part_schema(first, schema, cache.expected_schema)
    if verify:
        cache.verify()
    return cache
