"""Performance ratios, all measured in one run on one device (`python -m fca bench`).

Each timing is the median of interleaved repeats (A B A B ...), so slow drift of a shared machine
affects both sides of a ratio alike. Ratios, not absolute times, are what to compare across machines.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fca.engine.capture import bytes_per_token, num_slots, seqs_per_part, write_cache
from fca.engine.execution import synchronize
from fca.engine.loading import load_model
from fca.engine.replay import replay, stack_conditions
from fca.engine.sites import capture_tensors, model_logits, site_specs
from fca.jobs.build import manifest_draft
from fca.jobs.experiment import Experiment
from fca.tables import data
from fca.tables.conditions import PAPER_CONDITIONS, Condition, condition_coefficients
from fca.tables.profiles import calibration_profiles
from fca.tables.schema import cache_plan, cache_schema, record_batch
from fca.tables.store import open_cache
from fca.tables.timings import Timings
from fca.tables.writer import CacheWriter

REPO = Path(__file__).resolve().parents[2]  # the checkout holding the fca package


def _timed(fn: Callable[[], object], device: torch.device | None) -> float:
    synchronize(device)  # nothing queued before starts the clock, and all fn queued on the GPU is in it
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved(
    a: Callable[[], object],
    b: Callable[[], object],
    repeats: int = 5,
    device: torch.device | None = None,
) -> dict:
    """Median of a/b over interleaved repeats after one warm-up call of each, and each side's median seconds
    (each call timed to the end of its work on `device`)."""
    a(), b()
    ta, tb = [], []
    for i in range(repeats):
        for fn, times in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):  # alternate who goes first
            times.append(_timed(fn, device))
    return {
        "ratio": statistics.median(x / y for x, y in zip(ta, tb)),
        "a_s": statistics.median(ta),
        "b_s": statistics.median(tb),
    }


def _plan(model, windows: np.ndarray, batch_size: int) -> dict:
    """A build's manifest draft, with the model's real fingerprint and dtype: the bench's exactness check
    opens the cache as the audit would."""
    return manifest_draft(model, windows, batch_size, "float32", {"path": "bench"}, {"split": "bench"}, tokenizer={})


def windows_from_cache(cache, num_seqs: int) -> np.ndarray:
    """[N, T + 1] token windows rebuilt from a cache's `token` and `target` columns."""
    rows = cache.read_seqs(list(range(min(num_seqs, cache.num_seqs))), sites=[])
    return np.concatenate([rows["token"], rows["target"][:, -1:]], axis=1).astype(np.int64)


def long_format_write(coefficients: dict[str, np.ndarray], path: Path) -> None:
    """The straightforward alternative: one row per (sequence, position, site, channel), via pandas."""
    frames = []
    for site, values in coefficients.items():
        n, T, K = values.shape
        seq, pos, channel = np.meshgrid(np.arange(n), np.arange(T), np.arange(K), indexing="ij")
        frames.append(
            pd.DataFrame(
                {
                    "seq": seq.ravel(),
                    "pos": pos.ravel(),
                    "site": site,
                    "channel": channel.ravel(),
                    "value": values.ravel(),
                }
            )
        )
    pd.concat(frames, ignore_index=True).to_parquet(path)


def _stats_peak_memory(cache_dir: Path, baseline: bool = False) -> float:
    """Peak RSS (MB) of a fresh process that streams the statistics of `cache_dir` (or, with
    `baseline`, only imports the same modules)."""
    work = "" if baseline else "m, l = cache_moments(open_cache(sys.argv[1])); variance_decomposition(m, l); "
    code = (
        "import sys; from fca.tables.store import open_cache; from fca.tables.profiles import cache_moments; "
        f"from fca.tables.stats import variance_decomposition; {work}"
        # VmHWM, not ru_maxrss: the latter can carry the parent's size across fork + exec.
        "print([int(l.split()[1]) / 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(cache_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return float(out.stdout.strip().splitlines()[-1])


def _synthetic_plan(specs: dict, seq_len: int, num_seqs: int, **extra) -> dict:
    return cache_plan(
        specs, seq_len, num_seqs, {"path": "synthetic", "fingerprint": "synthetic"}, {"split": "synthetic"}, **extra
    )


def _synthetic_cache(out: Path, specs: dict, num_seqs: int, T: int, vocab: int, seed: int = 0) -> Path:
    """A large cache of random coefficients written straight through the store (no model needed)."""
    rng = np.random.default_rng(seed)
    schema = cache_schema(specs)
    plan = _synthetic_plan(specs, T, num_seqs, tokenizer={"vocab_size": vocab})
    writer = CacheWriter(out, plan, schema, seqs_per_part=512, overwrite=True)
    for lo in range(0, num_seqs, 128):
        n = min(128, num_seqs - lo)
        tokens = rng.integers(0, vocab, (n, T))
        coefficients = {name: rng.random((n, T, s.num_channels), dtype=np.float32) * 2 for name, s in specs.items()}
        writer.write(
            record_batch(schema, np.arange(lo, lo + n), tokens, tokens, np.zeros((n, T), np.float32), coefficients), n
        )
    return writer.finish()


def muddpythia_1p4b_specs() -> dict:
    """Site specs with the coefficient shapes of MUDDPythia-1.4B: 24 layers, layer i has C * (i + 2)
    channels (C = 4 streams, 1 in the last layer): 1,221 coefficients, 4,884 B/token in float32."""
    from fca.engine.models.muddpythia import MUDDPythiaConfig
    from fca.tables.spec import SiteSpec

    widths = MUDDPythiaConfig(n_layer=24).coefficients_per_layer()
    return {f"dense.{i}": SiteSpec(axes=(("channel", k),), family="dense") for i, k in enumerate(widths)}


def writer_seconds(
    specs: dict, workers: int, out: Path, num_seqs: int = 32, seq_len: int = 1024, batch: int = 8, seed: int = 0
) -> float:
    """Seconds to write `num_seqs` x `seq_len` synthetic tokens through `CacheWriter` with `workers`
    threads, parts sized as a real build sizes them. Two batches of coefficients (a per-channel offset
    plus noise, like dynamic plus static weights) are reused, so producing batches costs next to nothing."""
    rng = np.random.default_rng(seed)
    schema = cache_schema(specs)
    plan = _synthetic_plan(specs, seq_len, num_seqs)
    templates = [
        {
            k: (
                rng.standard_normal(s.num_channels) + 0.05 * rng.standard_normal((batch, seq_len, s.num_channels))
            ).astype(np.float32)
            for k, s in specs.items()
        }
        for _ in range(2)
    ]
    tokens = rng.integers(0, 50_000, (batch, seq_len))
    nll = np.zeros((batch, seq_len), np.float32)
    start = time.perf_counter()
    parts = seqs_per_part(bytes_per_token(specs), seq_len, batch, num_seqs, num_slots(specs))  # as a CUDA build
    writer = CacheWriter(out, plan, schema, parts, overwrite=True, workers=workers)
    for i, lo in enumerate(range(0, num_seqs, batch)):
        n = min(batch, num_seqs - lo)
        values = {k: v[:n] for k, v in templates[i % 2].items()}
        writer.write(record_batch(schema, np.arange(lo, lo + n), tokens[:n], tokens[:n], nll[:n], values), n)
    writer.finish()
    seconds = time.perf_counter() - start
    # Deleted after the clock stops (deleting is not writing, and an overwrite would time the unlink)
    # and before the next run starts: the kernel can write a cache left on disk back during
    # a later run, on the same cores, slowing whichever run that lands in.
    shutil.rmtree(out, ignore_errors=True)
    return seconds


# Sequences per writer-bench run: 16 parts of 16 x 1,024 tokens (1.29 GB raw), for the writer's steady
# rate. With 8 parts, each of two threads wrote 4 and one ended alone: runs of 64, 128 and 256 sequences
# in parts of 8, interleaved in one process, read two against one as 1.67 / 1.94 / 1.94 and 1.80 / 2.00
# / 1.98.
WRITER_BENCH_SEQS = 256


def writer_scaling(
    workers: list[int],
    num_seqs: int = WRITER_BENCH_SEQS,
    seq_len: int = 1024,
    batch: int = 8,
    repeats: int = 3,
    on_run: Callable[[int, int, int], None] | None = None,
) -> dict:
    """Raw MB/s of the cache writer for each worker count on MUDDPythia-1.4B-shaped coefficients
    (median of interleaved repeats), and each count's ratio to the first. `on_run(k, runs, workers)` is
    called as run k (from 1) of all `runs`, warm-ups included, starts: the runs take minutes in all."""
    specs = muddpythia_1p4b_specs()
    raw_mb = bytes_per_token(specs) * num_seqs * seq_len / 1e6
    times: dict[int, list[float]] = {w: [] for w in workers}
    # Every count once before timing (repeat None): a first run with new threads also pays for setting up
    # their allocator arenas (a longer run, with more page faults), which a build pays once.
    runs = [(w, None) for w in workers]
    runs += [(w, r) for r in range(repeats) for w in (workers if r % 2 == 0 else workers[::-1])]
    with tempfile.TemporaryDirectory(prefix="fca-writer-", ignore_cleanup_errors=True) as scratch:
        for k, (w, r) in enumerate(runs, 1):
            if on_run is not None:
                on_run(k, len(runs), w)
            if r is None:
                writer_seconds(specs, w, Path(scratch, "warmup"), min(num_seqs, 2 * w * batch), seq_len, batch)
            else:
                times[w].append(writer_seconds(specs, w, Path(scratch, f"w{w}"), num_seqs, seq_len, batch, seed=r))
    mb_s = {w: raw_mb / statistics.median(t) for w, t in times.items()}
    return {
        "raw_mb": raw_mb,
        "bytes_per_token": bytes_per_token(specs),
        "mb_s": mb_s,
        "ratio": {w: mb_s[w] / mb_s[workers[0]] for w in workers},
    }


@dataclass
class BenchRun:
    """What the figures of one bench run share: the model, its windows in batches, a scratch folder.

    The cache build is timed on a demo-sized cache (its fixed costs amortised as in real use); the replay
    figures on the first `num_seqs` of the same windows."""

    model: torch.nn.Module
    capture_windows: np.ndarray  # [capture_seqs, T + 1]
    num_seqs: int
    batch_size: int
    repeats: int
    work: Path

    def __post_init__(self) -> None:
        self.device = next(self.model.parameters()).device
        self.T = self.capture_windows.shape[1] - 1
        self.windows = self.capture_windows[: self.num_seqs]  # [num_seqs, T + 1]
        self.batches = self._batches(self.windows)
        self.capture_batches = self._batches(self.capture_windows)
        self.build_stages = Timings()  # the last cache build's

    def _batches(self, windows: np.ndarray) -> list[torch.Tensor]:
        b = self.batch_size
        return [torch.from_numpy(windows[i : i + b]).to(self.device) for i in range(0, len(windows), b)]

    def forward_over(self, batches: list[torch.Tensor]) -> None:
        for w in batches:
            model_logits(self.model(w[:, :-1]), self.model)

    def plain_forward(self) -> None:
        self.forward_over(self.batches)

    @cached_property
    def capture_plan(self) -> dict:
        """The build's plan, made once as a real build makes it, outside the timed write: it hashes every
        weight (on a GPU, a copy of each to the host besides)."""
        return _plan(self.model, self.capture_windows, self.batch_size)

    def build_cache(self) -> None:
        plan = self.capture_plan
        self.build_stages = Timings()
        write_cache(
            self.model,
            self.capture_windows,
            self.work / "capture",
            plan,
            self.batch_size,
            overwrite=True,
            timings=self.build_stages,
        )

    @cached_property
    def cache(self):
        """The cache the capture figures built (so those run first)."""
        return open_cache(self.work / "capture")

    @cached_property
    def recorded(self) -> list[dict[str, torch.Tensor]]:
        """Each replay batch's coefficients, recorded live: site -> [b, T, K] on the device."""
        return [capture_tensors(self.model, w[:, :-1])[1] for w in self.batches]

    @cached_property
    def recorded_host(self) -> list[dict[str, np.ndarray]]:
        """`recorded`, copied to the host once for the figures that build coefficients there."""
        return [{k: v.cpu().numpy() for k, v in c.items()} for c in self.recorded]

    def interleaved(self, a: Callable[[], object], b: Callable[[], object]) -> dict:
        return interleaved(a, b, self.repeats, device=self.device)

    def replay_recorded(self) -> None:
        for w, c in zip(self.batches, self.recorded):
            replay(self.model, w[:, :-1], c)


def capture_figures(run: BenchRun) -> dict:
    """Cache build over plain forward, and where the build's time went."""
    figures: dict = {}
    r = run.interleaved(run.build_cache, lambda: run.forward_over(run.capture_batches))
    figures["capture_ratio"] = r["ratio"]
    figures["capture_seconds"], figures["forward_seconds"] = r["a_s"], r["b_s"]
    figures["capture_stages_s"] = run.build_stages.rounded()  # per stage (fca.tables.timings)
    return figures


def replay_figures(run: BenchRun) -> dict:
    """Replay vs live, the coefficients already in memory (as they are after one cache read)."""
    return {"replay_ratio": run.interleaved(run.replay_recorded, run.plain_forward)["ratio"]}


def cache_figures(run: BenchRun) -> dict:
    """The built cache's exactness (as the audit checks it; nothing timed) and size, and replay fed from
    it vs live, read as the replay runner reads it: the next batch read and decoded on a background
    thread while this one runs."""
    cache, b = run.cache, run.batch_size
    exactness = Experiment.open(run.model, cache, None).run([Condition("correct")], run.num_seqs, b).exactness
    raw = 4 * num_slots(site_specs(run.model)) * len(run.capture_windows) * run.T  # float32 coefficient bytes

    def replay_from_cache() -> None:
        batches = [range(i * b, i * b + len(w)) for i, w in enumerate(run.batches)]
        with closing(cache.prefetch(batches, list(cache.sites))) as reads:
            for w in run.batches:
                replay(run.model, w[:, :-1], next(reads))

    return {
        "exactness": {
            "max_abs_logit_diff": exactness["max_abs_logit_diff"],
            "fidelity": exactness["fidelity"]["verdict"],
        },
        "parquet_bytes_ratio": cache.manifest.total_bytes / raw,
        "replay_from_cache_ratio": run.interleaved(replay_from_cache, run.plain_forward)["ratio"],
    }


def batched_conditions_figures(run: BenchRun) -> dict:
    """The five paper conditions stacked in one forward vs one condition, per batch; then the same with
    one sequence per condition, where a pass is furthest from saturating the device."""
    profiles = calibration_profiles(run.cache)
    conditions = [Condition(kind) for kind in PAPER_CONDITIONS]
    n = len(conditions)
    stacked = []  # per batch: site -> [n * b, T, K], condition-major
    for i, (w, own) in enumerate(zip(run.batches, run.recorded_host)):
        index = list(range(i * run.batch_size, i * run.batch_size + len(w)))
        other = {k: np.roll(v, 1, axis=0) for k, v in own.items()}
        per_condition = [condition_coefficients(c, own, index, profiles, other) for c in conditions]
        stacked.append(stack_conditions(per_condition, len(w), run.T))
    batched = run.interleaved(
        lambda: [replay(run.model, w[:, :-1].repeat(n, 1), s) for w, s in zip(run.batches, stacked)],
        run.replay_recorded,
    )
    # Row 0 of each condition's block: the first sequence (correct's rows come first).
    firsts = [{k: v[:: len(w)] for k, v in s.items()} for w, s in zip(run.batches, stacked)]  # [n, T, K]
    corrects = [{k: v[:1] for k, v in f.items()} for f in firsts]  # [1, T, K]
    one = run.interleaved(
        lambda: [replay(run.model, w[:1, :-1].repeat(n, 1), f) for w, f in zip(run.batches, firsts)],
        lambda: [replay(run.model, w[:1, :-1], c) for w, c in zip(run.batches, corrects)],
    )
    return {
        "batched_conditions_ratio": batched["ratio"],
        "batched_conditions_note": (
            f"{n} conditions stacked along the batch ({run.batch_size} x {n} sequences per pass) "
            f"vs one condition ({run.batch_size} per pass); {n}.0 means no gain from batching"
        ),
        "batched_conditions_ratio_one_sequence": one["ratio"],
    }


def long_format_figures(run: BenchRun) -> dict:
    """Our Parquet writer vs a straightforward pandas long-format writer, same coefficients."""
    coefficients = {k: np.concatenate([c[k] for c in run.recorded_host]) for k in run.recorded_host[0]}
    schema = cache_schema(site_specs(run.model))
    windows, b = run.windows, run.batch_size
    nll = np.zeros((len(windows), run.T), np.float32)

    def ours() -> None:
        writer = CacheWriter(run.work / "ours", _plan(run.model, windows, b), schema, len(windows), overwrite=True)
        for lo in range(0, len(windows), b):
            hi = min(len(windows), lo + b)
            rows = np.arange(lo, hi)
            values = {k: v[lo:hi] for k, v in coefficients.items()}
            writer.write(
                record_batch(schema, rows, windows[lo:hi, :-1], windows[lo:hi, 1:], nll[lo:hi], values), hi - lo
            )
        writer.finish()

    long_path = run.work / "long.parquet"
    r = interleaved(ours, lambda: long_format_write(coefficients, long_path), max(3, run.repeats // 2))  # host only
    return {
        "long_format_ratio": r["ratio"],
        "long_format_bytes_ratio": long_path.stat().st_size / open_cache(run.work / "ours").manifest.total_bytes,
    }


def stats_memory_figures(run: BenchRun, stats_seqs: int, big_cache_factor: int) -> dict:
    """Peak memory of the streaming statistics over a demo-sized synthetic cache and one `big_cache_factor`
    times larger: flat memory is the claim, and the import baseline shows what Python, numpy and pyarrow
    alone take."""
    figures: dict = {}
    specs, vocab = site_specs(run.model), int(run.model.config.vocab_size)
    for name, seqs in (("demo", stats_seqs), ("big", stats_seqs * big_cache_factor)):
        synthetic = _synthetic_cache(run.work / name, specs, seqs, run.T, vocab)
        figures[f"stats_{name}_cache_mb"] = open_cache(synthetic).manifest.total_bytes / 1e6
        figures[f"stats_{name}_peak_mem_mb"] = _stats_peak_memory(synthetic)
    figures["stats_peak_mem_mb"] = figures["stats_big_peak_mem_mb"]
    figures["stats_import_baseline_mem_mb"] = _stats_peak_memory(synthetic, baseline=True)
    return figures


def writer_figures(writer_seqs: int, on_run: Callable[[int, int, int], None] | None = None) -> dict:
    """The cache writer alone, 1 and 2 worker threads, on MUDDPythia-1.4B-shaped coefficients in batches
    of 8, as `bench/writer_scale.py` (see `WRITER_BENCH_SEQS`); `on_run` as `writer_scaling`'s."""
    scaling = writer_scaling([1, 2], num_seqs=writer_seqs, seq_len=1024, batch=8, repeats=5, on_run=on_run)
    return {
        "writer_mb_s_1": scaling["mb_s"][1],
        "writer_mb_s_2": scaling["mb_s"][2],
        "writer_scaling_2": scaling["ratio"][2],
    }


@torch.no_grad()
def run_bench(
    model_dir: str | Path,
    corpus: str | Path | None,
    device: str = "auto",
    num_seqs: int = 64,
    capture_seqs: int = 256,
    batch_size: int = 16,
    repeats: int = 7,
    stats_seqs: int = 256,
    big_cache_factor: int = 8,
    writer_seqs: int = WRITER_BENCH_SEQS,
    show_progress: bool = False,
) -> dict:
    """Every figure of the README's performance section, measured in one run on one device (the sizes
    default to the README's; the tests run it small)."""
    from tqdm.auto import tqdm

    model = load_model(model_dir, device=device)
    T = int(model.config.max_seq_len) if hasattr(model.config, "max_seq_len") else 128
    if corpus is not None and Path(corpus).exists():
        tokenizer = data.load_tokenizer(model_dir)
        capture_windows = data.split_windows(corpus, "eval", tokenizer, T, 0, capture_seqs)  # [N, T + 1]
    else:  # no corpus at hand (a bare GPU machine, say): the windows stored in the shipped demo cache
        capture_windows = windows_from_cache(open_cache(Path(model_dir).parent / "eval"), capture_seqs)
    figures: dict[str, Callable[[BenchRun], dict]] = {  # in order: the cache figures read the built cache
        "capture": capture_figures,
        "replay": replay_figures,
        "replay from cache": cache_figures,
        "batched conditions": batched_conditions_figures,
        "long format": long_format_figures,
        "statistics memory": lambda run: stats_memory_figures(run, stats_seqs, big_cache_factor),
        # (its 12 runs take minutes: the bar says which one is under way)
        "writer scaling": lambda run: writer_figures(
            writer_seqs,
            on_run=lambda k, runs, w: bar.set_postfix_str(
                f"writer scaling: run {k}/{runs}, {w} thread{'s' if w > 1 else ''}"
            ),
        ),
    }
    # One step per group of figures, and one for the end, so a run of minutes says where it is.
    bar = tqdm(total=len(figures) + 1, desc="bench", unit="step", disable=not show_progress)
    # The scratch caches go, and the bar closes, whether the bench finishes or fails (from here on: making the
    # batches may fail too, out of device memory, say).
    with bar, tempfile.TemporaryDirectory(prefix="fca-bench-", ignore_cleanup_errors=True) as work:
        run = BenchRun(model, capture_windows, min(num_seqs, len(capture_windows)), batch_size, repeats, Path(work))
        result: dict = {
            "device": str(run.device),
            "model": Path(model_dir).name,
            "num_seqs": run.num_seqs,
            "capture_seqs": len(capture_windows),
            "seq_len": run.T,
            "batch_size": batch_size,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
        }
        for name, measure in figures.items():
            bar.set_postfix_str(name)
            bar.update(1)
            result.update(measure(run))
        bar.set_postfix_str("done")
        bar.update(1)
        return result
