"""Where a cache build keeps its parts: `<out>.partial/` on a pyarrow filesystem, local or a URI.

One commit protocol for both: a part is committed by writing its Parquet file and moments sidecar, then
`part-XXXXX.record.json` (its part record, with both files' sha256). A part without a record, or whose
files no longer have the recorded bytes, is written again. `plan.json` holds the manifest draft and the
part size; a build with another plan starts over. Resuming is listing the records.

Finishing writes `manifest.json` last. On a local filesystem (`file://` included) the partial folder is
renamed into place; on an object store (no folder rename) the files are moved one by one, the manifest
last, so nothing at the destination looks finished before it is.

One build per cache: `<out>.lock` beside it, held with `filelock` (an OS lock, let go by the OS when its
holder dies) where the filesystem is local. An object store has no lock: there the lock is a record that
is checked and then written, which cannot be atomic; run one build per URI.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import time
from contextlib import suppress
from pathlib import Path

import filelock
import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from fca.tables.errors import CacheError
from fca.tables.jsonfile import parse_json
from fca.tables.outputs import OVERWRITE_HINT, OutputError, check_replaceable
from fca.tables.schema import (
    MANIFEST,
    PLAN,
    RECORD_SUFFIX,
    byte_stream_split_columns,
    is_cache_file,
    is_part_file,
    is_partial_file,
    read_arrays,
    stream_sha256,
)

LOCK_KEYS = {"pid", "host", "started"}


def is_uri(target: str | Path) -> bool:
    """A string naming a filesystem by scheme (`s3://bucket/cache`, `file:///data/cache`)."""
    return isinstance(target, str) and "://" in target


def resolve(out: str | Path) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) of a cache destination; CacheError when pyarrow cannot open a URI."""
    if not is_uri(out):
        return pafs.LocalFileSystem(), str(Path(out).absolute())
    try:
        fs, path = pafs.FileSystem.from_uri(out)
    except (ValueError, OSError) as err:  # unknown scheme, no credentials, pyarrow built without it
        raise CacheError(f"{out}: not a filesystem pyarrow can open ({str(err).splitlines()[0]})") from None
    return fs, path.rstrip("/")


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ")}


def _refusal(what: object, lock: object, holder: dict) -> CacheError:
    who = f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder else "unnamed"
    return CacheError(f"{what}: another build is writing this cache ({who}); lock {lock}")


class BuildLock:
    """`<out>.lock` on a local filesystem: an OS file lock (`filelock`), so a killed build's lock is free
    again. The file holds the holder's pid, host and start time, to name it in a refusal. A file at that
    path that is not such a lock (another tool's `Cargo.lock` beside `--out Cargo`) is never touched."""

    def __init__(self, path: Path, what: object) -> None:
        self.path, self.what = Path(path), what
        self._lock: filelock.BaseFileLock | None = None

    def _recorded(self) -> dict:
        """The holder's record; {} for no file, or an empty one (a build that stopped before writing it)."""
        if not self.path.exists() and not self.path.is_symlink():
            return {}
        try:
            text = self.path.read_text() if self.path.is_file() else None
            holder = parse_json(text, str(self.path)) if text else {} if text == "" else None
        except (OSError, ValueError):
            holder = None
        if not isinstance(holder, dict) or holder and not LOCK_KEYS <= set(holder) <= LOCK_KEYS | {"token"}:
            raise CacheError(
                f"{self.what}: {self.path} is in the way of its build lock, and it is not one (another tool's "
                "file?); it was left alone: build to another --out, or move it"
            )
        return holder

    def _take(self) -> filelock.BaseFileLock:
        holder = self._recorded()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError as err:  # a read-only or virtual folder: the cache could not be written there either
            raise CacheError(f"{self.what}: cannot create its build lock {self.path} ({err.strerror or err})") from None
        lock = filelock.FileLock(self.path, thread_local=False)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            raise _refusal(self.what, self.path, self._recorded() or holder) from None
        return lock

    def check_free(self) -> None:
        """Refuse now if another build holds the lock (a build checks before minutes of loading)."""
        if os.path.lexists(self.path):
            self._take().release()

    def acquire(self) -> None:
        lock = self._take()
        try:
            with open(self.path, "w") as f:
                json.dump(_holder(), f)
        except OSError as err:  # (a full disk)
            self.path.unlink(missing_ok=True)
            lock.release()
            raise CacheError(f"{self.what}: cannot write its build lock {self.path} ({err.strerror or err})") from None
        self._lock = lock

    def release(self) -> None:
        if self._lock is not None:
            self.path.unlink(missing_ok=True)
            self._lock.release()
            self._lock = None


class RecordLock:
    """`<uri>.lock` on an object store: the holder's record, checked and then written (not atomic)."""

    def __init__(self, fs: pafs.FileSystem, path: str, what: str) -> None:
        self.fs, self.path, self.what = fs, path, what
        self.held = False

    def check_free(self) -> None:
        if self.fs.get_file_info(self.path).type != pafs.FileType.NotFound:
            try:
                holder = parse_json(_read(self.fs, self.path), self.path)
            except (OSError, ValueError):
                holder = {}
            raise CacheError(f"{_refusal(self.what, self.path, holder)}; if that build is dead, delete the lock")

    def acquire(self) -> None:
        self.check_free()
        if "/" in self.path:  # a local or HDFS parent must exist (an object store needs none)
            self.fs.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
        _write(self.fs, self.path, json.dumps(_holder()).encode())
        self.held = True

    def release(self) -> None:
        if self.held:
            self.fs.delete_file(self.path)
            self.held = False


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as stream:
        return stream.read()


def _write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as stream:
        stream.write(data)


def is_part_record(record: object) -> bool:
    """A part's record as `CacheWriter` commits it: index, sequence count, file names and hashes."""

    def whole(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(record, dict) or not whole(record.get("index")) or not whole(record.get("num_seqs")):
        return False
    files = [(record.get("file"), record.get("sha256")), (record.get("moments"), record.get("moments_sha256"))]
    return all(isinstance(n, str) and is_part_file(n) and isinstance(h, str) for n, h in files)


class PartStore:
    """`<out>.partial/` of a build of `out` (a path or a pyarrow filesystem URI), and its destination."""

    def __init__(self, out: str | Path) -> None:
        self.name = out
        self.fs, self.root = resolve(out)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.partial = self.root + ".partial"
        # As messages show it: a local folder as given, a URI's with its scheme.
        self.shown = Path(f"{out}.partial") if not is_uri(out) else f"{out}.partial"

    def path(self, name: str) -> str:
        return f"{self.partial}/{name}"

    def where(self, name: str) -> str:
        """A file of the partial folder as messages name it."""
        return str(self.shown / name) if isinstance(self.shown, Path) else f"{self.shown}/{name}"

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def lock(self) -> BuildLock | RecordLock:
        if self.local:
            return BuildLock(Path(self.root + ".lock"), self.name)
        return RecordLock(self.fs, self.root + ".lock", str(self.name))

    # -- files -----------------------------------------------------------------------------------

    def put(self, name: str, data: bytes) -> None:
        """Write a file of the partial folder through a temporary one moved into place. A failure (a full
        disk) names the file and the cache, and leaves no temporary behind."""
        tmp = self.path(name + ".tmp")
        try:
            _write(self.fs, tmp, data)
            self.fs.move(tmp, self.path(name))
        except OSError as err:
            with suppress(OSError):
                self.fs.delete_file(tmp)
            reason = err.strerror or str(err).rsplit("Detail: ", 1)[-1] or type(err).__name__
            raise OSError(err.errno, f"{reason} (building the cache {self.name})", self.where(name)) from None

    def put_json(self, name: str, value: dict) -> None:
        self.put(name, json.dumps(value, indent=1).encode())

    def get_arrays(self, name: str) -> dict[str, np.ndarray]:
        return read_arrays(io.BytesIO(_read(self.fs, self.path(name))))

    def parquet_writer(self, name: str, schema) -> pq.ParquetWriter:
        """A part's writer, on `<name>.tmp` (moved into place by `commit`)."""
        return pq.ParquetWriter(
            self.path(name + ".tmp"),
            schema,
            filesystem=self.fs,
            compression="zstd",
            compression_level=3,
            use_dictionary=False,
            use_byte_stream_split=byte_stream_split_columns(schema),
            write_statistics=["seq"],
        )

    def sha256(self, name: str) -> str:
        with self.fs.open_input_stream(self.path(name)) as stream:
            return stream_sha256(stream)

    def size(self, name: str) -> int:
        return self.fs.get_file_info(self.path(name)).size

    def drop(self, name: str) -> None:
        with suppress(FileNotFoundError):
            self.fs.delete_file(self.path(name))

    # -- the protocol ------------------------------------------------------------------------------

    def commit_part(self, name: str, record: dict) -> None:
        """The part file into place, then its record: the commit."""
        self.fs.move(self.path(name + ".tmp"), self.path(name))
        self.put_json(name.removesuffix(".parquet") + RECORD_SUFFIX, record)

    def names(self) -> list[str]:
        return [i.base_name for i in self.fs.get_file_info(pafs.FileSelector(self.partial, allow_not_found=True))]

    def records(self) -> list[dict]:
        """The committed parts' records (a record that is not a part's, a damaged one, is skipped)."""
        records = []
        for name in self.names():
            if name.endswith(RECORD_SUFFIX):
                try:
                    record = parse_json(_read(self.fs, self.path(name)), name)
                except (OSError, ValueError):
                    continue
                if is_part_record(record):
                    records.append(record)
        return sorted(records, key=lambda r: r["index"])

    def intact(self, record: dict) -> bool:
        """Whether a part's files hold the bytes its record says (one damaged since, or cut short, does not)."""
        return all(
            self.exists(self.path(n)) and self.sha256(n) == h
            for n, h in ((record["file"], record["sha256"]), (record["moments"], record["moments_sha256"]))
        )

    def begin(self, plan: dict) -> tuple[list[dict], dict | None]:
        """Begin or resume a build of `plan` (the draft and `seqs_per_part`): -> (the intact committed parts,
        the earlier plan when one of other settings was cleared away, else None)."""
        if self.local and (os.path.lexists(self.partial)):  # a build's own folder, or nobody's to delete
            try:
                check_replaceable(self.partial, "build in progress", is_partial_file, PLAN, overwrite=True)
            except OutputError as err:
                raise CacheError(str(err)) from None
        earlier = None
        if self.exists(self.path(PLAN)):
            try:
                earlier = parse_json(_read(self.fs, self.path(PLAN)), PLAN)
            except (OSError, ValueError):
                earlier = {}
            if earlier == json.loads(json.dumps(plan)):
                for name in self.names():
                    if name.endswith(".tmp"):  # unfinished files of a build that stopped
                        self.drop(name)
                return [r for r in self.records() if self.intact(r)], None
        self.fs.delete_dir_contents(self.partial, missing_dir_ok=True)
        self.fs.create_dir(self.partial, recursive=True)
        self.put_json(PLAN, plan)
        return [], earlier if isinstance(earlier, dict) and earlier else None

    def check_destination(self, overwrite: bool) -> None:
        """A cache may be built at `out` when nothing is there, or (with `overwrite`) a cache alone."""
        if not is_uri(self.name):
            try:
                return check_replaceable(self.name, "cache", is_cache_file, MANIFEST, overwrite)
            except OutputError as err:
                raise CacheError(str(err)) from None
        info = self.fs.get_file_info(self.root)
        if info.type == pafs.FileType.NotFound:
            return
        if info.type != pafs.FileType.Directory:
            raise CacheError(f"{self.name}: is a file, not a cache folder; not replaced")
        names = sorted(i.base_name for i in self.fs.get_file_info(pafs.FileSelector(self.root)))
        foreign = [name for name in names if not is_cache_file(name)]
        if foreign:
            raise CacheError(
                f"{self.name}: holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which no cache "
                "holds; a build would replace or write among them, so it is refused (choose another --out)"
            )
        if MANIFEST in names and not overwrite:
            raise CacheError(f"{self.name}: already exists ({OVERWRITE_HINT})")

    def publish(self, files: list[str]) -> None:
        """Make the finished build (its `manifest.json` written in the partial folder) the cache at `out`."""
        if self.local:
            # Each step is one rename or a removal of what is no longer needed: a stop anywhere leaves either
            # a build that resumes or the new cache.
            out = Path(self.root)
            replaced = out.with_name(f".{out.name}.replaced")  # hidden: never listed as a cache
            shutil.rmtree(replaced, ignore_errors=True)  # left by a build stopped here before
            if out.exists():  # --overwrite (checked when the build started): set the old cache aside
                os.replace(out, replaced)
            os.replace(self.partial, out)
            for name in os.listdir(out):
                if name == PLAN or name.endswith(RECORD_SUFFIX):
                    (out / name).unlink()
            shutil.rmtree(replaced, ignore_errors=True)
            return
        if self.exists(f"{self.root}/{MANIFEST}"):  # overwriting (checked before the build)
            self.fs.delete_dir_contents(self.root)
        self.fs.create_dir(self.root, recursive=True)
        for name in files:
            self.fs.move(self.path(name), f"{self.root}/{name}")
        self.fs.move(self.path(MANIFEST), f"{self.root}/{MANIFEST}")
        self.fs.delete_dir(self.partial)


def published_manifest(uri: str) -> dict:
    """The manifest of a cache published at a URI."""
    fs, root = resolve(uri)
    try:
        data = _read(fs, f"{root}/{MANIFEST}")
    except OSError as err:
        raise CacheError(f"{uri}/{MANIFEST}: not readable ({str(err).splitlines()[0]})") from None
    return parse_json(data, f"{uri}/{MANIFEST}", CacheError)
