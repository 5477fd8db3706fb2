"""Scores of replay conditions from per-sequence NLLs: penalties with paired bootstrap CIs, gap retention.
Pure functions over arrays and dicts, shared by the audit, saved replay runs and the dashboard."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from fca.tables.conditions import parse_condition
from fca.tables.spec import SiteSpec
from fca.tables.stats import MIN_BOOTSTRAP_VALUES, paired_bootstrap_ci, percentile_interval, resampled_means

BOOTSTRAP_RESAMPLES = 2000
# Fewer documents give no CI over them: a percentile bootstrap over 2, 3 or 5 clusters covered the true
# mean 48%, 74% and 84% of the time in simulation, and could come out narrower than the CI over sequences
# by chance; from 10 documents on it covered 92-93% (37-100 documents: the same).
MIN_DOCUMENTS = 10
# A retention interval is given only where at most this share of resamples has no positive gap (such a
# resample has no retention); more would make it an interval over the lucky resamples only.
MAX_GAPLESS_SHARE = 0.025


def count_documents(documents: np.ndarray | None) -> int | None:
    """How many documents the evaluated windows lie in (`Cache.window_documents`); None where not recorded."""
    return None if documents is None else len(np.unique(documents))


def quoted_interval(row: dict) -> list[float]:
    """A condition's (or sweep point's) penalty 95% CI to quote: resampling documents where the report has
    that interval, else sequences (windows of one document are not independent; `summarize_conditions`).
    The null ends a saved report gives too few sequences' interval are NaN, as live: compared, never less."""
    bounds = row.get("penalty_ci95_documents") or row["penalty_ci95"]
    return [math.nan if x is None else x for x in bounds]


def summarize_conditions(
    per_seq_nll: Mapping[str, np.ndarray],
    seed: int = 0,
    reference: str = "correct",
    documents: np.ndarray | None = None,
) -> dict:
    """condition -> NLL, penalty vs `reference` and its paired bootstrap 95% CI over sequences (NaN from
    fewer than MIN_BOOTSTRAP_VALUES, `fca.tables.stats`); given
    `documents` [n] (the document each sequence's window begins in) of at least MIN_DOCUMENTS, also the CI
    resampling whole documents (`penalty_ci95_documents`): windows cut one after another from a text are
    not independent where they share a document, and resampling them one by one makes the CI too narrow.

    per_seq_nll: condition -> [n] mean NLL of each evaluated sequence (the same sequences for all)."""
    base = per_seq_nll[reference]
    table = {}
    for name, per_seq in per_seq_nll.items():
        diff = per_seq - base
        lo, hi = paired_bootstrap_ci(diff, BOOTSTRAP_RESAMPLES, seed) if name != reference else (0.0, 0.0)
        table[name] = {
            "nll": float(per_seq.mean()),
            "penalty": float(diff.mean()),
            "penalty_ci95": [lo, hi],
            "nll_sd_over_sequences": float(per_seq.std(ddof=1)) if len(per_seq) > 1 else None,  # (undefined at n=1)
        }
    if (count_documents(documents) or 0) >= MIN_DOCUMENTS:
        names = list(per_seq_nll)
        diffs = np.stack([per_seq_nll[name] - base for name in names], axis=1)  # [n, conditions]
        draws = resampled_means(diffs, documents, BOOTSTRAP_RESAMPLES, seed)
        for j, name in enumerate(names):
            table[name]["penalty_ci95_documents"] = (
                [0.0, 0.0] if name == reference else list(percentile_interval(draws[:, j]))
            )
    return table


def gap_retention_ci(
    per_seq_nll: Mapping[str, np.ndarray],
    retention: Mapping[str, float | None],
    seed: int = 0,
    documents: np.ndarray | None = None,
) -> dict:
    """condition -> 95% percentile bootstrap CI of its gap retention (where `retention`, from `gap_retention`,
    defines it), resampling whole documents given `documents` [n] of at least MIN_DOCUMENTS, else sequences:
    each resample's retention is 1 - penalty_X / penalty_global_mean of its means, the conditions drawn
    together (paired). Empty when more than MAX_GAPLESS_SHARE of the resamples have no positive gap."""
    names = [name for name, value in retention.items() if value is not None]
    if (count_documents(documents) or 0) < MIN_DOCUMENTS:
        documents = None  # (as the penalty's: too few documents to resample, so sequences, said as such)
    if not names or len(per_seq_nll["correct"]) < MIN_BOOTSTRAP_VALUES:  # (the penalty has no CI either)
        return {}
    base = per_seq_nll["correct"]
    diffs = np.stack([per_seq_nll[name] - base for name in ["global_mean", *names]], axis=1)  # [n, 1 + k]
    draws = resampled_means(diffs, documents, BOOTSTRAP_RESAMPLES, seed)
    gapped = draws[:, 0] > 0  # a resample whose gap is not positive has no retention
    if 1 - gapped.mean() > MAX_GAPLESS_SHARE:
        return {}
    ratios = 1 - draws[gapped, 1:] / draws[gapped, :1]  # [R', k]
    return {name: list(percentile_interval(ratios[:, j])) for j, name in enumerate(names)}


def gap_retention(table: dict) -> dict:
    """(NLL_global - NLL_X) / (NLL_global - NLL_correct) for every condition; None when the gap is not
    clearly positive: its bootstrap CI does not lie above zero, or is undefined (fewer than
    MIN_BOOTSTRAP_VALUES sequences: NaN live, null once saved as JSON)."""
    if "global_mean" not in table or "correct" not in table:
        return {}
    gap = table["global_mean"]["nll"] - table["correct"]["nll"]
    lower = quoted_interval(table["global_mean"])[0]  # (over documents where known: the honest interval)
    clearly_positive = lower is not None and lower > 0  # NaN > 0 is False
    out = {}
    for name, row in table.items():
        if name in ("correct", "global_mean"):
            continue
        out[name] = (table["global_mean"]["nll"] - row["nll"]) / gap if clearly_positive else None
    return out


# What the routing figures are, for the report's definitions.
ROUTING_DEFINITION = (
    "per MoE layer, the top-k experts of the router coefficients a condition feeds it (float32 softmax, "
    "top-k, as the router, redone on the replay's device from the tensors the routers were fed), compared "
    "with those of the token's own cached coefficients: same_experts, the share of tokens whose k experts "
    "are the same set; expert_overlap, the mean share of the k experts kept; weight_kept, the mean share of "
    "the token's own mixing weight left on the same experts (sum over experts of the smaller of the two "
    "weights, over the token's own total); tied, the share whose choice, their own or the condition's, was "
    "decided by a tie (e.g. a profile equal for every expert); each over the routers the condition changes "
    "(routers_changed), and per router"
)


# How a router's mixing weights are made, as the routing section names them (`weight_kept` depends on it).
RENORMALISED, RAW_PROBABILITIES = "renormalised top-k probabilities", "top-k probabilities as they are"


def summarize_routing(
    routers: Mapping[str, int],
    specs: Mapping[str, SiteSpec],
    per_seq: Mapping[str, Mapping[str, np.ndarray]],
    renormalized: Mapping[str, bool] | None = None,
) -> dict:
    """The report's `routing` section from a run's routing agreement (`fca.engine.routing`): the routers'
    experts per token and how their mixing weights are made (`weights`: renormalised top-k probabilities,
    or the top-k probabilities as they are, which `weight_kept` depends on); per condition, each figure per
    router (in the routers' order, for a by-layer view) and its mean over sequences and the routers the
    condition reassigns (`routers_changed`: all of them, unless the condition names sites; an untouched
    router keeps every token's experts and would only dilute the mean; a condition that changes none has
    null figures); and the `chance` levels of k experts drawn at random: the same set with probability
    1 / C(E, k), k/E of them kept on average.

    routers: site -> k; specs: the cache's sites (a router's channels are its E experts); per_seq:
    condition -> figure -> [n, S] per sequence and router (every sequence has T tokens, so the mean over
    sequences is the mean over tokens); renormalized: site -> whether the router renormalises (default: yes)."""
    order = list(routers)
    conditions = {}
    for name, figures in per_seq.items():
        changed = _routers_changed(name, order)
        columns = [order.index(r) for r in changed]
        row: dict = {
            figure: float(values[:, columns].mean()) if columns else None for figure, values in figures.items()
        }
        row["routers_changed"] = changed
        row.update({f"{figure}_per_router": values.mean(0).tolist() for figure, values in figures.items()})
        conditions[name] = row
    experts = {s: specs[s].num_channels for s in routers}
    chance = {
        "same_experts": float(np.mean([1 / math.comb(experts[s], k) for s, k in routers.items()])),
        "expert_overlap": float(np.mean([k / experts[s] for s, k in routers.items()])),
    }
    renormalized = renormalized or {}
    weights = {s: RENORMALISED if renormalized.get(s, True) else RAW_PROBABILITIES for s in routers}
    return {
        "routers": dict(routers),
        "experts": experts,
        "weights": weights,
        "chance": chance,
        "conditions": conditions,
    }


def _routers_changed(condition: str, routers: list[str]) -> list[str]:
    """The routers a condition reassigns: those among the sites it names, or all for a whole-model one."""
    try:
        sites = parse_condition(condition).sites
    except ValueError:  # (a name this version does not parse: counted over every router)
        sites = None
    return list(routers) if sites is None else [r for r in routers if r in sites]
