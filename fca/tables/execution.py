"""What ran, in figures: the execution under each replay condition, and the three properties of audits set
side by side. Torch-free, so reports and the dashboard can use it without loading a model.

`compare_audits` is what a page that sets two demos beside each other reads: for each audit report, its
variation (layer-identity share), dependence (penalties and gap retention) and execution (blocks executed,
FLOPs and latency against the Dense twin, and what runs under each condition) in one flat record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fca.tables.audit_report import AuditReport
from fca.tables.conditions import PAPER_CONDITIONS
from fca.tables.report import read_report

EXECUTION_CONDITIONS_DEFINITION = (
    "execution.conditions: for each condition, the tokens each block processed during that condition's replay "
    "(counted by forward pre-hooks on the blocks, as the family reads them from each call) over all evaluated "
    "sequences: blocks_executed_fraction = sum / (tokens x blocks), blocks_executed_per_token = sum / tokens, "
    "per_block_fraction = each block's share of the tokens"
)
FLOPS_RATIO_DEFINITION = (
    "flops_ratio_vs_dense: FLOPs of one forward of the model / FLOPs of its Dense twin on the same probe batch "
    "(the same FLOP counter and formulas), so work a model skips shows as a ratio below 1"
)


def condition_execution(executed: Mapping[str, np.ndarray], seq_len: int) -> dict[str, dict]:
    """Condition -> its execution figures, from tokens processed per sequence and block [n, L] (see
    `EXECUTION_CONDITIONS_DEFINITION`)."""
    out = {}
    for name, counts in executed.items():
        counts = np.asarray(counts, dtype=np.int64)
        n, blocks = counts.shape
        tokens = n * seq_len
        per_block = counts.sum(0)  # [L]
        out[name] = {
            "tokens": int(tokens),
            "tokens_per_block": [int(c) for c in per_block],
            "blocks_executed_per_token": float(per_block.sum() / tokens) if tokens else 0.0,
            "blocks_executed_fraction": float(per_block.sum() / (tokens * blocks)) if tokens and blocks else 0.0,
            "per_block_fraction": [float(c / tokens) if tokens else 0.0 for c in per_block],
        }
    return out


def audit_summary(report: AuditReport, label: str = "") -> dict:
    """One audit report's three properties in one flat record (None where the report has no such figure)."""
    exe, conditions = report.execution, report.conditions
    under = exe.conditions or {}
    return {
        "label": label or report.model.name,
        "model_type": report.model.model_type,
        "parameters": report.model.parameters,
        "controller_parameters": report.model.controller_parameters,
        "tokens": report.cache.tokens,
        # 1. variation
        "layer_identity_share": report.variance.layer_identity_share,
        # 2. dependence
        "nll_correct": conditions["correct"].nll if "correct" in conditions else None,
        "penalty": {name: conditions[name].penalty for name in PAPER_CONDITIONS if name in conditions},
        "gap_retention_static_layer": report.gap_retention.get("static_layer"),
        # 3. execution
        "num_blocks": exe.num_blocks,
        "blocks_executed_fraction": exe.blocks_executed_fraction,
        "blocks_executed_per_token": exe.blocks_executed_per_token,
        "controller_flops_share": exe.controller_flops_share,
        "flops_ratio_vs_dense": exe.flops_ratio_vs_dense,
        "latency_ratio_vs_dense": exe.latency_ratio_vs_dense,
        "latency_device": exe.latency.device if exe.latency is not None else None,
        "blocks_executed_fraction_under": {
            name: under[name].blocks_executed_fraction for name in PAPER_CONDITIONS if name in under
        },
    }


def compare_audits(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> list[dict]:
    """The audits at `paths` (e.g. cache/demo/audit.json and cache/demo-skip/audit.json), each as
    `audit_summary`'s record, in order: variation, dependence and execution side by side. A file that is not
    an audit report raises `fca.tables.report.ReportError` naming it."""
    labels = list(labels) if labels is not None else [Path(p).parent.name for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(paths)} audits and {len(labels)} labels")
    return [audit_summary(read_report(Path(path)), label) for path, label in zip(paths, labels)]


def blocks_of(per_token: float, num_blocks: int) -> str:
    """Blocks a token ran on average, of the model's: "6 of 6" where the mean is a whole number (every
    token ran as many), "4.37 of 6" otherwise (two decimals, as the reports give it)."""
    shown = f"{per_token:.2f}"
    return f"{shown.removesuffix('.00')} of {num_blocks}"
