"""The three-property audit: coefficient variation, functional dependence, actual execution.

`run_audit` checks Correct exactness first and refuses to report anything else if it fails. The
report is one JSON-ready dict; `fca.tables.report.render_markdown` turns it into a page.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from fca.tables.conditions import PAPER_CONDITIONS, Condition, parse_condition
from fca.engine.execution import execution_audit
from fca.engine.loading import fingerprint_state, load_model
from fca.tables.profiles import cache_moments, calibration_profiles
from fca.tables.environment import model_dtype_name
from fca.tables.fidelity import FOREIGN_TOLERANCES, MECHANISM_TOLERANCE, STORAGE_ULP
from fca.engine.replay import ReplayResults, check_exactness, run_conditions
from fca.tables.report import render_markdown, write_report  # noqa: F401  (re-exported: the audit's outputs)
from fca.engine.sites import find_sites
from fca.tables.stats import paired_bootstrap_ci, variance_decomposition
from fca.tables.store import Cache, CacheError, open_cache

BOOTSTRAP_RESAMPLES = 2000


def summarize_conditions(results: ReplayResults, seed: int = 0, reference: str = "correct") -> dict:
    """condition -> NLL, penalty vs `reference` and its paired bootstrap 95% CI over sequences."""
    base = results.per_seq_nll[reference]
    table = {}
    for name, per_seq in results.per_seq_nll.items():
        diff = per_seq - base
        lo, hi = paired_bootstrap_ci(diff, BOOTSTRAP_RESAMPLES, seed) if name != reference else (0.0, 0.0)
        table[name] = {"nll": float(per_seq.mean()), "penalty": float(diff.mean()), "penalty_ci95": [lo, hi],
                       "nll_sd_over_sequences": float(per_seq.std(ddof=1)) if len(per_seq) > 1 else 0.0}
    return table


def gap_retention(table: dict) -> dict:
    """(NLL_global - NLL_X) / (NLL_global - NLL_correct) for every condition; None when the gap is not
    clearly positive (its bootstrap CI reaches zero)."""
    if "global_mean" not in table or "correct" not in table:
        return {}
    gap = table["global_mean"]["nll"] - table["correct"]["nll"]
    clearly_positive = table["global_mean"]["penalty_ci95"][0] > 0
    out = {}
    for name, row in table.items():
        if name in ("correct", "global_mean"):
            continue
        out[name] = (table["global_mean"]["nll"] - row["nll"]) / gap if clearly_positive else None
    return out


def _check_pair(model_fp: str, model_dtype: str, evaluated: Cache, calibration: Cache) -> None:
    evaluated.check_model(model_fp, model_dtype)
    calibration.check_model(model_fp, model_dtype)
    a, b = evaluated.manifest.get("corpus", {}), calibration.manifest.get("corpus", {})
    if a.get("split") == b.get("split") and a.get("fingerprint") == b.get("fingerprint") and a.get("split_seed") == b.get("split_seed"):
        raise CacheError(f"{calibration.path}: the calibration cache comes from the same split ({a.get('split')!r}) as the evaluated cache; "
                         "static profiles must be estimated on an independent split")
    if set(evaluated.sites) != set(calibration.sites):
        raise CacheError(f"{calibration.path}: its sites differ from {evaluated.path}'s")


def run_audit(
    model_dir: str | Path,
    cache_dir: str | Path,
    calibration_dir: str | Path,
    dense_dir: str | Path | None = None,
    device: str = "auto",
    dtype: torch.dtype | None = None,
    batch_size: int = 16,
    num_seqs: int | None = None,
    seed: int = 0,
    extra_conditions: Sequence[str] = (),
    latency_runs: int = 7,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    started = time.perf_counter()
    step = (lambda stage: (lambda i, n: progress(stage, i, n))) if progress else (lambda stage: None)
    model = load_model(model_dir, device=device, dtype=dtype)
    model_fp = fingerprint_state(model)
    evaluated, calibration = open_cache(cache_dir, verify=True), open_cache(calibration_dir, verify=True)
    _check_pair(model_fp, model_dtype_name(model), evaluated, calibration)
    profiles = calibration_profiles(calibration, progress=step("calibration profiles"))
    conditions = [Condition(kind, seed=seed) for kind in PAPER_CONDITIONS] + [parse_condition(c, seed) for c in extra_conditions]
    seqs = None if num_seqs is None else list(range(min(num_seqs, evaluated.num_seqs)))
    results = run_conditions(model, evaluated, conditions, profiles, seqs=seqs, batch_size=batch_size, cross_seed=seed, progress=step("replay"))
    exactness = check_exactness(results)
    table = summarize_conditions(results, seed)
    moments, layout = cache_moments(evaluated, progress=step("variance"))
    variance = variance_decomposition(moments, layout)
    probe = torch.from_numpy(evaluated.read_seqs(list(range(min(8, evaluated.num_seqs))), sites=[])["token"].astype(np.int64)).to(next(model.parameters()).device)
    dense = load_model(dense_dir, device=device, dtype=dtype) if dense_dir else None
    execution = execution_audit(model, probe, dense, runs=latency_runs)
    params = sum(p.numel() for p in model.parameters())
    controller_params = sum(p.numel() for site in find_sites(model).values() for p in site.parameters())
    return {
        "fca_report_version": 1,
        "model": {"name": Path(model_dir).name, "model_type": model.config.model_type if hasattr(model, "config") else type(model).__name__,
                  "fingerprint": model_fp, "parameters": params, "controller_parameters": controller_params,
                  "dtype": model_dtype_name(model), "device": str(next(model.parameters()).device)},
        "cache": _cache_entry(evaluated, len(results.seqs)),
        "calibration": _cache_entry(calibration, calibration.num_seqs),
        "dense": {"name": Path(dense_dir).name, "fingerprint": fingerprint_state(dense), "parameters": sum(p.numel() for p in dense.parameters())} if dense else None,
        "exactness": exactness,
        "conditions": table,
        "gap_retention": gap_retention(table),
        "variance": variance,
        "execution": execution,
        "definitions": {**_definitions(evaluated, layout, seed, conditions), **(model.fca_definitions() if hasattr(model, "fca_definitions") else {})},
        "seconds": round(time.perf_counter() - started, 1),
    }


def _cache_entry(cache: Cache, evaluated_seqs: int) -> dict:
    corpus = cache.manifest.get("corpus", {})
    return {"path": cache.path.name, "fingerprint": cache.fingerprint, "split": corpus.get("split"), "corpus": corpus.get("name"),
            "sequences": evaluated_seqs, "seq_len": cache.seq_len, "tokens": evaluated_seqs * cache.seq_len,
            "coefficient_dtype": cache.coefficient_dtype, "environment": cache.environment}


def _definitions(cache: Cache, layout, seed: int, conditions: Sequence[Condition]) -> dict:
    families: dict[str, list[str]] = {}
    for site in layout.sites:
        for f in dict.fromkeys(layout.families[layout.site_slice(site)]):
            families.setdefault(f, []).append(site)
    return {
        "nll": "mean next-token negative log-likelihood in nats over all predicted positions of the evaluated windows",
        "penalty": "NLL_X - NLL_correct; 95% CI: paired percentile bootstrap over sequences "
                   f"({BOOTSTRAP_RESAMPLES} resamples, seed {seed})",
        "gap_retention": "(NLL_global_mean - NLL_X) / (NLL_global_mean - NLL_correct); null when the global_mean penalty CI reaches 0",
        "conditions": {
            "correct": "each sequence's own cached coefficients",
            "cross_input": f"coefficients of another evaluated sequence, pi = a uniform derangement of the evaluated sequences (seed {seed})",
            "token_shuffle": f"positions permuted within each sequence, one permutation per sequence shared by all sites (seed {seed}, keyed by sequence index)",
            "static_layer": "per-site, per-channel mean over all tokens of the calibration cache, at every token",
            "global_mean": "the calibration grand mean of each coefficient family, at every site, channel and token",
        },
        "condition_specs": {c.name: c.to_json() for c in conditions},
        "global_mean_families": families,
        "layer_identity_share": "within each family, SS_between(slot means per site and channel) / SS_total(around the family grand mean), "
                                "pooled over families as sum SS_between / sum SS_total, on the evaluated cache",
        "variance_factors": "site, channel within site: parts of the slot effect; position, token id and sequence: group means within each slot, "
                            "each as a share of SS_total (they overlap and do not add up); residual_after_slot = 1 - layer_identity_share",
        "splits": {"evaluated": cache.manifest.get("corpus", {}).get("split"), "calibration": "calibration"},
        "exactness": f"mechanism: in every evaluated batch, live logits vs Correct replay of the coefficients recorded in that same "
                     f"pass, same batch composition; max |diff| <= {MECHANISM_TOLERANCE:g} and identical NLL",
        "cache_fidelity": "cached coefficients of the evaluated sequences vs those recorded now (max |diff|; relative: "
                          "|diff| / (|recorded| + rms of the site's recorded)) and Correct-from-cache NLL vs live NLL; "
                          "bit-identical required when the cache was written in this environment and batch composition, "
                          f"else accepted within the tolerances by model dtype {FOREIGN_TOLERANCES} plus one storage unit "
                          f"for reduced-precision caches {STORAGE_ULP}; the conditions are built from the cache and "
                          "Correct-from-cache is the reference row",
        "controller_flops": "FLOPs inside controller sites / FLOPs of the whole forward (matrix products and attention, via torch FlopCounterMode)",
        "latency": "median over interleaved runs of (model forward time / Dense twin forward time), same device and batch",
        "coefficient": "; ".join(sorted({f"{s.family}: {s.coefficient}" for s in cache.site_specs.values() if s.coefficient}))
                       or "the value the computation consumes at each site",
    }
