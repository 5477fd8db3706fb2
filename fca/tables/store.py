"""The coefficient cache on disk: Parquet schema, atomic resumable writer, manifest, streaming reader.

Layout of one cache directory (README, "Cache layout"):
    manifest.json       what the cache is: model and tokenizer fingerprints, split, sites, part hashes
    part-00000.parquet  one row per (sequence, position); one FixedSizeList<float32>[K_s] column per site

A build writes into `<name>.partial/` next to the destination; complete parts are renamed from
`*.tmp` and listed in `progress.json`, so an interrupted build can resume. Only the final step writes
`manifest.json` and renames the directory into place: a directory with a manifest is a finished cache.
Part k always holds sequences [k * S, (k + 1) * S) for the cache's `seqs_per_part` S, so several
writer threads can fill different parts at once and the files do not depend on how many did.
`<name>.lock` beside the destination admits one build at a time.

bfloat16 caches store each coefficient's raw bits as uint16 (Parquet has no bfloat16); every reader
here widens them to float32 exactly (`coefficient_values`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import queue
import re
import shutil
import socket
import threading
import time
import zipfile
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fca.tables.environment import check_environment
from fca.tables.errors import CacheError
from fca.tables.fidelity import check_dtype
from fca.tables.outputs import OutputError, atomic_write_text, check_replaceable
from fca.tables.spec import SiteSpec
from fca.tables.stats import Moments, MomentsMerger, merge_token_sums, moments_arrays, token_groups, token_sums
from fca.tables.timings import Timings

SCHEMA_VERSION = 1
KEY_COLUMNS = ("seq", "pos", "token", "target", "live_nll")
KEY_INTS = KEY_COLUMNS[:4]  # int32 keys; every other column is floats (16-bit ones as their raw bits)
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
# Parts recorded since progress.json was last rewritten, one JSON record per line. Rewriting progress.json
# for every part costs O(parts) each, O(parts^2) in all; it is rewritten only once the journal holds more
# than 1/8 of its parts, or 8 records while there are up to 64, so recording costs O(1) per part. A small
# build (the demo's 8 parts) then only appends: a rewrite (a new file, then a rename) had cost its writer
# about 0.3 ms per part, 8x an append. progress.json is written when the build starts, with the plan.
PROGRESS_JOURNAL = "progress.journal.jsonl"
PROGRESS_REWRITE_PARTS = 64
MOMENTS = "moments.npz"  # the merged moments of all parts, written by `finish` (see `write_arrays`)
TOKEN_SUMS_ALLOWANCE = 2**20  # bytes of a part's token-id sums that are always kept (see `_close_part`)


def cache_schema(specs: dict[str, SiteSpec], coefficient_type: pa.DataType = pa.float32()) -> pa.Schema:
    fields = [
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("token", pa.int32(), nullable=False),
        pa.field("target", pa.int32(), nullable=False),
        pa.field("live_nll", pa.float32(), nullable=False),
    ]
    # The list items are declared non-null: Parquet then stores no definition level per value, which
    # made encoding a demo part 13% and decoding it 12% faster (zstd, byte-stream split; 41 interleaved
    # repeats). Caches written before that declared them nullable; readers take either (`same_site_type`).
    item = pa.field("element", coefficient_type, nullable=False)
    fields += [pa.field(name, pa.list_(item, spec.num_channels), nullable=False) for name, spec in specs.items()]
    return pa.schema(fields)


def same_site_type(stored: pa.DataType, expected: pa.DataType) -> bool:
    """Whether a part's column type is the expected one, whether or not its list items are declared
    nullable (caches by an older FCA declared them so; no coefficient is ever null)."""
    if pa.types.is_fixed_size_list(stored) and pa.types.is_fixed_size_list(expected):
        return stored.list_size == expected.list_size and stored.value_type.equals(expected.value_type)
    return stored.equals(expected)


# Stored coefficient types. bfloat16 has no Parquet type: its raw bits are stored as uint16 and the
# manifest's `coefficient_dtype` says how to read them; a uint16 column means bfloat16 bits.
COEFFICIENT_DTYPES = {"float32": pa.float32(), "float16": pa.float16(), "bfloat16": pa.uint16()}
COEFFICIENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values that are exactly bfloat16 numbers -> their bfloat16 bits (uint16, same shape).

    Refuses values that would lose bits: bfloat16 storage is lossless or nothing."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    if np.any(bits & 0xFFFF):
        raise CacheError("bfloat16 storage takes bfloat16 numbers; these float32 values would be rounded")
    return (bits >> 16).astype(np.uint16)


def _numpy(array: pa.Array) -> np.ndarray:
    """A primitive Arrow array as numpy: a zero-copy, read-only view where it has no nulls. `to_numpy`
    gives the same, but its first call imports pandas (0.2-0.6 s here): in a build, inside the first
    batches, on a writer thread."""
    if array.null_count or pa.types.is_boolean(array.type):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(array.type.to_pandas_dtype())
    if len(array) == 0:
        return np.empty(0, dtype)
    view = np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
    view.flags.writeable = False  # as `to_numpy` gives it: the Arrow data is shared, not copied
    return view


def coefficient_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A site column (FixedSizeList of K) -> float32 values [rows, K].

    float16 widens exactly; bfloat16 bits (uint16) become the high half of a float32, which is exact too."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    K = column.type.list_size
    flat = _numpy(column.flatten())
    if pa.types.is_uint16(column.type.value_type):
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    return flat.astype(np.float32, copy=False).reshape(-1, K)


def _decoded(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A record batch whose bfloat16-bit (uint16) site columns are replaced by float32 ones."""
    columns, fields, changed = [], [], False
    for column_field, column in zip(batch.schema, batch.columns):
        if pa.types.is_fixed_size_list(column_field.type) and pa.types.is_uint16(column_field.type.value_type):
            item = column_field.type.value_field
            list_type = pa.list_(pa.field(item.name, pa.float32(), nullable=item.nullable), column_field.type.list_size)
            column = pa.FixedSizeListArray.from_arrays(pa.array(coefficient_values(column).reshape(-1)), type=list_type)
            column_field = pa.field(column_field.name, list_type, nullable=column_field.nullable)
            changed = True
        columns.append(column)
        fields.append(column_field)
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields)) if changed else batch


def coefficient_arrow_type(name: str) -> pa.DataType:
    if name not in COEFFICIENT_DTYPES:
        raise CacheError(f"coefficient dtype {name!r} is not supported (choose {', '.join(COEFFICIENT_DTYPES)})")
    return COEFFICIENT_DTYPES[name]


def spec_to_json(spec: SiteSpec) -> dict:
    out = {
        "shape": [spec.num_channels],
        "axes": [[a, n] for a, n in spec.axes],
        "family": spec.family,
        "dtype": "float32",
    }
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


def cache_plan(
    specs: dict[str, SiteSpec],
    seq_len: int,
    num_seqs: int,
    model: dict,
    corpus: dict,
    coefficient_dtype: str = "float32",
    **extra,
) -> dict:
    """The manifest draft of a cache (everything but the part list and creation time)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "corpus": corpus,
        "seq_len": seq_len,
        "num_seqs": num_seqs,
        "num_tokens": num_seqs * seq_len,
        "coefficient_dtype": coefficient_dtype,
        "sites": {name: spec_to_json(spec) for name, spec in specs.items()},
        **extra,
    }


def _arrow(values: np.ndarray) -> pa.Array:
    """A 1-D numpy array as an Arrow array of its dtype, zero-copy (the reverse of `_numpy`). `pa.array`
    gives the same array, but its first call imports pandas (0.2 s here) to check the input is not a
    pandas object: in a build, inside the first batches."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def record_batch(
    schema: pa.Schema,
    seq: np.ndarray,
    tokens: np.ndarray,
    targets: np.ndarray,
    live_nll: np.ndarray,
    coefficients: dict[str, np.ndarray],
) -> pa.RecordBatch:
    """Columns straight from numpy. seq: [n]; tokens, targets, live_nll: [n, T]; coefficients: site -> [n, T, K].

    For a bfloat16 schema (uint16 site columns) a site's values are its bfloat16 bits (uint16 or int16),
    or float32 values that are exactly bfloat16 numbers."""
    n, T = tokens.shape
    columns = [
        _arrow(np.repeat(seq.astype(np.int32), T)),
        _arrow(np.tile(np.arange(T, dtype=np.int32), n)),
        _arrow(tokens.reshape(-1).astype(np.int32)),
        _arrow(targets.reshape(-1).astype(np.int32)),
        _arrow(live_nll.reshape(-1).astype(np.float32)),
    ]
    for column_field in schema:
        if column_field.name in KEY_COLUMNS:
            continue
        values = coefficients[column_field.name]
        K = column_field.type.list_size
        if values.shape != (n, T, K):
            raise CacheError(f"site {column_field.name}: coefficients of shape {values.shape}, expected {(n, T, K)}")
        if pa.types.is_uint16(
            column_field.type.value_type
        ):  # bfloat16 bits: take bits as they are, floats only if exact
            values = values.view(np.uint16) if values.dtype in (np.int16, np.uint16) else bfloat16_bits(values)
        flat = _arrow(np.ascontiguousarray(values, dtype=column_field.type.value_type.to_pandas_dtype()).reshape(-1))
        columns.append(pa.FixedSizeListArray.from_arrays(flat, type=column_field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def read_progress(partial: str | Path) -> dict | None:
    """What a build's `<out>.partial/` says it has done: its plan, `seqs_per_part` and `parts` (the records
    in progress.json, then those of its journal; a journal line cut short by a crash, the last, is
    skipped); None when there is no readable progress.json."""
    partial = Path(partial)
    try:
        progress = json.loads((partial / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(progress, dict) or not isinstance(progress.get("parts"), list):
        return None
    journal = partial / PROGRESS_JOURNAL
    for line in journal.read_text().splitlines() if journal.is_file() else []:
        try:
            progress["parts"].append(json.loads(line))
        except ValueError:
            continue
    return progress


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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomic(path: Path, obj: dict, indent: int | None = 1) -> None:
    """`indent=None` for files only the library reads: json's C encoder then writes them, 5x faster than
    its Python one (which `indent` needs), and a writer thread holds the GIL that much less."""
    atomic_write_text(path, json.dumps(obj, indent=indent))


def write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Named arrays as an .npz that `np.load` reads, written atomically and byte-for-byte reproducibly:
    `np.savez` stamps each member with the current time, which would make equal moments hash differently."""
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            array = np.asarray(array, order="C")  # keeps 0-d (`np.ascontiguousarray` would not)
            with z.open(info, "w", force_zip64=True) as f:
                # What `np.lib.format.write_array` writes, without its `tobytes` copy of each array (a
                # 10 MB per-position table per 1.4B part, in fresh pages each time).
                np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
                f.write(array.reshape(-1).view(np.uint8))
    os.replace(tmp, path)


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def is_cache_file(name: str) -> bool:
    """Whether a finished cache's folder holds an entry of this name (what --overwrite may delete): its
    files, and the build's bookkeeping, which a build stopped just after its final rename leaves behind."""
    return (
        name in (MANIFEST, MOMENTS, PROGRESS, PROGRESS_JOURNAL)
        or re.fullmatch(r"part-\d+(\.moments\.npz|\.parquet)", name) is not None
    )


def is_partial_file(name: str) -> bool:
    """Whether an unfinished build's `<out>.partial/` holds an entry of this name."""
    return is_cache_file(name) or name.endswith(".tmp")


def check_cache_destination(out: str | Path, overwrite: bool) -> None:
    """Refuse `out` unless it is new, or (with `overwrite`) an empty folder or a finished cache alone
    (`fca.tables.outputs.check_replaceable`), as a `CacheError`."""
    try:
        check_replaceable(out, "cache", is_cache_file, MANIFEST, overwrite)
    except OutputError as err:
        raise CacheError(str(err)) from None


def byte_stream_split_columns(schema: pa.Schema) -> list[str]:
    """The columns written byte-stream-split: `live_nll` and every site's values. pyarrow names a list
    column's values by their leaf path (`<site>.list.element`); the site's own name would leave them PLAIN
    (measured on the demo cache: 8.07 MB split against 8.66 PLAIN, for 30.3 ms of encoding against 24.7)."""
    return [f.name if f.name == "live_nll" else f"{f.name}.list.element" for f in schema if f.name not in KEY_INTS]


def moments_file(part_file: str) -> str:
    """The moments sidecar of a part: `part-00000.parquet` -> `part-00000.moments.npz`."""
    return part_file.removesuffix(".parquet") + ".moments.npz"


def piece_moments(
    batch: pa.RecordBatch, sites: list[str], num_seqs: int, part_rows: int | None = None
) -> tuple[Moments, tuple | None]:
    """Moments (no dense token table) and sparse token sums of a record batch of whole sequences.

    Token sums are None when the part (of `part_rows` rows; None: no token sums) cannot keep them (see
    `_close_part`): a piece's distinct ids already bound the part's from below, and sorting the rows by
    token is most of the cost (measured: 5x the other moments on 1.4B-shaped rows)."""
    T = batch.num_rows // num_seqs
    # Per-site views of the Arrow buffers, never concatenated (see `Moments.add_blocked`).
    blocks = [coefficient_values(batch.column(name)).reshape(num_seqs, T, -1) for name in sites]  # [n, T, K_s]
    num_slots = sum(b.shape[2] for b in blocks)
    tokens = _numpy(batch.column("token")).reshape(num_seqs, T)
    m = Moments(num_slots, T, None)
    m.add_blocked(blocks)
    if part_rows is None:
        return m, None
    groups = token_groups(tokens)  # the fit check's distinct ids, and the grouping of the sums
    if not _tokens_fit(len(groups[0]), num_slots, part_rows):
        return m, None
    return m, token_sums(blocks, tokens, groups)


def _tokens_fit(distinct: int, num_slots: int, rows: int) -> bool:
    """Token-id sums (distinct ids x C float64) are kept while small or at most a quarter of the part's
    float32 coefficients (ids repeat 8+ times on average): with a large vocabulary and small parts they
    would outweigh the part."""
    return 8 * distinct <= rows or distinct * num_slots * 8 <= TOKEN_SUMS_ALLOWANCE


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


# This process's mark in the locks it takes: a lock naming our pid without it was taken by an earlier process
# that had the same pid (pids start over when a container restarts, and the host name stays).
PROCESS_TOKEN = os.urandom(8).hex()
UNREADABLE_LOCK_STALE_S = 10.0  # a lock is written the moment it is created; one still unreadable is a crash's


def holder_is_dead(holder: dict) -> bool:
    """A lock's holder (its `host` and `pid`) that is known dead: on this host, no such process, or this
    process's pid taken by another process before it. A holder on another host cannot be checked and counts
    as alive."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return holder.get("token") != PROCESS_TOKEN
    return not _pid_alive(pid)


class BuildLock:
    """One build per cache: a lock file created atomically (O_CREAT | O_EXCL) holding the builder's pid,
    host and start time. A lock whose holder is not alive on this host is stale (a killed build): it is
    taken over, and the new build resumes from what the dead one left. A holder on another host cannot
    be checked and is treated as alive."""

    def __init__(self, path: Path, what: Path) -> None:
        self.path = path
        self.what = what  # the cache being built, for messages
        self.held = False

    def _read(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _stale(self, holder: dict | None) -> bool:
        if holder is None:  # empty or damaged: a build that crashed between creating and writing it
            try:
                return time.time() - self.path.stat().st_mtime > UNREADABLE_LOCK_STALE_S
            except OSError:
                return False
        return holder_is_dead(holder)

    def check_free(self) -> None:
        """Refuse now if another build holds the lock (`acquire` takes it later, when the writer starts; a
        build checks first, before minutes of loading a model and reading a corpus)."""
        if self.path.exists() and not self._stale(self._read()):
            raise self._refusal(self._read())

    def _refusal(self, holder: dict | None) -> CacheError:
        who = (
            f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
            if holder
            else "lock unreadable: delete it if no build is running"
        )
        return CacheError(f"{self.what}: another build is writing this cache ({who}); lock {self.path}")

    def _take_over(self, holder: dict | None) -> None:
        """Remove a stale lock, unless another build replaced it meanwhile (then put that one back)."""
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if json.loads(aside.read_text()) != holder:
                os.link(aside, self.path)
        except (OSError, ValueError):
            pass
        aside.unlink(missing_ok=True)

    def acquire(self) -> None:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "token": PROCESS_TOKEN,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if self._stale(holder):
                    self._take_over(holder)
                    continue
                raise self._refusal(holder) from None
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self.held = True
            return
        raise CacheError(f"{self.what}: could not take the build lock {self.path}")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def build_lock(out: Path) -> BuildLock:
    """The lock of the cache `out`: `<out>.lock` beside it."""
    out = Path(out)
    return BuildLock(out.with_name(out.name + ".lock"), out)


@dataclass
class _OpenPart:
    """A part file being written: its ParquetWriter on `<file>.tmp` and what it holds so far."""

    index: int
    file: str
    writer: pq.ParquetWriter
    num_seqs: int = 0
    rows: int = 0
    moments: Moments | None = None  # of the pieces written so far (slots in schema order)
    token_pieces: list | None = field(default_factory=list)  # their sparse token sums; None: not kept


class _WriterThreads:
    """Writer threads sharing one queue of pieces. A part is written by one thread (its Parquet writer is
    not shared): the thread that takes a part's first piece holds the part until it is complete and takes
    its later pieces; an idle thread takes the next piece of a part no thread holds. So a slow part holds
    up no other thread. (With parts dealt out as k % threads, the caller waited on a busy thread's full
    queue while another thread sat idle, and the threads advanced in lockstep, each round as slow as its
    slowest part.) `put` waits while more than `max_pending` sequences are queued or being written."""

    def __init__(self, owner: CacheWriter, count: int, max_pending: int) -> None:
        self.owner = owner
        self.max_pending = max_pending
        self.items: deque = deque()  # (part, piece, sequences), in the order written
        self.pending = 0
        self.holders: dict[int, int] = {}  # part -> the thread writing it
        self.closed = False
        self.cond = threading.Condition()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), name=f"fca-cache-writer-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self.threads:
            thread.start()

    def put(self, k: int, piece: pa.RecordBatch, n: int) -> None:
        with self.cond, self.owner.timings("queue_wait"):
            # An empty queue takes any piece, so a piece larger than the bound cannot wait forever.
            while self.pending and self.pending + n > self.max_pending and not self.owner._stopping:
                self.cond.wait(0.5)
            self.items.append((k, piece, n))
            self.pending += n
            self.cond.notify_all()

    def _take(self, index: int) -> tuple[int, pa.RecordBatch, int] | None:
        """The next piece for thread `index` (the lock held): of a part it holds first, so parts close
        early, else of a part nobody holds."""
        for held_only in (True, False):
            for position, (k, piece, n) in enumerate(self.items):
                holder = self.holders.get(k)
                if holder == index or (holder is None and not held_only):
                    del self.items[position]
                    self.holders[k] = index
                    return k, piece, n
        return None

    def _run(self, index: int) -> None:
        open_parts: dict[int, _OpenPart] = {}
        while True:
            with self.cond, self.owner.timings("writer_idle"):  # nothing queued for this thread
                while (item := self._take(index)) is None and not self.closed:
                    self.cond.wait()
            if item is None:  # closed, and nothing left for this thread
                break
            k, piece, n = item
            try:
                if not self.owner._stopping:
                    self.owner._write_piece(open_parts, k, piece, n)
            except BaseException as err:  # raised again in the caller's thread
                self.owner._fail(err)
            finally:
                with self.cond:
                    self.pending -= n
                    if k not in open_parts:  # complete (or dropped after an error): any thread may take it
                        self.holders.pop(k, None)
                    self.cond.notify_all()
        self.owner._discard(open_parts)

    def close(self) -> None:
        """Let the threads write what is queued (or drop it, after an error), then wait for them."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join()


class CacheWriter:
    """Writes a cache into `<out>.partial/`, part by part; `finish()` renames it into place.

    `plan` is the manifest draft (everything but the part list; it must hold `num_seqs`). Part k holds
    sequences [k * S, (k + 1) * S), S = `seqs_per_part`, whatever the number of `workers`: with
    `workers=1` parts are written in the caller's thread; with more, batches go to worker threads
    (`_WriterThreads`: each part is written by one of them, whichever is free when its first batch
    comes) and `write` returns once the batch is queued. pyarrow encodes and compresses without the GIL,
    so the threads scale with cores. `processes=True`: the `workers` are processes instead
    (`fca.tables.writer_processes`), which leave the caller's interpreter lock alone. Memory: at most
    `workers` x `max_pending_seqs` sequences (default S each) queued or being written. After a worker's
    error, queued batches are dropped and the error is raised in the caller at the next `write` or at
    `finish`.

    Parts may complete out of order; `progress.json` lists the complete ones. If a `.partial` directory
    with the same plan and S exists, the writer resumes: `pending_ranges()` are the sequences of the
    incomplete parts, to be written again in full. A lock beside the destination refuses a second build.

    Every part's moments (`fca.tables.stats`: count, sums, sums of squares, per-position and per-sequence
    sums, extremes, sparse token-id sums) go beside it as `part-XXXXX.moments.npz`, named with their hash
    in the part's record; `finish` merges them in part order into `moments.npz` (its hash in the
    manifest's `moments` entry), which `fca.tables.profiles.cache_moments` reads instead of the parts.

    `shard` (a set of part indices) makes a *shard writer* for distributed builds: it writes only those
    parts into an existing `<out>.partial/`, takes no lock, resumes nothing and writes no progress; the
    driver (a normal writer holding the lock) records what `close_shard()` returns with `add_parts`.
    """

    def __init__(
        self,
        out: str | Path,
        plan: dict,
        schema: pa.Schema,
        seqs_per_part: int,
        overwrite: bool = False,
        workers: int = 1,
        max_pending_seqs: int | None = None,
        shard: Sequence[int] | None = None,
        timings: Timings | None = None,
        processes: bool = False,
    ) -> None:
        self.out = Path(out)
        self.timings = timings if timings is not None else Timings()  # encode, moments, close_part, ...
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.schema = schema
        self.plan = plan
        self.seqs_per_part = int(seqs_per_part)
        if self.seqs_per_part < 1:
            raise CacheError(f"{self.out}: seqs_per_part must be at least 1, not {seqs_per_part}")
        self.num_seqs = int(plan["num_seqs"])
        self.num_parts = -(-self.num_seqs // self.seqs_per_part)
        self.sites = [f.name for f in schema if f.name not in KEY_COLUMNS]
        self.shard = None if shard is None else sorted({int(k) for k in shard})
        self.lock = build_lock(self.out)
        if self.shard is not None:
            bad = [k for k in self.shard if not 0 <= k < self.num_parts]
            if bad:
                raise CacheError(f"{self.partial}: parts {bad[:5]} are outside the plan's {self.num_parts} parts")
            if not self.partial.is_dir():
                raise CacheError(f"{self.partial}: a shard writer needs the driver's partial directory")
            self.parts: dict[int, dict] = {}
        else:
            self.lock.acquire()
            try:
                check_cache_destination(self.out, overwrite)
                self.parts = self._resume()
            except BaseException:
                self.lock.release()
                raise
        self._mutex = threading.Lock()  # guards `parts` and progress.json
        # Moments merged in part order as parts complete (`_merge_completed`); `_kept`: parts of an earlier run.
        self._merge_lock = threading.Lock()
        self._merger = self._new_merger()
        self._merged_through = 0  # parts [0, this) are merged; -1: merging while building is off
        self._held: dict[int, dict] = {}
        self._kept = set(self.parts)
        self._journaled = 0  # records in the progress journal since progress.json was rewritten
        self._stopping = False
        self._failures: list[BaseException] = []
        self._open: dict[int, _OpenPart] = {}  # parts written in the caller's thread (workers=1)
        self.closed_moments: dict[int, dict] | None = None  # a shard writer's, kept for its owner if a dict
        workers = max(1, min(int(workers), self.num_parts))  # a worker writes a whole part: more would idle
        bound = workers * (max_pending_seqs or self.seqs_per_part)
        self._threads = None  # _WriterThreads or WriterProcesses; None: parts written in the caller's thread
        try:
            if processes:
                from fca.tables.writer_processes import WriterProcesses

                self._threads = WriterProcesses(self, workers, bound)
            elif workers > 1:
                self._threads = _WriterThreads(self, workers, bound)
        except BaseException:  # the writers could not start: no build, and no lock left behind
            if self.shard is None:
                self.lock.release()
            raise

    def _resume(self) -> dict[int, dict]:
        if self.partial.exists() or self.partial.is_symlink():  # a build's own folder, or nobody's to delete
            try:
                check_replaceable(self.partial, "build in progress", is_partial_file, PROGRESS, overwrite=True)
            except OutputError as err:
                raise CacheError(str(err)) from None
        progress = read_progress(self.partial)
        parts: dict[int, dict] = {}
        if progress is not None:
            if progress.get("plan") == self.plan and progress.get("seqs_per_part") == self.seqs_per_part:
                # A part is kept only with the bytes it was recorded with (its own and its moments'): one
                # damaged since, or cut short by a full disk, is written again, not published.
                parts = {int(p["index"]): p for p in progress["parts"] if self._intact(p)}
            else:
                shutil.rmtree(self.partial)
        elif self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True, exist_ok=True)
        for stale in self.partial.glob("*.tmp"):  # unfinished parts of a build that stopped
            stale.unlink()
        if not (self.partial / PROGRESS).is_file():  # a fresh build: the plan, which a resume must match
            self._save_progress(parts)
        return parts

    def _intact(self, record: dict) -> bool:
        files = [(record["file"], record.get("sha256"))]
        if "moments" in record:
            files.append((record["moments"], record.get("moments_sha256")))
        return all((self.partial / name).is_file() and file_sha256(self.partial / name) == sha for name, sha in files)

    def _save_progress(self, parts: dict[int, dict]) -> None:
        """progress.json with every part in `parts`; the journal, all of it in there now, goes."""
        progress = {"plan": self.plan, "seqs_per_part": self.seqs_per_part, "parts": [parts[i] for i in sorted(parts)]}
        _write_json_atomic(self.partial / PROGRESS, progress, indent=None)
        (self.partial / PROGRESS_JOURNAL).unlink(missing_ok=True)
        self._journaled = 0

    @property
    def done_seqs(self) -> int:
        """Sequences in complete parts."""
        return sum(p["num_seqs"] for p in self.parts.values())

    def part_range(self, k: int) -> tuple[int, int]:
        return k * self.seqs_per_part, min(self.num_seqs, (k + 1) * self.seqs_per_part)

    def pending_parts(self) -> list[int]:
        """Indices of the incomplete parts (of the shard, for a shard writer), in order."""
        return [k for k in (self.shard if self.shard is not None else range(self.num_parts)) if k not in self.parts]

    def pending_ranges(self) -> list[tuple[int, int]]:
        """(first, last + 1) sequences of every incomplete part, in order: what a build must (re)write."""
        return [self.part_range(k) for k in self.pending_parts()]

    # -- writing ------------------------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch, num_seqs: int) -> None:
        """Write `num_seqs` whole consecutive sequences (their `seq` column says which). A batch that
        crosses a part boundary is split there (zero-copy slices); each piece is one row group."""
        self._raise_failure()
        if not batch.schema.equals(self.schema):  # (a writer process reads the batch with the cache's schema)
            raise CacheError(f"{self.partial}: a batch of another schema than the cache's ({batch.schema.names})")
        if num_seqs < 1 or batch.num_rows == 0 or batch.num_rows % num_seqs:
            raise CacheError(f"{self.partial}: a batch of {batch.num_rows} rows is not {num_seqs} whole sequences")
        rows_per_seq = batch.num_rows // num_seqs
        first = int(batch.column("seq")[0].as_py())
        if first < 0 or first + num_seqs > self.num_seqs:
            raise CacheError(
                f"{self.partial}: sequences {first}..{first + num_seqs - 1} are outside the plan's {self.num_seqs}"
            )
        lo = first
        while lo < first + num_seqs:
            k = lo // self.seqs_per_part
            hi = min(first + num_seqs, self.part_range(k)[1])
            self._check_part(k, lo, hi)
            piece = batch.slice((lo - first) * rows_per_seq, (hi - lo) * rows_per_seq)
            if self._threads is not None:
                self._threads.put(k, piece, hi - lo)
            else:
                self._write_piece(self._open, k, piece, hi - lo)
            lo = hi

    def _check_part(self, k: int, lo: int, hi: int) -> None:
        if self.shard is not None and k not in self.shard:
            raise CacheError(f"{self.partial}: part {k} is not in this writer's shard {self.shard[:5]}")
        if k in self.parts:
            raise CacheError(f"{self.partial}: part {k} is already complete; sequences {lo}..{hi - 1} written twice")

    @property
    def shares_memory(self) -> bool:
        """Whether batches can be handed over in shared memory (`shared_block`, `write_shared`): the
        writers are processes, and the system has anonymous memory files."""
        from fca.tables.writer_processes import SHARES_MEMORY, WriterProcesses

        return SHARES_MEMORY and isinstance(self._threads, WriterProcesses)

    def shared_block(self, size: int) -> tuple[int, mmap.mmap]:
        """(id, mapping) of a new block of `size` bytes that the writer processes map too (`shares_memory`)."""
        return self._threads.shared_block(size)

    def write_shared(
        self, lo: int, n: int, windows: np.ndarray, block: int, nll_at: tuple, sites_at: dict, free
    ) -> None:
        """Sequences [lo, lo + n), all in one part, whose values a writer process reads from shared `block`
        (`shared_block`): at (offset, dtype, shape) there, `nll_at` the live NLL [n, T] and `sites_at` each
        site's coefficients [n, T, K]; `windows` [n, T + 1] are their token ids. `free()` is called once,
        when the values have been copied out of the block or never will be (including when this raises)."""
        try:
            self._raise_failure()
            k = lo // self.seqs_per_part
            if n < 1 or lo < 0 or lo + n > self.part_range(k)[1]:
                raise CacheError(f"{self.partial}: sequences {lo}..{lo + n - 1} are not within one part")
            self._check_part(k, lo, lo + n)
        except BaseException:
            free()
            raise
        self._threads.put_shared(k, n, lo, windows, block, nll_at, sites_at, free)

    def _write_piece(self, open_parts: dict[int, _OpenPart], k: int, piece: pa.RecordBatch, n: int) -> None:
        part = open_parts.get(k)
        if part is None:
            part = open_parts[k] = self._open_part(k)
        with self.timings("encode"):
            part.writer.write_batch(piece)
        lo, hi = self.part_range(k)
        part_rows = (hi - lo) * (piece.num_rows // n) if part.token_pieces is not None else None
        with self.timings("moments"):
            m, tokens = piece_moments(piece, self.sites, n, part_rows)
            part.moments = m if part.moments is None else part.moments.merge(m)
        part.token_pieces = None if tokens is None else [*part.token_pieces, tokens]
        part.num_seqs += n
        part.rows += piece.num_rows
        if part.num_seqs >= hi - lo:
            with self.timings("close_part"):  # footer, moments sidecar, hashes, progress record, merge
                self._close_part(open_parts.pop(k))

    def _open_part(self, k: int) -> _OpenPart:
        name = f"part-{k:05d}.parquet"
        writer = pq.ParquetWriter(
            self.partial / (name + ".tmp"),
            self.schema,
            compression="zstd",
            compression_level=3,
            use_dictionary=False,
            use_byte_stream_split=byte_stream_split_columns(self.schema),
            write_statistics=["seq"],
        )
        return _OpenPart(k, name, writer)

    def _close_part(self, part: _OpenPart) -> None:
        part.writer.close()
        tmp, final = self.partial / (part.file + ".tmp"), self.partial / part.file
        moments = moments_file(part.file)
        tokens = None
        if part.token_pieces is not None:
            tokens = merge_token_sums(part.token_pieces, part.moments.num_slots)
            if not _tokens_fit(len(tokens[0]), part.moments.num_slots, part.rows):
                tokens = None  # the merged moments then have no token-id factor (`cache_moments`)
        arrays = moments_arrays(part.moments, tokens)
        write_arrays(self.partial / moments, arrays)
        os.replace(tmp, final)
        record = {
            "index": part.index,
            "file": part.file,
            "first_seq": self.part_range(part.index)[0],
            "num_seqs": part.num_seqs,
            "rows": part.rows,
            "sha256": file_sha256(final),
            "bytes": final.stat().st_size,
            "moments": moments,
            "moments_sha256": file_sha256(self.partial / moments),
        }
        self.add_parts([record])
        if self.shard is None:  # a shard writer's parts are merged by the driver's writer
            self._merge_completed(part.index, arrays)
        elif self.closed_moments is not None:  # a writer process sends them with the record
            self.closed_moments[part.index] = arrays

    def add_parts(self, records: Sequence[dict]) -> None:
        """Record complete parts (written here, or by shard writers) and, unless this is a shard writer,
        save the progress so that a stopped build resumes from them."""
        with self._mutex:
            for record in records:
                self.parts[int(record["index"])] = record
            if self.shard is not None:
                return
            self._journaled += len(records)
            if 8 * self._journaled <= max(len(self.parts), PROGRESS_REWRITE_PARTS):
                with open(self.partial / PROGRESS_JOURNAL, "a") as journal:
                    journal.write("".join(json.dumps(r) + "\n" for r in records))
                return
            self._save_progress(self.parts)

    def _discard(self, open_parts: dict[int, _OpenPart]) -> None:
        """Close unfinished parts without marking them complete (the partial directory stays resumable)."""
        for part in open_parts.values():
            try:
                part.writer.close()
            except Exception:  # the part is being thrown away; its file goes next
                pass
            (self.partial / (part.file + ".tmp")).unlink(missing_ok=True)
        open_parts.clear()

    def _fail(self, err: BaseException) -> None:
        with self._mutex:
            self._failures.append(err)
        self._stopping = True

    def _raise_failure(self) -> None:
        if self._failures:
            raise self._failures[0]

    def _join_workers(self) -> None:
        if self._threads is not None:
            self._threads.close()
            self._threads = None

    # -- ending -------------------------------------------------------------------------------------

    def close_shard(self) -> list[dict]:
        """A shard writer's end: wait for its threads, check its parts are complete, return their records."""
        try:
            self._join_workers()
            self._raise_failure()
            missing = self.pending_parts()
            if missing or self._open:
                raise CacheError(f"{self.partial}: shard parts {(missing or sorted(self._open))[:5]} are incomplete")
        except BaseException:
            self.abort()
            raise
        return [self.parts[k] for k in self.shard]

    def _new_merger(self) -> MomentsMerger:
        width = sum(f.type.list_size for f in self.schema if f.name not in KEY_COLUMNS)
        vocab = (self.plan.get("tokenizer") or {}).get("vocab_size") or (
            (self.plan.get("model") or {}).get("config") or {}
        ).get("vocab_size")
        return MomentsMerger(width, int(self.plan["seq_len"]), int(vocab) if vocab else None)

    def merge_committed(self, k: int) -> None:
        """Merge part k's moments from its sidecar once the parts before it are merged: what the driver
        of a distributed build calls as each shard writer's part commits, so that its finish does not
        read every sidecar at the end."""
        self._merge_completed(k, None)

    def _merge_completed(self, k: int, arrays: dict | None) -> None:
        """Part k's moments (None: in its sidecar), just committed: merged now if every part before it
        is, else held until they are (in part order, so the bits do not depend on which worker finished
        first). Parts kept from an earlier run are merged from their sidecars when their turn comes. What
        is left at `finish` is read from the sidecars there."""
        with self._merge_lock:
            if self._merged_through < 0:  # a kept part has no moments: nothing will be merged
                return
            self._held[k] = arrays
            while True:
                k = self._merged_through
                if "moments" not in self.parts.get(k, {"moments": None}):
                    self._merged_through, self._held = -1, {}  # a part by an older FCA: no stored moments
                    return
                if self._held.get(k) is not None:
                    block = self._held.pop(k)
                elif k in self._held or k in self._kept:
                    self._held.pop(k, None)
                    block = read_arrays(self.partial / self.parts[k]["moments"])
                else:
                    break
                self._merger.add(block)
                self._merged_through += 1

    def _merge_moments(self) -> dict | None:
        """Merge the parts' moments in part order into `moments.npz` (the parts not merged while the
        build ran are read from their sidecars); None when a part has none (parts kept from a build by an
        older FCA): statistics then scan the coefficients, as for older caches."""
        records = [self.parts[k] for k in range(self.num_parts)]
        if not records or any("moments" not in r for r in records):
            return None
        with self._merge_lock:
            for r in records[max(self._merged_through, 0) :]:  # (-1 cannot be: every record has moments)
                self._merger.add(read_arrays(self.partial / r["moments"]))
            self._merged_through = self.num_parts
            merged, with_tokens = self._merger.result()
        arrays = moments_arrays(merged)
        if with_tokens:  # stored sparse, like the parts': only the ids the cache holds
            seen = np.flatnonzero(merged.tok_count > 0)
            arrays.update(tok_ids=seen, tok_count=merged.tok_count[seen], tok_sum=merged.tok_sum[seen])
        write_arrays(self.partial / MOMENTS, arrays)
        return {
            "file": MOMENTS,
            "sha256": file_sha256(self.partial / MOMENTS),
            "token_sums": with_tokens,
            # The parts these moments describe (`Manifest.contents_fingerprint`): a part rewritten later no
            # longer matches, and readers then scan instead of trusting stale sums.
            "contents": hashlib.sha256("".join(r["sha256"] for r in records).encode()).hexdigest(),
            # The per-part sidecars, in part order, for merging a subset of parts.
            "parts": [[r["moments"], r["moments_sha256"]] for r in records],
        }

    def finish(self, extra: dict | None = None) -> Path:
        """Wait for the workers, check every part is complete, write the manifest, rename into place."""
        try:
            with self.timings("finish_wait"):  # the workers' last parts
                self._join_workers()
            started = time.perf_counter()
            self._raise_failure()
            if self._open:
                missing = sorted(self._open)
                raise CacheError(f"{self.partial}: parts {missing} are incomplete (sequences missing)")
            missing = [k for k in range(self.num_parts) if k not in self.parts]
            if missing:
                raise CacheError(f"{self.partial}: parts {missing[:5]} were never written")
            moments = self._merge_moments()
            # Part records as before (`PartRecord`'s fields); their sidecars are listed in `moments`.
            sidecar = ("moments", "moments_sha256")
            manifest = {
                **self.plan,
                **(extra or {}),
                "seqs_per_part": self.seqs_per_part,
                "parts": [
                    {key: v for key, v in self.parts[k].items() if key not in sidecar} for k in range(self.num_parts)
                ],
                **({"moments": moments} if moments else {}),
            }
            # Every step below is one rename or a removal of what is no longer needed, so a stop anywhere
            # leaves either a build that resumes (progress.json is kept until the rename) or the new cache.
            _write_json_atomic(self.partial / MANIFEST, manifest)
            replaced = self.out.with_name(f".{self.out.name}.replaced")  # hidden: never listed as a cache
            shutil.rmtree(replaced, ignore_errors=True)  # left by a build stopped here before
            if self.out.exists():  # --overwrite (checked when the build started): set the old cache aside
                os.replace(self.out, replaced)
            os.replace(self.partial, self.out)
            for bookkeeping in (PROGRESS, PROGRESS_JOURNAL):
                (self.out / bookkeeping).unlink(missing_ok=True)
            shutil.rmtree(replaced, ignore_errors=True)
            self.timings.add("finish", time.perf_counter() - started)  # merged moments, manifest, rename
        except BaseException:
            self.abort()
            raise
        self.lock.release()
        return self.out

    def abort(self) -> None:
        """Stop: batches already queued are written (at most about a part per worker; after a worker's
        error, dropped), unfinished parts deleted, complete parts kept, so the build can resume."""
        self._join_workers()
        self._discard(self._open)
        self.lock.release()


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
    return PartRecord(
        file=file,
        num_seqs=_typed(p.get("num_seqs"), int, f"{file}'s num_seqs", where),
        rows=_typed(p.get("rows"), int, f"{file}'s rows", where),
        sha256=_typed(p.get("sha256"), str, f"{file}'s sha256", where),
        bytes=_typed(p.get("bytes"), int, f"{file}'s bytes", where),
        index=_typed(p.get("index"), int, f"{file}'s index", where, optional=True),
        first_seq=_typed(p.get("first_seq"), int, f"{file}'s first_seq", where, optional=True),
    )


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
    """One part file. Part `index` holds sequences from `first_seq` on (None in caches written before
    they were recorded: parts were then listed in order)."""

    file: str
    num_seqs: int
    rows: int
    sha256: str
    bytes: int
    index: int | None = None
    first_seq: int | None = None


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
    seqs_per_part: int | None  # None for caches written before it was recorded
    environment: dict | None  # fca.tables.environment's record; None for caches that predate it
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
                    fingerprint=tokenizer.get("fingerprint"), vocab_size=_optional_int(tokenizer.get("vocab_size"))
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
                coefficient_dtype=raw.get("coefficient_dtype", "float32"),
                sites={name: spec_from_json(d) for name, d in _typed(raw["sites"], dict, "sites", where).items()},
                parts=tuple(_part_record(p, where) for p in _typed(raw["parts"], list, "parts", where)),
                seqs_per_part=_typed(raw.get("seqs_per_part"), int, "seqs_per_part", where, optional=True),
                environment=_environment(raw.get("environment"), where),
                created=raw.get("created"),
                library_versions=_typed(raw.get("library_versions") or {}, dict, "library_versions", where),
                raw=raw,
            )
        except CacheError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
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
        elif self.seqs_per_part is not None and self.seqs_per_part < 1:
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
            if bad is not None:
                problem = f"part {bad.file} has {bad.rows} rows for {bad.num_seqs} sequences of {T} tokens"
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
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CacheError(f"{path}: not valid JSON ({err})") from None
    return Manifest.from_json(raw, str(path))


@dataclass
class Cache:
    """A finished cache opened for reading. Opening reads the manifest and one part's schema; a part's
    footer (its schema, checked, and its row groups' `seq` ranges) is read when a read first needs it,
    so opening and reading a few sequences cost the same with 10 parts or 10^5."""

    path: Path
    manifest: Manifest
    _footers: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _starts: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _read_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _verified: set = field(default_factory=set, init=False, repr=False, compare=False)  # part positions

    @property
    def site_specs(self) -> dict[str, SiteSpec]:
        return dict(self.manifest.sites)  # a copy: callers may reorder or filter it

    @property
    def sites(self) -> list[str]:
        return list(self.manifest.sites)

    @property
    def num_seqs(self) -> int:
        return self.manifest.num_seqs

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    @property
    def fingerprint(self) -> str:
        """Identity of the cache contents: the hash of its part hashes."""
        return self.manifest.contents_fingerprint

    def part_paths(self) -> list[Path]:
        return [self.path / p.file for p in self.manifest.parts]

    def dataset(self):
        """A pyarrow Dataset over the part files. pyarrow.dataset is imported here, not with this
        module: it pulls in pandas, which opening a cache and reading its footers never need
        and which would delay the dashboard's first page."""
        import pyarrow.dataset as ds

        return ds.dataset([str(p) for p in self.part_paths()], format="parquet")

    def _part_starts(self) -> np.ndarray:
        """[parts + 1] first sequence of every part in manifest order, and the end (the manifest's part
        records say it; older caches listed parts in order without it). Computed once per opened cache."""
        if self._starts is None:
            sizes = [p.num_seqs for p in self.manifest.parts]
            firsts = [p.first_seq for p in self.manifest.parts]
            starts = np.concatenate([[0], np.cumsum(sizes)]) if None in firsts else np.array([*firsts, self.num_seqs])
            self._starts = starts.astype(np.int64)
        return self._starts

    def _footer(self, position: int) -> tuple[Path, pq.ParquetFile, list[tuple[int, int, int]]]:
        """(path, open part file, [(row group, first seq, last seq)]) of the part at `position` in the
        manifest, its schema checked: read once per opened cache, on the first read that needs it."""
        with self._read_lock:  # the prefetch thread and the caller's may ask for the same part at once
            if position not in self._footers:
                self._footers[position] = self._read_footer(position)
            return self._footers[position]

    def _read_footer(self, position: int) -> tuple[Path, pq.ParquetFile, list[tuple[int, int, int]]]:
        path = self.path / self.manifest.parts[position].file
        try:
            part = pq.ParquetFile(path)
            check_part_schema(path, part.schema_arrow, self.expected_schema)
            groups = []
            for i in range(part.metadata.num_row_groups):
                stats = part.metadata.row_group(i).column(0).statistics
                if stats is None or not stats.has_min_max:
                    raise CacheError(f"{path}: row group {i} has no `seq` statistics")
                groups.append((i, int(stats.min), int(stats.max)))
        except (pa.ArrowInvalid, OSError) as err:
            raise CacheError(f"{path}: unreadable part file ({str(err).splitlines()[0]})") from None
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
        starts = self._part_starts()
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
                try:
                    with self._read_lock:  # one open file, read from the prefetch thread and the caller's
                        pieces.append(part.read_row_group(i, columns=columns))
                except (pa.ArrowInvalid, OSError) as err:
                    raise CacheError(f"{path}: unreadable part file ({str(err).splitlines()[0]})") from None
        if not pieces:
            return pa.schema([pa.field("seq", pa.int32())]).empty_table()
        # "default" unifies list items declared nullable and not: a cache an older FCA began and this one
        # resumed has parts of both kinds.
        table = pa.concat_tables(pieces, promote_options="default")
        seq = table.column("seq").to_numpy()
        keep = np.isin(seq, w)
        return table if keep.all() else table.filter(pa.array(keep))

    def iter_batches(
        self, columns: Sequence[str] | None = None, batch_size: int = 65536, decode: bool = True
    ) -> Iterator[pa.RecordBatch]:
        """Stream record batches (one part file, one row group at a time); memory stays bounded.

        With `decode` (the default) site columns come as FixedSizeList<float32> whatever the stored type
        (bfloat16 bits are widened exactly); without, as stored."""
        for path in self.part_paths():
            try:
                batches = pq.ParquetFile(path).iter_batches(
                    batch_size=batch_size, columns=list(columns) if columns else None
                )
                for batch in batches:
                    yield _decoded(batch) if decode else batch
            except (pa.ArrowInvalid, OSError) as err:
                raise CacheError(f"{path}: unreadable part file ({str(err).splitlines()[0]})") from None

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
        table = self._read_rows(wanted, ["seq", "pos", "token", "target", "live_nll", *sites])
        T = self.seq_len
        if table.num_rows != len(wanted) * T:
            raise CacheError(
                f"{self.path}: expected {len(wanted) * T} rows for {len(wanted)} sequences, found {table.num_rows}"
            )
        order = np.lexsort((table.column("pos").to_numpy(), table.column("seq").to_numpy()))
        row_of = {s: i for i, s in enumerate(wanted)}
        pick = np.array([row_of[s] for s in seqs])
        out: dict[str, np.ndarray] = {}
        for key in ("token", "target", "live_nll"):
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

    @property
    def environment(self) -> dict | None:
        """Where the coefficients were computed (fca.tables.environment), or None for caches that predate the record."""
        return self.manifest.environment

    @property
    def model_dtype(self) -> str:
        return self.manifest.model_dtype

    @property
    def coefficient_dtype(self) -> str:
        return self.manifest.coefficient_dtype

    @property
    def vocab_size(self) -> int | None:
        """`Manifest.vocab_size`: the tokenizer record, else the model config, else None."""
        return self.manifest.vocab_size

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

    def span_hashes(self, span: int, chunk: int = 1024) -> np.ndarray:
        """The distinct hashes of every `span`-token stretch of every sequence's window (its T tokens and
        last target), read `chunk` sequences at a time: what two caches' text shares, wherever the window
        boundaries fall and whatever their manifests say of where it came from."""
        hashes = []
        for lo in range(0, self.num_seqs, chunk):
            rows = self.read_seqs(range(lo, min(self.num_seqs, lo + chunk)), sites=[])
            windows = np.concatenate([rows["token"], rows["target"][:, -1:]], axis=1)  # [n, T + 1]
            hashes.append(np.unique(span_hashes(windows, span)))
        return np.unique(np.concatenate(hashes)) if hashes else np.zeros(0, np.uint64)

    def verify(self, seqs: range | None = None) -> None:
        """Recompute the sha256 of every part (or of those holding `seqs`) against the manifest; a part is
        hashed once per opened cache."""
        starts = self._part_starts()
        for position, part in enumerate(self.manifest.parts):
            if position in self._verified:
                continue
            if seqs is not None and not (starts[position] < seqs.stop and seqs.start < starts[position + 1]):
                continue
            path = self.path / part.file
            if not path.is_file():
                raise CacheError(f"{path}: part file missing")
            if file_sha256(path) != part.sha256:
                raise CacheError(f"{path}: contents do not match the manifest's sha256 (corrupt or modified)")
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


def check_part_schema(part: Path, schema: pa.Schema, expected: pa.Schema) -> None:
    """CacheError naming the part and column when `schema` lacks a column of `expected` or types it otherwise."""
    for column_field in expected:
        if column_field.name not in schema.names:
            raise CacheError(f"{part}: column {column_field.name!r} is missing")
        if not same_site_type(schema.field(column_field.name).type, column_field.type):
            raise CacheError(
                f"{part}: column {column_field.name!r} has type {schema.field(column_field.name).type}, "
                f"expected {column_field.type}"
            )


def open_cache(path: str | Path, verify: bool = False) -> Cache:
    """Open a finished cache: checks the manifest, that every part file is there with its recorded
    size, and the first part's schema (the others' when first read; `verify=True` checks every part's
    hash). Raises `CacheError` with a one-line reason."""
    path = Path(path).resolve() if str(path) in ("", ".") else Path(path)  # ("" and "." name no folder)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CacheError(f"{path}: cache directory not found")
    if not manifest_path.is_file():
        hint = (
            " (an unfinished build: rerun build-cache to resume)"
            if path.with_name(path.name + ".partial").exists() or path.name.endswith(".partial")
            else ""
        )
        raise CacheError(f"{manifest_path}: missing; not a finished cache{hint}")
    cache = Cache(path, read_manifest(path))
    # Every part must be there with the size the manifest records (a stat each: truncated or overwritten
    # parts are refused here); one part's schema is read now, each other's when a read first needs it
    # (`Cache._footer`), so a cache of 10^5 parts opens as fast as one of 10.
    for record in cache.manifest.parts:
        part = path / record.file
        try:
            size = part.stat().st_size
        except FileNotFoundError:
            raise CacheError(f"{part}: part file missing") from None
        if size != record.bytes:
            if verify:
                cache.verify()  # names the part whose hash differs
            raise CacheError(
                f"{part}: not the part the manifest records ({size:,} bytes, recorded {record.bytes:,}: "
                "truncated or overwritten)"
            )
    if cache.manifest.parts:
        first = path / cache.manifest.parts[0].file
        try:
            schema = pq.read_schema(first)
        except (pa.ArrowInvalid, OSError) as err:
            raise CacheError(f"{first}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
        check_part_schema(first, schema, cache.expected_schema)
    if verify:
        cache.verify()
    return cache
