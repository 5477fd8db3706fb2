"""Caches written to a pyarrow filesystem URI (s3://, gs://, hdfs://, file://, ...): how a build commits
parts there and publishes the finished cache.

Object stores have no directory rename and no exclusive create, so a URI build does not use the local
protocol (`<out>.partial/` renamed into place, an O_EXCL lock file). Instead:

- each part is written in a local staging directory (the ordinary `CacheWriter`, so the files are
  byte for byte those of a local build), then committed under `<uri>.partial/`: the part file, its
  moments sidecar, and last `part-XXXXX.record.json` (its part record). A record is the commit: a part
  without one, or whose files are missing or differ from the sha256 it records, is redone;
- `<uri>.partial/plan.json` holds the manifest draft and part size; a rerun with another plan starts over;
- `publish` moves the committed parts to `<uri>/`, uploads the merged moments and writes `manifest.json`
  last, so nothing at `<uri>` looks finished before it is; an interrupted publish is resumed by a rerun;
- the destination follows a local one's rules: a folder holding files no cache holds is refused, with or
  without --overwrite (it would be written among, or deleted);
- one build per URI: `<uri>.lock` names the holder. It is checked and then created, which object stores
  cannot make atomic: two builds started in the same instant may both proceed (their parts are equal, as
  parts are deterministic, but run one build per URI).

Reading a cache from a URI is not supported: copy it to a local or mounted path first (for example
`pyarrow.fs.copy_files(URI, DIR)`), then open that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

from fca.tables.errors import CacheError
from fca.tables.outputs import OVERWRITE_HINT
from fca.tables.schema import is_cache_file
from fca.tables.writer import PROCESS_TOKEN, holder_is_dead

PLAN = "plan.json"
RECORD_SUFFIX = ".record.json"
COPY_CHUNK = 8 << 20


def is_uri(target: str | Path) -> bool:
    """A string naming a filesystem by scheme (`s3://bucket/cache`, `file:///data/cache`)."""
    return isinstance(target, str) and "://" in target


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) of a URI; CacheError with a one-line reason when pyarrow cannot open it."""
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as err:  # unknown scheme, no credentials, pyarrow built without it
        raise CacheError(f"{uri}: not a filesystem pyarrow can open ({str(err).splitlines()[0]})") from None
    return fs, path.rstrip("/")


def _info(fs: pafs.FileSystem, path: str) -> pafs.FileInfo:
    return fs.get_file_info(path)


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return _info(fs, path).type != pafs.FileType.NotFound


def read_json(fs: pafs.FileSystem, path: str) -> dict:
    with fs.open_input_stream(path) as stream:
        return json.loads(stream.read().decode())


def write_json(fs: pafs.FileSystem, path: str, value: dict) -> None:
    """One object, written whole (an object store shows it complete or not at all)."""
    with fs.open_output_stream(path) as stream:
        stream.write(json.dumps(value, indent=1).encode())


def upload(local: Path, fs: pafs.FileSystem, path: str) -> None:
    with open(local, "rb") as source, fs.open_output_stream(path) as target:
        while chunk := source.read(COPY_CHUNK):
            target.write(chunk)


def download(fs: pafs.FileSystem, path: str, local: Path) -> None:
    tmp = local.with_name(local.name + ".tmp")
    with fs.open_input_stream(path) as source, open(tmp, "wb") as target:
        while chunk := source.read(COPY_CHUNK):
            target.write(chunk)
    os.replace(tmp, local)


def sha256_of(fs: pafs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open_input_stream(path) as stream:
        while chunk := stream.read(COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def remote_manifest(uri: str) -> dict:
    """The manifest of a cache published at a URI, as JSON."""
    fs, root = resolve(uri)
    try:
        return read_json(fs, f"{root}/manifest.json")
    except (OSError, ValueError) as err:
        raise CacheError(f"{uri}/manifest.json: not readable ({str(err).splitlines()[0]})") from None


class RemoteLock:
    """`<uri>.lock`: the holder's host, pid and start time. Checked, then created (see the module
    docstring). A lock whose holder died on this host is taken over (the new build resumes from what the
    dead one committed); one held from another host cannot be checked, and the message says to delete
    it if that build is dead."""

    def __init__(self, fs: pafs.FileSystem, path: str, uri: str) -> None:
        self.fs, self.path, self.uri = fs, path, uri
        self.held = False

    def acquire(self) -> RemoteLock:
        if exists(self.fs, self.path):
            try:
                holder = read_json(self.fs, self.path)
            except (OSError, ValueError):
                holder = {}
            if holder_is_dead(holder):
                self.fs.delete_file(self.path)
                return self.acquire()
            raise CacheError(
                f"{self.uri}: another build holds {self.uri}.lock (host {holder.get('host')}, pid "
                f"{holder.get('pid')}, since {holder.get('started')}); if that build is dead, delete the lock and rerun"
            )
        if "/" in self.path:  # a local or HDFS parent must exist (an object store needs none)
            self.fs.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
        write_json(
            self.fs,
            self.path,
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "token": PROCESS_TOKEN,
            },
        )
        self.held = True
        return self

    def release(self) -> None:
        if self.held:
            try:
                self.fs.delete_file(self.path)
            except FileNotFoundError:
                pass
            self.held = False


class RemoteParts:
    """`<uri>.partial/` of a URI build: the plan, the committed parts and their records."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fs, self.root = resolve(uri)
        self.partial = self.root + ".partial"

    def finished(self) -> bool:
        return exists(self.fs, f"{self.root}/manifest.json")

    def lock(self) -> RemoteLock:
        return RemoteLock(self.fs, self.root + ".lock", self.uri)

    @contextmanager
    def staged(self, overwrite: bool) -> Iterator[Path]:
        """A build of this URI: refused when a cache is there (unless `overwrite`), else the URI's lock
        held and a local staging directory to build in, both let go afterwards."""
        self.check_destination(overwrite)
        lock = self.lock().acquire()
        try:
            with staging() as stage:
                yield stage
        finally:
            lock.release()

    def check_destination(self, overwrite: bool) -> None:
        """The rules of a local destination (`fca.tables.outputs.check_replaceable`): nothing there, a cache
        replaced only with `overwrite`, and never a folder holding anything a cache does not (the publish
        replaces what is there: files of another kind had been deleted, or written among)."""
        info = _info(self.fs, self.root)
        if info.type == pafs.FileType.NotFound:
            return
        if info.type != pafs.FileType.Directory:
            raise CacheError(f"{self.uri}: is a file, not a cache folder; not replaced")
        names = sorted(i.base_name for i in self.fs.get_file_info(pafs.FileSelector(self.root)))
        foreign = [name for name in names if not is_cache_file(name)]
        if foreign:
            raise CacheError(
                f"{self.uri}: holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which no cache "
                "holds; a build would replace or write among them, so it is refused (choose another --out)"
            )
        if "manifest.json" in names and not overwrite:
            raise CacheError(f"{self.uri}: already exists ({OVERWRITE_HINT})")
        # (cache files without a manifest: the parts an interrupted publish moved, taken up by the rerun)

    def start(self, plan: dict, seqs_per_part: int) -> list[dict]:
        """Begin or resume: -> the records of the parts already committed under this plan (others are
        cleared away)."""
        wanted = {"plan": plan, "seqs_per_part": seqs_per_part}
        plan_path = f"{self.partial}/{PLAN}"
        if exists(self.fs, plan_path):
            try:
                same = read_json(self.fs, plan_path) == json.loads(json.dumps(wanted))
            except (OSError, ValueError):
                same = False
            if same:
                return self.committed()
        self.fs.delete_dir_contents(self.partial, missing_dir_ok=True)
        self.fs.create_dir(self.partial)
        write_json(self.fs, plan_path, wanted)
        return []

    def committed(self) -> list[dict]:
        """Records whose part and sidecar are there with the recorded bytes (their sha256; a part changed
        after its commit had been taken up by size alone, and published as finished)."""
        selector = pafs.FileSelector(self.partial, allow_not_found=True)
        records = []
        for info in self.fs.get_file_info(selector):
            if not info.path.endswith(RECORD_SUFFIX):
                continue
            try:
                record = read_json(self.fs, info.path)
            except (OSError, ValueError):
                continue
            if all(self._holds(name, digest) for name, digest in _files_of(record)):
                records.append(record)
        return sorted(records, key=lambda r: r["index"])

    def _holds(self, name: str | None, digest: str | None) -> bool:
        path = f"{self.partial}/{name}"
        return isinstance(name, str) and exists(self.fs, path) and sha256_of(self.fs, path) == digest

    def commit(self, local_partial: Path, record: dict) -> None:
        """Upload a part written in `local_partial` and its sidecar, then its record (the commit)."""
        for name in (record["file"], record.get("moments")):
            if name:
                upload(local_partial / name, self.fs, f"{self.partial}/{name}")
        write_json(self.fs, f"{self.partial}/{record['file'].removesuffix('.parquet')}{RECORD_SUFFIX}", record)

    def fetch_sidecars(self, records: list[dict], local_partial: Path) -> None:
        """The committed parts' moments sidecars, into the local staging directory the manifest is
        finished in (the merge reads them there)."""
        for record in records:
            name = record.get("moments")
            if name and not (local_partial / name).is_file():
                download(self.fs, f"{self.partial}/{name}", local_partial / name)

    def publish(self, local_out: Path) -> str:
        """Make the finished cache staged in `local_out` (its manifest, merged moments, and whatever
        parts were written locally) the cache at the URI: parts and sidecars committed under
        `<uri>.partial/` are moved, the rest uploaded, `manifest.json` written last."""
        manifest = json.loads((local_out / "manifest.json").read_text())
        files = [p["file"] for p in manifest["parts"]]
        files += [name for name, _ in (manifest.get("moments") or {}).get("parts", [])]
        if manifest.get("moments"):
            files.append(manifest["moments"]["file"])
        if self.finished():  # a cache is there and overwriting it was asked for (checked before the build)
            self.fs.delete_dir_contents(self.root)
        # (no manifest but files: parts moved by an interrupted publish, found below)
        self.fs.create_dir(self.root)
        for name in files:
            staged, target = f"{self.partial}/{name}", f"{self.root}/{name}"
            if exists(self.fs, staged):
                self.fs.move(staged, target)
            elif (local_out / name).is_file():
                upload(local_out / name, self.fs, target)
            elif not exists(self.fs, target):
                raise CacheError(f"{self.uri}: {name} is neither committed nor staged; rerun the build")
        write_json(self.fs, f"{self.root}/manifest.json", manifest)
        if exists(self.fs, self.partial):
            self.fs.delete_dir(self.partial)
        return self.uri


def _files_of(record: dict) -> list[tuple[object, object]]:
    """(file, sha256) of a committed part and of its moments sidecar, when it has one."""
    files = [(record.get("file"), record.get("sha256"))]
    return files + ([(record.get("moments"), record.get("moments_sha256"))] if "moments" in record else [])


@contextmanager
def staging() -> Iterator[Path]:
    """A local directory to stage a URI build in, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="fca-stage-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
