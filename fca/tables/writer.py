"""Writing a cache: parts written by a pool of threads and committed to `<out>.partial/`, resumable, one
build at a time (`fca.tables.writer_store` keeps the parts, the commit protocol and the lock).

Part k always holds sequences [k * S, (k + 1) * S) for the cache's `seqs_per_part` S, so several writer
threads (or Ray actors, each with a shard writer) can fill different parts at once and the files do not
depend on how many did.
"""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fca.tables.errors import CacheError
from fca.tables.schema import (
    KEY_COLUMNS,
    MANIFEST,
    MOMENTS,
    PLAN,
    arrays_bytes,
    arrow_numpy,
    coefficient_values,
    moments_file,
)
from fca.tables.stats import Moments, MomentsMerger, merge_token_sums, moments_arrays, token_groups, token_sums
from fca.tables.timings import Timings
from fca.tables.writer_store import BuildLock, PartStore, RecordLock, is_uri

TOKEN_SUMS_ALLOWANCE = 2**20  # bytes of a part's token-id sums that are always kept (see `_close_part`)


# A build's plan entries as its options name them, to say which settings kept an unfinished build from
# resuming. A difference is named by the longest key path listed here that begins its path (else by its
# own path); `num_tokens` and `raw_bytes_per_token` follow from the others and are named only alone.
PLAN_SETTINGS = {
    ("environment", "batch_size"): "batch",
    ("environment", "model_dtype"): "dtype",
    ("environment", "device_type"): "device",
    ("environment", "device_name"): "device",
    ("num_seqs",): "num-seqs",
    ("seq_len",): "seq-len",
    ("coefficient_dtype",): "coefficient-dtype",
    ("corpus", "split"): "split",
    ("corpus", "split_seed"): "split-seed",
    ("corpus", "text_column"): "text-column",
    ("corpus",): "corpus",
    ("model",): "model",
    ("tokenizer",): "tokenizer",
    ("sites",): "sites",
    ("seqs_per_part",): "sequences per part",
}
DERIVED_PLAN_ENTRIES = {("num_tokens",), ("raw_bytes_per_token",)}
_ABSENT = object()


def _plan_differences(before: object, now: object, path: tuple = ()) -> list[tuple[tuple, object, object]]:
    """(key path, value before, value now) of every entry in which two plans differ, in the plans' order."""
    if isinstance(before, dict) and isinstance(now, dict):
        keys = list(dict.fromkeys([*before, *now]))
        return [d for k in keys for d in _plan_differences(before.get(k, _ABSENT), now.get(k, _ABSENT), (*path, k))]
    return [] if before == now else [(path, before, now)]


def settings_changed(before: dict, now: dict) -> str:
    """The settings in which an unfinished build's plan (`before`) differs from this build's (`now`), as the
    build's options name them: e.g. "batch 8 -> 16, split eval -> calibration", or "model" where the
    values (a fingerprint, a config) say nothing in a line."""
    differences = _plan_differences(before, now)
    named = [d for d in differences if d[0] not in DERIVED_PLAN_ENTRIES] or differences
    values: dict[str, list[tuple[object, object]]] = {}
    for path, old, new in named:
        prefix = max((key for key in PLAN_SETTINGS if path[: len(key)] == key), key=len, default=None)
        values.setdefault(PLAN_SETTINGS[prefix] if prefix else ".".join(map(str, path)), []).append((old, new))

    def shown(value: object) -> str:
        return "none" if value is _ABSENT or value is None else str(value)

    def short(value: object) -> bool:
        return (
            value is _ABSENT
            or isinstance(value, (int, float, type(None)))
            or (isinstance(value, str) and len(value) <= 24)
        )

    return ", ".join(
        f"{name} {shown(pairs[0][0])} -> {shown(pairs[0][1])}"
        if len(pairs) == 1 and all(map(short, pairs[0]))
        else name
        for name, pairs in values.items()
    )


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
    tokens = arrow_numpy(batch.column("token")).reshape(num_seqs, T)
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


def check_cache_destination(out: str | Path, overwrite: bool) -> None:
    """Refuse `out` unless it is new, or (with `overwrite`) an empty folder or a finished cache alone."""
    PartStore(out).check_destination(overwrite)


def build_lock(out: str | Path) -> BuildLock | RecordLock:
    """The lock of the cache `out`: `<out>.lock` beside it."""
    return PartStore(out).lock()


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


class CacheWriter:
    """Writes a cache into `<out>.partial/` (`out` a folder or a pyarrow filesystem URI), part by part;
    `finish()` publishes it.

    `plan` is the manifest draft (everything but the part list; it must hold `num_seqs`). Part k holds
    sequences [k * S, (k + 1) * S), S = `seqs_per_part`, whatever the number of `workers`: with
    `workers=1` parts are written in the caller's thread; with more, by a thread pool, each part by one
    thread at a time (a part's pieces are written in order), and `write` returns once the batch is
    queued. pyarrow encodes and compresses without the GIL, so the threads scale with cores. Memory: at
    most `workers` x S sequences queued or being written. After a thread's error, queued batches are
    dropped and the error is raised in the caller at the next `write` or at `finish`.

    Each complete part is committed (`PartStore.commit_part`): its file, its moments sidecar
    (`fca.tables.stats`: count, sums, sums of squares, per-position and per-sequence sums, extremes,
    sparse token-id sums), then its record. A writer of the same plan and S resumes the committed parts:
    `pending_ranges()` are the sequences still to write, in whole parts; an unfinished build of another
    plan is cleared, and `started_over` says which settings differed. `finish` merges the sidecars in part
    order into `moments.npz`, which `fca.tables.profiles.cache_moments` reads instead of the parts.

    `shard` (part indices) makes a *shard writer* for distributed builds: it commits only those parts into
    the driver's `<out>.partial/`, takes no lock and resumes nothing; the driver (a normal writer holding
    the lock) records what `close_shard()` returns with `add_parts`.
    """

    def __init__(
        self,
        out: str | Path,
        plan: dict,
        schema: pa.Schema,
        seqs_per_part: int,
        overwrite: bool = False,
        workers: int = 1,
        shard: Sequence[int] | None = None,
        timings: Timings | None = None,
    ) -> None:
        self.store = PartStore(out)
        self.out = out if is_uri(out) else Path(out)
        self.partial = self.store.shown
        self.timings = timings if timings is not None else Timings()  # encode, moments, close_part, ...
        self.schema, self.plan = schema, plan
        self.seqs_per_part = int(seqs_per_part)
        if self.seqs_per_part < 1:
            raise CacheError(f"{self.out}: seqs_per_part must be at least 1, not {seqs_per_part}")
        self.num_seqs = int(plan["num_seqs"])
        self.num_parts = -(-self.num_seqs // self.seqs_per_part)
        self.sites = [f.name for f in schema if f.name not in KEY_COLUMNS]
        self.shard = None if shard is None else sorted({int(k) for k in shard})
        self.lock = self.store.lock()
        # Why an unfinished build in `<out>.partial/` was cleared instead of resumed (its plan differs), in a
        # line for the caller to show; None when there was none, or it was resumed.
        self.started_over: str | None = None
        self.parts: dict[int, dict] = {}
        if self.shard is not None:
            bad = [k for k in self.shard if not 0 <= k < self.num_parts]
            if bad:
                raise CacheError(f"{self.partial}: parts {bad[:5]} are outside the plan's {self.num_parts} parts")
            if not self.store.exists(self.store.path(PLAN)):
                raise CacheError(f"{self.partial}: a shard writer needs the driver's partial directory")
        else:
            self.lock.acquire()
            try:
                self.store.check_destination(overwrite)
                kept, earlier = self.store.begin({"plan": plan, "seqs_per_part": self.seqs_per_part})
                self.parts = {int(r["index"]): r for r in kept}
                if earlier is not None:  # said, not done silently: the rerun with another flag loses its parts
                    before = {**(earlier.get("plan") or {}), "seqs_per_part": earlier.get("seqs_per_part")}
                    changed = settings_changed(before, {**plan, "seqs_per_part": self.seqs_per_part})
                    self.started_over = (
                        f"{self.partial}: unfinished build with other settings ({changed}); starting over"
                    )
            except BaseException:
                self.lock.release()
                raise
        self._cond = threading.Condition()  # guards `parts`, the queue and the failures
        # Moments merged in part order as parts complete (`merge_committed`); `_kept`: parts of an earlier run.
        self._merge_lock = threading.Lock()
        self._merger = self._new_merger()
        self._merged_through = 0  # parts [0, this) are merged
        self._held: dict[int, dict | None] = {}
        self._kept = set(self.parts)
        self._failures: list[BaseException] = []
        self._open: dict[int, _OpenPart] = {}  # parts being written
        workers = max(1, min(int(workers), self.num_parts))  # a thread writes a whole part: more would idle
        self._bound = workers * self.seqs_per_part
        self._pending = 0  # sequences queued or being written
        self._queued: dict[int, deque] = {}  # part -> its pieces waiting, for the one thread draining it
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fca-cache-writer") if workers > 1 else None

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
        if not batch.schema.equals(self.schema):
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
            if self.shard is not None and k not in self.shard:
                raise CacheError(f"{self.partial}: part {k} is not in this writer's shard {self.shard[:5]}")
            if k in self.parts:
                raise CacheError(
                    f"{self.partial}: part {k} is already complete; sequences {lo}..{hi - 1} written twice"
                )
            piece = batch.slice((lo - first) * rows_per_seq, (hi - lo) * rows_per_seq)
            if self._pool is not None:
                self._put(k, piece, hi - lo)
            else:
                self._write_piece(k, piece, hi - lo)
            lo = hi

    def _put(self, k: int, piece: pa.RecordBatch, n: int) -> None:
        """Queue a piece of part k; a part is drained by one pool task at a time, so its pieces are written
        in order while any free thread takes the next part (a slow part holds up no other)."""
        with self._cond, self.timings("queue_wait"):
            # An empty queue takes any piece, so a piece larger than the bound cannot wait forever.
            while self._pending and self._pending + n > self._bound and not self._failures:
                self._cond.wait(0.5)
            self._pending += n
            start = k not in self._queued
            self._queued.setdefault(k, deque()).append((piece, n))
        if start:
            self._pool.submit(self._drain, k)

    def _drain(self, k: int) -> None:
        while True:
            with self._cond:
                if not self._queued[k]:
                    del self._queued[k]
                    return
                piece, n = self._queued[k].popleft()
            try:
                if not self._failures:
                    self._write_piece(k, piece, n)
            except BaseException as err:  # raised again in the caller's thread
                with self._cond:
                    self._failures.append(err)
            finally:
                with self._cond:
                    self._pending -= n
                    self._cond.notify_all()

    def _write_piece(self, k: int, piece: pa.RecordBatch, n: int) -> None:
        """Write a piece of part k (committing the part when complete). An OSError that names no file (a
        full disk: Arrow's "Error writing bytes to file. Detail: [errno 28] ...") is given the part's name."""
        name = f"part-{k:05d}.parquet"
        try:
            part = self._open.get(k)
            if part is None:
                part = self._open[k] = _OpenPart(k, name, self.store.parquet_writer(name, self.schema))
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
                with self.timings("close_part"):  # footer, moments sidecar, hashes, record, merge
                    self._close_part(self._open.pop(k))
        except OSError as err:
            if err.filename is not None:
                raise
            detail = str(err).rsplit("Detail: ", 1)[-1]
            reason = detail.split("] ", 1)[-1] if detail.lower().startswith("[errno") else detail
            raise OSError(err.errno or errno.EIO, reason or type(err).__name__, self.store.where(name)) from None

    def _check_finite(self, part: _OpenPart) -> None:
        """Refuse a part whose coefficients hold NaN or inf, read off its moments (a NaN or inf makes its
        slot's sum and extremes non-finite, so no value is scanned twice): a cache of them passed
        `inspect --verify` and was refused only by replay."""
        m = part.moments
        bad = ~(np.isfinite(m.sum) & np.isfinite(m.minimum) & np.isfinite(m.maximum))  # [C]
        if bad.any():
            lo, hi = self.part_range(part.index)
            widths = [self.schema.field(name).type.list_size for name in self.sites]
            site = self.sites[int(np.searchsorted(np.cumsum(widths), int(np.argmax(bad)), side="right"))]
            raise CacheError(
                f"{self.store.where(part.file)}: the model computed non-finite coefficients (NaN or inf) at site "
                f"{site!r} in sequences {lo}-{hi - 1}; a cache of them could not be replayed (NaN weights, or a "
                "controller that overflows)"
            )

    def _close_part(self, part: _OpenPart) -> None:
        part.writer.close()
        self._check_finite(part)
        tokens = None
        if part.token_pieces is not None:
            tokens = merge_token_sums(part.token_pieces, part.moments.num_slots)
            if not _tokens_fit(len(tokens[0]), part.moments.num_slots, part.rows):
                tokens = None  # the merged moments then have no token-id factor (`cache_moments`)
        arrays = moments_arrays(part.moments, tokens)
        sidecar, moments = arrays_bytes(arrays), moments_file(part.file)
        self.store.put(moments, sidecar)
        record = {
            "index": part.index,
            "file": part.file,
            "first_seq": self.part_range(part.index)[0],
            "num_seqs": part.num_seqs,
            "rows": part.rows,
            "sha256": self.store.sha256(part.file + ".tmp"),
            "bytes": self.store.size(part.file + ".tmp"),
            "moments": moments,
            "moments_sha256": hashlib.sha256(sidecar).hexdigest(),
        }
        self.store.commit_part(part.file, record)
        self.add_parts([record])
        if self.shard is None:  # a shard writer's parts are merged by the driver's writer
            self.merge_committed(part.index, arrays)

    def add_parts(self, records: Sequence[dict]) -> None:
        """Take complete parts as committed (here, or by shard writers)."""
        with self._cond:
            for record in records:
                self.parts[int(record["index"])] = record

    def _discard(self) -> None:
        """Close unfinished parts without committing them (the partial folder stays resumable)."""
        for part in self._open.values():
            with suppress(Exception):  # the part is being thrown away; its file goes next
                part.writer.close()
            self.store.drop(part.file + ".tmp")
        self._open.clear()

    def _raise_failure(self) -> None:
        if self._failures:
            raise self._failures[0]

    def _join_workers(self) -> None:
        """Let the threads write what is queued (or drop it, after an error), then wait for them."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

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

    def merge_committed(self, k: int, arrays: dict | None = None) -> None:
        """Part k's moments (None: in its sidecar), just committed: merged now if every part before it
        is, else held until they are (in part order, so the bits do not depend on which thread finished
        first). Parts kept from an earlier run are read from their sidecars when their turn comes. The
        driver of a distributed build calls it as each shard writer's part commits."""
        with self._merge_lock:
            self._held[k] = arrays
            while (j := self._merged_through) in self._held or j in self._kept:
                block = self._held.pop(j, None)
                self._kept.discard(j)
                self._merger.add(block if block is not None else self.store.get_arrays(self.parts[j]["moments"]))
                self._merged_through += 1

    def _merge_moments(self) -> dict:
        """Merge the parts' moments in part order into `moments.npz` (the parts not merged while the build
        ran are read from their sidecars); -> the manifest's `moments` entry."""
        records = [self.parts[k] for k in range(self.num_parts)]
        with self._merge_lock:
            for r in records[self._merged_through :]:
                self._merger.add(self.store.get_arrays(r["moments"]))
            self._merged_through = self.num_parts
            merged, with_tokens = self._merger.result()
        arrays = moments_arrays(merged)
        if with_tokens:  # stored sparse, like the parts': only the ids the cache holds
            seen = np.flatnonzero(merged.tok_count > 0)
            arrays.update(tok_ids=seen, tok_count=merged.tok_count[seen], tok_sum=merged.tok_sum[seen])
        data = arrays_bytes(arrays)
        self.store.put(MOMENTS, data)
        return {
            "file": MOMENTS,
            "sha256": hashlib.sha256(data).hexdigest(),
            "token_sums": with_tokens,
            # The parts these moments describe (`Manifest.contents_fingerprint`): a part rewritten later no
            # longer matches, and readers then scan instead of trusting stale sums.
            "contents": hashlib.sha256("".join(r["sha256"] for r in records).encode()).hexdigest(),
            # The per-part sidecars, in part order, for merging a subset of parts.
            "parts": [[r["moments"], r["moments_sha256"]] for r in records],
        }

    def finish(self, extra: dict | None = None) -> Path | str:
        """Wait for the threads, check every part is complete, write the manifest, publish the cache."""
        try:
            with self.timings("finish_wait"):  # the threads' last parts
                self._join_workers()
            started = time.perf_counter()
            self._raise_failure()
            if self._open:
                raise CacheError(f"{self.partial}: parts {sorted(self._open)} are incomplete (sequences missing)")
            missing = [k for k in range(self.num_parts) if k not in self.parts]
            if missing:
                raise CacheError(f"{self.partial}: parts {missing[:5]} were never written")
            moments = self._merge_moments()
            sidecar = ("moments", "moments_sha256")  # listed in `moments`, not in the part records
            parts = [{key: v for key, v in self.parts[k].items() if key not in sidecar} for k in range(self.num_parts)]
            manifest = {**self.plan, **(extra or {}), "seqs_per_part": self.seqs_per_part, "parts": parts}
            self.store.put_json(MANIFEST, {**manifest, "moments": moments})
            self.store.publish([name for r in self.parts.values() for name in (r["file"], r["moments"])] + [MOMENTS])
            self.timings.add("finish", time.perf_counter() - started)  # merged moments, manifest, publishing
        except BaseException:
            self.abort()
            raise
        self.lock.release()
        return self.out

    def abort(self) -> None:
        """Stop: batches already queued are written (after a thread's error, dropped), unfinished parts
        deleted, complete parts kept, so the build can resume."""
        self._join_workers()
        self._discard()
        self.lock.release()
