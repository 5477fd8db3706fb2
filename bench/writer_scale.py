"""Cache writer throughput against the number of writer threads, on MUDDPythia-1.4B-shaped coefficients.

Synthetic coefficients with the 1.4B shapes (24 sites, layer i with C * (i + 2) channels: 4,884 B of
float32 coefficients per token, 4,904 B with the key columns) go through the real `CacheWriter`
(Parquet, zstd, byte-stream-split, parts sized as a real build sizes them) with 1, 2, ... workers.
Reported: raw MB/s per worker count (median of interleaved repeats) and the ratio to the first count.
No model runs, so this is the writer's ceiling: a build on CUDA keeps up when it exceeds the forward
pass's rate (bytes per token x tokens per second).

    python -m bench.writer_scale --workers 1 2 4 [--seqs 256] [--seq-len 1024] [--batch 8] [--repeats 3] [--json PATH]

Memory: two batches of coefficients (2 x 40 MB at the defaults) plus each worker's queue (about one part).
Disk: one cache at a time in a temporary directory (about 1.5 GB at the defaults), deleted after each run.
The default of 256 sequences (16 parts of 16) is what `fca bench` writes and what the README's figures
come from; fewer parts measure the end of a build more than its rate (`fca.jobs.bench.WRITER_BENCH_SEQS`).
Many writers need more parts for the same: with 8 writers, 16 parts are two each.
"""

from __future__ import annotations

import argparse
import json
import os

from fca.jobs.bench import WRITER_BENCH_SEQS, writer_scaling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seqs", type=int, default=WRITER_BENCH_SEQS, help="sequences written per run")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="sequences per record batch (one row group)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()

    result = writer_scaling(
        args.workers, num_seqs=args.seqs, seq_len=args.seq_len, batch=args.batch, repeats=args.repeats
    )
    figures = {
        "config": "MUDDPythia-1.4B coefficient shapes, synthetic values, float32",
        "cpu_count": os.cpu_count(),
        "seqs": args.seqs,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "repeats": args.repeats,
        "raw_mb_per_run": result["raw_mb"],
        "bytes_per_token": result["bytes_per_token"],
        **{f"writer_mb_s_{w}": v for w, v in result["mb_s"].items()},
        **{f"writer_scaling_{w}": v for w, v in result["ratio"].items()},
    }
    for key, value in figures.items():
        print(f"{key:24s} {value:,.4g}" if isinstance(value, float) else f"{key:24s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
