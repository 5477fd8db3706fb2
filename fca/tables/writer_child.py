"""A cache writer process: the writer's side of `fca.tables.writer_processes` (the protocol is described
there). It runs shard writers, one per build that uses it, and writes the pieces it is handed in the order
they came; a thread of its own reads the socket, so the parent's sends never wait for an encoding, and it
copies a shared batch's values out as soon as it reads the message, so the build gets its buffers back
without waiting for the pieces queued before.

    python -m fca.tables.writer_child FD    (FD: this writer's end of the socket pair its parent made)
"""

from __future__ import annotations

import mmap
import os
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import numpy as np
import pyarrow as pa

from fca.tables.errors import CacheError
from fca.tables.schema import record_batch
from fca.tables.timings import Timings
from fca.tables.writer import CacheWriter


def _values(block, at: tuple) -> np.ndarray:
    """A copy of the array at (offset, dtype, shape) in a shared block (or the error mapping it)."""
    if isinstance(block, BaseException):
        raise block
    offset, dtype, shape = at
    return np.frombuffer(block, dtype, int(np.prod(shape)), offset).reshape(shape).copy()


def serve(conn: Connection) -> None:
    """A writer's loop: shard writers by build id, pieces written in the order they came."""
    inbox: queue.Queue = queue.Queue()  # unbounded: the parent bounds what it has in flight
    dropped: set[int] = set()
    blocks: dict[int, mmap.mmap] = {}  # shared blocks by id, and the ids of each build's
    build_blocks: dict[int, list[int]] = {}
    send_lock = threading.Lock()  # both threads answer

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    def take_shared(message: tuple) -> tuple:
        """A shared batch's values copied out, and its buffers handed back at once: the parent reuses them
        for a batch two behind, so they must not wait for the pieces queued before this one."""
        build, (k, n, lo, windows, block, nll_at, sites_at, ticket) = message[1], message[2:]
        try:
            if build in dropped:
                return ("piece", build, k, n, None)
            nll = _values(blocks[block], nll_at)
            coefficients = {name: _values(blocks[block], at) for name, at in sites_at.items()}
            return ("piece", build, k, n, (lo, windows, nll, coefficients))
        except BaseException as err:
            return ("piece", build, k, n, err)
        finally:
            send(("free", build, ticket))

    def read() -> None:
        while True:
            try:
                message = conn.recv()
                if message[0] == "piece":  # its record batch follows as Arrow IPC bytes
                    message = (*message, conn.recv_bytes())
                elif message[0] == "block":  # its descriptor follows
                    build, block, size = message[1:]
                    fd = recv_handle(conn)
                    try:
                        with os.fdopen(fd, "rb", buffering=0):
                            blocks[block] = mmap.mmap(fd, size)
                    except OSError as err:  # (out of address space, say) reported with the batches in it
                        blocks[block] = err
                    build_blocks.setdefault(build, []).append(block)
                    continue
                elif message[0] == "shared":
                    message = take_shared(message)
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
                schema = pa.ipc.read_schema(pa.py_buffer(schema))
                num_parts = -(-int(plan["num_seqs"]) // int(seqs_per_part))
                writer = CacheWriter(out, plan, schema, seqs_per_part, shard=range(num_parts), timings=Timings())
                writer.closed_moments = {}  # a part's moments go back with its record: no sidecar read there
                builds[build] = (writer, {})
            except BaseException as err:  # reported with the build's first piece
                builds[build] = (err, {})
        elif kind == "piece":  # payload: Arrow IPC bytes, or a shared batch's values, or the error taking them
            k, n, payload = message[2:]
            writer, open_parts = builds.get(build, (None, {}))
            if build in dropped or not isinstance(writer, CacheWriter):
                reply = ("error", build, k, n, _one_line(writer)) if isinstance(writer, BaseException) else None
                send(reply or ("done", build, k, n, None))
                continue
            try:
                if isinstance(payload, BaseException):  # the shared batch could not be read
                    raise payload
                if isinstance(payload, tuple):
                    lo, windows, nll, coefficients = payload
                    with writer.timings("make_batch"):
                        seqs = np.arange(lo, lo + n)
                        batch = record_batch(writer.schema, seqs, windows[:, :-1], windows[:, 1:], nll, coefficients)
                else:
                    batch = pa.ipc.read_record_batch(pa.py_buffer(payload), writer.schema)  # zero-copy
                writer._write_piece(open_parts, k, batch, n)
                closed = k not in open_parts
                send(("done", build, k, n, (writer.parts[k], writer.closed_moments.pop(k)) if closed else None))
            except BaseException as err:
                writer._discard(open_parts)
                dropped.add(build)
                send(("error", build, k, n, _one_line(err)))
        elif kind == "end":
            writer, open_parts = builds.pop(build, (None, {}))
            stages = {}
            if isinstance(writer, CacheWriter):
                writer._discard(open_parts)  # parts the build did not complete (it stopped, or failed)
                stages = writer.timings.rounded(9)
            for block in build_blocks.pop(build, []):  # freed once the parent's mapping goes too
                try:
                    mapped = blocks.pop(block)
                    if isinstance(mapped, mmap.mmap):
                        mapped.close()
                except BufferError:  # a view of it is still alive: unmapped when that goes
                    pass
            dropped.discard(build)
            send(("ended", build, stages))


def _one_line(err: BaseException | None) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}" if not isinstance(err, CacheError) else text[0]


def _child_main(fd: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the build (the parent) handles it and ends this
    # writer; here it only printed a traceback from the middle of a read, interleaved with the others'.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with Connection(fd) as conn:  # this writer's end of the socket pair its parent made
        serve(conn)


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
