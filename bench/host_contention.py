"""What a cache writer beside it costs a forward pass whose time is the host's (a small model on a GPU).

On CUDA a build's forward thread launches kernels while a collector and writer threads take values out
of pinned memory, encode Parquet and sum moments. When the model is small, the GPU waits for the launches,
so anything the other threads take from that host thread shows in the build's time. This bench measures
it on a CPU, where a pass of the shipped model over one 8-token sequence on one torch thread is host-bound
the same way (its ~800 ops each cost the host a few microseconds), timed three ways in one run:

- alone;
- beside a thread that writes the shipped model's coefficients for 256 windows again and again (the
  real `CacheWriter`: record batches of 16 windows, 8 parts of 32, moments, hashes, progress);
- beside a process doing the same writing (a second core, no shared interpreter).

Reported: the forward's time per batch beside each, over its time alone (medians of interleaved rounds),
and the time one such writing takes by itself. With two cores there is a core for each side, so a ratio
above 1 beside the thread and none beside the process is the interpreter lock: the forward thread waits
for it each time one of its ops returns, and the writer holds it between its numpy and pyarrow calls.

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
from fca.engine.capture import record_windows
from fca.engine.loading import load_model
from fca.engine.sites import model_logits, site_specs
from fca.jobs.bench import _plan, windows_from_cache
from fca.tables.store import CacheWriter, cache_schema, open_cache, record_batch

DEMO = Path(__file__).resolve().parent.parent / "cache" / "demo"
WINDOWS, BATCH, PART_SEQS = 256, 16, 32  # a demo-sized cache as a CUDA build spreads it: 8 parts


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

    def run(self) -> None:
        out = self.work / f"cache-{os.getpid()}"
        writer = CacheWriter(out, self.plan, self.schema, PART_SEQS, overwrite=True)
        for lo, nll, coefficients in self.batches:
            hi = lo + len(nll)
            rows = record_batch(
                self.schema, np.arange(lo, hi), self.windows[lo:hi, :-1], self.windows[lo:hi, 1:], nll, coefficients
            )
            writer.write(rows, hi - lo)
        writer.finish({})
        shutil.rmtree(out)


def _write_until(writing: DemoWriting, stop) -> None:
    while not stop.is_set():
        writing.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--forwards", type=int, default=150, help="host-bound passes timed per measurement")
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the forward's thread; the writer gets the other core
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

    def beside(start_writer) -> float:
        stop, handle = start_writer()
        time.sleep(0.05)  # the writer under way
        try:
            return forward_seconds()
        finally:
            stop.set()
            handle.join()

    def thread():
        stop = threading.Event()
        handle = threading.Thread(target=_write_until, args=(writing, stop), daemon=True)
        handle.start()
        return stop, handle

    context = multiprocessing.get_context("fork")  # the child only writes (numpy, pyarrow), never runs torch

    def process():
        stop = context.Event()
        handle = context.Process(target=_write_until, args=(writing, stop), daemon=True)
        handle.start()
        return stop, handle

    try:
        for _ in range(2):  # warm-up: allocator, imports, the first files
            writing.run()
            forward_seconds()
        write_times, alone, by_thread, by_process = [], [], [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            writing.run()
            write_times.append(time.perf_counter() - start)
            alone.append(forward_seconds())
            by_thread.append(beside(thread))
            by_process.append(beside(process))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = float(np.median(alone))
    emit(
        {
            "model": "shipped demo (featuregate), one 8-token sequence per pass, 1 torch thread",
            "writing": f"{WINDOWS} windows of {windows.shape[1] - 1} tokens, batches of {BATCH}, parts of {PART_SEQS}",
            "cpu_count": os.cpu_count(),
            "rounds": args.rounds,
            "forward_us_alone": round(base * 1e6, 1),
            "forward_beside_writer_thread": round(float(np.median(by_thread)) / base, 3),
            "forward_beside_writer_process": round(float(np.median(by_process)) / base, 3),
            "writing_ms": round(float(np.median(write_times)) * 1e3, 1),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
