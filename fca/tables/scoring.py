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
    return {
        name: (table["global_mean"]["nll"] - row["nll"]) / gap if clearly_positive else None
        for name, row in table.items()
        if name not in ("correct", "global_mean")
    }


# What the routing figures are, for the report's definitions.
ROUTING_DEFINITION = (
    "per MoE layer, the experts each token ran under a condition, read from what the layer's experts module "
    "was handed in the replay (expert indices and mixing weights, as the model's own routing chose them: "
    "softmax or sigmoid top-k, group-limited, hash or capacity-limited alike), compared with what it was "
    "handed for the token's own cached coefficients (Correct replay): same_experts, the share of tokens that "
    "ran the same set of experts; expert_overlap, the mean share of the token's own experts that still ran; "
    "weight_kept, the mean share of the token's own mixing weight left on the same experts (sum over experts "
    "of the smaller of the two weights, over the token's own total; null where the experts are handed no "
    "weights); each over the routers the condition changes (routers_changed), and per router. Ties between "
    "experts were broken as that replay broke them. A router whose experts' selection could not be observed "
    "has no figure (not_reported says why)"
)


def routing_not_reported(unobserved: Mapping[str, str], routers: int) -> str:
    """One sentence for the routers whose routing could not be observed (router site -> why), of `routers`
    in all; "" for none."""
    if not unobserved:
        return ""
    by_reason: dict[str, list[str]] = {}
    for router, reason in unobserved.items():
        by_reason.setdefault(reason, []).append(router)
    reasons = "; ".join(
        f"{', '.join(names[:2])}{f' and {len(names) - 2} more' if len(names) > 2 else ''}: {reason}"
        for reason, names in by_reason.items()
    )
    whom = "any router" if len(unobserved) == routers else f"{len(unobserved)} of {routers} routers"
    return f"No routing figure is reported for {whom}: which experts ran could not be read at the experts ({reasons})."


def summarize_routing(
    routers: Mapping[str, int],
    specs: Mapping[str, SiteSpec],
    per_seq: Mapping[str, Mapping[str, np.ndarray]],
    unobserved: Mapping[str, str] | None = None,
) -> dict:
    """The report's `routing` section from a run's routing agreement (`fca.engine.routing`): the routers'
    experts per token; per condition, each figure per router (in the routers' order, for a by-layer view)
    and its mean over sequences and the routers the condition reassigns (`routers_changed`: all of them,
    unless the condition names sites; an untouched router keeps every token's experts and would only dilute
    the mean; a condition that changes none has null figures); the `chance` levels of k experts drawn at
    random: the same set with probability 1 / C(E, k), k/E of them kept on average; and `not_reported`, a
    sentence naming the routers whose selection could not be observed and why (only where there are any).
    With no router observed the section is that sentence alone.

    routers: observed router site -> k; specs: the cache's sites (a router's channels are its E experts);
    per_seq: condition -> figure -> [n, S] per sequence and router (every sequence has T tokens, so the mean
    over sequences is the mean over tokens; NaN weight_kept where no weights were handed: null);
    unobserved: router site -> why it has no figure."""
    unobserved = dict(unobserved or {})
    note = routing_not_reported(unobserved, len(routers) + len(unobserved))
    if not routers:
        return {"not_reported": note} if note else {}
    order = list(routers)
    conditions = {}
    for name, figures in per_seq.items():
        changed = _routers_changed(name, order)
        columns = [order.index(r) for r in changed]
        row: dict = {}
        for figure, values in figures.items():
            taken = values[:, columns]
            known = taken[:, ~np.isnan(taken).any(0)] if columns else taken  # (routers handed no weights: none)
            row[figure] = float(known.mean()) if known.size else None
        row["routers_changed"] = changed
        row.update(
            {
                f"{figure}_per_router": [None if np.isnan(v) else float(v) for v in values.mean(0)]
                for figure, values in figures.items()
            }
        )
        conditions[name] = row
    experts = {s: specs[s].num_channels for s in routers}
    chance = {
        "same_experts": float(np.mean([1 / math.comb(experts[s], min(k, experts[s])) for s, k in routers.items()])),
        "expert_overlap": float(np.mean([min(k, experts[s]) / experts[s] for s, k in routers.items()])),
    }
    return {
        "routers": dict(routers),
        "experts": experts,
        "chance": chance,
        "conditions": conditions,
        **({"not_reported": note} if note else {}),
    }


def _routers_changed(condition: str, routers: list[str]) -> list[str]:
    """The routers a condition reassigns: those among the sites it names, or all for a whole-model one."""
    try:
        sites = parse_condition(condition).sites
    except ValueError:  # (a name this version does not parse: counted over every router)
        sites = None
    return list(routers) if sites is None else [r for r in routers if r in sites]
