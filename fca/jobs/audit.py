"""The three-property audit: coefficient variation, functional dependence, actual execution.

`run_audit` (also `fca.audit`) opens and checks an `Experiment`, runs both exactness checks first and
refuses to report anything else if either fails. The report is one `AuditReport`
(`fca.tables.audit_report`); `fca.tables.report.render_markdown` turns it into a page, `write_report` writes both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from fca.engine.environment import model_dtype_name
from fca.engine.families import family_of
from fca.engine.loading import fingerprint_state
from fca.engine.sites import controller_parameters, model_class_name
from fca.jobs.experiment import CacheSource, Experiment, ModelSource, check_condition_sites, parameter_count
from fca.tables.audit_report import (
    REPORT_VERSION,
    AuditReport,
    CalibrationCache,
    ConditionRow,
    Dense,
    EvaluatedCache,
    Exactness,
    Execution,
    Model,
    Routing,
    SweepRow,
    Variance,
)
from fca.tables.conditions import PAPER_CONDITIONS, Condition, as_conditions
from fca.tables.execution import EXECUTION_CONDITIONS_DEFINITION, FLOPS_RATIO_DEFINITION, condition_execution
from fca.tables.fidelity import (
    FOREIGN_TOLERANCES,
    MECHANISM_NLL_TOLERANCE,
    MECHANISM_TOLERANCE,
    STORAGE_ULP,
    STORAGE_ULP_ALLOWANCE,
)
from fca.tables.profiles import cache_moments
from fca.tables.runs import SWEEP_ALPHAS  # an audit's interpolation sweep, as the Replay lab's; `sweep=()` skips it
from fca.tables.scoring import (
    BOOTSTRAP_RESAMPLES,
    MIN_DOCUMENTS,
    ROUTING_DEFINITION,
)
from fca.tables.stats import MIN_BOOTSTRAP_VALUES, variance_decomposition
from fca.tables.store import Cache
from fca.tables.text import mapping_text


def run_audit(
    model: ModelSource,
    cache: CacheSource,
    calibration: CacheSource,
    dense: ModelSource | None = None,
    device: str = "auto",
    dtype: torch.dtype | None = None,
    batch_size: int | None = None,
    num_seqs: int | None = None,
    seed: int = 0,
    extra_conditions: Sequence[str | Condition] = (),
    latency_runs: int = 7,
    progress: Callable[[str, int, int], None] | None = None,
    sweep: Sequence[float] = SWEEP_ALPHAS,
    training: dict | None = None,
) -> AuditReport:
    """The three-property report of `model` (a directory, or a module held in memory: `fca.audit`) on an
    evaluated and a calibration cache (directories or opened caches), with its Dense twin's latency when
    `dense` is given. Cache part hashes are verified first. `sweep`: alphas of an interpolation sweep
    (`interpolate:alpha` conditions and an `interpolation_sweep` section; () for none). `training`: how
    the model was trained, e.g. {"seed": 3, "steps": 800}, for a model held in memory (a directory's is
    read from its training log); a study of such audits shows their seeds."""
    check_condition_sites(as_conditions(extra_conditions, seed), cache)
    experiment = Experiment.open(model, cache, calibration, dense, device=device, dtype=dtype, verify=True)
    if training is not None:
        if not isinstance(training, dict) or not isinstance(training.get("seed", 0), int):
            raise ValueError(f"training must be a dict with a whole-number seed, e.g. {{'seed': 3}}; got {training!r}")
        experiment.training = {**experiment.training, **training}
    return audit_experiment(
        experiment,
        batch_size=batch_size,
        num_seqs=num_seqs,
        seed=seed,
        extra_conditions=extra_conditions,
        latency_runs=latency_runs,
        progress=progress,
        sweep=sweep,
    )


def audit_experiment(
    experiment: Experiment,
    batch_size: int | None = None,
    num_seqs: int | None = None,
    seed: int = 0,
    extra_conditions: Sequence[str | Condition] = (),
    latency_runs: int = 7,
    progress: Callable[[str, int, int], None] | None = None,
    sweep: Sequence[float] = SWEEP_ALPHAS,
) -> AuditReport:
    """The report of an opened experiment. Nothing is reported unless both exactness checks pass."""
    started = time.perf_counter()
    step = (lambda stage: lambda i, n: progress(stage, i, n)) if progress else (lambda stage: None)
    model, evaluated, calibration = experiment.model, experiment.evaluated, experiment.calibration
    dense = experiment.dense  # loaded (and checked to be a Dense twin) before the replays, not after
    conditions = [Condition(kind, seed=seed) for kind in PAPER_CONDITIONS]
    conditions = list(dict.fromkeys([*conditions, *as_conditions(extra_conditions, seed)]))  # each run once
    try:
        alphas = sorted({float(a) for a in sweep})
    except (TypeError, ValueError):
        raise ValueError(f"sweep: interpolation alphas must be numbers, got {list(sweep)!r}") from None
    swept = [Condition("interpolate", a, seed=seed) for a in alphas]
    conditions += [c for c in swept if c not in conditions]  # an extra interpolate:0.5 is run once
    results = experiment.run(
        conditions, num_seqs, batch_size, seed, progress=step("replay"), profile_progress=step("calibration profiles")
    )
    exactness = results.exactness  # judged by the run: nothing below is computed from an inexact one
    # As a saved run's: the CIs resample whole documents where the cache records the documents the windows
    # begin in, as windows of one document are not independent.
    figures = experiment.score(results, seed)
    moments, layout = cache_moments(evaluated, progress=step("variance"), num_seqs=num_seqs)
    variance = variance_decomposition(moments, layout)
    execution = experiment.measure_execution(latency_runs)
    if results.executed is not None:  # what ran under each condition, counted during its replay
        execution["conditions"] = condition_execution(results.executed, evaluated.seq_len)
    routed = "routing" in figures
    rows = {name: ConditionRow.read(row, f"conditions.{name}") for name, row in figures["conditions"].items()}
    return AuditReport(
        fca_report_version=REPORT_VERSION,
        model=Model(
            name=experiment.name,
            model_type=model.config.model_type if hasattr(model, "config") else model_class_name(model),
            fingerprint=experiment.model_fingerprint,
            parameters=parameter_count(model),
            controller_parameters=controller_parameters(model),
            dtype=model_dtype_name(model),
            device=str(experiment.device),
            # The configuration the caches record: a study compares it, so that two architectures of equal
            # parameter counts are not averaged as seeds of one.
            config=evaluated.manifest.model.config,
        ),
        cache=EvaluatedCache(**_cache_entry(evaluated, len(results.seqs)), documents=figures["documents"]),
        calibration=CalibrationCache(
            **_cache_entry(calibration, calibration.num_seqs),
            # what global_mean put at every coefficient of each family (the evaluated cache's own grand
            # means, under variance, are another split's)
            family_grand_means={f: float(v) for f, v in experiment.profiles().family_means.items()},
        ),
        dense=Dense(
            name=experiment.dense_name,
            fingerprint=fingerprint_state(dense),
            parameters=parameter_count(dense),
        )
        if dense is not None
        else None,
        exactness=Exactness.read(exactness, "exactness"),
        conditions=rows,
        gap_retention=figures["gap_retention"],
        gap_retention_ci95={k: tuple(v) for k, v in figures["gap_retention_ci95"].items()},
        interpolation_sweep=_sweep_section(rows, swept) if swept else None,
        routing=Routing.read(figures["routing"], "routing") if routed else None,
        variance=Variance.read(variance, "variance"),
        execution=Execution.read(execution, "execution"),
        definitions={
            **_definitions(evaluated, calibration, layout, seed, conditions, swept, family_of(model).coefficient_kind),
            **family_of(model).definitions(model),
            **({"routing": ROUTING_DEFINITION} if routed else {}),
        },
        # The seed and training run travel inside the report: a study of committed audits needs no models.
        training=experiment.training or None,
        seconds=round(time.perf_counter() - started, 1),
    )


def _sweep_section(rows: dict[str, ConditionRow], swept: Sequence[Condition]) -> tuple[SweepRow, ...]:
    """One row per alpha, in increasing order, with the condition's name so readers (the study) can
    tell the sweep's conditions from the others."""
    return tuple(
        SweepRow(
            alpha=c.alpha,
            condition=c.name,
            nll=rows[c.name].nll,
            penalty=rows[c.name].penalty,
            penalty_ci95=rows[c.name].penalty_ci95,
            penalty_ci95_documents=rows[c.name].penalty_ci95_documents,
        )
        for c in swept
    )


def _cache_entry(cache: Cache, evaluated_seqs: int) -> dict:
    corpus = cache.manifest.corpus
    return {
        "path": cache.path.name,
        "fingerprint": cache.fingerprint,
        "split": corpus.split,
        "split_seed": corpus.split_seed,
        "corpus": corpus.name,
        "corpus_fingerprint": corpus.fingerprint,  # (two files of one name may hold other text)
        "sequences": evaluated_seqs,
        "seq_len": cache.seq_len,
        "tokens": evaluated_seqs * cache.seq_len,
        "coefficient_dtype": cache.coefficient_dtype,
        "environment": cache.environment,
    }


# What the conditions beyond the paper's five mean, for the reports that run them (`_definitions`).
EXTRA_KINDS = {
    "interpolate": "alpha * own coefficients + (1 - alpha) * static_layer profile, at every site and token",
    "position_profile": "per-site, per-channel calibration mean at each position t, given at position t",
    "token_shuffle": "positions permuted within each sequence",
}


def _extra_definition(c: Condition) -> str:
    text = EXTRA_KINDS.get(c.kind, c.kind)
    if c.independent:
        text += ", one permutation per sequence and site"
    if c.sites is not None:
        text += f"; at {', '.join(c.sites)} only, the other sites keep their own coefficients"
    return text


def _definitions(
    cache: Cache,
    calibration: Cache,
    layout,
    seed: int,
    conditions: Sequence[Condition],
    swept: Sequence[Condition] = (),
    coefficient_kind: str = "",
) -> dict:
    extra = [c for c in conditions if c.name not in PAPER_CONDITIONS and c not in swept]  # named by their spec
    families: dict[str, list[str]] = {}
    for site in layout.sites:
        for f in dict.fromkeys(layout.families[layout.site_slice(site)]):
            families.setdefault(f, []).append(site)
    return {
        "nll": "mean next-token negative log-likelihood in nats over all predicted positions of the evaluated windows",
        "penalty": "NLL_X - NLL_correct; 95% CI: paired percentile bootstrap over sequences "
        f"({BOOTSTRAP_RESAMPLES} resamples, seed {seed}); none (null) from fewer than {MIN_BOOTSTRAP_VALUES}",
        "gap_retention": "(NLL_global_mean - NLL_X) / (NLL_global_mean - NLL_correct); "
        "null when the global_mean penalty CI reaches 0",
        # (keys of their own: a study compares the two above, and audits made before these still agree)
        "penalty_documents": "penalty_ci95_documents: the same bootstrap resampling whole documents, the "
        "evaluated windows grouped by the document each begins in (consecutive windows of one document share "
        "its text, so are not independent); only for caches built from a corpus, whose manifest records the "
        f"end-of-document token (cache.documents: how many), and from at least {MIN_DOCUMENTS} documents; "
        "where given, it is the global_mean CI that decides whether gap retention is defined",
        "gap_retention_ci95": "95% percentile bootstrap CI of the gap retention, 1 - penalty_X / penalty_global_mean "
        f"of each resample's means ({BOOTSTRAP_RESAMPLES} resamples, seed {seed}), resampling whole documents "
        "where the cache records them, else sequences; only where the gap retention is defined",
        "conditions": {
            "correct": "each sequence's own cached coefficients",
            "cross_input": "coefficients of another evaluated sequence, "
            f"pi = a uniform derangement of the evaluated sequences (seed {seed})",
            "token_shuffle": "positions permuted within each sequence, one permutation per sequence shared by all "
            f"sites (seed {seed}, keyed by sequence index)",
            "static_layer": "per-site, per-channel mean over all tokens of the calibration cache, at every token",
            "global_mean": "the calibration grand mean of each coefficient family, at every site, channel and token",
        },
        # Their own keys, not in `conditions`: studies compare `conditions` with audits made without them.
        **(
            {
                "interpolation_sweep": "interpolate:alpha = alpha * own coefficients + (1 - alpha) * static_layer "
                "profile at every site and token (alpha 0: the static profile, 1: correct), scored like the conditions"
            }
            if swept
            else {}
        ),
        **({"extra_conditions": {c.name: _extra_definition(c) for c in extra}} if extra else {}),
        "condition_specs": {c.name: c.to_json() for c in conditions},
        "global_mean_families": families,
        "layer_identity_share": "within each family, SS_between(slot means per site and channel) / "
        "SS_total(around the family grand mean), "
        "pooled over families as sum SS_between / sum SS_total, on the evaluated cache",
        "per_site_share": "the same ratio over one site's slots, both sums still around the family grand mean (so "
        "a site whose mean sits away from the other sites' counts that offset as layer identity); per_slot_share: "
        "count * (slot mean - family grand mean)^2 / the slot's sum of squares around the family grand mean",
        "model_fingerprint": "sha256 over the model's state dict in name order, each tensor as the text "
        "'name|dtype|shape|' (dtype as torch names it, e.g. torch.float32; shape as a Python tuple, e.g. (192,)) "
        "followed by its raw bytes: the weights' identity, not the hash of a checkpoint file",
        "variance_factors": "site, channel within site: parts of the slot effect; position, token id and sequence: "
        "group means within each slot, each as a share of SS_total (they overlap and do not add up); "
        "residual_after_slot = 1 - layer_identity_share",
        "variance_chance_levels": "per within-slot factor, the share its groups take with no effect: k groups among "
        "n values of a slot explain (k - 1) / (n - 1) of its within variance in expectation, "
        "times residual_after_slot",
        "splits": {
            "evaluated": cache.manifest.corpus.split,
            "calibration": calibration.manifest.corpus.split,
        },
        "exactness": "mechanism: in every evaluated batch, live logits vs Correct replay of the coefficients "
        f"recorded in that same pass, same batch composition; max |diff| <= {MECHANISM_TOLERANCE:g} and mean NLL "
        f"within {MECHANISM_NLL_TOLERANCE:g}",
        "cache_fidelity": "cached coefficients of the evaluated sequences vs those recorded now (max |diff|; relative: "
        "|diff| / (|recorded| + rms of the site's recorded)) and Correct-from-cache NLL vs live NLL; "
        "bit-identical required when the cache was written in this environment and batch composition, "
        f"else accepted within the tolerances by model dtype: {mapping_text(FOREIGN_TOLERANCES)}, to which a "
        f"reduced-precision cache adds its storage unit u ({mapping_text(STORAGE_ULP)}) times "
        f"({mapping_text(STORAGE_ULP_ALLOWANCE)}); the conditions are built "
        "from the cache and "
        "Correct-from-cache is the reference row",
        "controller_flops": "FLOPs inside controller sites / FLOPs of the whole forward "
        "(matrix products and attention, via torch FlopCounterMode, with formulas for the CPU's fused "
        "attention and grouped expert products; heavy operators without one are listed in uncounted_ops)",
        "latency": "median over interleaved runs of (model forward time / Dense twin forward time), "
        "same device and batch",
        "flops_ratio_vs_dense": FLOPS_RATIO_DEFINITION,
        "execution_conditions": EXECUTION_CONDITIONS_DEFINITION,
        "coefficient": "; ".join(
            sorted({f"{s.family}: {s.coefficient}" for s in cache.site_specs.values() if s.coefficient})
        )
        or coefficient_kind  # (the family's words, where its sites do not say: MUDDPythia's)
        or "the value the computation consumes at each site",
    }
