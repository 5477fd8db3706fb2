"""Cache writers in their own processes: parts encoded, summed and hashed beside the build, not in it.

Writer threads share the build's interpreter lock: they hold it between their numpy and pyarrow calls,
and a forward pass whose time is the host's (a small model on a GPU) takes it back after every op
(`bench/host_contention.py`: such a pass ran 1.63-1.82x its time alone beside one writer thread,
1.03-1.15x beside a writer process). Here each writer is a process running a shard writer
(`CacheWriter(..., shard=...)`, as the Ray engine's actors do): it owns the parts it is handed, writes
them and their moments sidecars into `<out>.partial/`, and sends back each part's record and moments,
which the build's own writer records and merges as it does its threads'. The build keeps its lock,
progress, resume and manifest; the cache is the same, byte for byte.

The processes outlive one build (`writer_pool`): starting them costs about 0.3 s (they import numpy and
pyarrow, never torch), more than a small model's whole forward over a demo-sized cache. They are started
with the interpreter running this process (not forked: the parent may hold CUDA and thread state), each
talks over its end of a socket pair, and exits when the parent closes its end or dies.

Messages, parent to writer: ("build", id, out, plan, schema, S); ("piece", id, k, n) followed by the record
batch as Arrow IPC bytes, sent from the batch's own memory (pickling had copied it holding the lock);
("end", id, drop). Writer to parent: ("done", id, k, n, (record, moments) when part k is complete, else
None); ("error", id, k, n, message); ("ended", id, {stage: seconds}). A writer reads on a thread of its
own, so a parent's send never waits for a piece to be encoded, and ("end", id, True) makes it skip that
build's queued pieces at once.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, wait
from pathlib import Path

import pyarrow as pa

from fca.tables.errors import CacheError

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # so the writers import this very `fca`
_BUILD_IDS = itertools.count(1)


# ------------------------------------------------------------------------------------- a writer process


def _serve(conn: Connection) -> None:
    """A writer's loop: shard writers by build id, pieces written in the order they came."""
    from fca.tables.store import CacheWriter
    from fca.tables.timings import Timings

    inbox: queue.Queue = queue.Queue()  # unbounded: the parent bounds what it has in flight
    dropped: set[int] = set()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
                if message[0] == "piece":  # its record batch follows as Arrow IPC bytes
                    message = (*message, conn.recv_bytes())
            except (EOFError, OSError):
                inbox.put(None)
                return
            if message[0] == "end" and message[2]:
                dropped.add(message[1])
            inbox.put(message)

    threading.Thread(target=read, name="fca-writer-inbox", daemon=True).start()
    builds: dict[int, tuple] = {}  # id -> (shard writer, its open parts)
    while (message := inbox.get()) is not None:
        kind, build = message[0], message[1]
        if kind == "build":
            out, plan, schema, seqs_per_part = message[2:]
            try:
                num_parts = -(-int(plan["num_seqs"]) // int(seqs_per_part))
                writer = CacheWriter(out, plan, schema, seqs_per_part, shard=range(num_parts), timings=Timings())
                writer.closed_moments = {}  # a part's moments go back with its record: no sidecar read there
                builds[build] = (writer, {})
            except BaseException as err:  # reported with the build's first piece
                builds[build] = (err, {})
        elif kind == "piece":
            k, n, payload = message[2:]
            writer, open_parts = builds.get(build, (None, {}))
            if build in dropped or not isinstance(writer, CacheWriter):
                reply = ("error", build, k, n, _one_line(writer)) if isinstance(writer, BaseException) else None
                conn.send(reply or ("done", build, k, n, None))
                continue
            try:
                batch = pa.ipc.read_record_batch(pa.py_buffer(payload), writer.schema)  # zero-copy
                writer._write_piece(open_parts, k, batch, n)
                closed = k not in open_parts
                conn.send(("done", build, k, n, (writer.parts[k], writer.closed_moments.pop(k)) if closed else None))
            except BaseException as err:
                writer._discard(open_parts)
                dropped.add(build)
                conn.send(("error", build, k, n, _one_line(err)))
        elif kind == "end":
            writer, open_parts = builds.pop(build, (None, {}))
            stages = {}
            if isinstance(writer, CacheWriter):
                writer._discard(open_parts)  # parts the build did not complete (it stopped, or failed)
                stages = writer.timings.rounded(9)
            dropped.discard(build)
            conn.send(("ended", build, stages))


def _one_line(err: BaseException | None) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}" if not isinstance(err, CacheError) else text[0]


def _child_main(fd: int) -> None:
    with Connection(fd) as conn:  # this writer's end of the socket pair its parent made
        _serve(conn)


# ---------------------------------------------------------------------------------------- the pool


class _Pool:
    """Writer processes and the one thread that reads all their replies, handing each to its build."""

    def __init__(self, count: int) -> None:
        path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        try:
            for _ in range(count):
                ours, theirs = socket.socketpair()  # private to the two ends: nothing to listen on or guard
                with theirs:
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "fca.tables.writer_processes", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()],
                            env={**os.environ, "PYTHONPATH": path},
                        )
                    )
                self.conns.append(Connection(ours.detach()))
        except BaseException:
            self.shutdown()
            raise
        self.send_locks = [threading.Lock() for _ in self.conns]
        self.builds: dict[int, WriterProcesses] = {}
        self.broken = False
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="fca-writer-replies", daemon=True)
        self.reader.start()

    def send(self, i: int, message: tuple, payload=None) -> None:
        """A message to writer i, and after it `payload` (a buffer) as raw bytes: written from its own
        memory, the lock released, where pickling would copy it holding the lock."""
        with self.send_locks[i]:
            self.conns[i].send(message)
            if payload is not None:
                self.conns[i].send_bytes(memoryview(payload))

    def _read(self) -> None:
        live = dict(enumerate(self.conns))
        while live:
            try:
                ready = wait(list(live.values()))
            except (OSError, ValueError):  # the pool was shut down
                return
            for conn in ready:
                i = self.conns.index(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the writer died
                    del live[i]
                    self.broken = True
                    for build in list(self.builds.values()):
                        build.lost(i)
                    continue
                build = self.builds.get(message[1])
                if build is not None:
                    build.reply(i, message)

    def alive(self) -> bool:
        return not self.broken and all(proc.poll() is None for proc in self.procs)

    def shutdown(self) -> None:
        for conn in self.conns:  # a writer reads the end of its socket and exits
            conn.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def writer_pool(count: int) -> _Pool:
    """At least `count` writer processes, started on first use and kept for later builds."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and (not _POOL.alive() or (len(_POOL.procs) < count and not _POOL.builds)):
            _POOL.shutdown()
            _POOL = None
        if _POOL is None:
            _POOL = _Pool(count)
        return _POOL


@atexit.register
def _shutdown_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.shutdown()
        _POOL = None


# ------------------------------------------------------------------------------------ one build's side


class WriterProcesses:
    """`CacheWriter`'s writers as processes, with `_WriterThreads`' interface (`put`, `close`): a part
    goes to the writer with the least in flight when its first piece comes, and its later pieces follow
    it there. `put` waits while more than `max_pending` sequences are in flight."""

    def __init__(self, owner, count: int, max_pending: int) -> None:
        self.owner = owner
        self.max_pending = max_pending
        self.pool = writer_pool(count)
        self.count = min(count, len(self.pool.procs))
        self.id = next(_BUILD_IDS)
        self.pending = 0
        self.load = [0] * self.count
        self.holders: dict[int, int] = {}
        self.ended: set[int] = set()
        self.waiting = 0  # callers of `put` waiting for room
        self.cond = threading.Condition()
        with self.pool.lock:
            self.pool.builds[self.id] = self
        plan = (str(owner.out), owner.plan, owner.schema, owner.seqs_per_part)
        for i in range(self.count):
            try:
                self.pool.send(i, ("build", self.id, *plan))
            except OSError:
                self.lost(i)

    def put(self, k: int, piece, n: int) -> None:
        with self.cond, self.owner.timings("queue_wait"):
            # An empty pipeline takes any piece, so a piece larger than the bound cannot wait forever.
            while self.pending and self.pending + n > self.max_pending and not self.owner._stopping:
                self.waiting += 1
                self.cond.wait(0.5)
                self.waiting -= 1
            i = self.holders.get(k)
            if i is None:
                i = self.holders[k] = min(range(self.count), key=self.load.__getitem__)
            self.pending += n
            self.load[i] += n
        try:
            self.pool.send(i, ("piece", self.id, k, n), piece.serialize())  # Arrow IPC; the schema is the build's
        except OSError:
            self.lost(i)

    def reply(self, i: int, message: tuple) -> None:
        """On the pool's reading thread: one reply of writer i."""
        kind = message[0]
        if kind == "ended":
            for stage, seconds in message[2].items():
                self.owner.timings.add(stage, seconds)
            with self.cond:
                self.ended.add(i)
                self.cond.notify_all()
            return
        _, _, k, n, detail = message
        try:
            if kind == "error":
                self.owner._fail(CacheError(f"{self.owner.partial}: writer process: {detail}"))
            elif detail is not None:  # part k is complete: recorded and merged as a thread's would be
                record, moments = detail
                self.owner.add_parts([record])
                self.owner._merge_completed(k, moments)
        except BaseException as err:
            self.owner._fail(err)
        finally:
            with self.cond:
                self.pending -= n
                self.load[i] -= n
                if kind == "error" or detail is not None:
                    self.holders.pop(k, None)
                if self.waiting:  # (waking nobody still costs the reading thread the lock's round trip)
                    self.cond.notify_all()

    def lost(self, i: int) -> None:
        self.owner._fail(CacheError(f"{self.owner.partial}: writer process {i} exited"))
        with self.cond:
            if i < self.count:
                self.ended.add(i)
                self.pending -= self.load[i]  # what it had will never be answered
                self.load[i] = 0
            self.cond.notify_all()

    def close(self) -> None:
        """Let the writers write what is queued (or drop it, after an error), then wait for them."""
        drop = bool(self.owner._stopping)
        for i in range(self.count):
            if i not in self.ended:
                try:
                    self.pool.send(i, ("end", self.id, drop))
                except OSError:
                    self.lost(i)
        with self.cond:
            while len(self.ended) < self.count:
                self.cond.wait(0.5)
        with self.pool.lock:
            self.pool.builds.pop(self.id, None)


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
