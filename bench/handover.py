"""What a cache build's own process spends handing one MUDDPythia-1.4B-shaped batch to its writers.

On CUDA a build's collector thread takes each batch from the host buffers its device copies landed in and
hands it to the writers; whatever it and the writers do in the build's process competes with the thread
launching the forward pass (`bench/host_contention.py`). Three ways, on the same batches (8 x 1,024
tokens, 24 sites, 4,884 B of coefficients per token: 40 MB), through the real `CacheWriter`:

- `threads`: values copied out of the host buffers, made into a record batch and queued for writer
  threads (the default on CUDA); the threads encode in this process;
- `processes_ipc`: the same record batch sent to writer processes as Arrow IPC bytes;
- `processes_shared`: the host buffers are blocks of shared memory (`HostCopies` with writer processes,
  what a build with `--writer-processes` uses where the system has anonymous memory files), so handing a
  batch over is one message saying where it lies; the writer process copies it out and makes the record
  batch. The values are put in the blocks before the clock starts, as the device's copies would be.

Reported, per batch (medians of interleaved runs): the CPU time of the handing thread, and of the whole
build process (for `threads`, their encoding too), in ms; and the ratio of each to `threads`. CPU time,
not wall time: the writers are slower than this loop, which would otherwise measure them.

    python -m bench.handover [--batches 16] [--runs 3] [--workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.output import emit
from fca.engine.capture import NLL_KEY, HostCopies, hand_over
from fca.jobs.bench import muddpythia_1p4b_specs
from fca.tables.schema import cache_plan, cache_schema, record_batch
from fca.tables.writer import CacheWriter

BATCH, SEQ_LEN = 8, 1024
WAYS = ("threads", "processes_ipc", "processes_shared")


def handover_cpu(way: str, host: dict[str, torch.Tensor], windows: np.ndarray, out: Path, workers: int) -> tuple:
    """(handing thread, build process) CPU seconds per batch for writing `windows` [N, T + 1] one way, every
    batch's values those in `host` (site -> [BATCH, T, K], and the live NLL)."""
    specs = muddpythia_1p4b_specs()
    schema = cache_schema(specs)
    num_seqs = len(windows)
    plan = cache_plan(specs, SEQ_LEN, num_seqs, model={"path": "s", "fingerprint": "s"}, corpus={"split": "x"})
    writer = CacheWriter(out, plan, schema, 2 * BATCH, overwrite=True, workers=workers, processes=way != "threads")
    copies = HostCopies(torch.device("cpu"), writer) if way == "processes_shared" else None
    if copies is not None:  # both blocks filled once, as the device's copies fill them on CUDA
        for _ in range(2):
            _, _, slot = copies.start(host, writer.timings)
            copies.release(slot)
    handing, process_start = 0.0, time.process_time()
    for lo in range(0, num_seqs, BATCH):
        hi = lo + BATCH
        if copies is not None:
            slot = copies.free.get()  # as `HostCopies.start` waits for a free block
            started = time.thread_time()
            hand_over(writer, copies, windows, lo, hi, None, slot)
        else:
            started = time.thread_time()
            arrays = {name: t.numpy().copy() for name, t in host.items()}  # out of the reused host buffers
            nll = arrays.pop(NLL_KEY)
            rows = record_batch(schema, np.arange(lo, hi), windows[lo:hi, :-1], windows[lo:hi, 1:], nll, arrays)
            writer.write(rows, BATCH)
        handing += time.thread_time() - started
    writer.finish({})
    process = time.process_time() - process_start
    if copies is not None:
        copies.close()
    shutil.rmtree(out)
    batches = num_seqs // BATCH
    return handing / batches, process / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16, help="batches of 8 x 1,024 tokens per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    specs = muddpythia_1p4b_specs()
    host = {name: torch.from_numpy(rng.standard_normal((BATCH, SEQ_LEN, s.num_channels), dtype=np.float32))
            for name, s in specs.items()}  # fmt: skip
    host[NLL_KEY] = torch.rand(BATCH, SEQ_LEN)
    windows = rng.integers(0, 50_000, (args.batches * BATCH, SEQ_LEN + 1))
    work = Path(tempfile.mkdtemp(prefix="fca-handover-"))
    handing: dict[str, list[float]] = {way: [] for way in WAYS}
    process: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for way in WAYS:  # warm-up: the writer processes, allocator arenas, first files
            handover_cpu(way, host, windows[: 2 * BATCH], work / "warm", args.workers)
        for run in range(args.runs):
            for way in WAYS if run % 2 == 0 else WAYS[::-1]:
                thread_s, process_s = handover_cpu(way, host, windows, work / way, args.workers)
                handing[way].append(thread_s)
                process[way].append(process_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    handing_ms = {way: statistics.median(v) * 1e3 for way, v in handing.items()}
    process_ms = {way: statistics.median(v) * 1e3 for way, v in process.items()}
    emit(
        {
            "batch": f"{BATCH} x {SEQ_LEN} tokens, MUDDPythia-1.4B shapes (40 MB of float32 coefficients)",
            "workers": args.workers,
            "runs": args.runs,
            **{f"handing_thread_cpu_ms_{way}": round(ms, 2) for way, ms in handing_ms.items()},
            **{f"build_process_cpu_ms_{way}": round(ms, 1) for way, ms in process_ms.items()},
            **{
                f"handing_thread_cpu_ratio_{way}": round(handing_ms[way] / handing_ms["threads"], 4) for way in WAYS[1:]
            },
            **{f"build_process_cpu_ratio_{way}": round(process_ms[way] / process_ms["threads"], 3) for way in WAYS[1:]},
        },
        args.json,
    )


if __name__ == "__main__":
    main()
