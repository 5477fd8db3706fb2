"""Writing a cache: atomic, resumable, one build at a time.

A build writes into `<name>.partial/` next to the destination; complete parts are renamed from
`*.tmp` and listed in `progress.json`, so an interrupted build can resume. Only the final step writes
`manifest.json` and renames the directory into place: a directory with a manifest is a finished cache.
Part k always holds sequences [k * S, (k + 1) * S) for the cache's `seqs_per_part` S, so several
writer threads can fill different parts at once and the files do not depend on how many did.
`<name>.lock` beside the destination admits one build at a time.
"""

from __future__ import annotations

import calendar
import errno
import hashlib
import json
import mmap
import os
import re
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fca.tables.errors import CacheError
from fca.tables.outputs import OutputError, atomic_write_text, check_replaceable
from fca.tables.schema import (
    KEY_COLUMNS,
    MANIFEST,
    MOMENTS,
    PROGRESS,
    PROGRESS_JOURNAL,
    arrow_numpy,
    byte_stream_split_columns,
    coefficient_values,
    file_sha256,
    is_cache_file,
    is_partial_file,
    moments_file,
    read_arrays,
    write_arrays,
)
from fca.tables.stats import Moments, MomentsMerger, merge_token_sums, moments_arrays, token_groups, token_sums
from fca.tables.timings import Timings

# The journal (PROGRESS_JOURNAL) lists the parts recorded since progress.json was last rewritten, one JSON
# record per line. Rewriting progress.json
# for every part costs O(parts) each, O(parts^2) in all; it is rewritten only once the journal holds more
# than 1/8 of its parts, or 8 records while there are up to 64, so recording costs O(1) per part. A small
# build (the demo's 8 parts) then only appends: a rewrite (a new file, then a rename) had cost its writer
# about 0.3 ms per part, 8x an append. progress.json is written when the build starts, with the plan.
PROGRESS_REWRITE_PARTS = 64
TOKEN_SUMS_ALLOWANCE = 2**20  # bytes of a part's token-id sums that are always kept (see `_close_part`)


def read_progress(partial: str | Path) -> dict | None:
    """What a build's `<out>.partial/` says it has done: its plan, `seqs_per_part` and `parts` (the records
    in progress.json, then those of its journal); None when there is no readable progress.json. A record
    that is not a part's (a journal line cut short by a crash, a damaged entry) is skipped: that part is
    written again."""
    partial = Path(partial)
    try:
        progress = json.loads((partial / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(progress, dict) or not isinstance(progress.get("parts"), list):
        return None
    records = list(progress["parts"])
    journal = partial / PROGRESS_JOURNAL
    try:
        lines = journal.read_bytes().decode("utf-8", errors="replace").splitlines() if journal.is_file() else []
    except OSError:
        lines = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    progress["parts"] = [r for r in records if _is_part_record(r)]
    return progress


def _is_part_record(record: object) -> bool:
    """A part's record as `_close_part` writes it: index, part file name, sequence count and hashes."""

    def whole(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(record, dict) or not whole(record.get("index")) or not whole(record.get("num_seqs")):
        return False
    names = [record.get("file"), *([record["moments"]] if "moments" in record else [])]
    hashes = [record.get("sha256"), *([record.get("moments_sha256")] if "moments" in record else [])]
    return all(isinstance(n, str) and PART_FILE.fullmatch(n) for n in names) and all(isinstance(h, str) for h in hashes)


PART_FILE = re.compile(r"part-\d+(\.moments\.npz|\.parquet)")  # the files a part's record may name


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


def _write_json_atomic(path: Path, obj: dict, indent: int | None = 1) -> None:
    """`indent=None` for files only the library reads: json's C encoder then writes them, 5x faster than
    its Python one (which `indent` needs), and a writer thread holds the GIL that much less."""
    atomic_write_text(path, json.dumps(obj, indent=indent))


def check_cache_destination(out: str | Path, overwrite: bool) -> None:
    """Refuse `out` unless it is new, or (with `overwrite`) an empty folder or a finished cache alone
    (`fca.tables.outputs.check_replaceable`), as a `CacheError`."""
    try:
        check_replaceable(out, "cache", is_cache_file, MANIFEST, overwrite)
    except OutputError as err:
        raise CacheError(str(err)) from None


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
UNREADABLE_LOCK_STALE_S = 10.0  # a lock is written the moment it is created; one still empty is a crash's
LOCK_CLOCK_SLACK_S = 2.0  # a lock's time has whole seconds, and /proc's start times follow the boot clock
LOCK_KEYS = {"pid", "host", "started", "token"}


def _process_started(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), from Linux's /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # (the name may hold spaces)
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _lock_time(started: object) -> float | None:
    try:
        return calendar.timegm(time.strptime(str(started), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None


def holder_is_dead(holder: dict) -> bool:
    """A lock's holder (its `host` and `pid`) that is known dead: on this host, no such process, this
    process's pid taken by another process before it, or a process with its pid that started after the lock
    was taken (pids start over when a container restarts, and the host name stays). A holder on another
    host cannot be checked and counts as alive."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return holder.get("token") != PROCESS_TOKEN
    if not _pid_alive(pid):
        return True
    started, taken = _process_started(pid), _lock_time(holder.get("started"))
    return started is not None and taken is not None and started > taken + LOCK_CLOCK_SLACK_S


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
        """The holder's record; {} for an empty lock (a build that crashed between creating and writing it).
        Anything else at the lock's path is not FCA's (`Cargo.lock` beside `--out Cargo`, a folder): it
        must never be taken over, which would delete it."""
        try:
            if self.path.is_file() and self.path.stat().st_size == 0:
                return {}
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            raise self._not_ours() from None
        if not isinstance(holder, dict) or not {"pid", "host", "started"} <= set(holder) <= LOCK_KEYS:
            raise self._not_ours()
        return holder

    def _not_ours(self) -> CacheError:
        return CacheError(
            f"{self.what}: {self.path} is in the way of its build lock, and it is not one (another tool's "
            "file?); it was left alone: build to another --out, or move it"
        )

    def _stale(self, holder: dict) -> bool:
        if not holder:  # empty: a build that crashed between creating and writing it (or one writing it now)
            try:
                return time.time() - self.path.stat().st_mtime > UNREADABLE_LOCK_STALE_S
            except OSError:
                return False
        return holder_is_dead(holder)

    def check_free(self) -> None:
        """Refuse now if another build holds the lock (`acquire` takes it later, when the writer starts; a
        build checks first, before minutes of loading a model and reading a corpus)."""
        if self.path.exists() or self.path.is_symlink():
            holder = self._read()
            if not self._stale(holder):
                raise self._refusal(holder)

    def _refusal(self, holder: dict) -> CacheError:
        who = (
            f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
            if holder
            else f"its lock is still empty; delete it if no build is running, or wait {UNREADABLE_LOCK_STALE_S:g} s"
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
            except OSError as err:  # (a read-only or virtual folder: the cache could not be written there either)
                raise CacheError(
                    f"{self.what}: cannot create its build lock {self.path} ({err.strerror or err})"
                ) from None
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
            except OSError as err:  # (a full disk: an empty lock left behind would refuse the retry)
                self.path.unlink(missing_ok=True)
                raise CacheError(
                    f"{self.what}: cannot write its build lock {self.path} ({err.strerror or err})"
                ) from None
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
    incomplete parts, to be written again in full; one of another plan is deleted, and `started_over`
    says which settings differed. A lock beside the destination refuses a second build.

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
        # Why an unfinished build in `<out>.partial/` was discarded instead of resumed (its plan differs), in
        # a line for the caller to show; None when there was none, or it was resumed.
        self.started_over: str | None = None
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
            else:  # said, not done silently: the rerun of an interrupted build with another flag loses its parts
                before = {**(progress.get("plan") or {}), "seqs_per_part": progress.get("seqs_per_part")}
                changed = settings_changed(before, {**self.plan, "seqs_per_part": self.seqs_per_part})
                self.started_over = f"{self.partial}: unfinished build with other settings ({changed}); starting over"
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
        """Write a piece of part k (closing the part when complete). An OSError that names no file (a full
        disk: Arrow's "Error writing bytes to file. Detail: [errno 28] ...") is given the part's name."""
        try:
            self._write_piece_of(open_parts, k, piece, n)
        except OSError as err:
            if err.filename is not None:
                raise
            detail = str(err).rsplit("Detail: ", 1)[-1]
            reason = re.sub(r"^\[errno \d+\] ", "", detail, flags=re.I) or type(err).__name__
            raise OSError(err.errno or errno.EIO, reason, str(self.partial / f"part-{k:05d}.parquet")) from None

    def _write_piece_of(self, open_parts: dict[int, _OpenPart], k: int, piece: pa.RecordBatch, n: int) -> None:
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

    def _check_finite(self, part: _OpenPart) -> None:
        """Refuse a part whose coefficients hold NaN or inf, read off its moments (a NaN or inf makes its
        slot's sum and extremes non-finite, so no value is scanned twice): a model with NaN weights, or a
        controller that overflows, was cached, passed `inspect --verify`, and was refused only by replay."""
        m = part.moments
        bad = ~(np.isfinite(m.sum) & np.isfinite(m.minimum) & np.isfinite(m.maximum))  # [C]
        if bad.any():
            lo, hi = self.part_range(part.index)
            widths = [self.schema.field(name).type.list_size for name in self.sites]
            site = self.sites[int(np.searchsorted(np.cumsum(widths), int(np.argmax(bad)), side="right"))]
            raise CacheError(
                f"{self.partial / part.file}: the model computed non-finite coefficients (NaN or inf) at site "
                f"{site!r} in sequences {lo}-{hi - 1}; a cache of them could not be replayed (NaN weights, or a "
                "controller that overflows)"
            )

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
        self._check_finite(part)
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
