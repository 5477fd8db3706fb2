"""What a cache writer beside it costs a forward pass whose time is the host's (a small model on a GPU).

On CUDA a build's forward thread launches kernels while a collector and writer threads take values out
of pinned memory, encode Parquet and sum moments. When the model is small, the GPU waits for the launches,
so anything the other threads take from that host thread shows in the build's time. This bench measures
it on a CPU, where a pass of the shipped model over one 8-token sequence on one torch thread is host-bound
the same way (its ~800 ops each cost the host a few microseconds), timed five ways in one run:

- alone;
- beside a thread that writes the shipped model's coefficients for 256 windows again and again (the
  real `CacheWriter`: record batches of 16 windows, 8 parts of 32, moments, hashes, progress);
- beside a process doing the same writing (no shared interpreter);
- beside a thread that makes the record batches and hands them to a writer process as Arrow IPC bytes
  (`CacheWriter(..., processes=True)` given record batches);
- beside a thread that puts the values in shared memory and tells a writer process where they are, which
  makes the record batches itself (`HostCopies` and `hand_over`: a build with writer processes). On CUDA
  the device's copies fill that memory, so a collector thread does even less: it waits for them and sends.

Each side has its own core (the forward the first, the writing the second, writer processes the rest),
so what the forward loses beside a thread and not beside a process is the interpreter lock: the forward
thread takes it back each time one of its ops returns, and the writing holds it between its numpy and
pyarrow calls. With only two cores the handing and sharing threads share the second core with the writer
process.

Reported: the forward's time per pass beside each, over its time alone, and the forward time lost per
writing done beside it (medians of interleaved rounds); the time one writing takes by itself; and the CPU
time the forward's process spends per writing, for each way that runs in it (a writer process's own work
is not counted: it has its own interpreter), with the forward idle.

    python -m bench.host_contention [--rounds 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.output import emit
from fca.engine.capture import NLL_KEY, HostCopies, hand_over, record_windows
from fca.engine.loading import load_model
from fca.engine.sites import model_logits, site_specs
from fca.jobs.bench import _plan, windows_from_cache
from fca.tables.schema import cache_schema, record_batch
from fca.tables.store import open_cache
from fca.tables.writer import CacheWriter
from fca.tables.writer_processes import writer_pool

DEMO = Path(__file__).resolve().parent.parent / "cache" / "demo"
WINDOWS, BATCH, PART_SEQS = 256, 16, 32  # a demo-sized cache as a CUDA build spreads it: 8 parts
NAMES = {  # what runs beside the forward
    "thread": "writer_thread",
    "process": "writer_process",
    "handing": "thread_handing_to_writer_process",
    "shared": "thread_sharing_with_writer_process",
}


class DemoWriting:
    """The writer's side: the shipped model's coefficients for WINDOWS windows, recorded once, written as a
    cache (record batches, parts, moments, hashes, progress) by `run()` as often as asked."""

    def __init__(self, model: torch.nn.Module, windows: np.ndarray, work: Path) -> None:
        self.windows, self.work = windows, work
        self.schema = cache_schema(site_specs(model))
        self.plan = _plan(model, windows, BATCH)
        self.batches = []  # (first sequence, live NLL [b, T], site -> coefficients [b, T, K])
        for lo in range(0, len(windows), BATCH):
            nll, coefficients = record_windows(model, torch.from_numpy(windows[lo : lo + BATCH]))
            self.batches.append((lo, nll.float().numpy(), {k: v.float().numpy() for k, v in coefficients.items()}))

    def run(self, processes: bool = False, shared: bool = False, on_batch=None) -> None:
        """Written in this thread, or (`processes`) handed from it to a writer process as record batches,
        or (`shared`) as a build with writer processes hands them over: in shared memory. `on_batch()` is
        called after each batch."""
        out = self.work / f"cache-{os.getpid()}-{threading.get_ident()}"
        writer = CacheWriter(out, self.plan, self.schema, PART_SEQS, overwrite=True, processes=processes or shared)
        copies = HostCopies(torch.device("cpu"), writer) if shared else None
        for lo, nll, coefficients in self.batches:
            hi = lo + len(nll)
            if copies is not None:
                tensors = {NLL_KEY: nll, **coefficients}
                _, _, slot = copies.start({k: torch.from_numpy(v) for k, v in tensors.items()}, writer.timings)
                hand_over(writer, copies, self.windows, lo, hi, None, slot)
            else:
                seqs = np.arange(lo, hi)
                writer.write(
                    record_batch(
                        self.schema, seqs, self.windows[lo:hi, :-1], self.windows[lo:hi, 1:], nll, coefficients
                    ),
                    hi - lo,
                )
            if on_batch is not None:
                on_batch()
        writer.finish({})
        if copies is not None:
            copies.close()
        shutil.rmtree(out)


def _pin(core: int | None) -> None:
    """This thread (or process) to one core, so that the forward and the writing never share one: what is
    left between them is the interpreter lock and the memory they share. Threads and processes started
    from here inherit it (the writer pool's reading thread and processes, when started from a pinned
    thread)."""
    if core is not None:
        os.sched_setaffinity(0, {core})


def _write_until(writing: DemoWriting, stop, kind: str, batches_done=None, core: int | None = None) -> None:
    """Writings until `stop`, counting each batch handed over in `batches_done` (a whole writing is 16 of
    them: counting writings alone, a measurement of ~3 writings was off by up to a third)."""
    _pin(core)

    def count() -> None:
        batches_done.value += 1

    while not stop.is_set():
        writing.run(processes=kind == "handing", shared=kind == "shared", on_batch=count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--forwards", type=int, default=150, help="host-bound passes timed per measurement")
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the forward's thread; the writer gets the other core
    # The forward on the first core, the writing's threads (or process) on the second, writer processes
    # on the rest, or on the second core beside the handing thread where there are only two.
    cores = sorted(os.sched_getaffinity(0))
    forward_core, writer_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    process_cores = set(cores[2:] or cores[1:])
    model = load_model(DEMO / "featuregate", device="cpu")
    windows = windows_from_cache(open_cache(DEMO / "eval"), WINDOWS)  # [N, T + 1]
    short = torch.from_numpy(windows[:64, :8]).long()  # 64 sequences of 8 tokens, one per pass
    work = Path(tempfile.mkdtemp(prefix="fca-contention-"))
    writing = DemoWriting(model, windows, work)

    @torch.no_grad()
    def forward_seconds() -> float:  # per pass
        start = time.perf_counter()
        for i in range(args.forwards):
            model_logits(model(short[i % 64 : i % 64 + 1]), model)
        return (time.perf_counter() - start) / args.forwards

    context = multiprocessing.get_context("fork")  # the child only writes (numpy, pyarrow), never runs torch

    def beside(kind: str) -> tuple[float, float]:
        """(seconds per forward pass, writings done per second) with a writer of `kind` running beside."""
        stop, done = context.Event(), context.Value("i", 0)  # batches
        work_args = (writing, stop, kind, done, writer_core)
        if kind == "process":
            handle = context.Process(target=_write_until, args=work_args, daemon=True)
        else:
            handle = threading.Thread(target=_write_until, args=work_args, daemon=True)
        handle.start()
        time.sleep(0.05)  # the writer under way
        try:
            before, start = done.value, time.perf_counter()
            per_pass = forward_seconds()
            writings = (done.value - before) / len(writing.batches)
            return per_pass, writings / (time.perf_counter() - start)
        finally:
            stop.set()
            handle.join()

    try:
        # Warm-up: allocator, imports, the first files; the writer process pool, started from a thread on
        # the writer's core so that its processes and reading thread stay there.
        warm = threading.Thread(
            target=lambda: (_pin(writer_core), writing.run(processes=True), writing.run(shared=True))
        )
        warm.start()
        warm.join()
        if process_cores:
            for proc in writer_pool(1).procs:
                os.sched_setaffinity(proc.pid, process_cores)
        _pin(forward_core)
        for _ in range(2):
            writing.run()
            forward_seconds()
        kinds = tuple(NAMES)
        write_times, alone, by = [], [], {kind: [] for kind in kinds}
        own_cpu: dict[str, list[float]] = {kind: [] for kind in kinds if kind != "process"}
        for _ in range(args.rounds):
            start = time.perf_counter()
            writing.run()
            write_times.append(time.perf_counter() - start)
            alone.append(forward_seconds())
            for kind in kinds:
                by[kind].append(beside(kind))
            for kind in own_cpu:
                start = time.process_time()
                writing.run(processes=kind == "handing", shared=kind == "shared")
                own_cpu[kind].append(time.process_time() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = float(np.median(alone))

    def lost_ms(runs: list[tuple[float, float]]) -> float | None:
        """Per run: (extra seconds per pass) / (writings per second x seconds per pass), in ms; the median
        (None when a run saw no batch written: too few passes timed)."""
        if any(rate == 0 for _, rate in runs):
            return None
        return round(float(np.median([(t - base) / (rate * t) for t, rate in runs])) * 1e3, 2)

    emit(
        {
            "model": "shipped demo (featuregate), one 8-token sequence per pass, 1 torch thread",
            "writing": f"{WINDOWS} windows of {windows.shape[1] - 1} tokens, batches of {BATCH}, parts of {PART_SEQS}",
            "cores": len(cores),
            "rounds": args.rounds,
            "forward_us_alone": round(base * 1e6, 1),
            **{
                f"forward_beside_{name}": round(float(np.median([t for t, _ in by[kind]])) / base, 3)
                for kind, name in NAMES.items()
            },
            # What each writing costs the forward: its extra time over the writings done meanwhile.
            **{f"forward_ms_lost_per_writing_{name}": lost_ms(by[kind]) for kind, name in NAMES.items()},
            "writing_ms": round(float(np.median(write_times)) * 1e3, 1),
            **{
                f"process_cpu_ms_per_writing_{NAMES[kind]}": round(float(np.median(seconds)) * 1e3, 1)
                for kind, seconds in own_cpu.items()
            },
        },
        args.json,
    )


if __name__ == "__main__":
    main()
