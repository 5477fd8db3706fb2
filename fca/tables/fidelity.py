"""The two exactness checks of a replay, judged: the replay mechanism and the cache's fidelity.

1. Mechanism (strict, on every evaluated batch): the live pass records the coefficients on this machine;
   a Correct replay of exactly those, in the same batch composition, must reproduce the live logits
   (max |difference| <= MECHANISM_TOLERANCE, 0 expected) and the mean NLL within MECHANISM_NLL_TOLERANCE
   (what such logits can move it). This proves the controllers are removed and replay is faithful; it
   holds on any device. If it fails, nothing else is reported.
2. Cache fidelity (measured, always reported): the cached coefficients of the evaluated sequences
   against those just recorded, and Correct-from-cache NLL against live NLL. Where the cache was
   written in this very environment and batch composition, they must be bit-identical; anywhere else,
   floating-point reduction order differs and small differences are expected: accepted within
   FOREIGN_TOLERANCES, refused beyond them. A change of model dtype is never accepted.

Torch-free: the replay runner measures, these functions judge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fca.tables.environment import describe, differing_fields, same_environment
from fca.tables.errors import CacheError, ExactnessError

MECHANISM_TOLERANCE = 1e-6
# Logits within MECHANISM_TOLERANCE move a token's log-softmax by at most twice that; twice again covers
# the float32 rounding of the mean. (With logits identical, as seen everywhere so far, the NLLs are too.)
MECHANISM_NLL_TOLERANCE = 4 * MECHANISM_TOLERANCE

# Accepted differences for a cache computed in another environment, by model dtype, set from measured
# drift (the demo model, bench/fidelity_drift.py). float32: coefficients differ by up to 5.4e-7 between
# two x86 CPUs (AVX2, AVX-512), 3.3e-6 relative between a CPU and an H200 either way, 7e-7 on one GPU
# in other batches than the build's; NLLs by 3e-9 nats (per sequence 2.3e-7). The float32 bounds sit
# 30x above the largest drift and 10x below a 1e-3 change of the coefficients. bfloat16: CPU against
# GPU, coefficients differ by one unit in the last place (7.5e-3 relative), NLLs by 1.2e-4 nats (per
# sequence 2.2e-3); the bounds allow about eight units. float16 sits between, by its unit (2^-10).
# `nll_token`: the per-token live NLL the cache stores against the one computed now, ten times the
# per-sequence bound (one token's NLL drifts more than a mean of 128): a damaged `live_nll` column, say
# 3 nats off, is refused, not reported as "accepted".
FOREIGN_TOLERANCES = {
    "float32": {"coefficient_rel": 1e-4, "nll_mean": 1e-4, "nll_seq": 1e-3, "nll_token": 1e-2},
    "float16": {"coefficient_rel": 1e-2, "nll_mean": 5e-3, "nll_seq": 5e-2, "nll_token": 0.5},
    "bfloat16": {"coefficient_rel": 6e-2, "nll_mean": 2e-2, "nll_seq": 1e-1, "nll_token": 1.0},
}
# A cache stored at reduced precision is compared after rounding the recorded coefficients the same way;
# elsewhere a value near a rounding boundary may land one storage unit away, so that unit is allowed too.
STORAGE_ULP = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}
# How many storage units each tolerance takes on: a coefficient one unit off moves the NLL a little (the
# per-token tolerance is already wide enough to hold it).
STORAGE_ULP_ALLOWANCE = {"coefficient_rel": 1, "nll_mean": 10, "nll_seq": 50}


class FidelityError(CacheError):
    """The cache's coefficients are not what this model computes on its sequences here."""


@dataclass
class FidelityMeasure:
    """Differences between cached and freshly recorded coefficients and NLLs, accumulated over batches."""

    max_abs_coefficient_diff: float = 0.0
    max_rel_coefficient_diff: float = 0.0
    differing_coefficients: int = 0  # coefficients that are not bit-identical
    coefficients_compared: int = 0
    per_site_max_abs_diff: dict[str, float] = field(default_factory=dict)
    stored_live_nll_max_diff: float = 0.0  # per-token live NLL stored in the cache vs computed now
    same_batches: bool = True  # every evaluated batch was one batch of the build
    # Differences found in batches that were batches of the build: in the build's own environment these
    # must be none, whatever other batches of the same run may show.
    differing_in_build_batches: int = 0

    def add_site(self, site: str, max_abs: float, max_rel: float, differing: int, compared: int) -> None:
        self.max_abs_coefficient_diff = max(self.max_abs_coefficient_diff, max_abs)
        self.max_rel_coefficient_diff = max(self.max_rel_coefficient_diff, max_rel)
        self.differing_coefficients += differing
        self.coefficients_compared += compared
        self.per_site_max_abs_diff[site] = max(self.per_site_max_abs_diff.get(site, 0.0), max_abs)

    def merge(self, other: FidelityMeasure) -> None:
        """Add the differences `other` measured on other sequences (a shard of a distributed replay)."""
        for site, value in other.per_site_max_abs_diff.items():
            self.per_site_max_abs_diff[site] = max(self.per_site_max_abs_diff.get(site, 0.0), value)
        self.max_abs_coefficient_diff = max(self.max_abs_coefficient_diff, other.max_abs_coefficient_diff)
        self.max_rel_coefficient_diff = max(self.max_rel_coefficient_diff, other.max_rel_coefficient_diff)
        self.differing_coefficients += other.differing_coefficients
        self.coefficients_compared += other.coefficients_compared
        self.stored_live_nll_max_diff = max(self.stored_live_nll_max_diff, other.stored_live_nll_max_diff)
        self.same_batches = self.same_batches and other.same_batches
        self.differing_in_build_batches += other.differing_in_build_batches

    @property
    def bit_identical(self) -> bool:
        return self.differing_coefficients == 0 and self.stored_live_nll_max_diff == 0.0


def is_build_batch(seqs: list[int], batches: set[tuple[int, int]] | None) -> bool:
    """True when `seqs` is exactly one batch of the build, in order (so each row saw the same kernels)."""
    if batches is None or not seqs:
        return False
    lo, hi = seqs[0], seqs[-1] + 1
    return (lo, hi) in batches and seqs == list(range(lo, hi))


def check_dtype(cache_path: str, cache_model_dtype: str | None, model_dtype: str) -> None:
    """A cache recorded with one model dtype is never replayed in another."""
    recorded = cache_model_dtype or "float32"
    if recorded != model_dtype:
        raise FidelityError(
            f"{cache_path}: coefficients were recorded with a {recorded} model, "
            f"but the model runs in {model_dtype} here; "
            f"replay in {recorded} (--dtype {recorded}) or rebuild the cache in {model_dtype}"
        )


def tolerances(model_dtype: str, coefficient_dtype: str) -> dict:
    """The accepted differences for a foreign cache of this model dtype and storage dtype."""
    base = dict(FOREIGN_TOLERANCES.get(model_dtype, FOREIGN_TOLERANCES["float32"]))
    ulp = STORAGE_ULP.get(coefficient_dtype, 0.0)
    for key, units in STORAGE_ULP_ALLOWANCE.items():
        base[key] += units * ulp
    return base


def replay_standard(computed_on: dict | None, here: dict, coefficient_dtype: str = "float32") -> str:
    """What a replay in the environment `here` would hold a cache computed on `computed_on` to, in words,
    before anything runs (`fca inspect`): `judge_fidelity` applies the same rules to what a replay measures."""
    if same_environment(computed_on, here):
        return (
            "the cache's own environment: in its build's batches its coefficients must be bit-identical "
            "(in other batches, within the foreign-cache tolerances)"
        )
    tol = tolerances(here["model_dtype"], coefficient_dtype)
    why = (
        "a cache of unknown environment"
        if not computed_on
        else f"another environment ({', '.join(differing_fields(computed_on, here))} differ)"
    )
    return (
        f"{why}: its coefficients are accepted within {tol['coefficient_rel']:.2g} relative and "
        f"Correct-from-cache NLL within {tol['nll_mean']:.2g} nats of live, and refused beyond"
    )


def judge_mechanism(max_abs_logit_diff: float, nll_live: float, nll_replayed: float, batches: int) -> dict:
    """Check 1: raise ExactnessError unless replaying the recorded coefficients reproduced the live run."""
    if not (max_abs_logit_diff <= MECHANISM_TOLERANCE and abs(nll_live - nll_replayed) <= MECHANISM_NLL_TOLERANCE):
        raise ExactnessError(
            f"Correct replay does not reproduce the live run (max |logit diff| {max_abs_logit_diff:.3g}, at most "
            f"{MECHANISM_TOLERANCE:g}; NLL {nll_replayed!r} replayed, {nll_live!r} live, at most "
            f"{MECHANISM_NLL_TOLERANCE:g} apart); no other figure is reported"
        )
    return {
        "max_abs_logit_diff": max_abs_logit_diff,
        "nll_live": nll_live,
        "nll_replayed": nll_replayed,
        "tolerance": MECHANISM_TOLERANCE,
        "batches": batches,
        "passed": True,
    }


def calibration_origin(computed_on: dict | None, replayed_on: dict) -> dict:
    """Where the calibration cache was computed, against this run. Its coefficients enter a run only through
    their means (the static profiles), never replayed one by one, so no fidelity is measured for them; a
    foreign origin is said, not judged."""
    return {
        "computed_on": computed_on,
        "computed_on_text": describe(computed_on),
        "same_environment": same_environment(computed_on, replayed_on),
        "differing_fields": differing_fields(computed_on, replayed_on),
    }


# Why a cache refused in its own recorded environment is refused, and what to do.
NOT_ITS_OUTPUT = (
    "the cache is not this model's output on these sequences (changed since it was built?), or was computed "
    "under settings its manifest does not record; rebuild it here"
)


def judge_fidelity(
    cache_path: str,
    measure: FidelityMeasure,
    live_nll: np.ndarray,
    cache_nll: np.ndarray,
    computed_on: dict | None,
    replayed_on: dict,
    coefficient_dtype: str = "float32",
) -> dict:
    """Check 2: the cache's fidelity here. live_nll, cache_nll: [n] per-sequence mean NLL of the live run and
    of Correct-from-cache replay. Raises FidelityError when the cache must be refused."""
    same_env = same_environment(computed_on, replayed_on)
    strict = same_env and measure.same_batches
    # One batch of other sequences (a run's last, partial batch) loosens the judgement of that batch only.
    strict_where_built = same_env and measure.differing_in_build_batches > 0
    tol = tolerances(replayed_on["model_dtype"], coefficient_dtype)
    seq_diff = np.abs(cache_nll - live_nll)
    nll_diff = abs(float(cache_nll.mean()) - float(live_nll.mean()))
    out = {
        "computed_on": computed_on,
        "replayed_on": replayed_on,
        "computed_on_text": describe(computed_on),
        "replayed_on_text": describe(replayed_on),
        "same_environment": same_env,
        "same_batches": measure.same_batches,
        "differing_in_build_batches": measure.differing_in_build_batches,
        "max_abs_coefficient_diff": measure.max_abs_coefficient_diff,
        "max_rel_coefficient_diff": measure.max_rel_coefficient_diff,
        "differing_coefficients": measure.differing_coefficients,
        "coefficients_compared": measure.coefficients_compared,
        "per_site_max_abs_diff": measure.per_site_max_abs_diff,
        "stored_live_nll_max_diff": measure.stored_live_nll_max_diff,
        "nll_live": float(live_nll.mean()),
        "nll_correct_from_cache": float(cache_nll.mean()),
        "nll_diff": nll_diff,
        "max_seq_nll_diff": float(seq_diff.max()) if len(seq_diff) else 0.0,
        "coefficient_dtype": coefficient_dtype,
        "tolerances": {"bit_identical_required": strict, **({} if strict else tol)},
        "differing_fields": differing_fields(computed_on, replayed_on),
    }
    where = f"computed on {describe(computed_on)}, replayed on {describe(replayed_on)}"
    if measure.bit_identical:
        out["verdict"] = "bit-identical"
        return out
    if strict or strict_where_built:
        what = (
            f"cached coefficients differ from those this model computes now (max |diff| "
            f"{measure.max_abs_coefficient_diff:.3g})"
            if measure.differing_coefficients
            else f"the cached live NLL differs from the one computed now (max |diff| "
            f"{measure.stored_live_nll_max_diff:.3g} nats per token; the coefficients are identical)"
        )
        batches = "" if strict else " and in batches of the build"
        raise FidelityError(
            f"{cache_path}: {what}, in what its manifest records as this very environment{batches} ({where}): "
            f"{NOT_ITS_OUTPUT}"
        )
    worst = [
        (name, value, tol[key])
        for name, value, key in (
            ("max relative coefficient difference", measure.max_rel_coefficient_diff, "coefficient_rel"),
            ("Correct-from-cache NLL difference", nll_diff, "nll_mean"),
            ("per-sequence NLL difference", out["max_seq_nll_diff"], "nll_seq"),
            ("stored live NLL difference per token", measure.stored_live_nll_max_diff, "nll_token"),
        )
        if not value <= tol[key]
    ]
    if worst:
        name, value, limit = worst[0]
        if same_env:  # only the batches differ, and other batches move values by float rounding at most
            why = (
                f"in what its manifest records as this very environment ({describe(replayed_on)}), batched "
                f"otherwise); {NOT_ITS_OUTPUT}"
            )
        else:
            why = f"{where}); rebuild the cache in this environment"
        raise FidelityError(
            f"{cache_path}: the cache does not match this model here beyond floating-point drift ({name} {value:.3g} > "
            f"{limit:g}; {why}"
        )
    out["verdict"] = "within tolerance"
    return out
