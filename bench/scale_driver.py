"""The distributed build's driver at many parts: its own overhead per part, and what grows with the count.

Two measurements (docs/scale.md quotes them):
1. `--parts N --workers W`: N tiny synthetic parts (one 8-token sequence of 4 channels each) written by
   W Ray actors with shard writers and recorded by the same driver as a real build
   (`fca.jobs.distributed.drive_parts` + `CacheWriter`), then finished (moments merged, manifest
   written), opened and two sequences read (first and last part). Reports the driver's CPU seconds per
   part (`time.process_time` of the driver process over the drive), wall time per part, time in
   `add_parts` and in `finish`, and the open and the first read.
2. `--records M,...`: the bookkeeping alone at M parts (no files, no Ray): recording M part records one
   by one, the manifest's size and the time to parse it into a `Manifest`, the lookup of a part by index.

    python bench/scale_driver.py --parts 400 --workers 2 --records 1000,10000,100000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.output import emit  # noqa: E402
from fca.tables.manifest import Manifest
from fca.tables.schema import cache_plan, cache_schema, record_batch
from fca.tables.spec import SiteSpec  # noqa: E402
from fca.tables.store import open_cache
from fca.tables.writer import CacheWriter

T, K = 8, 4
SPECS = {"blocks.0.gate": SiteSpec(axes=(("group", K),), family="gate")}


def synthetic_plan(num_seqs: int) -> dict:
    return cache_plan(
        SPECS,
        T,
        num_seqs,
        model={"path": "synthetic", "fingerprint": "0" * 64, "config": {"vocab_size": 64}},
        corpus={"name": "synthetic", "split": "eval"},
        tokenizer={"vocab_size": 64},
    )


def synthetic_rows(lo: int, hi: int):
    rng = np.random.default_rng(lo)
    n = hi - lo
    tokens = rng.integers(0, 64, size=(n, T + 1))
    values = {"blocks.0.gate": rng.random((n, T, K), dtype=np.float32)}
    schema = cache_schema(SPECS)
    nll = rng.random((n, T), dtype=np.float32)
    return record_batch(schema, np.arange(lo, hi), tokens[:, :-1], tokens[:, 1:], nll, values), n


class SyntheticWorker:
    """A build actor without a model: writes part k of the synthetic plan with a shard writer."""

    def write_part(self, out: str, plan: dict, part_seqs: int, k: int) -> dict:
        writer = CacheWriter(out, plan, cache_schema(SPECS), part_seqs, shard=[k])
        lo, hi = writer.part_range(k)
        writer.write(*synthetic_rows(lo, hi))
        return writer.close_shard()[0]


def drive(parts: int, workers: int, root: Path) -> dict:
    import ray

    from fca.jobs.distributed import REPO_ROOT, drive_parts

    path = os.pathsep.join(p for p in (REPO_ROOT, str(ROOT / "bench"), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=workers, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}}
    )
    try:
        Worker = ray.remote(num_cpus=1)(SyntheticWorker)
        actors = [Worker.remote() for _ in range(workers)]
        ray.get([a.__ray_ready__.remote() for a in actors])  # started before the clock
        plan = synthetic_plan(parts)
        out = root / "synthetic"
        writer = CacheWriter(out, plan, cache_schema(SPECS), 1)
        in_add = [0.0]
        add = writer.add_parts

        def timed_add(records):
            start = time.perf_counter()
            add(records)
            in_add[0] += time.perf_counter() - start

        writer.add_parts = timed_add
        wall, cpu = time.perf_counter(), time.process_time()
        drive_parts(
            ray,
            actors,
            writer,
            lambda actor, k: actor.write_part.remote(str(out), plan, 1, k),
        )
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        start = time.perf_counter()
        writer.finish()
        finish = time.perf_counter() - start
        start = time.perf_counter()
        cache = open_cache(out)
        opened = time.perf_counter() - start
        start = time.perf_counter()
        cache.read_seqs([0, parts - 1])  # the first and last parts' footers, and one row group of each
        first_read = time.perf_counter() - start
    finally:
        ray.shutdown()
    return {
        "parts": parts,
        "workers": workers,
        "driver_cpu_ms_per_part": 1e3 * cpu / parts,
        "wall_ms_per_part": 1e3 * wall / parts,
        "add_parts_ms_per_part": 1e3 * in_add[0] / parts,
        "finish_s": finish,
        "open_cache_s": opened,
        "read_two_seqs_s": first_read,
        "manifest_bytes": (out / "manifest.json").stat().st_size,
    }


def bookkeeping(parts: int, root: Path) -> dict:
    """Record `parts` fake part records one by one (as a driver does), then parse a manifest that lists them."""
    plan = synthetic_plan(parts)
    writer = CacheWriter(root / f"records-{parts}", plan, cache_schema(SPECS), 1)
    record = {
        "file": "",
        "first_seq": 0,
        "num_seqs": 1,
        "rows": T,
        "sha256": "f" * 64,
        "bytes": 4096,
        "moments": "",
        "moments_sha256": "f" * 64,
    }
    start = time.perf_counter()
    for k in range(parts):
        writer.add_parts([{**record, "index": k, "file": f"part-{k:05d}.parquet", "first_seq": k}])
    recorded = time.perf_counter() - start
    writer.abort()
    manifest = {**plan, "seqs_per_part": 1, "parts": [writer.parts[k] for k in range(parts)]}
    text = json.dumps(manifest, indent=1)
    start = time.perf_counter()
    m = Manifest.from_json(json.loads(text))
    parsed = time.perf_counter() - start
    start = time.perf_counter()
    by_index = {p.index: p for p in m.parts}
    _ = [by_index[k] for k in range(0, parts, max(1, parts // 100))]
    lookup = time.perf_counter() - start
    return {
        "parts": parts,
        "record_ms_per_part": 1e3 * recorded / parts,
        "manifest_bytes": len(text),
        "manifest_parse_s": parsed,
        "index_build_and_100_lookups_s": lookup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--records", default="1000,10000,100000")
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "load_average": os.getloadavg(),
            "cpus": os.cpu_count(),
            "drive": drive(args.parts, args.workers, Path(tmp)) if args.parts else None,
            "bookkeeping": [bookkeeping(int(m), Path(tmp)) for m in args.records.split(",") if m],
        }
    emit(result, args.json)


if __name__ == "__main__":
    main()
