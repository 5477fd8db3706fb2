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
with the interpreter running this process (not forked: the parent may hold CUDA and thread state) and run
`fca.tables.writer_child`; each talks over its end of a socket pair, and exits when the parent closes its
end or dies.

A model build hands its batches over through shared memory (`shared_block`, `put_shared`): the host
buffers its device copies land in (on CUDA, pinned in place) are blocks the writers map too, so the build's
side of a batch is one short message; the writer copies the values out on its reading thread, answers that
the buffers are free again, and makes the record batch itself. Nothing of the batch is built, copied or
sent holding the build's interpreter lock. A block is an anonymous memory file (`memfd`) whose descriptor
each writer receives once, so nothing is left in the file system if either side dies. Without `memfd`
(not Linux), and for `CacheWriter.write`'s record batches, batches go as Arrow IPC bytes instead.

Messages, parent to writer: ("build", id, out, plan, schema as Arrow IPC bytes, S); ("piece", id, k, n)
followed by the record batch as Arrow IPC bytes, sent from the batch's own memory (pickling had copied it
holding the lock);
("block", id, block, bytes) followed by its descriptor; ("shared", id, k, n, first sequence, windows
[n, T + 1], block, nll at, site -> at, ticket), where `at` is (offset, dtype, shape) in the block;
("end", id, drop). Writer to parent: ("done", id, k, n, (record, moments) when part k is complete, else
None); ("error", id, k, n, message); ("free", id, ticket) once a shared batch's values are copied out;
("ended", id, {stage: seconds}). A writer reads on a thread of its own, so a parent's send never waits
for a piece to be encoded, and ("end", id, True) makes it skip that build's queued pieces at once.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import send_handle
from pathlib import Path

from fca.tables.errors import CacheError

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # so the writers import this very `fca`
_BUILD_IDS = itertools.count(1)
_BLOCK_IDS = itertools.count(1)
_TICKETS = itertools.count(1)
SHARES_MEMORY = hasattr(os, "memfd_create")  # Linux: batches handed over in shared memory


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
                            [sys.executable, "-m", "fca.tables.writer_child", str(theirs.fileno())],
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

    def send_descriptor(self, i: int, message: tuple, fd: int) -> None:
        """A message to writer i, and after it a duplicate of file descriptor `fd`."""
        with self.send_locks[i]:
            self.conns[i].send(message)
            send_handle(self.conns[i], fd, self.procs[i].pid)

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
        # The sockets are shut down, and the reader thread seen out, before their descriptors are closed:
        # closed under a reader blocked on them, their numbers went to the next pool's sockets, from which
        # the old reader then read (a new build failed at once with "writer process 0 exited").
        for conn in self.conns:  # a writer reads the end of its socket and exits; our reader, its EOF
            try:
                with socket.socket(fileno=os.dup(conn.fileno())) as end:
                    end.shutdown(socket.SHUT_RDWR)
            except OSError:  # (already closed, or its writer gone)
                pass
        reader = getattr(self, "reader", None)  # (none while the writers are still being started)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5)
        for conn in self.conns:
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
        self.frees: dict[int, tuple] = {}  # ticket -> (writer, what frees its shared batch's buffers)
        self.cond = threading.Condition()
        with self.pool.lock:
            self.pool.builds[self.id] = self
        # The schema travels as Arrow IPC bytes: pickling one drops its list items' names and non-nullability
        # (pyarrow 26), and the writer processes' parts would then differ from the threads'.
        schema = owner.schema.serialize().to_pybytes()
        plan = (str(owner.out), owner.plan, schema, owner.seqs_per_part)
        for i in range(self.count):
            try:
                self.pool.send(i, ("build", self.id, *plan))
            except OSError:
                self.lost(i)

    def _route(self, k: int, n: int) -> int:
        """The writer for n more sequences of part k, once there is room for them (the lock held)."""
        with self.owner.timings("queue_wait"):
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
        return i

    def put(self, k: int, piece, n: int) -> None:
        with self.cond:
            i = self._route(k, n)
        try:
            self.pool.send(i, ("piece", self.id, k, n), piece.serialize())  # Arrow IPC; the schema is the build's
        except OSError:
            self.lost(i)

    def shared_block(self, size: int) -> tuple[int, mmap.mmap]:
        """A new block of `size` bytes that this build's writers map too: (its id, this side's mapping).
        It is freed once this mapping is dropped and the build has ended."""
        fd = os.memfd_create("fca-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            block = next(_BLOCK_IDS)
            for i in range(self.count):
                try:
                    self.pool.send_descriptor(i, ("block", self.id, block, size), fd)
                except OSError:
                    self.lost(i)
            return block, mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def put_shared(self, k: int, n: int, lo: int, windows, block: int, nll_at, sites_at, free) -> None:
        """Sequences [lo, lo + n) of part k, their values in shared `block` at (offset, dtype, shape):
        `nll_at` the live NLL [n, T], `sites_at` each site's coefficients [n, T, K]. `windows` [n, T + 1]
        are their token ids. `free()` is called once, when the block's values have been copied out (or
        will never be: the writer was lost)."""
        ticket = next(_TICKETS)
        with self.cond:
            i = self._route(k, n)
            if i in self.ended:  # lost already (the build has failed): nothing will answer
                self.pending -= n
                self.load[i] -= n
                free()
                return
            self.frees[ticket] = (i, free)
        try:
            self.pool.send(i, ("shared", self.id, k, n, lo, windows, block, nll_at, sites_at, ticket))
        except OSError:
            self.lost(i)

    def _free(self, ticket: int) -> None:
        with self.cond:
            entry = self.frees.pop(ticket, None)
        if entry is not None:
            entry[1]()

    def reply(self, i: int, message: tuple) -> None:
        """On the pool's reading thread: one reply of writer i."""
        kind = message[0]
        if kind == "free":
            self._free(message[2])
            return
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
            lost_tickets = [ticket for ticket, (writer, _) in self.frees.items() if writer == i]
        for ticket in lost_tickets:  # its buffers are never coming back from it: the build may reuse them
            self._free(ticket)

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
