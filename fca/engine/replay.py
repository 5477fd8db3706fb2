"""Replay: run the frozen model with given coefficients (controllers removed), score conditions."""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fca.engine.capture import as_input_ids, token_nll
from fca.engine.environment import current_environment
from fca.engine.execution import ExecutionTally
from fca.engine.families import family_of
from fca.engine.routing import ExpertObserver, RoutingTally, Selection
from fca.engine.sites import (
    capture_tensors,
    find_sites,
    model_class_name,
    model_logits,
    run_model,
    site_modes,
    tensor_provider,
    vocab_rows,
)
from fca.tables.conditions import Condition, condition_coefficients, derangement
from fca.tables.errors import CacheError, Cancelled, ExactnessError, SiteError  # noqa: F401  (ExactnessError re-exported)
from fca.tables.fidelity import (
    MECHANISM_TOLERANCE,
    FidelityMeasure,
    check_dtype,
    is_build_batch,
    judge_fidelity,
    judge_mechanism,
)
from fca.tables.profiles import Profiles
from fca.tables.schema import KEY_COLUMNS
from fca.tables.store import Cache


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of host -> device copies on `device`, made on first use."""
    return torch.cuda.Stream(device)


class DeviceCoefficients(dict):
    """Coefficients (site -> array or tensor) served as contiguous tensors on `device`, each site moved
    when the forward pass first asks for it; its items are the sites moved so far.

    Host values are copied as they are; each site casts them on the device to the dtype its controller
    produces (`Site.replayed`): a cast on the CPU would cost host time the device does not need, and a
    cast here to the model's dtype would round a float32 controller's values in a bfloat16 model.

    On CUDA a site's copy leaves from pinned memory on a side stream when the forward reaches the site,
    so the host copies into pinned memory happen while the device runs the layers before it (the CPU
    launches kernels ahead of the GPU); the compute stream waits only for the copies of the sites it has
    reached. Copying every site before the forward had left the GPU idle while the
    host pinned all of them (40 MB per batch of 8 x 1,024 tokens at MUDDPythia-1.4B's shapes).
    Contiguous always: some kernels (sigmoid, softmax) round differently on strided inputs, and a replay
    must not depend on the caller's memory layout.
    """

    def __init__(self, coefficients: Mapping[str, object], device: torch.device) -> None:
        super().__init__()
        self.given = coefficients
        self.device = device

    def __missing__(self, name: str) -> torch.Tensor:
        values = self.given[name]
        try:
            t = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(values))
        except (TypeError, ValueError):  # None, text, ragged lists: not an array torch can take
            raise ValueError(  # (reprlib: a long text or list is shown cut short)
                f"site {name!r}: replay coefficients must be an array of numbers, not {reprlib.repr(values)}"
            ) from None
        if self.device.type == "cuda" and t.device.type == "cpu":
            compute = torch.cuda.current_stream(self.device)
            copy = _copy_stream(self.device)
            if t.is_pinned():  # possibly the target of a device -> host copy the compute stream has queued
                copy.wait_stream(compute)
            with torch.cuda.stream(copy):
                t = t.contiguous().pin_memory().to(self.device, non_blocking=True)
            compute.wait_stream(copy)
            t.record_stream(compute)  # memory of the copy stream, in use on the compute stream
        moved = self[name] = t.to(device=self.device).contiguous()
        return moved


@torch.no_grad()
def replay(
    model: nn.Module, input_ids, coefficients: Mapping[str, object], only: set[str] | None = None
) -> torch.Tensor:
    """Logits [B, T, V] of the frozen model fed `coefficients` (site -> array broadcastable to [B, T, K_s]).

    Every site is replayed unless `only` names a subset (a set of names, or one name; the rest run live).
    The replayed controllers are never called. A site name the model lacks, a replayed site given no
    coefficients (`SiteError`: a ValueError, and a KeyError) and coefficients that are not floating-point
    numbers broadcastable to the site's shape raise a ValueError naming the site. On CUDA, host coefficients
    given in pinned memory are copied from that very memory, asynchronously, as any non-blocking copy:
    refill such a buffer only after the logits are used (or the device synchronized).
    """
    logits, fed = _replay_staged(model, input_ids, coefficients, only)
    check_finite_coefficients(logits, fed)
    return logits


def _replay_staged(
    model: nn.Module, input_ids, coefficients: Mapping[str, object], only: set[str] | None = None
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """`replay`, also returning the coefficients as the replayed sites were fed them: site -> the tensor
    on the model's device (before each site's cast to its dtype)."""
    ids = as_input_ids(input_ids, model)
    if not isinstance(coefficients, Mapping):
        raise ValueError(f"coefficients must map site names to arrays, not {type(coefficients).__name__}")
    if isinstance(only, str):  # one site's name, not a set of its characters
        only = {only}
    staged = DeviceCoefficients(coefficients, next(model.parameters()).device)
    with site_modes(model, "replay", provider=tensor_provider(staged), only=only) as chosen:
        missing = sorted(set(chosen) - set(coefficients))
        if missing:
            raise SiteError(f"no coefficients given for site(s) {missing}")
        # A cache's rows may be given whole (their key columns are not sites), and with `only` the other
        # sites' coefficients too; a misspelt site would otherwise be left out without a word.
        sites = list(find_sites(model))
        unknown = sorted(set(coefficients) - set(sites) - set(KEY_COLUMNS))
        if unknown:
            raise SiteError(f"coefficients given for site(s) {unknown} that the model lacks; its sites: {sites}")
        try:
            output = run_model(model, ids)
        except RuntimeError as err:
            if isinstance(err, torch.OutOfMemoryError):
                raise
            # The live model runs, so what differs is what the sites handed on: a declaration whose axes
            # the consumer does not expect (a capture, which checks the controller's output, would say so).
            raise ValueError(
                f"{model_class_name(model)} failed on the replayed coefficients ({str(err).splitlines()[0]}); do the "
                "sites' declared axes match what their consumers expect? (fca.capture checks them)"
            ) from err
        return model_logits(output, model), staged


def check_finite_coefficients(logits: torch.Tensor, fed: Mapping[str, torch.Tensor]) -> None:
    """Refuse coefficients holding NaN or infinity once they made the logits non-finite: the logits would
    otherwise come back as NaN without a word. Only non-finite logits are looked into, found by their sum
    (one reduction: NaN or infinity anywhere makes it non-finite; isfinite().all() took 30x longer, 3.5% of
    the demo's forward), so a valid replay pays no pass over its coefficients. Replay runs check their NLL
    instead, per condition (`check_finite`)."""
    if bool(torch.isfinite(logits.sum(dtype=torch.float32))):
        return
    bad = {name: int((~torch.isfinite(t)).sum()) for name, t in fed.items() if t.is_floating_point()}
    bad = {name: count for name, count in bad.items() if count}
    if bad:
        listed = ", ".join(f"{name} ({count} of {fed[name].numel()} values)" for name, count in bad.items())
        raise ValueError(f"coefficients given hold NaN or infinity at site(s) {listed}; the logits are not finite")


# ---------------------------------------------------------------------------------------------
# Replay runner: score conditions on the sequences of a cache.


@dataclass
class ReplayResults:
    seqs: list[int]
    per_seq_nll: dict[str, np.ndarray]  # condition name -> [n] mean NLL of each sequence
    conditions: dict[str, Condition]
    # Check 1, the replay mechanism: live vs Correct replay of the coefficients recorded in that same pass.
    max_abs_logit_diff: float = 0.0
    nll_live: float = float("nan")
    nll_correct: float = float("nan")  # Correct replay of the recorded coefficients
    batches: int = 0
    # Check 2, the cache's fidelity: cached vs recorded coefficients, Correct-from-cache vs live NLL.
    fidelity: FidelityMeasure | None = None
    live_per_seq: np.ndarray | None = None  # [n]
    cache_correct_per_seq: np.ndarray | None = None  # [n]
    cache_path: str = ""
    computed_on: dict | None = None  # the cache's environment
    replayed_on: dict | None = None  # this run's environment
    coefficient_dtype: str = "float32"
    # Routing agreement (`fca.engine.routing`), read at the experts modules, for models with routers: router
    # site -> k (the experts per token its experts were handed), and condition -> figure -> [n, S] per
    # sequence and router, in `routers`' order; routing_unobserved: router site -> why it has no figure.
    routers: dict[str, int] = field(default_factory=dict)
    routing: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    routing_unobserved: dict[str, str] = field(default_factory=dict)
    replayed_per_seq: np.ndarray | None = None  # [n] Correct replay of the recorded coefficients (check 1)
    # What ran: condition -> [n, L] tokens each block processed per sequence, counted at the blocks during
    # that condition's replay (`fca.engine.execution.ExecutionTally`); None where they cannot be counted.
    executed: dict[str, np.ndarray] | None = None
    exactness: dict | None = None  # `check_exactness`'s verdict, once judged (`Experiment.run` judges)

    def nll(self, name: str) -> float:
        if name not in self.per_seq_nll:  # e.g. "correct", not asked for (the run scores what it was asked)
            raise KeyError(f"no condition {name!r} in this run; it scored {list(self.per_seq_nll)}")
        return float(self.per_seq_nll[name].mean())


def check_token_ids(rows: dict[str, np.ndarray], vocab: int | None, cache_path: Path, seqs: list[int]) -> None:
    """The cached windows' token and target ids [b, T] must index the model's vocabulary: a damaged cache
    would otherwise fail inside the embedding (on a GPU, as a device assert)."""
    ids = np.concatenate([rows["token"], rows["target"]], axis=1)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise CacheError(
            f"{cache_path}: sequences {seqs[0]}-{seqs[-1]} hold token ids from {low} to {high}, outside the "
            f"model's vocabulary [0, {vocab}): not this model's windows, or a damaged cache"
        )


def check_finite(results: ReplayResults) -> None:
    """Refuse a run with a condition whose NLL is not a number (coefficients far from any the model makes,
    e.g. `interpolate:1e30`, overflow it): such a figure would be reported, averaged and plotted as if it
    were one."""
    for name, per_seq in results.per_seq_nll.items():
        bad = int(np.count_nonzero(~np.isfinite(per_seq)))
        if bad:
            raise ValueError(
                f"{name}: the replay's NLL is not finite in {bad} of {len(per_seq)} sequences (its coefficients "
                "overflow the model); no figure of this run is reported"
            )


def check_exactness(results: ReplayResults) -> dict:
    """Judge both checks of a run (fca.tables.fidelity): raises ExactnessError if replaying the recorded coefficients
    did not reproduce the live run, FidelityError if the cache is not this model's output here; else returns
    the report's `exactness` section. The audit, `fca replay`, the Replay lab and the bench all call this."""
    mechanism = judge_mechanism(results.max_abs_logit_diff, results.nll_live, results.nll_correct, results.batches)
    fidelity = judge_fidelity(
        results.cache_path,
        results.fidelity,
        results.live_per_seq,
        results.cache_correct_per_seq,
        results.computed_on,
        results.replayed_on,
        results.coefficient_dtype,
    )
    measured = {name: getattr(results, name) for name in ("max_abs_logit_diff", "nll_live", "nll_correct")}
    return measured | {"tolerance": MECHANISM_TOLERANCE, "mechanism": mechanism, "fidelity": fidelity}


def _nll_per_seq(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [b, T, V], targets [b, T] -> mean NLL per sequence [b] (float64)."""
    return token_nll(logits, targets).double().mean(1)


def stack_conditions(parts: list[dict[str, np.ndarray]], b: int, T: int) -> dict[str, np.ndarray]:
    """Concatenate several conditions' coefficients along the batch axis -> site -> [len(parts) * b, T, K]."""
    out = {}
    for name in parts[0]:
        K = parts[0][name].shape[-1]
        out[name] = np.concatenate([np.broadcast_to(p[name], (b, T, K)) for p in parts], axis=0)
    return out


_STORAGE_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _measure_fidelity(
    measure: FidelityMeasure,
    recorded: Mapping[str, torch.Tensor],
    cached: Mapping[str, np.ndarray],
    coefficient_dtype: str,
) -> int:
    """Compare cached coefficients [b, T, K] with those just recorded, site by site, on the model's device.
    Returns how many cached values differ from the recorded ones (as stored: rounded alike in 16 bits)."""
    storage = _STORAGE_TORCH_DTYPES.get(coefficient_dtype)
    differing_here = 0
    for name, rec in recorded.items():
        rec = rec.float()
        # A reduced-precision cache is compared with the recorded values rounded the same way.
        expected = rec if storage is None else rec.to(storage).float()
        got = torch.from_numpy(np.ascontiguousarray(cached[name])).to(rec.device)
        diff = (got - expected).abs()
        scale = rec.abs() + rec.pow(2).mean().sqrt().clamp_min(torch.finfo(torch.float32).tiny)
        differing = int(torch.count_nonzero(diff))
        measure.add_site(name, float(diff.max()), float((diff / scale).max()), differing, diff.numel())
        differing_here += differing
    return differing_here


def _is_plain_correct(condition: Condition) -> bool:
    """Correct at every site (any seed: Correct draws nothing)."""
    return condition == Condition("correct", seed=condition.seed)


@dataclass
class _BatchCheck:
    max_abs_logit_diff: float
    live_nll: np.ndarray  # [b] per-sequence mean NLL of the live pass
    replayed_nll: np.ndarray  # [b] the same for Correct replay of the recorded coefficients
    cache_is_recorded: bool  # the cached coefficients equal the recorded ones in float32
    # what the experts modules were handed in the Correct replay of the recorded coefficients (when observed)
    correct_selection: dict[str, list[Selection]] | None = None


def _check_batch(
    model: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    own: dict[str, np.ndarray],
    cache: Cache,
    batch_seqs: list[int],
    measure: FidelityMeasure,
    observer: ExpertObserver | None,
    executed: ExecutionTally,
) -> _BatchCheck:
    """Both exactness checks on one batch. Check 1: the live pass records its coefficients, and replaying
    exactly those must reproduce it. Check 2 (accumulated in `measure`): how far the cache is from what
    this model computes here, coefficients and stored per-token live NLL. With an `observer`, the experts'
    selection in the Correct replay is kept; `executed` counts what the Correct replay runs."""
    live, recorded = capture_tensors(model, ids)
    with (
        observer.recording() if observer is not None else nullcontext() as selection,
        executed.counting(ids.shape[0]),
    ):
        replayed = replay(model, ids, recorded)
    live_tokens = token_nll(live, targets)  # [b, T]
    build_batch = is_build_batch(batch_seqs, cache.build_batches())
    measure.same_batches = measure.same_batches and build_batch
    stored = torch.from_numpy(own["live_nll"].astype(np.float32)).to(live_tokens.device)
    # nan_to_num: a NaN stored NLL must count as the largest difference (Python's max would skip it).
    gap = float((stored - live_tokens).abs().nan_to_num(nan=float("inf")).max())
    measure.stored_live_nll_max_diff = max(measure.stored_live_nll_max_diff, gap)
    differing = _measure_fidelity(measure, recorded, {name: own[name] for name in cache.sites}, cache.coefficient_dtype)
    if build_batch:  # (a stored NLL that differs counts as one difference)
        measure.differing_in_build_batches += differing + (gap != 0)
    return _BatchCheck(
        max_abs_logit_diff=float((live.float() - replayed.float()).abs().max()),
        live_nll=live_tokens.double().mean(1).cpu().numpy(),
        replayed_nll=_nll_per_seq(replayed, targets).cpu().numpy(),
        # Replaying the cache is replaying the recorded pass: the float32 values it recorded, unrounded.
        cache_is_recorded=differing == 0 and cache.coefficient_dtype not in _STORAGE_TORCH_DTYPES,
        correct_selection=selection,
    )


def _shard_bounds(shard: tuple[int, int] | None, batch_size: int, n: int) -> tuple[int, int]:
    """Positions [lo, hi) of a run's `n` sequences that a shard scores: whole batches of the whole run."""
    if shard is None:
        return 0, n
    lo, hi = shard
    if lo % batch_size or (hi % batch_size and hi != n) or not 0 <= lo <= hi <= n:
        raise ValueError(f"shard {shard} is not whole batches of {batch_size} within {n} sequences")
    return lo, hi


def _replay_nll(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, stacked: dict, g: int) -> np.ndarray:
    """Per-sequence NLL of one replay of `g` conditions stacked along the batch: ids and targets [b, T],
    each site's coefficients [g * b, T, K] condition-major; returns [g, b]."""
    logits, _ = _replay_staged(model, ids.repeat(g, 1), stacked)  # [g * b, T, V]
    return _nll_per_seq(logits, targets.repeat(g, 1)).cpu().numpy().reshape(g, ids.shape[0])


@torch.no_grad()
def run_conditions(
    model: nn.Module,
    cache: Cache,
    conditions: Sequence[Condition],
    profiles: Profiles | None = None,
    seqs: Sequence[int] | None = None,
    batch_size: int = 16,
    cross_seed: int = 0,
    max_logit_bytes: int = 1 << 30,
    check_exactness: bool = True,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    shard: tuple[int, int] | None = None,
    routers: Sequence[str] | Mapping[str, object] | None = None,
) -> ReplayResults:
    """Per-sequence NLL of every condition on `seqs` (default: all) of `cache`.

    `shard` = (lo, hi): score only positions [lo, hi) of `seqs` (lo a multiple of `batch_size`, so the
    batches are those of the whole run); arrays keep the whole run's length, zero outside the shard, and
    the derangement and permutations are the whole run's. `fca.jobs.distributed` merges shards.

    With `check_exactness`, each batch first runs live in record mode, then as Correct replay of the
    coefficients just recorded, in the same batch composition (check 1), and its cached coefficients and
    stored live NLL are compared with the recorded ones (check 2). Conditions are built from the cache's
    coefficients; several are stacked into one forward while the logits fit in `max_logit_bytes`.
    The controllers never run during replay. Judge the result with `check_exactness(results)`.

    `routers`: the router sites whose routing agreement to report (`fca.engine.routing`; a mapping's keys);
    None: those the model's family names (`Family.routers`). Their figures are read from what the family's
    experts modules are handed (`Family.expert_paths`, `Family.expert_selection`), compared with what they
    were handed for the tokens' own coefficients: the check's Correct replay where the cache is the recorded
    pass, else the Correct condition (replayed for this even when not asked for, without checks).
    """
    seqs = list(range(cache.num_seqs)) if seqs is None else [int(s) for s in seqs]
    names = [c.name for c in conditions]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"condition(s) {', '.join(twice)} given more than once")
    replayed_on = current_environment(model)
    check_dtype(str(cache.path / "manifest.json"), cache.model_dtype, replayed_on["model_dtype"])
    partner = derangement(len(seqs), cross_seed) if any(c.kind == "cross_input" for c in conditions) else None
    device = next(model.parameters()).device
    T = cache.seq_len
    # Conditions stacked per forward while their logits fit the budget (one at a time when the vocabulary
    # is not recorded).
    vocab = cache.vocab_size
    per_pass = max(1, max_logit_bytes // (batch_size * T * vocab * 4)) if vocab else 1
    per_seq = {name: np.zeros(len(seqs)) for name in names}
    live_nll, replayed_nll, cache_nll = np.zeros(len(seqs)), np.zeros(len(seqs)), np.zeros(len(seqs))
    measure = FidelityMeasure()
    max_diff, batches = 0.0, 0
    lo_seq, hi_seq = _shard_bounds(shard, batch_size, len(seqs))
    starts = range(lo_seq, hi_seq, batch_size)
    family = family_of(model)
    routers = [s for s in (family.routers(model) if routers is None else routers) if s in cache.sites]
    observer = (
        ExpertObserver(model, family.expert_paths, family.expert_selection) if routers and family.expert_paths else None
    )
    tally = RoutingTally(routers, observer, names, len(seqs))
    observing = observer is not None and bool(tally.observed)
    executed = ExecutionTally(model, names, len(seqs))
    # The next batch is read and decoded on a background thread while this one runs.
    reads = cache.prefetch([seqs[lo : lo + batch_size] for lo in starts])
    # (closing: stops the reader thread, also on errors and cancellation; leaving the observer removes its hooks)
    with closing(reads), observer if observer is not None else nullcontext():
        for lo in starts:
            if should_stop is not None and should_stop():
                raise Cancelled("replay cancelled")
            index = list(range(lo, min(hi_seq, lo + batch_size)))
            batch_seqs = [seqs[i] for i in index]
            own = next(reads)
            check_token_ids(own, vocab_rows(model) or vocab, cache.path, batch_seqs)
            ids = torch.from_numpy(own["token"].astype(np.int64)).to(device)
            targets = torch.from_numpy(own["target"].astype(np.int64)).to(device)
            coefficients = {name: own[name] for name in cache.sites}
            b = len(index)
            cache_is_recorded = False
            tally.start_batch(index, T)  # (a tally of no observed routers does nothing: no guards needed)
            check_executed = None  # [b, L] what the check's Correct replay ran
            if check_exactness:
                check = _check_batch(
                    model, ids, targets, own, cache, batch_seqs, measure, observer if observing else None, executed
                )
                check_executed = executed.last
                max_diff = max(max_diff, check.max_abs_logit_diff)
                live_nll[index], replayed_nll[index] = check.live_nll, check.replayed_nll
                batches += 1
                cache_is_recorded = check.cache_is_recorded
                if cache_is_recorded:  # Correct-from-cache is the replay just run: reuse its scores, and what
                    cache_nll[index] = replayed_nll[index]  # its experts were handed is the tokens' own selection
                    tally.set_own(check.correct_selection)
            other = cache.coefficients([seqs[partner[i]] for i in index]) if partner is not None else None
            to_run = [c for c in conditions if not (cache_is_recorded and _is_plain_correct(c))]
            # Correct-from-cache even unasked: the fidelity check needs it, and routing the tokens' own selection.
            if (check_exactness or observing) and not cache_is_recorded and not any(map(_is_plain_correct, to_run)):
                to_run.append(Condition("correct"))
            scored: dict[Condition, np.ndarray] = {}  # condition -> [b] NLL
            # A Correct not replayed again ran what the check's replay ran, fed the tokens' own coefficients.
            for c in conditions:
                if c not in to_run:
                    executed.add(c.name, index, check_executed)
                    tally.add_own(c.name)
            for start in range(0, len(to_run), per_pass):
                group = to_run[start : start + per_pass]
                parts = [condition_coefficients(c, coefficients, index, profiles, other) for c in group]
                stacked = stack_conditions(parts, b, T)
                with observer.recording() if observing else nullcontext() as taken, executed.counting(len(group) * b):
                    nll = _replay_nll(model, ids, targets, stacked, len(group))
                if executed.last is not None:
                    for c, counted in zip(group, executed.last.reshape(len(group), b, -1)):
                        executed.add(c.name, index, counted)
                scored.update(zip(group, nll))
                if observing:  # (a Correct replayed only for the checks is not reported)
                    own_at = next((i for i, c in enumerate(group) if _is_plain_correct(c)), None)
                    tally.add_observed([c.name if c in conditions else None for c in group], taken, own_at)
            tally.end_batch()
            for c in conditions:
                per_seq[c.name][index] = replayed_nll[index] if c not in scored else scored[c]
            if check_exactness and not cache_is_recorded:
                cache_nll[index] = next(row for c, row in scored.items() if _is_plain_correct(c))
            if progress is not None:
                progress(index[-1] + 1, len(seqs))
    return ReplayResults(
        seqs=seqs,
        per_seq_nll=per_seq,
        conditions={c.name: c for c in conditions},
        max_abs_logit_diff=max_diff,
        nll_live=float(live_nll.mean()),
        nll_correct=float(replayed_nll.mean()),
        batches=batches,
        fidelity=measure if check_exactness else None,
        live_per_seq=live_nll,
        cache_correct_per_seq=cache_nll,
        cache_path=str(cache.path),
        computed_on=cache.environment,
        replayed_on=replayed_on,
        coefficient_dtype=cache.coefficient_dtype,
        replayed_per_seq=replayed_nll,
        routers={site: tally.top_k.get(site, 0) for site in tally.observed},
        routing=tally.figures() if tally.observed else {},
        routing_unobserved=tally.unobserved,
        executed=executed.counts,
    )
