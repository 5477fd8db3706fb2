"""The paper that introduced Frozen-Controller Auditing: its published figures, and a table that sets a
report's own figures beside them (variation, dependence, execution).

The figures are the paper's, as the README quotes them; they are points of reference, not results for the
model a report describes (the paper's gated Transformers are larger and trained on far more tokens).
"""

from __future__ import annotations

from fca.tables.audit_report import AuditReport
from fca.tables.text import percent

ARXIV_ID = "2607.26192"
CITATION = f"arXiv:{ARXIV_ID}"

# Static-layer gap retention of its two gated Transformer configurations (FeatureGate).
STATIC_RETENTION = (0.9870, 0.9943)
# Share of the coefficient variance that layer identity explained, over its models.
LAYER_IDENTITY_SHARE = (0.87, 0.96)
# MUDDPythia-1.4B, dense-connection coefficients replayed under these conditions: NLL penalty in nats.
MUDDPYTHIA_PENALTIES = {"cross_input": 1.9067, "token_shuffle": 2.9637}
# Its gated model executed every block and took this multiple of its Dense twin's time.
BLOCKS_EXECUTED_FRACTION = 1.0
LATENCY_VS_DENSE = 1.308


def _range(pair: tuple[float, float], digits: int) -> str:
    return f"{100 * pair[0]:.{digits}f}-{100 * pair[1]:.{digits}f}%"


def comparison_rows(report: AuditReport) -> list[dict]:
    """One row per figure the paper published: {question, figure, this_model, paper}, as text. A figure the
    report lacks reads "not in this report" (never 0)."""
    conditions = report.conditions
    interval = report.retention_interval("static_layer")
    missing = "not in this report"

    static = report.gap_retention.get("static_layer")
    static_text = missing if "static_layer" not in conditions else percent(static)
    if static is not None and interval:
        static_text += f" (95% CI {percent(interval[0])} to {percent(interval[1])})"

    def penalty(name: str) -> str:
        row = conditions.get(name)
        return missing if row is None else f"{row.penalty:+.4f} nats"

    ratio = report.execution.latency_ratio_vs_dense
    blocks = report.execution.blocks_executed_fraction
    paper_static = f"{percent(STATIC_RETENTION[0], 2)} and {percent(STATIC_RETENTION[1], 2)} (two gated configurations)"
    rows = [  # (question, figure, this model, the paper)
        (
            "variation",
            "layer-identity share of the coefficient variance",
            percent(report.variance.layer_identity_share),
            _range(LAYER_IDENTITY_SHARE, 0),
        ),
        ("dependence", "static-layer gap retention", static_text, paper_static),
        *(
            ("dependence", f"{name} penalty vs correct", penalty(name), f"MUDDPythia-1.4B: {value:+.4f} nats")
            for name, value in MUDDPYTHIA_PENALTIES.items()
        ),
        ("execution", "blocks executed per token", percent(blocks, 0), percent(BLOCKS_EXECUTED_FRACTION, 0)),
        (
            "execution",
            "time vs the Dense twin",
            "not measured" if ratio is None else f"{ratio:.3f}x",
            f"{LATENCY_VS_DENSE:.3f}x (+{100 * (LATENCY_VS_DENSE - 1):.1f}%)",
        ),
    ]
    return [dict(zip(("question", "figure", "this_model", "paper"), row)) for row in rows]


def citation_sentence() -> str:
    """Where the paper's figures come from, in one line (plain text: no link markup)."""
    return (
        f"The paper's figures: the study that introduced Frozen-Controller Auditing, {CITATION}; "
        "points of reference from larger models, not results for this one."
    )


def comparison_markdown(report: AuditReport) -> list[str]:
    """The comparison as Markdown lines: a heading, the table and the citation."""
    lines = [
        "## This model beside the paper",
        "",
        "| question | figure | this model | the paper |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['question']} | {r['figure']} | {r['this_model']} | {r['paper']} |" for r in comparison_rows(report)
    ]
    return lines + ["", citation_sentence()]
