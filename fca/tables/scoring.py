"""Scores of replay conditions from per-sequence NLLs: penalties with paired bootstrap CIs, gap retention.
Pure functions over arrays and dicts, shared by the audit, saved replay runs and the dashboard."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fca.tables.stats import paired_bootstrap_ci

BOOTSTRAP_RESAMPLES = 2000


def summarize_conditions(per_seq_nll: Mapping[str, np.ndarray], seed: int = 0, reference: str = "correct") -> dict:
    """condition -> NLL, penalty vs `reference` and its paired bootstrap 95% CI over sequences.

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
    return table


def gap_retention(table: dict) -> dict:
    """(NLL_global - NLL_X) / (NLL_global - NLL_correct) for every condition; None when the gap is not
    clearly positive: its bootstrap CI does not lie above zero, or is undefined (one sequence: NaN live,
    null once saved as JSON)."""
    if "global_mean" not in table or "correct" not in table:
        return {}
    gap = table["global_mean"]["nll"] - table["correct"]["nll"]
    lower = table["global_mean"]["penalty_ci95"][0]
    clearly_positive = lower is not None and lower > 0  # NaN > 0 is False
    out = {}
    for name, row in table.items():
        if name in ("correct", "global_mean"):
            continue
        out[name] = (table["global_mean"]["nll"] - row["nll"]) / gap if clearly_positive else None
    return out
