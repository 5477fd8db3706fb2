"""An experiment: a model with its evaluated and calibration caches, opened and checked once.

Every job that replays (the audit, saved replay runs, the dashboard's Replay lab, the benches) starts
from an `Experiment`, so they all accept and refuse the same inputs: the caches must be this model's
(fingerprint), recorded in its dtype, of the same sites, and the calibration cache must come from an
independent split. The model may be a directory or a module held in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fca.engine.environment import model_dtype_name
from fca.engine.execution import execution_audit
from fca.engine.loading import fingerprint_state, load_model
from fca.engine.replay import ReplayResults, check_exactness, check_finite, check_token_ids, run_conditions
from fca.engine.sites import controller_parameters, find_sites, model_class_name, site_specs, vocab_rows
from fca.tables.catalog import DENSE_TWINS, is_dense_twin
from fca.tables.conditions import Condition, as_conditions, check_sites_named
from fca.tables.errors import CacheError, ModelLoadError
from fca.tables.fidelity import calibration_origin
from fca.tables.profiles import Profiles, calibration_profiles
from fca.tables.scoring import count_documents, gap_retention, gap_retention_ci, summarize_conditions, summarize_routing
from fca.tables.store import Cache, open_cache
from fca.tables.study import model_training

ModelSource = str | Path | nn.Module
CacheSource = str | Path | Cache


def _model(source: ModelSource | None, device: str, dtype: torch.dtype | None) -> nn.Module | None:
    if source is None or isinstance(source, nn.Module):
        return source
    return load_model(source, device=device, dtype=dtype)


def _cache(source: CacheSource, verify: bool) -> Cache:
    return source if isinstance(source, Cache) else open_cache(source, verify=verify)


def check_condition_sites(conditions: Sequence[Condition], cache: CacheSource) -> None:
    """Refuse a condition that names a site the evaluated cache lacks, from its manifest alone: before a
    model loads (minutes, for a large one) and before any part is hashed."""
    check_sites_named(conditions, _cache(cache, verify=False).sites)


def _config_dict(model: nn.Module) -> dict:
    """A model's config as a dict ({} for a module without one)."""
    config = getattr(model, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else {}


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # (a parameter shared by modules counts once)


def model_name(source: ModelSource) -> str:
    """A model's name in reports: its directory's name, or its class name when held in memory."""
    return model_class_name(source) if isinstance(source, nn.Module) else Path(source).name


DEFAULT_BATCH_SIZE = 16  # sequences per replayed batch when neither the run nor the cache says
SHARED_SPAN_TOKENS = 32  # text shared by chance is rarer at this length (none between the demo's splits)
# Windows shorter than two such stretches compare half a window, down to this: of the 16-token stretches of
# disjoint KJV splits (the demo's 2,048-id vocabulary), 0.01% recur by chance.
MIN_SHARED_SPAN_TOKENS = 16
# Character- and byte-level vocabularies compare longer stretches: 32 characters of scripture are a formula
# that recurs by chance (1.03% of them between disjoint slices of the KJV), 64 hardly (0.10%), while a
# shifted copy shares 95% at either length.
CHARACTER_VOCAB, CHARACTER_SPAN_TOKENS = 512, 64
MAX_SHARED_SPAN_SHARE = 0.01  # one duplicated window among hundreds passes; a shifted copy does not


def shared_text_span(evaluated: Cache, calibration: Cache) -> int:
    """The stretch length compared: 32 tokens, 64 for a vocabulary of at most 512 ids (characters or bytes),
    at most half a window, and at most a whole window. A copy cut at other offsets overlaps one of the
    windows it is compared with by at least half a window, so stretches of half a window find it whatever
    the shift (in 33-token windows, 32-token stretches missed every copy shifted by 2 or more). Never
    shorter than 16 tokens, or 32 characters, which recur by chance."""
    vocab = evaluated.vocab_size
    characters = vocab is not None and vocab <= CHARACTER_VOCAB
    wanted, shortest = (
        (CHARACTER_SPAN_TOKENS, SHARED_SPAN_TOKENS) if characters else (SHARED_SPAN_TOKENS, MIN_SHARED_SPAN_TOKENS)
    )
    window = min(evaluated.seq_len, calibration.seq_len) + 1
    return min(window, max(shortest, min(wanted, window // 2)))


def check_shared_text(evaluated: Cache, calibration: Cache) -> None:
    """Refuse caches that share more than 1% of either one's text: the distinct stretches (`shared_text_span`)
    found in both, wherever the window boundaries fall. Both shares count: a small calibration cache cut
    from a large evaluated one is all leak while a tiny share of the evaluated text."""
    span = shared_text_span(evaluated, calibration)
    evaluated_spans, calibration_spans = evaluated.span_hashes(span), calibration.span_hashes(span)
    shared = np.intersect1d(evaluated_spans, calibration_spans, assume_unique=True).size
    shares = shared / max(calibration_spans.size, 1), shared / max(evaluated_spans.size, 1)
    if max(shares) > MAX_SHARED_SPAN_SHARE:
        raise CacheError(
            f"{calibration.path}: shares text with the evaluated cache {evaluated.path}: {shares[0]:.1%} of its "
            f"{span}-token stretches are there, and {shares[1]:.1%} of the evaluated cache's are here (at most "
            f"{MAX_SHARED_SPAN_SHARE:.0%} of either); static profiles must be estimated on other text"
        )


def check_independent(evaluated: Cache, calibration: Cache) -> None:
    """Static profiles must be estimated on another split than the one they are evaluated on. Splits of
    one corpus file are disjoint only when drawn with the same split seed (`fca.tables.data.split_documents`).
    Caches of another corpus, and caches without a split seed (windows given in memory), must share almost
    no text (`check_shared_text`): the same text saved in another format is another corpus file."""
    a, b = evaluated.manifest.corpus, calibration.manifest.corpus
    if (a.split, a.fingerprint, a.split_seed) == (b.split, b.fingerprint, b.split_seed):
        raise CacheError(
            f"{calibration.path}: the calibration cache comes from the same split ({a.split!r}) as the "
            "evaluated cache; static profiles must be estimated on an independent split"
        )
    if a.fingerprint is not None and a.fingerprint == b.fingerprint and a.split_seed != b.split_seed:
        raise CacheError(
            f"{calibration.path}: its {b.split!r} split of {b.name or 'the corpus'} was drawn with split seed "
            f"{b.split_seed}, the evaluated cache's {a.split!r} split with {a.split_seed}: splits drawn with "
            f"different seeds share documents; build the calibration cache with --split-seed {a.split_seed}"
        )
    if a.split_seed is None or b.split_seed is None or a.fingerprint != b.fingerprint:
        # Windows given in memory (or caches older than split seeds) say nothing of how they were drawn:
        # their split names are labels only. Another corpus file may hold the same text (the KJV as .txt
        # and as Parquet). Either way the text they hold is compared instead.
        check_shared_text(evaluated, calibration)
    if set(evaluated.sites) != set(calibration.sites):
        raise CacheError(f"{calibration.path}: its sites differ from {evaluated.path}'s")


@dataclass(frozen=True)
class ReplaySpec:
    """What a replay opens (one process, or each Ray worker): the model, the evaluated and calibration
    caches, the Dense twin, the device and the model's dtype (None: the cache's)."""

    model: ModelSource
    cache: CacheSource
    calibration: CacheSource | None
    dense: ModelSource | None = None
    device: str = "auto"
    dtype: torch.dtype | None = None

    def open(self, verify: bool = False) -> Experiment:
        return Experiment.open(self.model, self.cache, self.calibration, self.dense, self.device, self.dtype, verify)


@dataclass
class Experiment:
    model: nn.Module
    evaluated: Cache
    calibration: Cache | None  # None: no static or global profiles (execution and Correct replay only)
    name: str  # the model's name in reports
    model_fingerprint: str
    dense_source: ModelSource | None = None  # the Dense twin, loaded on first use (`dense`)
    dtype: torch.dtype | None = None
    training: dict = field(default_factory=dict)  # the model directory's training summary (seed, steps, ...)
    _dense: nn.Module | None = field(default=None, repr=False)
    _profiles: Profiles | None = field(default=None, repr=False)

    @classmethod
    def open(
        cls,
        model: ModelSource,
        cache: CacheSource,
        calibration: CacheSource | None,
        dense: ModelSource | None = None,
        device: str = "auto",
        dtype: torch.dtype | None = None,
        verify: bool = False,
    ) -> Experiment:
        """Load the model if given as a path, open the caches (`verify`: re-hash their parts) and check they
        belong together. Raises CacheError / ModelLoadError with a one-line reason. `dtype` None: a model
        given as a path is loaded in the precision the evaluated cache was recorded in."""
        evaluated = _cache(cache, verify)
        if dtype is None and not isinstance(model, nn.Module):
            dtype = getattr(torch, evaluated.model_dtype, None)
        loaded = _model(model, device, dtype)
        calibrated = None if calibration is None else _cache(calibration, verify)
        if calibrated is not None and calibrated.model_dtype != evaluated.model_dtype:
            raise CacheError(
                f"{calibrated.path}: recorded with a {calibrated.model_dtype} model, the evaluated cache with a "
                f"{evaluated.model_dtype} one; build the calibration cache in {evaluated.model_dtype} too"
            )
        fingerprint = fingerprint_state(loaded)
        for c in (evaluated, calibrated):
            if c is not None:
                c.check_model(fingerprint, model_dtype_name(loaded))
        evaluated.check_sites(site_specs(loaded))  # (the calibration cache's are checked against these)
        if calibrated is not None:
            check_independent(evaluated, calibrated)
        training = {} if isinstance(model, nn.Module) else model_training(model)
        return cls(loaded, evaluated, calibrated, model_name(model), fingerprint, dense, dtype, training)

    @property
    def dense(self) -> nn.Module | None:
        """The Dense twin (for the latency ratio), loaded on first use on the model's device and dtype."""
        if self._dense is None and self.dense_source is not None:
            dense = _model(self.dense_source, str(self.device), self.dtype)
            # Messages name the directory as given: two runs' twins are often both called "dense".
            where = type(dense).__name__ if isinstance(self.dense_source, nn.Module) else str(self.dense_source)
            if find_sites(dense):  # e.g. the gated model itself, given by mistake
                raise ModelLoadError(
                    f"{where}: has controller sites, so it is not a Dense twin (the same sizes without controllers)"
                )
            if dense.training:  # dropout would be timed (the gated model is refused the same way)
                raise ModelLoadError(f"{where}: is in training mode; call .eval() on the Dense twin")
            config, dense_config = _config_dict(self.model), _config_dict(dense)
            twin = DENSE_TWINS.get(config.get("model_type"))
            if twin is not None and not is_dense_twin(config, dense_config):  # (a family that knows its twin)
                raise ModelLoadError(
                    f"{where}: not the Dense twin of {self.name} (a twin is the same family with the same "
                    f"sizes and {twin.switch} false), so a latency ratio against it would not measure the controllers"
                )
            if twin is None:  # any other model: a twin is the model without its controllers, weight for weight
                expected, got = parameter_count(self.model) - controller_parameters(self.model), parameter_count(dense)
                if got != expected:
                    raise ModelLoadError(
                        f"{where}: has {got:,} parameters, and {self.name} without its controllers "
                        f"{expected:,}: not its Dense twin (the same model without controllers), so a latency ratio "
                        "against it would not measure the controllers"
                    )
            self._dense = dense
        return self._dense

    @property
    def dense_name(self) -> str | None:
        return None if self.dense_source is None else model_name(self.dense_source)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def fingerprint(self) -> str:
        """Identity of the experiment: model weights and the caches' contents."""
        parts = (
            self.model_fingerprint,
            self.evaluated.fingerprint,
            self.calibration.fingerprint if self.calibration else "",
        )
        return hashlib.sha256("|".join(parts).encode()).hexdigest()

    def profiles(self, progress: Callable[[int, int], None] | None = None) -> Profiles:
        """Static and global profiles of the calibration cache, computed once."""
        if self.calibration is None:
            raise CacheError(
                f"{self.evaluated.path}: static and global profiles need a calibration cache (an "
                "independent split of the same model); none was given"
            )
        if self._profiles is None:
            self._profiles = calibration_profiles(self.calibration, progress=progress)
        return self._profiles

    def probe_ids(self, num_seqs: int = 8) -> torch.Tensor:
        """Token ids [n, T] of the first evaluated sequences, on the model's device: the execution probe."""
        seqs = list(range(min(num_seqs, self.evaluated.num_seqs)))
        rows = self.evaluated.read_seqs(seqs, sites=[])
        check_token_ids(rows, vocab_rows(self.model) or self.evaluated.vocab_size, self.evaluated.path, seqs)
        return torch.from_numpy(rows["token"].astype("int64")).to(self.device)

    def measure_execution(self, runs: int = 7) -> dict:
        """Blocks executed, controller FLOPs and latency against the Dense twin (when there is one)."""
        return execution_audit(self.model, self.probe_ids(), self.dense, runs=runs)

    def check_run(self, conditions: Sequence[Condition], num_seqs: int) -> None:
        """Refuse a run these caches cannot serve, before any replay starts, with the reason: a condition
        they lack what for, or a part of the first `num_seqs` evaluated sequences whose bytes are not those
        its hash records (a value changed in place would otherwise be read, and judged as another
        machine's rounding), or a site it does not hold. Parts are hashed once per opened cache."""
        check_sites_named(conditions, self.evaluated.sites)
        self.evaluated.verify(range(num_seqs))
        positions = [c for c in conditions if c.kind == "position_profile"]
        if positions and self.calibration is not None and self.calibration.seq_len < self.evaluated.seq_len:
            raise ValueError(
                f"{self.calibration.path}: {positions[0].name} needs a calibration mean at each of the evaluated "
                f"cache's {self.evaluated.seq_len} positions, and this calibration cache has {self.calibration.seq_len}"
            )

    def batch_size_for(self, batch_size: int | None) -> int:
        """A run's batch size: as asked, else the batches the evaluated cache was built in, else 16. In the
        build's batches a cache written here must be bit-identical to what the model records now; in others
        it is only held to the tolerances of another environment (`fca.tables.fidelity`)."""
        if batch_size is not None:
            return batch_size
        return (self.evaluated.environment or {}).get("batch_size") or DEFAULT_BATCH_SIZE

    def planned_run(
        self, conditions: Sequence[Condition | str] | str, num_seqs: int | None, batch_size: int | None, seed: int
    ) -> tuple[list[Condition], int, int]:
        """The conditions, the number of sequences and the batch size (`batch_size_for`) of a run, checked
        (`check_run`) before it starts."""
        batch_size = self.batch_size_for(batch_size)
        if num_seqs is not None and num_seqs < 1 or batch_size < 1:
            raise ValueError(
                f"a replay needs at least one sequence and a batch of at least one (got {num_seqs}, {batch_size})"
            )
        conditions = as_conditions(conditions, seed)
        n = self.evaluated.num_seqs if num_seqs is None else min(num_seqs, self.evaluated.num_seqs)
        self.check_run(conditions, n)
        return conditions, n, batch_size

    def run(
        self,
        conditions: Sequence[Condition | str],
        num_seqs: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        profile_progress: Callable[[int, int], None] | None = None,
        shard: tuple[int, int] | None = None,
        judge: bool = True,
    ) -> ReplayResults:
        """Replay `conditions` (`Condition`s, or specs such as "interpolate:0.5") on the first `num_seqs`
        evaluated sequences (all by default), with both exactness checks on every batch. With `judge`, no
        figure leaves unchecked: the checks are judged before returning (`fca.engine.replay.check_exactness`:
        ExactnessError or FidelityError), and the verdict is `results.exactness`. `judge=False` returns
        the figures unjudged, for a bench of the checks themselves.
        `shard`: score only those positions of the run (`run_conditions`; a distributed replay's actor,
        whose driver judges the merged run)."""
        conditions, n, batch_size = self.planned_run(conditions, num_seqs, batch_size, seed)
        profiles = self.profiles(profile_progress) if any(c.needs_profiles for c in conditions) else None
        results = run_conditions(
            self.model,
            self.evaluated,
            conditions,
            profiles,
            seqs=list(range(n)),
            batch_size=batch_size,
            cross_seed=seed,
            progress=progress,
            should_stop=should_stop,
            shard=shard,
        )
        if judge and shard is None:
            self.judge(results)
        return results

    def judge(self, results: ReplayResults) -> None:
        """Judge a whole run's exactness checks (`check_exactness`: raises unless they hold) and its figures
        (`check_finite`), and say where the calibration cache was computed."""
        results.exactness = check_exactness(results)
        if self.calibration is not None:
            results.exactness["calibration"] = calibration_origin(self.calibration.environment, results.replayed_on)
        check_finite(results)

    def score(self, results: ReplayResults, seed: int) -> dict:
        """A judged run's figures, as a saved run and an audit report hold them: the conditions' NLLs and
        penalty CIs (also over documents where the evaluated cache records them), gap retention and its CI,
        the documents counted, and `routing` where the model has routers."""
        documents = self.evaluated.window_documents(len(results.seqs))  # [n]; None: not recorded
        conditions = summarize_conditions(results.per_seq_nll, seed, documents=documents)
        retention = gap_retention(conditions)
        figures = {
            "conditions": conditions,
            # (as the audit's: {} unless global_mean ran and the gap is clearly positive)
            "gap_retention": retention,
            "gap_retention_ci95": gap_retention_ci(results.per_seq_nll, retention, seed, documents),
            "documents": count_documents(documents),
        }
        if results.routers or results.routing_unobserved:
            figures["routing"] = summarize_routing(
                results.routers, self.evaluated.site_specs, results.routing, results.routing_unobserved
            )
        return figures
