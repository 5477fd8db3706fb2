"""The cache writer: parallel parts, resume, one build per cache, bfloat16 storage, prefetching reads."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fca
from fca.cli import main
from fca.engine.capture import record_windows, write_cache
from fca.engine.sites import site_specs
from fca.jobs.build import build_cache_from_corpus
from fca.tables.errors import CacheError
from fca.tables.profiles import cache_moments
from fca.tables.schema import (
    PLAN,
    bfloat16_bits,
    cache_plan,
    cache_schema,
    coefficient_arrow_type,
    record_batch,
)
from fca.tables.spec import SiteSpec
from fca.tables.store import open_cache
from fca.tables.timings import Timings
from fca.tables.writer import CacheWriter, settings_changed
from fca.tables.writer_store import PartStore

from .conftest import REPO
from .helpers import make_model_dir, write_corpus

capture_module = sys.modules["fca.engine.capture"]  # the module; `fca.capture` is also the function

N_SEQS = 12
T = 16
SEQS_PER_PART = 4  # with batches of 2: three parts of two batches each


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("writer")
    corpus = write_corpus(root / "prose.txt")
    make_model_dir(root / "model", corpus)
    return root


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of SEQS_PER_PART tiny sequences, so a 12-sequence cache has several parts to share out."""
    row_bytes = 4 * 4 + 4 + 4 * 8  # keys, live NLL, the tiny model's two 4-channel gates
    monkeypatch.setattr(capture_module, "TARGET_PART_BYTES", row_bytes * T * SEQS_PER_PART)
    monkeypatch.setattr(capture_module, "SPREAD_PARTS", 1)  # sized by bytes alone
    monkeypatch.setattr(capture_module, "MOMENTS_SHARE", 0)


def test_part_size_spreads_a_small_cuda_build_over_several_parts():
    from fca.engine.capture import SPREAD_PARTS, TARGET_PART_BYTES, seqs_per_part, spreads_parts

    assert spreads_parts("cuda") and not spreads_parts("cpu")  # on a CPU one writer works inline
    row, seq_len = 308, 128  # the demo: 39 kB per sequence, so one target part holds 850 sequences
    assert seqs_per_part(row, seq_len, 16) == TARGET_PART_BYTES // (row * seq_len) // 16 * 16 == 848
    assert seqs_per_part(row, seq_len, 16, spread_over=256) == 256 // SPREAD_PARTS == 32  # 8 parts
    assert seqs_per_part(row, seq_len, 16, spread_over=100) == 16  # ceil(100 / 8) = 13, up to a whole batch
    assert seqs_per_part(row, seq_len, 16, spread_over=8) == 16  # never below one batch
    assert seqs_per_part(row, seq_len, 16, spread_over=100_000) == 848  # large builds: parts of the target size
    big_row = 4904  # MUDDPythia-1.4B at 1,024 tokens: 5 MB per sequence
    assert seqs_per_part(big_row, 1024, 8, spread_over=64) == seqs_per_part(big_row, 1024, 8) == 8
    assert seqs_per_part(row, seq_len, 16, num_slots=72) == 848  # the demo's 74 kB of moments change nothing


def test_a_part_outweighs_its_moments_sidecar():
    """A part's moments sidecar (per-position sums: 8 x T x C bytes, whatever the part's size) is at most
    1/MOMENTS_SHARE of the part's raw bytes: MUDDPythia-1.4B's 10 MB sidecar asks for 16 sequences per
    part, not the target size's 8; Qwen3-MoE-30B-A3B's 50 MB one for 16 sequences, not 1. Small CUDA
    builds are still spread over SPREAD_PARTS parts."""
    from fca.engine.capture import MOMENTS_SHARE, seqs_per_part

    for row, slots, batch, expected in ((4904, 1221, 8, 16), (24596, 6144, 1, 16), (24596, 6144, 8, 16)):
        S = seqs_per_part(row, 1024, batch, num_slots=slots)
        assert S == expected and S % batch == 0
        assert S * row * 1024 >= MOMENTS_SHARE * 8 * 1024 * slots > (S - batch) * row * 1024  # the fewest that do
    assert seqs_per_part(1044, 1024, 8, num_slots=256) == 24  # Mixtral-8x7B: the target size already does
    assert seqs_per_part(4904, 1024, 8, spread_over=64, num_slots=1221) == 8  # 8 parts of a 64-sequence build
    assert seqs_per_part(4904, 1024, 8, spread_over=256, num_slots=1221) == 16


def _build(artifacts, out, workers, split="eval", **kw):
    settings = dict(num_seqs=N_SEQS, seq_len=T, batch_size=2, device="cpu", show_progress=False)
    return build_cache_from_corpus(
        artifacts / "model", artifacts / "prose.txt", split, out, workers=workers, **{**settings, **kw}
    )


def _hashes(path):
    parts = open_cache(path, verify=True).manifest.parts
    return [(p.file, p.first_seq, p.num_seqs, p.sha256) for p in parts]


def _same_values(a, b):
    ca, cb = open_cache(a), open_cache(b)
    ra, rb = ca.read_seqs(range(N_SEQS)), cb.read_seqs(range(N_SEQS))
    return ra.keys() == rb.keys() and all(np.array_equal(ra[k], rb[k]) for k in ra)


# ---------------------------------------------------------------------------------------------
# Parallel writer: same parts for any number of workers.


@pytest.mark.slow
def test_a_build_reports_where_its_time_went(artifacts, tmp_path, small_parts):
    """`write_cache(timings=)`: each stage of the build, from every thread, in seconds; the forward's
    stage holds most of a CPU build (the writer works inline), the writers' stages appear with threads."""

    model = fca.load_model(artifacts / "model")
    windows = np.random.default_rng(2).integers(0, 300, (N_SEQS, T + 1))
    plan = cache_plan(site_specs(model), T, N_SEQS, model={"path": "m", "fingerprint": "m"}, corpus={"split": "x"})
    for workers in (1, 3):
        stages = Timings()
        started = time.perf_counter()
        write_cache(model, windows, tmp_path / f"w{workers}", plan, batch_size=2, workers=workers, timings=stages)
        wall = time.perf_counter() - started
        seconds = stages.seconds
        expected = {"record", "collect", "encode", "moments", "close_part", "finish_wait", "finish"}
        assert expected <= set(seconds)
        assert ("queue_wait" in seconds) == (workers > 1)  # the writer threads' stage
        assert all(s >= 0 for s in seconds.values())
        # Stages of the caller's thread cannot add up to more than the build's wall time.
        own_thread = ("record", "finish_wait", "finish") if workers > 1 else seconds
        assert sum(seconds[stage] for stage in own_thread) <= wall


def test_the_writer_never_imports_pandas(tmp_path):
    """`pa.array` and `Array.to_numpy` import pandas on their first call (0.2-0.6 s, inside the first
    batches of a build, on the writer's threads); the writer builds Arrow columns from numpy buffers and
    reads them back as numpy views instead. A whole cache, moments included, in a fresh interpreter, so
    that nothing else has imported pandas yet."""
    code = (
        "import sys, numpy as np\n"
        "from fca.tables.spec import SiteSpec\n"
        "from fca.tables.schema import cache_plan, cache_schema, record_batch\n"
        "from fca.tables.writer import CacheWriter\n"
        "specs = {'g': SiteSpec(axes=(('channel', 4),), family='gate')}\n"
        "schema = cache_schema(specs)\n"
        "plan = cache_plan(specs, 3, 4, model={'path': 'm', 'fingerprint': 'm'}, corpus={'split': 'x'})\n"
        "writer = CacheWriter(sys.argv[1], plan, schema, seqs_per_part=2, workers=2)\n"
        "ids = np.arange(6).reshape(2, 3)\n"
        "for lo in (0, 2):\n"
        "    values = {'g': np.full((2, 3, 4), lo, np.float32)}\n"
        "    writer.write(record_batch(schema, np.arange(lo, lo + 2), ids, ids, np.zeros((2, 3), np.float32), values), 2)\n"
        "writer.finish()\n"
        "print('pandas' in sys.modules)\n"
    )
    out = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    cache = open_cache(out, verify=True)
    assert [p.num_seqs for p in cache.manifest.parts] == [2, 2]
    assert cache.read_seqs([3])["g"].tolist() == [[[2.0] * 4] * 3]


def test_three_workers_write_the_same_cache_as_one(artifacts, tmp_path, small_parts):
    one = _build(artifacts, tmp_path / "one", workers=1)
    three = _build(artifacts, tmp_path / "three", workers=3)
    parts = _hashes(one)
    assert len(parts) == N_SEQS // SEQS_PER_PART
    assert [(f, s, n) for f, s, n, _ in parts] == [(f"part-0000{k}.parquet", 4 * k, 4) for k in range(3)]
    assert _hashes(three) == parts
    assert _same_values(one, three)
    assert open_cache(three).manifest.seqs_per_part == SEQS_PER_PART
    # Row groups are the record batches: two sequences each, in order.
    meta = pq.ParquetFile(open_cache(three).part_paths()[1]).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [2 * T, 2 * T]


def test_a_slow_part_holds_up_no_other_writer_thread(tmp_path, monkeypatch):
    """Parts go to whichever writer thread is free: while one thread is slow on part 0, the other writes
    parts 1, 2 and 3 (dealt out as k % 2, part 2 would wait behind part 0), and the cache is the same."""
    specs = {"a": SiteSpec(axes=(("channel", 2),), family="g")}
    schema = cache_schema(specs)
    plan = cache_plan(specs, 5, 8, model={"path": "s", "fingerprint": "s"}, corpus={"split": "x"})
    z = np.zeros((2, 5), np.int64)
    real_write_piece = CacheWriter._write_piece
    written: list[tuple[int, str]] = []

    def write_piece(self, k, piece, n):
        if k == 0:
            time.sleep(0.5)
        real_write_piece(self, k, piece, n)
        written.append((k, threading.current_thread().name))

    monkeypatch.setattr(CacheWriter, "_write_piece", write_piece)
    caches = []
    for workers in (2, 1):
        written.clear()
        writer = CacheWriter(tmp_path / f"w{workers}", plan, schema, 2, workers=workers)
        for lo in range(0, 8, 2):
            coefficients = {"a": np.full((2, 5, 2), lo, np.float32)}
            writer.write(record_batch(schema, np.arange(lo, lo + 2), z, z, z.astype(np.float32), coefficients), 2)
        caches.append(writer.finish())
        if workers == 2:
            assert [k for k, _ in written] == [1, 2, 3, 0]
            assert len({name for k, name in written if k != 0} - {dict(written)[0]}) == 1  # all on the other thread
    assert _hashes(caches[0]) == _hashes(caches[1])


def test_a_writer_threads_error_reaches_the_caller_and_leaves_the_build_resumable(tmp_path, monkeypatch):
    """A thread's error (here: the disk, on part 1) is raised in the caller, by `write` or `finish`;
    what was queued is dropped, unfinished files go, the lock is released, and a new writer redoes
    exactly the parts that are not complete."""
    specs = {"a": SiteSpec(axes=(("channel", 2),), family="g")}
    schema = cache_schema(specs)
    plan = cache_plan(specs, 5, 8, model={"path": "s", "fingerprint": "s"}, corpus={"split": "x"})
    z = np.zeros((2, 5), np.int64)
    real_write_piece = CacheWriter._write_piece

    def write_piece(self, k, piece, n):
        if k == 1:
            raise OSError("No space left on device")
        real_write_piece(self, k, piece, n)

    monkeypatch.setattr(CacheWriter, "_write_piece", write_piece)
    writer = CacheWriter(tmp_path / "c", plan, schema, 2, workers=2)
    with pytest.raises(OSError, match="No space left"):
        for lo in range(0, 8, 2):
            coefficients = {"a": np.full((2, 5, 2), lo, np.float32)}
            writer.write(record_batch(schema, np.arange(lo, lo + 2), z, z, z.astype(np.float32), coefficients), 2)
        writer.finish()
    writer.abort()
    partial = tmp_path / "c.partial"
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.lock").exists()
    assert not list(partial.glob("*.tmp"))
    monkeypatch.undo()
    pending = CacheWriter(tmp_path / "c", plan, schema, 2).pending_ranges()
    assert (2, 4) in pending and set(pending) <= {(0, 2), (2, 4), (4, 6), (6, 8)}


# Errors and interruptions.


def _plan_and_schema(n=4):
    specs = {"a": SiteSpec(axes=(("channel", 2),), family="g")}
    return cache_plan(specs, 5, n, model={"path": "s", "fingerprint": "s"}, corpus={"split": "x"}), cache_schema(specs)


def _rows(schema, lo, hi):
    z = np.zeros((hi - lo, 5), np.int64)
    coefficients = {"a": np.full((hi - lo, 5, 2), lo, np.float32)}
    return record_batch(schema, np.arange(lo, hi), z, z, z.astype(np.float32), coefficients)


def _write_pairs(writer, first, last, pause=0.0):
    """Sequences [first, last) to `writer` in batches of two, `pause` seconds after each."""
    for lo in range(first, last, 2):
        writer.write(_rows(writer.schema, lo, lo + 2), 2)
        time.sleep(pause)
    return writer


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_have_the_mode_open_gives_under_the_umask(artifacts, tmp_path, umask):
    """Every file FCA writes, through a temporary file or not, is readable by whoever may read a file
    `open(..., "w")` makes: a model's weights were written 0600 (by safetensors) beside 0644 config.json."""
    from fca.tables.runs import save_run

    from .helpers import make_model_dir

    earlier = os.umask(umask)
    try:
        make_model_dir(tmp_path / "model", artifacts / "prose.txt")
        plan, schema = _plan_and_schema(4)
        cache = _write_pairs(CacheWriter(tmp_path / "c", plan, schema, 2), 0, 4).finish()
        results = {"conditions": {"correct": {"nll": 1.0, "penalty": 0.0, "penalty_ci95": [0.0, 0.0]}}}
        save_run(
            cache, {"spec": {"conditions": ["correct"], "num_seqs": 4, "seed": 0}, "results": results, "created": "x"}
        )
    finally:
        os.umask(earlier)
    modes = {str(f.relative_to(tmp_path)): oct(f.stat().st_mode & 0o777) for f in tmp_path.rglob("*") if f.is_file()}
    assert "model/model.safetensors" in modes and "c/manifest.json" in modes and len(modes) > 6
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))


def test_runs_saved_beside_a_cache_later_overwritten_are_not_listed_as_the_new_ones(tmp_path):
    """`<cache>.runs/` outlives `build-cache --overwrite`: its runs of the old contents were listed (and shown
    in the Replay lab) as runs of the new cache. Runs that record no fingerprint are listed as before."""
    from fca.tables.runs import list_runs, save_run

    plan, schema = _plan_and_schema(4)
    cache = _write_pairs(CacheWriter(tmp_path / "c", plan, schema, 2), 0, 4).finish()
    results = {"conditions": {"correct": {"nll": 1.0, "penalty": 0.0, "penalty_ci95": [0.0, 0.0]}}}

    def run(created, **spec):
        spec = {"conditions": ["correct"], "num_seqs": 4, "seed": 0, **spec}
        save_run(cache, {"spec": spec, "results": results, "created": created})

    run("2026-01-01T00:00:01Z", cache_fingerprint=open_cache(cache).fingerprint)
    run("2026-01-01T00:00:02Z")  # (an older record: no fingerprint)
    run("2026-01-01T00:00:03Z", cache_fingerprint="0" * 64)  # another cache's
    assert [r["created"][-3:] for r in list_runs(cache)] == ["02Z", "01Z"]
    plan, schema = _plan_and_schema(6)
    _write_pairs(CacheWriter(cache, plan, schema, 2, overwrite=True), 0, 6).finish()
    assert [r["created"][-3:] for r in list_runs(cache)] == ["02Z"]
    run("2026-01-01T00:00:04Z", cache_fingerprint=open_cache(cache).fingerprint)
    assert [r["created"][-3:] for r in list_runs(cache)] == ["04Z", "02Z"]
    shutil.rmtree(cache)  # no manifest to tell them apart: all are listed
    assert len(list_runs(cache)) == 4


def test_each_part_commits_with_its_record_and_a_resume_lists_the_records(tmp_path):
    """plan.json is written when a build starts; each complete part is then committed by its record
    (`part-XXXXX.record.json`); a resumed build lists the records, taking a damaged one (cut short by a
    crash, not a part's, or naming a part whose bytes changed) as a part to write again, and ends with the
    same cache as an uninterrupted one, without its bookkeeping."""
    plan, schema = _plan_and_schema(8)
    writer = _write_pairs(CacheWriter(tmp_path / "c", plan, schema, 2), 0, 6)  # parts 0, 1 and 2 of 4
    partial = tmp_path / "c.partial"
    assert json.loads((partial / PLAN).read_text())["plan"] == plan
    records = sorted(partial.glob("part-*.record.json"))
    assert [r.name for r in records] == [f"part-0000{k}.record.json" for k in range(3)]
    writer.abort()
    kept = {r: r.read_bytes() for r in records}
    records[1].write_text('{"index": 1, "fi')  # cut short
    record = json.loads(kept[records[2]])
    records[2].write_text(json.dumps({**record, "file": 5}))  # not a part's
    (partial / "part-00003.record.json").write_text(json.dumps({**record, "index": 3, "sha256": "0" * 64}))
    probe = CacheWriter(tmp_path / "c", plan, schema, 2)
    assert probe.pending_parts() == [1, 2, 3]
    probe.abort()
    for path, data in kept.items():
        path.write_bytes(data)
    resumed = CacheWriter(tmp_path / "c", plan, schema, 2)
    assert resumed.pending_parts() == [3]
    whole = _write_pairs(CacheWriter(tmp_path / "whole", plan, schema, 2), 0, 8).finish()
    cache = open_cache(_write_pairs(resumed, 6, 8).finish(), verify=True)
    assert cache.manifest.raw["parts"] == open_cache(whole).manifest.raw["parts"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(p.name for p in whole.iterdir())


def test_builds_at_once_each_write_the_cache_one_thread_writes(tmp_path):
    """Two builds in two threads at once, each with its writer threads, of other sizes and part sizes: each
    cache is what one thread alone writes."""
    results = {}

    def build(name, num_seqs, seqs_per_part, batch, workers):
        results[name] = _synthetic(num_seqs, seqs_per_part, workers, tmp_path / name, batch=batch)[0]

    jobs = [("a", 23, 4, 3, 2), ("b", 17, 2, 2, 3)]
    threads = [threading.Thread(target=build, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, num_seqs, seqs_per_part, batch, _ in jobs:
        alone, _ = _synthetic(num_seqs, seqs_per_part, 1, tmp_path / f"{name}-alone", batch=batch)
        assert open_cache(results[name], verify=True).manifest.raw["parts"] == open_cache(alone).manifest.raw["parts"]


@pytest.mark.slow
def test_an_interrupted_build_with_writer_threads_resumes_through_the_cli(artifacts, tmp_path, small_parts):
    clean = _build(artifacts, tmp_path / "clean", workers=1)
    out = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        _build(artifacts, out, workers=2, progress=_interrupt_at(10))
    partial = tmp_path / "cache.partial"
    assert not out.exists() and not (tmp_path / "cache.lock").exists() and not list(partial.glob("*.tmp"))
    done = {p["index"] for p in PartStore(out).records()}
    assert done and done != {0, 1, 2}
    args = ["--model", str(artifacts / "model"), "--corpus", str(artifacts / "prose.txt"), "--split", "eval"]
    sizes = ["--num-seqs", str(N_SEQS), "--seq-len", str(T), "--batch", "2", "--device", "cpu"]
    assert main(["build-cache", *args, *sizes, "--out", str(out), "--writers", "2"]) == 0
    assert _hashes(out) == _hashes(clean) and _same_values(out, clean)


def test_a_part_is_read_only_when_a_read_needs_it(artifacts, tmp_path, small_parts):
    """Opening reads one part's schema; reading sequences opens only the footers of the parts holding
    them (found from the manifest), so a part whose columns are wrong is refused when it is first read."""
    from fca.tables.schema import MANIFEST, file_sha256

    cache_dir = _build(artifacts, tmp_path / "lazy", workers=1)
    whole = open_cache(cache_dir).read_seqs(range(N_SEQS))
    third = cache_dir / "part-00002.parquet"  # sequences 8..11, rewritten without a site column
    pq.write_table(pq.read_table(third).drop_columns(["blocks.1.gate"]), third)
    manifest = json.loads((cache_dir / MANIFEST).read_text())
    manifest["parts"][2].update(sha256=file_sha256(third), bytes=third.stat().st_size)
    (cache_dir / MANIFEST).write_text(json.dumps(manifest))
    cache = open_cache(cache_dir)
    assert cache._footers == {}
    got = cache.read_seqs([5, 1])  # parts 1 and 0
    assert sorted(cache._footers) == [0, 1]
    assert all(np.array_equal(got[k], whole[k][[5, 1]]) for k in got)
    with pytest.raises(CacheError, match="part-00002.parquet: column 'blocks.1.gate' is missing"):
        cache.read_seqs([9])


def _synthetic(num_seqs, seqs_per_part, workers, out, batch=3, dtype="float32", **writer_options):
    """Random coefficients through CacheWriter directly, batches crossing part boundaries."""
    specs = {
        "a": SiteSpec(axes=(("channel", 3),), family="g"),
        "b": SiteSpec(axes=(("stream", 2), ("source", 2)), family="g"),
    }
    schema = cache_schema(specs, coefficient_arrow_type(dtype))
    plan = cache_plan(
        specs,
        5,
        num_seqs,
        model={"path": "synthetic", "fingerprint": "synthetic"},
        corpus={"split": "x"},
        coefficient_dtype=dtype,
    )
    rng = np.random.default_rng(0)
    values = {k: rng.standard_normal((num_seqs, 5, s.num_channels)).astype(np.float32) for k, s in specs.items()}
    tokens = rng.integers(0, 50, (num_seqs, 5))
    writer = CacheWriter(out, plan, schema, seqs_per_part, workers=workers, **writer_options)
    for lo in range(0, num_seqs, batch):
        hi = min(num_seqs, lo + batch)
        nll = np.zeros((hi - lo, 5), np.float32)
        writer.write(
            record_batch(
                schema, np.arange(lo, hi), tokens[lo:hi], tokens[lo:hi], nll, {k: v[lo:hi] for k, v in values.items()}
            ),
            hi - lo,
        )
    return writer.finish(), values


def test_batches_split_at_part_boundaries_identically(tmp_path):
    one, values = _synthetic(11, 4, 1, tmp_path / "one")
    three, _ = _synthetic(11, 4, 3, tmp_path / "three")
    assert [p.num_seqs for p in open_cache(one).manifest.parts] == [4, 4, 3]
    assert _hashes(one) == _hashes(three)
    got = open_cache(three).read_seqs([10, 0, 5])
    for k, v in values.items():
        np.testing.assert_array_equal(got[k], v[[10, 0, 5]])


def test_finish_refuses_missing_parts(tmp_path):
    specs = {"a": SiteSpec(axes=(("channel", 2),), family="g")}
    schema = cache_schema(specs)
    plan = cache_plan(specs, 5, 8, model={"path": "s", "fingerprint": "s"}, corpus={"split": "x"})
    writer = CacheWriter(tmp_path / "c", plan, schema, 4, workers=2)
    z = np.zeros((4, 5), np.int64)
    coefficients = {"a": np.zeros((4, 5, 2), np.float32)}
    writer.write(record_batch(schema, np.arange(4, 8), z, z, z.astype(np.float32), coefficients), 4)
    with pytest.raises(CacheError, match=r"parts \[0\] were never written"):
        writer.finish()
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.lock").exists()
    # Part 1 completed out of order and is kept: a new writer has only part 0 left to do.
    assert CacheWriter(tmp_path / "c", plan, schema, 4).pending_ranges() == [(0, 4)]


# ---------------------------------------------------------------------------------------------
# Resume: an interrupted parallel build redoes exactly the incomplete parts.


@pytest.mark.slow
def test_interrupted_parallel_build_resumes_to_the_same_cache(artifacts, tmp_path, small_parts):
    clean = _build(artifacts, tmp_path / "clean", workers=1)
    out = tmp_path / "cache"
    calls = {"n": 0}

    def interrupt(done, total):
        calls["n"] += 1
        if calls["n"] == 5:  # batch 5 of 6: part 2 is half written
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(artifacts, out, workers=3, progress=interrupt)
    partial = tmp_path / "cache.partial"
    assert not out.exists() and not (tmp_path / "cache.lock").exists() and not list(partial.glob("*.tmp"))
    complete = {p["index"] for p in PartStore(out).records()}
    assert complete == {0, 1}  # queued parts are finished on the way out; part 2's second batch was never computed

    written = []
    _build(artifacts, out, workers=2, progress=lambda done, total: written.append(done))
    redone = written[-1] - written[0] + 2  # sequences computed on resume (batches of 2)
    assert redone == N_SEQS - SEQS_PER_PART * len(complete)
    assert _hashes(out) == _hashes(clean) and _same_values(out, clean)
    assert not partial.exists()


@pytest.mark.slow
def test_more_writers_than_parts_are_not_started(artifacts, tmp_path, small_parts):
    """100,000 writers asked for: one per part runs (threads beyond that would idle; that many could not
    even start), and the cache is the one-writer cache."""
    clean = _build(artifacts, tmp_path / "clean", workers=1)
    started = threading.active_count()
    seen = []
    _build(artifacts, tmp_path / "many", workers=100_000, progress=lambda *_: seen.append(threading.active_count()))
    assert max(seen) - started <= N_SEQS // SEQS_PER_PART + 1
    assert _hashes(tmp_path / "many") == _hashes(clean)


@pytest.mark.parametrize("stop_at", ["set aside", "rename", "bookkeeping"])
def test_a_build_stopped_while_replacing_an_old_cache_still_ends_in_a_cache(artifacts, tmp_path, stop_at, monkeypatch):
    """`--overwrite` over an old cache, stopped at each step of putting the new one in place: the same
    command then finishes (or has finished) the build, with the contents of an uninterrupted one."""
    from fca.tables import writer_store

    clean = _build(artifacts, tmp_path / "clean", workers=1)
    out = tmp_path / "cache"
    shutil.copytree(clean, out)  # the old cache
    real_replace, real_unlink = os.replace, Path.unlink

    def replace(src, dst):
        if (stop_at, Path(src).name) in (("set aside", "cache"), ("rename", "cache.partial")):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    def unlink(path, missing_ok=False):
        if stop_at == "bookkeeping" and path == out / PLAN:
            raise KeyboardInterrupt
        return real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(writer_store.os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        _build(artifacts, out, workers=1, overwrite=True)
    monkeypatch.undo()
    if stop_at == "bookkeeping":  # the new cache is in place, with the build's plan beside its files
        assert (out / PLAN).exists() and _same_values(out, clean)
    _build(artifacts, out, workers=1, overwrite=True)
    assert _hashes(out) == _hashes(clean) and _same_values(out, clean)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "clean"]  # nothing set aside or partial left
    assert not (out / PLAN).exists() and not list(out.glob("*.record.json"))


def test_a_resumed_build_rewrites_parts_damaged_since_they_were_recorded(artifacts, tmp_path, small_parts):
    """A kept part must still have the bytes its record hashes (its own and its moments'); one changed in
    place (same size) or cut short is written again, and the finished cache is the clean one."""
    clean = _build(artifacts, tmp_path / "clean", workers=1)
    out, partial = tmp_path / "cache", tmp_path / "cache.partial"

    def interrupt(done, total):
        if done == 10:  # parts 0 and 1 complete
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(artifacts, out, workers=1, progress=interrupt)
    records = {p["index"]: p for p in PartStore(out).records()}
    assert set(records) == {0, 1}
    part = partial / records[1]["file"]
    data = bytearray(part.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 3 : len(data) // 3 + 64])
    part.write_bytes(bytes(data))  # same size, other bytes
    moments = partial / records[0]["moments"]
    moments.write_bytes(moments.read_bytes()[:-10])
    written = []
    _build(artifacts, out, workers=1, progress=lambda done, total: written.append(done))
    assert written[0] == 2  # every part written again, from the first batch
    assert _hashes(out) == _hashes(clean) and _same_values(out, clean)


def test_a_part_whose_items_are_declared_nullable_is_refused_naming_its_column(artifacts, tmp_path, small_parts):
    """FCA writes every coefficient list's items non-null; a part declaring them nullable (another
    writer's, or an edited file) is a part of another schema, refused in one line naming file and column."""
    import shutil

    from fca.tables.schema import MANIFEST, file_sha256

    clean = _build(artifacts, tmp_path / "clean", workers=1)
    mixed = tmp_path / "mixed"
    shutil.copytree(clean, mixed)
    manifest = json.loads((mixed / MANIFEST).read_text())
    record = manifest["parts"][0]
    table = pq.read_table(mixed / record["file"])
    nullable = pa.schema(
        [pa.field(f.name, pa.list_(f.type.value_type, f.type.list_size), nullable=False) if "." in f.name else f
         for f in table.schema]
    )  # fmt: skip
    pq.write_table(table.cast(nullable), mixed / record["file"], compression="zstd", row_group_size=T * 2)
    assert pq.read_schema(mixed / record["file"]).field("blocks.0.gate").type.value_field.nullable
    record.update(sha256=file_sha256(mixed / record["file"]), bytes=(mixed / record["file"]).stat().st_size)
    (mixed / MANIFEST).write_text(json.dumps(manifest))
    assert len(manifest["parts"]) == 3
    with pytest.raises(CacheError, match=r"part-00000\.parquet: column 'blocks\.0\.gate' has type .* expected "):
        open_cache(mixed).read_seqs([0])


def test_parts_completed_out_of_order_are_kept(tmp_path):
    """Parts 1 and 2 complete, part 0 half written: a new build must redo part 0 and only part 0."""
    specs = {"a": SiteSpec(axes=(("channel", 2),), family="g")}
    schema = cache_schema(specs)
    plan = cache_plan(specs, 5, 12, model={"path": "s", "fingerprint": "s"}, corpus={"split": "x"})
    z = np.zeros((2, 5), np.int64)

    def batch(lo):
        coefficients = {"a": np.full((2, 5, 2), lo, np.float32)}
        return record_batch(schema, np.arange(lo, lo + 2), z, z, z.astype(np.float32), coefficients)

    writer = CacheWriter(tmp_path / "c", plan, schema, 4, workers=2)
    for lo in (4, 6, 8, 10, 0):
        writer.write(batch(lo), 2)
    writer.abort()
    resumed = CacheWriter(tmp_path / "c", plan, schema, 4, workers=2)
    assert resumed.pending_ranges() == [(0, 4)] and resumed.done_seqs == 8
    with pytest.raises(CacheError, match="part 1 is already complete"):
        resumed.write(batch(4), 2)
    for lo in (0, 2):
        resumed.write(batch(lo), 2)
    cache = open_cache(resumed.finish(), verify=True)
    assert cache.read_seqs([0, 5, 11])["a"][:, 0, 0].tolist() == [0, 4, 10]


# ---------------------------------------------------------------------------------------------
# One build per cache.


def _held_elsewhere(out):
    """A process that holds the build lock of `out` until killed; -> the process, once it holds it."""
    code = "import sys, time\nfrom fca.tables.writer import build_lock\nlock = build_lock(sys.argv[1])\nlock.acquire()\nprint('held', flush=True)\ntime.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_second_writer_is_refused_naming_the_holder(artifacts, tmp_path, capsys):
    plan, schema = _plan_and_schema()
    first = CacheWriter(tmp_path / "c", plan, schema, 2)
    holder = rf"another build is writing this cache \(pid {os.getpid()} on {socket.gethostname()}"
    with pytest.raises(CacheError, match=holder):
        CacheWriter(tmp_path / "c", plan, schema, 2)
    # The same through the CLI, the lock held by another process: one line, the holder named.
    elsewhere = _held_elsewhere(tmp_path / "eval")
    try:
        code = main(
            ["build-cache", "--model", str(artifacts / "model"), "--corpus", str(artifacts / "prose.txt"),
             "--split", "eval", "--out", str(tmp_path / "eval"), "--num-seqs", "4", "--device", "cpu"]
        )  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert code != 0 and err.startswith("fca: error:") and "\n" not in err
        assert f"pid {elsewhere.pid} on {socket.gethostname()}" in err and "eval.lock" in err
        assert json.loads((tmp_path / "eval.lock").read_text())["pid"] == elsewhere.pid
    finally:
        elsewhere.kill()
        elsewhere.wait()
    first.abort()
    assert not (tmp_path / "c.lock").exists()


def _interrupt_at(seqs_done):
    def progress(done, total):
        if done >= seqs_done:
            raise KeyboardInterrupt

    return progress


def test_stale_lock_is_resumed_past(artifacts, tmp_path, small_parts):
    clean = _build(artifacts, tmp_path / "clean", workers=1)
    out = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        _build(artifacts, out, workers=1, progress=_interrupt_at(6))
    done_before = {p["index"] for p in PartStore(out).records()}
    assert done_before == {0}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is no longer alive: the lock of a killed build
    (tmp_path / "cache.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
    written = []
    _build(artifacts, out, workers=2, progress=lambda done, total: written.append(done))
    assert written[0] == SEQS_PER_PART + 2  # resumed after part 0
    assert _hashes(out) == _hashes(clean) and not (tmp_path / "cache.lock").exists()


def test_an_unfinished_build_of_other_settings_is_said_to_start_over(artifacts, tmp_path, small_parts, capsys):
    """An interrupted build rerun with another --batch (or split, ...) cannot resume: its parts were computed
    otherwise. It starts over, and says which settings differ instead of discarding the parts silently."""
    out = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        _build(artifacts, out, workers=1, progress=_interrupt_at(6))
    assert PartStore(out).records()  # something to lose
    _build(artifacts, out, workers=1, batch_size=4, show_progress=True)
    said = [line for line in capsys.readouterr().err.splitlines() if "starting over" in line]
    assert said == [f"{tmp_path / 'cache.partial'}: unfinished build with other settings (batch 2 -> 4); starting over"]
    assert open_cache(out, verify=True).environment["batch_size"] == 4

    with pytest.raises(KeyboardInterrupt):
        _build(artifacts, out.with_name("other"), workers=1, progress=_interrupt_at(6))
    _build(artifacts, out.with_name("other"), workers=1, split="calibration", num_seqs=8, show_progress=True)
    assert "(split eval -> calibration, num-seqs 12 -> 8); starting over" in capsys.readouterr().err
    _build(artifacts, out.with_name("resumed"), workers=1, show_progress=True)
    assert "starting over" not in capsys.readouterr().err  # (nothing unfinished: nothing said)
    before = {"model": {"fingerprint": "a" * 64}, "environment": {"batch_size": 8, "threads": 2}}
    now = {"model": {"fingerprint": "b" * 64}, "environment": {"batch_size": 16, "threads": 4}}
    assert settings_changed(before, now) == "model, batch 8 -> 16, environment.threads 2 -> 4"


def test_a_held_lock_is_refused_before_loading_and_a_dead_holders_is_taken_over(artifacts, tmp_path, monkeypatch):
    """A build refuses a held lock before it loads the model or reads the corpus. The lock is the OS's: a
    build killed while holding it leaves its file (naming it), and that lock is free; so is an empty file
    left by a build stopped between creating and writing it."""
    import fca.jobs.build as build
    from fca.tables.writer import build_lock

    lock = tmp_path / "cache.lock"
    holder = _held_elsewhere(tmp_path / "cache")
    monkeypatch.setattr(build, "prepare_corpus_build", lambda *a, **k: pytest.fail("loaded before refusing"))
    try:
        with pytest.raises(CacheError, match=f"another build is writing this cache \\(pid {holder.pid} on"):
            _build(artifacts, tmp_path / "cache", workers=1)
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.undo()
    assert json.loads(lock.read_text())["pid"] == holder.pid  # the killed build's record is left...
    build_lock(tmp_path / "cache").check_free()  # ...and its lock is free
    lock.write_text("")
    _build(artifacts, tmp_path / "cache", workers=1)  # taken over
    assert open_cache(tmp_path / "cache").num_seqs == N_SEQS and not lock.exists()


def test_a_file_of_another_tool_where_the_lock_goes_is_left_alone(artifacts, tmp_path):
    """`--out Cargo` beside a `Cargo.lock`: an old file that is not a build lock had been taken for a crashed
    build's and deleted (a folder `X.lock` was moved aside; a JSON lock of another tool read as "pid None")."""
    old = time.time() - 60
    for name, make in (
        ("Cargo", lambda p: p.write_text("version = 3\n")),
        ("flake", lambda p: p.write_text(json.dumps({"nodes": {}, "version": 7}))),
        ("folder", lambda p: p.mkdir()),
    ):
        lock = tmp_path / f"{name}.lock"
        make(lock)
        os.utime(lock, (old, old))
        said = rf"{name}: {re.escape(str(lock))} is in the way of its build lock, and it is not one \(another tool"
        with pytest.raises(CacheError, match=said):
            _build(artifacts, tmp_path / name, workers=1)
        assert lock.exists() and not (tmp_path / name).exists() and not (tmp_path / f"{name}.partial").exists()
    assert (tmp_path / "Cargo.lock").read_text() == "version = 3\n"


def test_a_lock_that_cannot_be_written_is_removed(tmp_path, monkeypatch):
    """A full disk between creating the lock and writing its record left an empty lock that refused the retry
    as "another build"."""
    import fca.tables.writer as writer
    import fca.tables.writer_store as writer_store

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_store.json, "dump", full_disk)
    with pytest.raises(
        CacheError, match=r"cache: cannot write its build lock .*cache\.lock \(No space left on device\)"
    ):
        writer.build_lock(tmp_path / "cache").acquire()
    assert not (tmp_path / "cache.lock").exists()


def test_a_lock_that_cannot_be_created_is_one_line_naming_it(artifacts, capsys):
    """A destination where no file can be made (a virtual folder, where even root cannot) was a raw
    `[Errno 2] No such file or directory: '/proc/x.lock'`."""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    out = Path("/proc") / f"fca-test-{os.getpid()}"
    model, corpus = str(artifacts / "model"), str(artifacts / "prose.txt")
    code = main(["build-cache", "--model", model, "--corpus", corpus, "--split", "eval", "--out", str(out),
                 "--num-seqs", "2", "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"fca: error: {out}: cannot create its build lock {out}.lock (No such file or directory)"


def test_an_os_error_is_one_line_with_its_path_first():
    from fca.cli import _one_line

    assert _one_line(PermissionError(13, "Permission denied", "c/part.parquet")) == "c/part.parquet: Permission denied"
    assert (
        _one_line(OSError(18, "Invalid cross-device link", "a.tmp", None, "b"))
        == "a.tmp -> b: Invalid cross-device link"
    )
    assert _one_line(OSError("no path")) == "no path"
    assert _one_line(KeyError("blocks.9.gate: no such site")) == "blocks.9.gate: no such site"


# ---------------------------------------------------------------------------------------------
# bfloat16 storage.


def test_bfloat16_model_coefficients_stored_bit_for_bit(artifacts, tmp_path):
    model = fca.load_model(artifacts / "model", dtype=torch.bfloat16)
    windows = np.random.default_rng(1).integers(0, 300, (6, T + 1))
    plan = cache_plan(
        site_specs(model),
        T,
        6,
        model={"path": "m", "fingerprint": "m"},
        corpus={"split": "x"},
        coefficient_dtype="bfloat16",
    )
    out = write_cache(model, windows, tmp_path / "bf16", plan, batch_size=3)
    cache = open_cache(out, verify=True)
    assert cache.manifest.coefficient_dtype == "bfloat16"
    stored = pq.read_schema(cache.part_paths()[0]).field("blocks.0.gate").type
    assert str(stored) == "fixed_size_list<element: uint16 not null>[4]"
    got = cache.read_seqs(range(6))
    for lo in (0, 3):  # the same record passes as the build (same batch composition)
        _, recorded = record_windows(model, torch.from_numpy(windows[lo : lo + 3]))
        for name, values in recorded.items():
            assert values.dtype == torch.bfloat16
            expected = values.float().numpy()
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(got[name][lo : lo + 3].view(np.uint32), expected.view(np.uint32))
    # Streaming readers see float32 too: the statistics are those of the decoded values.
    batch = next(cache.iter_batches(columns=["blocks.1.gate"]))
    assert str(batch.schema.field("blocks.1.gate").type) == "fixed_size_list<element: float not null>[4]"
    moments, layout = cache_moments(cache, with_tokens=False)
    decoded = np.concatenate([got[s].astype(np.float64) for s in layout.sites], axis=2).reshape(-1, layout.num_slots)
    assert moments.num_seqs == 6
    np.testing.assert_allclose(moments.slot_mean, decoded.mean(axis=0), rtol=1e-12)
    np.testing.assert_array_equal(moments.maximum, decoded.max(axis=0))


def test_a_bfloat16_cache_replays_in_bfloat16_unless_told_otherwise(artifacts, tmp_path, capsys):
    """Without --dtype, replay loads the model in the precision the cache was recorded in; a float32 replay,
    asked for, is refused with the reason."""
    for split in ("eval", "calibration"):
        build_cache_from_corpus(
            artifacts / "model",
            artifacts / "prose.txt",
            split,
            tmp_path / split,
            num_seqs=4,
            batch_size=2,
            device="cpu",
            dtype=torch.bfloat16,
            coefficient_dtype="bfloat16",
            show_progress=False,
        )
    experiment = fca.Experiment.open(artifacts / "model", tmp_path / "eval", tmp_path / "calibration", device="cpu")
    assert {p.dtype for p in experiment.model.parameters()} == {torch.bfloat16}
    args = ["replay", "--model", str(artifacts / "model"), "--cache", str(tmp_path / "eval")]
    args += ["--calibration", str(tmp_path / "calibration"), "--num-seqs", "4", "--device", "cpu", "--no-save"]
    assert main(args) == 0
    assert "static_layer" in capsys.readouterr().out
    assert main([*args, "--dtype", "float32"]) == 2
    assert "recorded with a bfloat16 model" in capsys.readouterr().err


def test_a_float16_cache_of_a_float32_model_halves_it_and_replays(artifacts, tmp_path, capsys):
    """`--coefficient-dtype float16` (README, "Cache layout"): the coefficients rounded to float16 and stored
    as Parquet half floats, read back as float32, and judged after the same rounding, so a replay in the
    build's own environment and batches accepts it."""
    built = {}
    for dtype in ("float32", "float16"):
        for split in ("eval", "calibration"):
            build_cache_from_corpus(
                artifacts / "model", artifacts / "prose.txt", split, tmp_path / dtype / split, num_seqs=4,
                batch_size=2, device="cpu", coefficient_dtype=dtype, show_progress=False,
            )  # fmt: skip
        built[dtype] = open_cache(tmp_path / dtype / "eval", verify=True)
    half, full = built["float16"], built["float32"]
    assert half.manifest.coefficient_dtype == "float16"
    assert (
        str(pq.read_schema(half.part_paths()[0]).field("blocks.0.gate").type)
        == "fixed_size_list<element: halffloat not null>[4]"
    )
    got, reference = half.read_seqs(range(4)), full.read_seqs(range(4))
    for site in half.sites:
        assert got[site].dtype == np.float32
        np.testing.assert_array_equal(got[site], reference[site].astype(np.float16).astype(np.float32))
    # DuckDB reads the half floats too (it refused them byte-stream-split: "only supported for FLOAT, ...").
    import duckdb

    first = duckdb.sql(f"SELECT \"blocks.0.gate\" FROM '{half.part_paths()[0]}' WHERE seq = 0 AND pos = 0").fetchall()
    assert first[0][0] == pytest.approx(got["blocks.0.gate"][0, 0].tolist(), abs=0)
    args = [
        "replay",
        "--model",
        str(artifacts / "model"),
        "--cache",
        str(tmp_path / "float16" / "eval"),
        "--batch",
        "2",
    ]
    args += [
        "--calibration",
        str(tmp_path / "float16" / "calibration"),
        "--num-seqs",
        "4",
        "--device",
        "cpu",
        "--no-save",
    ]
    assert main(args) == 0, capsys.readouterr().err
    assert "static_layer" in capsys.readouterr().out


def test_bfloat16_storage_of_a_float32_model_is_refused(artifacts, tmp_path, capsys, monkeypatch):
    """Refused from the arguments, before the weights load (minutes for a large model); so is a model folder
    without its tokenizer."""
    import fca.jobs.build

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the build was refused")

    monkeypatch.setattr(fca.jobs.build, "load_model", no_loading)
    code = main(
        [
            "build-cache",
            "--model",
            str(artifacts / "model"),
            "--corpus",
            str(artifacts / "prose.txt"),
            "--split",
            "eval",
            "--out",
            str(tmp_path / "c"),
            "--num-seqs",
            "4",
            "--device",
            "cpu",
            "--coefficient-dtype",
            "bfloat16",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "bfloat16 coefficient storage is for bfloat16 models" in err
    assert "this build loads the model in float32 (load it with --dtype bfloat16" in err
    assert not any(tmp_path.iterdir())  # nothing left behind: no partial directory, no lock
    shutil.copytree(artifacts / "model", tmp_path / "untokenized")
    (tmp_path / "untokenized" / "tokenizer.json").unlink()
    args = ["--corpus", str(artifacts / "prose.txt"), "--split", "eval", "--out", str(tmp_path / "c")]
    assert main(["build-cache", "--model", str(tmp_path / "untokenized"), *args, "--device", "cpu"]) != 0
    assert "untokenized/tokenizer.json: tokenizer not found" in capsys.readouterr().err


def test_bfloat16_bits_only_for_exact_values():
    as_bf16 = torch.tensor([1.0, -2.5, 0.1, 3.0e38, -1e-30]).bfloat16()
    exact = as_bf16.float().numpy()
    bits = bfloat16_bits(exact)
    np.testing.assert_array_equal(bits, as_bf16.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal((bits.astype(np.uint32) << 16).view(np.float32), exact)
    with pytest.raises(CacheError, match="would be rounded"):
        bfloat16_bits(np.array([0.1], np.float32))


# ---------------------------------------------------------------------------------------------
# Prefetching reads.


def test_prefetch_gives_read_seqs_results_in_order(artifacts, tmp_path, small_parts):
    cache = open_cache(_build(artifacts, tmp_path / "c", workers=1))
    batches = [[0, 1, 2], [11, 4], [5], [7, 6, 8, 9]]
    for depth in (1, 2):
        got = list(cache.prefetch(batches, sites=["blocks.1.gate"], depth=depth))
        assert len(got) == len(batches)
        for seqs, result in zip(batches, got):
            expected = cache.read_seqs(seqs, sites=["blocks.1.gate"])
            assert result.keys() == expected.keys() and all(np.array_equal(result[k], expected[k]) for k in result)


@pytest.mark.slow
def test_prefetch_raises_in_the_caller_and_stops_when_closed(artifacts, tmp_path, small_parts):
    cache = open_cache(_build(artifacts, tmp_path / "c", workers=1))
    it = cache.prefetch([[0], [99], [1]])
    assert np.array_equal(next(it)["token"], cache.read_seqs([0])["token"])
    with pytest.raises(CacheError, match="out of range"):
        next(it)
    it = cache.prefetch([[i] for i in range(N_SEQS)], depth=1)
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "fca-cache-prefetch"]


def test_moments_merged_while_building_equal_those_merged_at_the_end(tmp_path):
    """A writer merges each part's moments once it and the parts before it are complete (any worker
    order); the result is the bits of merging every sidecar in part order at the end."""
    from fca.tables.schema import MOMENTS, read_arrays
    from fca.tables.stats import merge_moment_arrays

    for workers in (1, 3):
        out, _ = _synthetic(23, 4, workers, tmp_path / f"w{workers}")
        cache = open_cache(out)
        records = cache.manifest.raw["moments"]["parts"]
        again, _ = merge_moment_arrays((read_arrays(out / name) for name, _ in records), 3 + 4, cache.seq_len, None)
        stored = read_arrays(out / MOMENTS)
        for key in ("sum", "sumsq", "pos_sum", "seq_term", "minimum", "maximum"):
            assert np.array_equal(stored[key], getattr(again, key)), (workers, key)


def test_moment_sidecars_are_the_bytes_numpy_writes(tmp_path):
    """`arrays_bytes` writes each member's header and raw bytes itself (no copy of the array); the file
    is byte for byte what `np.lib.format.write_array` gives in the same fixed-date zip, for 0-d, empty,
    Fortran-ordered and integer arrays, so stored moment hashes do not change."""
    import zipfile

    from fca.tables.schema import arrays_bytes, read_arrays

    rng = np.random.default_rng(5)
    arrays = {
        "count": np.asarray(8192),
        "scalar": np.float64(0.25),
        "pos_sum": rng.standard_normal((33, 7)),
        "ids": np.arange(11, dtype=np.int32),
        "bits": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "empty": np.zeros((0, 4)),
        "fortran": np.asfortranarray(rng.standard_normal((5, 3))),
    }
    reference = tmp_path / "reference.npz"
    with zipfile.ZipFile(reference, "w", compression=zipfile.ZIP_STORED) as z:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            with z.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(array, order="C"), allow_pickle=False)
    (tmp_path / "written.npz").write_bytes(arrays_bytes(arrays))
    assert (tmp_path / "written.npz").read_bytes() == reference.read_bytes()
    back = read_arrays(tmp_path / "written.npz")
    for name, array in arrays.items():
        assert back[name].shape == np.shape(array) and np.array_equal(back[name], array), name


def test_a_full_disk_names_the_part_it_was_writing(tmp_path, monkeypatch):
    """Arrow's own message for a full disk, "Error writing bytes to file. Detail: [errno 28] No space left on
    device", names no file; the build said only that."""
    plan, schema = _plan_and_schema()
    real_write_batch = pq.ParquetWriter.write_batch

    def full_disk(self, batch, *args, **kwargs):
        if int(batch.column("seq")[0].as_py()) >= 2:
            raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
        return real_write_batch(self, batch, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_batch", full_disk)
    for workers in (1, 2):
        writer = CacheWriter(tmp_path / f"c{workers}", plan, schema, 2, workers=workers)
        with pytest.raises(OSError) as err:
            _write_pairs(writer, 0, 4)
            writer.finish()
        writer.abort()
        assert (err.value.filename, err.value.strerror) == (
            str(tmp_path / f"c{workers}.partial" / "part-00001.parquet"),
            "No space left on device",
        )
