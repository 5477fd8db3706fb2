"""Ray as the opt-in engine: cache builds and replays sharded over actors (`--engine ray`).

Nothing here runs unless asked: `ray` is imported inside the functions, so the default single-process
path never starts or imports it.

Build (`build_cache_distributed`): one actor per GPU (CPU actors where the cluster has none) loads the
model once and holds the split's windows (the first actor tokenizes the corpus and makes the manifest
draft, so the draft records the workers' environment; the others get the windows through the object
store and must report the same environment). The driver holds the build lock and `<out>.partial/`
(a `CacheWriter`) and hands out part indices one at a time. An actor writes and commits part k with a
shard writer (the same encoder, the same batches from the part's first sequence, the same commit), so
the files are those of a single-process build and a stopped build resumes by part. A failed actor's part goes back to the queue for the others; when none
is left the build stops, resumable. The driver merges moments and writes the manifest last.

Replay (`ShardedExperiment`): each actor opens the `Experiment` once; `run` splits the evaluated
sequences on batch boundaries (batch composition, hence both exactness checks, unchanged), each actor
scores its shard with the whole run's derangement and permutations, and the driver concatenates the
per-sequence NLLs and merges the fidelity measures (max of maxima, sums of counts), so the bootstrap and
report are those of one process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from fca.engine.capture import build_writer, finish_stamp, record_pending
from fca.engine.environment import current_environment
from fca.engine.loading import fingerprint_state, load_model
from fca.engine.replay import ReplayResults
from fca.jobs.audit import audit_experiment
from fca.jobs.build import BuildSpec, prepare_corpus_build
from fca.jobs.experiment import Experiment, ModelSource, ReplaySpec
from fca.jobs.runs import run_replay
from fca.tables.audit_report import AuditReport
from fca.tables.conditions import Condition
from fca.tables.errors import CacheError, Cancelled
from fca.tables.fidelity import FidelityMeasure
from fca.tables.writer import CacheWriter, check_cache_destination

REPO_ROOT = str(Path(__file__).resolve().parents[2])  # so local Ray workers import this very `fca`
STOP_POLL_S = 0.5  # how often a sharded replay asks `should_stop` while its shards run


def connect(address: str | None = None):
    """The `ray` module, connected: to `address` (a running cluster, or "auto"), else a local cluster
    started here. A session already connected (a notebook, the tests) is used as it is."""
    import ray

    if not ray.is_initialized():
        path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=None if address else {"env_vars": {"PYTHONPATH": path}},
        )
    return ray


def start_actors(ray, actor_class: type, workers: int | None, *args) -> list:
    """`workers` actors of `actor_class` (default one per GPU, else one per CPU of the cluster), each with
    one GPU where the cluster has GPUs, else one CPU; each is made as `actor_class(threads, family_files,
    *args)` (`_Actor`), with the driver's torch threads for CPU actors and the family files it ran."""
    from fca.engine.user_families import loaded_family_files

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    options = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
    count = workers or gpus or max(1, int(resources.get("CPU", 1)))
    threads = None if gpus else torch.get_num_threads()
    Worker = ray.remote(max_restarts=0)(actor_class)
    family_files = loaded_family_files()
    return [Worker.options(**options).remote(threads, family_files, *args) for _ in range(count)]


class _Actor:
    """What every actor sets up before its work."""

    def __init__(self, threads: int | None, family_files: Sequence[str]) -> None:
        from fca.engine.user_families import load_family_files

        # Ray sets OMP_NUM_THREADS=1 in its workers; torch's thread count is part of the recorded environment
        # (CPU reductions may depend on it), so CPU workers use the driver's.
        if threads:
            torch.set_num_threads(threads)
        # A model of a family declared in a file (`--family`) loads in each actor only once the actor has
        # run the files the driver ran: an actor is a process of its own, with the built-in registry.
        load_family_files(family_files)


# ------------------------------------------------------------------------------------------ build


class _BuildWorker(_Actor):
    """One build actor: the model loaded once, the windows held, parts written on request."""

    def __init__(
        self, threads: int | None, family_files: Sequence[str], spec: BuildSpec, fail_after: int | None
    ) -> None:
        super().__init__(threads, family_files)
        self.spec = spec
        self.fail_after = fail_after  # tests: raise after this many parts, as a lost worker would
        self.written = 0
        self.model = self.windows = self.plan = None

    def prepare(self) -> tuple[dict, np.ndarray]:
        """Tokenize the split and make the manifest draft (first actor only)."""
        self.model, self.windows, self.plan = prepare_corpus_build(self.spec)
        return self.plan, self.windows

    def load(self, windows: np.ndarray, plan: dict) -> dict:
        """Load the model, take the windows; -> this actor's environment record (must equal the plan's)."""
        self.model = load_model(self.spec.model_dir, device=self.spec.device, dtype=self.spec.dtype)
        self.windows, self.plan = windows, plan
        return {
            "environment": {**current_environment(self.model), "batch_size": self.spec.batch_size},
            "fingerprint": fingerprint_state(self.model),
        }

    def write_part(self, out: str, schema: pa.Schema, part_seqs: int, k: int) -> dict:
        """Write and commit part k into `<out>.partial/` (a folder or a URI) with a shard writer of the
        driver's `schema` and `part_seqs`; -> its record."""
        if self.fail_after is not None and self.written >= self.fail_after:
            raise RuntimeError(f"simulated lost worker after {self.written} part(s)")
        writer = CacheWriter(out, self.plan, schema, part_seqs, shard=[k])
        record_pending(self.model, self.windows, writer, self.spec.batch_size, self.spec.coefficient_dtype)
        self.written += 1
        return writer.close_shard()[0]


def build_cache_distributed(
    model_dir: str | Path,
    corpus: str | Path,
    split: str,
    out: str | Path,
    overwrite: bool = False,
    workers: int | None = None,
    address: str | None = None,
    show_progress: bool = True,
    fail_after: int | None = None,
    **settings,
) -> Path | str:
    """`build_cache_from_corpus` over Ray actors; the same cache, value for value (module docstring).
    `settings`: the other fields of `fca.jobs.build.BuildSpec`.

    `workers`: actors (`start_actors`); `fail_after`: for tests, every actor fails after that many
    parts. Raises CacheError when every actor has failed; rerunning resumes from the committed parts.
    `out` may be a pyarrow filesystem URI (s3://..., file://...): the actors commit their parts there."""
    spec = BuildSpec(str(model_dir), str(corpus), split, **settings)
    check_cache_destination(out, overwrite)  # before starting a cluster and tokenizing for nothing
    ray = connect(address)
    actors = start_actors(ray, _BuildWorker, workers, spec, fail_after)
    try:
        plan_ref, windows_ref = actors[0].prepare.options(num_returns=2).remote()
        plan = ray.get(plan_ref)
        loaded = ray.get([a.load.remote(windows_ref, plan_ref) for a in actors[1:]])
        for record in loaded:
            if record["environment"] != plan["environment"] or record["fingerprint"] != plan["model"]["fingerprint"]:
                raise CacheError(
                    f"{out}: build workers differ ({record['environment']} vs {plan['environment']}); a cache "
                    "records one environment, so run its workers on identical devices"
                )
        device_type = plan["environment"]["device_type"]
        writer = build_writer(
            out, plan, spec.batch_size, device_type, spec.part_seqs, show_progress, overwrite=overwrite
        )
        schema, S = writer.schema, writer.seqs_per_part
        try:
            drive_parts(
                ray, actors, writer, lambda actor, k: actor.write_part.remote(str(out), schema, S, k), show_progress
            )
        except BaseException:
            writer.abort()
            raise
        return writer.finish(finish_stamp())
    finally:
        for actor in actors:
            ray.kill(actor)


def drive_parts(
    ray,
    actors: list,
    writer: CacheWriter,
    submit: Callable[[object, int], object],
    show_progress: bool = False,
    in_flight: int = 2,
) -> None:
    """Hand the writer's pending parts to actors, `in_flight` at a time each (the next part waits in the
    actor's queue, so an actor never idles between parts), and record each part as it commits.

    A part whose actor fails goes back to the queue and that actor is dropped; when no actor is left the
    build stops (CacheError naming the writer's directory; committed parts stay). Each committed part's
    moments are merged as it comes."""
    from tqdm.auto import tqdm

    queue = list(reversed(writer.pending_parts()))  # popped from the end: lowest index first
    alive = list(actors)
    running: dict = {}  # object ref -> (actor, part)

    def fill() -> None:
        for actor in alive:
            while queue and sum(a is actor for a, _ in running.values()) < in_flight:
                k = queue.pop()
                running[submit(actor, k)] = (actor, k)

    with tqdm(total=writer.num_parts, initial=len(writer.parts), unit="part", disable=not show_progress) as bar:
        fill()
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            actor, k = running.pop(done[0])
            try:
                record = ray.get(done[0])
            except Exception as err:  # a lost or failing worker: its part is redone by another
                queue.append(k)
                if actor in alive:
                    alive.remove(actor)
                if not alive:
                    raise CacheError(
                        f"{writer.partial}: every build worker failed (last: {str(err).splitlines()[0]}); "
                        f"{len(writer.parts)} of {writer.num_parts} parts are committed: rerun to resume"
                    ) from None
            else:
                writer.add_parts([record])
                writer.merge_committed(record["index"])
                bar.update(1)
            fill()


# ------------------------------------------------------------------------------------------ replay


class _ReplayWorker(_Actor):
    """One replay actor: the experiment opened once; scores shards of a run."""

    def __init__(self, threads: int | None, family_files: Sequence[str], spec: ReplaySpec) -> None:
        super().__init__(threads, family_files)
        self.experiment = spec.open()

    def run(self, conditions: list[Condition], n: int, batch_size: int, seed: int, shard) -> ReplayResults:
        return self.experiment.run(conditions, n, batch_size, seed, shard=shard)


def shard_bounds(n: int, batch_size: int, shards: int) -> list[tuple[int, int]]:
    """Split positions [0, n) into at most `shards` contiguous runs of whole batches, as even as can be."""
    batches = -(-n // batch_size)
    cuts = np.linspace(0, batches, min(shards, batches) + 1).round().astype(int)
    return [(int(a) * batch_size, min(n, int(b) * batch_size)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def merge_results(shards: Sequence[ReplayResults], bounds: Sequence[tuple[int, int]]) -> ReplayResults:
    """Shard results (each full-length, filled on its bounds) -> the results of one run over all positions."""
    first = shards[0]
    if any(r.replayed_on != first.replayed_on for r in shards):
        raise CacheError("replay workers ran in different environments; run them on identical devices")

    def joined(get) -> np.ndarray:  # [n, ...] rows of each shard's positions
        out = np.zeros_like(get(first), dtype=np.float64)
        for r, (lo, hi) in zip(shards, bounds):
            out[lo:hi] = get(r)[lo:hi]
        return out

    # A router one shard could not observe has no figure in the merged run; the others keep their columns.
    unobserved = {s: why for r in shards for s, why in r.routing_unobserved.items()}
    kept = [s for s in first.routers if s not in unobserved]

    def columns(r: ReplayResults) -> list[int]:
        order = list(r.routers)
        return [order.index(s) for s in kept]

    measure = FidelityMeasure()
    for r in shards:
        measure.merge(r.fidelity)
    live, replayed = joined(lambda r: r.live_per_seq), joined(lambda r: r.replayed_per_seq)
    return ReplayResults(
        seqs=first.seqs,
        per_seq_nll={name: joined(lambda r: r.per_seq_nll[name]) for name in first.per_seq_nll},
        conditions=first.conditions,
        max_abs_logit_diff=max(r.max_abs_logit_diff for r in shards),
        nll_live=float(live.mean()),
        nll_correct=float(replayed.mean()),
        batches=sum(r.batches for r in shards),
        fidelity=measure,
        live_per_seq=live,
        cache_correct_per_seq=joined(lambda r: r.cache_correct_per_seq),
        cache_path=first.cache_path,
        computed_on=first.computed_on,
        replayed_on=first.replayed_on,
        coefficient_dtype=first.coefficient_dtype,
        replayed_per_seq=replayed,
        routers={s: max(r.routers.get(s, 0) for r in shards) for s in kept},
        routing={
            name: {figure: joined(lambda r: r.routing[name][figure][:, columns(r)]) for figure in figures}
            for name, figures in (first.routing.items() if kept else ())
        },
        routing_unobserved=unobserved,
        executed=None
        if any(r.executed is None for r in shards)
        else {name: joined(lambda r: r.executed[name]).astype(np.int64) for name in first.executed},
    )


@dataclass
class ShardedExperiment(Experiment):
    """An `Experiment` whose `run` scores conditions on Ray actors (everything else runs in the driver:
    profiles for the report, the variance decomposition, the execution audit)."""

    actors: list = field(default_factory=list, repr=False)

    @classmethod
    def open_sharded(
        cls,
        spec: ReplaySpec,
        verify: bool = False,
        workers: int | None = None,
        address: str | None = None,
    ) -> ShardedExperiment:
        """Open the experiment in the driver (checks, as `Experiment.open`) and once in each actor. The
        model and caches are given as paths, which every actor must see (a shared filesystem)."""
        if not isinstance(spec.model, (str, Path)):
            raise ValueError("a sharded experiment loads the model in every actor: give its directory, not a module")
        base = spec.open(verify)
        calibration = None if base.calibration is None else str(base.calibration.path)
        paths = {"model": str(spec.model), "cache": str(base.evaluated.path), "calibration": calibration}
        each = replace(spec, dense=None, **paths)  # (the Dense twin's latency is the driver's)
        actors = start_actors(connect(address), _ReplayWorker, workers, each)
        return cls(**{f.name: getattr(base, f.name) for f in fields(Experiment)}, actors=actors)

    def run(
        self,
        conditions: Sequence[Condition],
        num_seqs: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        profile_progress: Callable[[int, int], None] | None = None,
        judge: bool = True,
    ) -> ReplayResults:
        """`Experiment.run` on the actors: each scores its shard, the driver merges and judges the run.
        Progress is reported per finished shard; `should_stop` is asked while the shards run, and a stop
        raises `Cancelled` at once (the actors finish their shards, whose figures are dropped).
        `profile_progress` is not reported: each actor estimates the profiles itself."""
        import ray

        conditions, n, batch_size = self.planned_run(conditions, num_seqs, batch_size, seed)  # in the driver first
        bounds = shard_bounds(n, batch_size, len(self.actors))
        refs = [a.run.remote(conditions, n, batch_size, seed, b) for a, b in zip(self.actors, bounds)]
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=STOP_POLL_S)
            if should_stop is not None and should_stop():
                raise Cancelled("replay cancelled")
            if progress is not None:
                progress(sum(hi - lo for (lo, hi), ref in zip(bounds, refs) if ref not in pending), n)
        results = merge_results(ray.get(refs), bounds)
        if judge:
            self.judge(results)
        return results

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


# ------------------------------------------------------------------------------------------ entry points


def run_audit_distributed(
    model: str | Path,
    cache: str | Path,
    calibration: str | Path,
    dense: ModelSource | None = None,
    device: str = "auto",
    dtype: torch.dtype | None = None,
    workers: int | None = None,
    address: str | None = None,
    **audit: object,
) -> AuditReport:
    """`fca.jobs.audit.run_audit` with the replay sharded over Ray actors: the same report. `audit`: the
    keyword arguments of `audit_experiment` (batch_size, num_seqs, seed, extra_conditions, ...)."""
    spec = ReplaySpec(model, cache, calibration, dense, device, dtype)
    with closing(ShardedExperiment.open_sharded(spec, verify=True, workers=workers, address=address)) as experiment:
        return audit_experiment(experiment, **audit)


def run_replay_distributed(
    model: str | Path,
    cache: str | Path,
    calibration: str | Path | None,
    conditions: Sequence[str | Condition],
    device: str = "auto",
    workers: int | None = None,
    address: str | None = None,
    dtype: torch.dtype | None = None,
    **replay: object,
) -> dict:
    """`fca.jobs.runs.run_replay` with the conditions scored on Ray actors: the same record."""
    spec = ReplaySpec(model, cache, calibration, device=device, dtype=dtype)
    with closing(ShardedExperiment.open_sharded(spec, workers=workers, address=address)) as experiment:
        return run_replay(None, None, None, conditions, experiment=experiment, **replay)
