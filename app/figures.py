"""Pure figure builders: a table in, a plotly Figure out. No Streamlit, no I/O, so every chart can be
built and checked in a plain test. Every axis has a title, with its unit where it has one
(coefficients are unitless multipliers; NLL is in nats per token; time in milliseconds).

A table is a pandas DataFrame; the builders that only read columns by name (`share_by_site`,
`penalty_bars` without runs) also take a dict of equal-length lists, which lets the Overview draw its
charts before pandas is imported (see app/views/overview.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

if TYPE_CHECKING:
    import pandas as pd

# Streamlit's chart theme sets fonts, grid and backgrounds; our template adds only the colour cycle
# (Vega's tableau10, whose colours the single-series charts below use too). A named plotly template
# such as "plotly_white" would build defaults for every trace type on first use: ~0.1 s of the first
# page on a fresh server, for styling that the theme then overrides.
COLORWAY = [
    "#4c78a8",
    "#f58518",
    "#e45756",
    "#72b7b2",
    "#54a24b",
    "#eeca3b",
    "#b279a2",
    "#ff9da6",
    "#9d755d",
    "#bab0ac",
]
TEMPLATE = {"layout": {"colorway": COLORWAY, "hoverlabel": {"align": "left"}}}
SHARE = "share of coefficient variance (fraction)"
COEFFICIENT = "coefficient value (unitless)"
NLL = "NLL (nats / token)"
PENALTY = "penalty vs correct (nats / token)"


def _layout(fig: go.Figure, title: str, height: int = 380, **kwargs) -> go.Figure:
    fig.update_layout(template=TEMPLATE, title=title, height=height, margin=dict(l=60, r=20, t=50, b=60), **kwargs)
    return fig


def share_by_site(df: pd.DataFrame | dict, pooled: float | None = None) -> go.Figure:
    """df: site, share. Bars per site, a dashed line at the pooled share."""
    fig = go.Figure(
        go.Bar(x=df["site"], y=df["share"], marker_color="#4c78a8", hovertemplate="%{x}: %{y:.3f}<extra></extra>")
    )
    if pooled is not None:
        fig.add_hline(
            y=pooled,
            line_dash="dash",
            line_color="#e45756",
            annotation_text=f"pooled {pooled:.3f}",
            annotation_position="top left",
        )
    fig.update_yaxes(title=SHARE, range=[0, 1])
    fig.update_xaxes(title="site (layer)")
    return _layout(fig, "Layer-identity share per site")


def factor_bars(df: pd.DataFrame) -> go.Figure:
    """df: factor, share (None allowed: shown as 'n/a'). Horizontal bars, one per factor."""
    shares = np.array([np.nan if v is None else float(v) for v in df["share"]])
    fig = go.Figure(
        go.Bar(
            y=df["factor"],
            x=np.nan_to_num(shares),
            orientation="h",
            marker_color="#72b7b2",
            text=[f"{v:.3f}" if np.isfinite(v) else "n/a" for v in shares],
            textposition="outside",
            hovertemplate="%{y}: %{x:.3f}<extra></extra>",
        )
    )
    fig.update_xaxes(title=SHARE, range=[0, 1.1])
    fig.update_yaxes(title="factor", autorange="reversed")
    return _layout(fig, "What explains the variance (shares of the total; they overlap)")


def slot_heatmap(df: pd.DataFrame, value_title: str, title: str) -> go.Figure:
    """df: site, channel (int), value, label. Sites may have different widths (ragged): the missing
    cells are NaN and show blank."""
    sites = list(dict.fromkeys(df["site"]))
    width = int(df["channel"].max()) + 1 if len(df) else 0
    z = np.full((len(sites), width), np.nan)
    text = np.full((len(sites), width), "", dtype=object)
    row = {s: i for i, s in enumerate(sites)}
    r = df["site"].map(row).to_numpy()
    c = df["channel"].to_numpy(dtype=int)
    z[r, c] = df["value"].to_numpy(dtype=float)
    text[r, c] = df["label"].astype(str).to_numpy()
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(width)),
            y=sites,
            customdata=text,
            colorscale="Viridis",
            colorbar=dict(title=value_title),
            hovertemplate="%{y} channel %{x} (%{customdata}): %{z:.4f}<extra></extra>",
            hoverongaps=False,
        )
    )
    fig.update_xaxes(title="channel index within the site")
    fig.update_yaxes(title="site (layer)", autorange="reversed")
    return _layout(fig, title, height=max(300, 60 + 28 * len(sites)))


def axis_heatmaps(df: pd.DataFrame, value_title: str, title: str) -> go.Figure:
    """Structured sites (two axes, e.g. MUDD stream x source): one heatmap per first-axis entry.
    df: site, group (first-axis name, e.g. stream 'q'), index (second-axis position), value."""
    groups = list(dict.fromkeys(df["group"]))
    sites = list(dict.fromkeys(df["site"]))
    fig = make_subplots(
        rows=1, cols=len(groups), subplot_titles=[str(g) for g in groups], shared_yaxes=True, horizontal_spacing=0.03
    )
    lo, hi = np.nanmin(df["value"]), np.nanmax(df["value"])
    for j, g in enumerate(groups):
        part = df[df["group"] == g]
        width = int(df["index"].max()) + 1
        z = np.full((len(sites), width), np.nan)
        rows = part["site"].map({s: i for i, s in enumerate(sites)}).to_numpy()
        z[rows, part["index"].to_numpy(dtype=int)] = part["value"].to_numpy(dtype=float)
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=list(range(width)),
                y=sites,
                coloraxis="coloraxis",
                hovertemplate=f"{g} %{{y}} source %{{x}}: %{{z:.4f}}<extra></extra>",
                hoverongaps=False,
            ),
            1,
            j + 1,
        )
        fig.update_xaxes(title="source index", row=1, col=j + 1)
    fig.update_yaxes(title="site (layer)", autorange="reversed", row=1, col=1)
    fig.update_layout(coloraxis=dict(colorscale="Viridis", cmin=lo, cmax=hi, colorbar=dict(title=value_title)))
    return _layout(fig, title, height=max(300, 60 + 28 * len(sites)))


def site_distributions(df: pd.DataFrame) -> go.Figure:
    """df: site, q01, q05, q25, q50, q75, q95, q99, mean. Precomputed box plots (whiskers 5-95%), so
    the chart costs the same for any cache size."""
    fig = go.Figure(
        go.Box(
            x=df["site"],
            q1=df["q25"],
            median=df["q50"],
            q3=df["q75"],
            lowerfence=df["q05"],
            upperfence=df["q95"],
            mean=df["mean"],
            name="coefficients",
            marker_color="#4c78a8",
            boxpoints=False,
        )
    )
    fig.add_trace(
        go.Scatter(
            x=df["site"],
            y=df["q01"],
            mode="markers",
            marker=dict(symbol="line-ew-open", size=12, color="#999"),
            name="1% / 99%",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=df["site"],
            y=df["q99"],
            mode="markers",
            marker=dict(symbol="line-ew-open", size=12, color="#999"),
            showlegend=False,
        )
    )
    fig.update_yaxes(title=COEFFICIENT)
    fig.update_xaxes(title="site (layer)")
    return _layout(fig, "Distribution of coefficients per site (box 25-75%, whiskers 5-95%)")


def token_layer_heatmap(z: pd.DataFrame, tokens: list[str], value_title: str, title: str) -> go.Figure:
    """z: rows = sites, columns = positions. `tokens`: the decoded token at each position (x labels)."""
    positions = [int(c) for c in z.columns]
    labels = [f"{p}:{t}" for p, t in zip(positions, tokens)]
    fig = go.Figure(
        go.Heatmap(
            z=z.to_numpy(dtype=float),
            x=labels,
            y=list(z.index),
            colorscale="RdBu_r",
            colorbar=dict(title=value_title),
            zmid=float(np.nanmean(z.to_numpy())) if z.size else None,
            hovertemplate="%{y} @ %{x}: %{z:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(title="position: decoded token", tickangle=-60, type="category")
    fig.update_yaxes(title="site (layer)", autorange="reversed")
    return _layout(fig, title, height=max(320, 140 + 28 * len(z.index)))


def profile_lines(df: pd.DataFrame, token_label: str) -> go.Figure:
    """df: slot (label 'site/channel'), live, static, lo, hi. The chosen token's coefficients against the
    calibration mean and its quantile band, slot by slot."""
    x = df["slot"].tolist()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=df["hi"], mode="lines", line=dict(width=0), showlegend=False, hoverinfo="skip"))
    fig.add_trace(
        go.Scatter(
            x=x,
            y=df["lo"],
            mode="lines",
            line=dict(width=0),
            fill="tonexty",
            fillcolor="rgba(76,120,168,0.2)",
            name="calibration band",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=df["static"],
            mode="lines",
            line=dict(color="#4c78a8", dash="dash"),
            name="static profile (calibration mean)",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=df["live"],
            mode="lines+markers",
            line=dict(color="#e45756"),
            marker=dict(size=5),
            name=f"live: {token_label}",
        )
    )
    fig.update_xaxes(title="slot (site / channel, in execution order)", type="category", tickangle=-60)
    fig.update_yaxes(title=COEFFICIENT)
    return _layout(
        fig, "Live coefficients of one token vs the static profile", height=420, legend=dict(orientation="h", y=1.12)
    )


def deviation_heatmap(z: np.ndarray, slots: list[str], tokens: list[str], title: str, first: int = 0) -> go.Figure:
    """z: [t, C] standardised deviation (live - static) / calibration SD of positions first..first+t-1;
    drawn with slots as rows and positions as columns, so long sequences run along the page."""
    labels = [f"{first + i}:{t}" for i, t in enumerate(tokens)]
    bound = float(np.nanpercentile(np.abs(z), 99)) if z.size else 1.0
    fig = go.Figure(
        go.Heatmap(
            z=z.T,
            x=labels,
            y=slots,
            colorscale="RdBu_r",
            zmid=0,
            zmin=-bound,
            zmax=bound,
            colorbar=dict(title="deviation (SDs)"),
            hovertemplate="%{x} / %{y}: %{z:.2f} SD<extra></extra>",
        )
    )
    fig.update_xaxes(title="position: decoded token", type="category", tickangle=-60)
    fig.update_yaxes(title="slot (site / channel)", autorange="reversed", type="category")
    return _layout(fig, title, height=min(1000, max(360, 160 + 11 * len(slots))))


def token_strip(df: pd.DataFrame, chosen: int | None = None) -> go.Figure:
    """df: pos, token, deviation. One point per token; click a point to choose that token."""
    colors = ["#e45756" if p == chosen else "#4c78a8" for p in df["pos"]]
    fig = go.Figure(
        go.Scatter(
            x=df["pos"],
            y=df["deviation"],
            mode="markers+text",
            text=df["token"],
            textposition="top center",
            marker=dict(size=9, color=colors),
            textfont=dict(size=9, color="#666"),
            customdata=df["token"],
            hovertemplate="position %{x} %{customdata}: %{y:.2f} SD<extra></extra>",
        )
    )
    fig.update_xaxes(title="position in the sequence (token index)")
    fig.update_yaxes(title="RMS deviation from static profile (SDs)")
    return _layout(fig, "Tokens of the sequence (click one to inspect it)", height=320)


def nll_bars(df: pd.DataFrame, title: str = "NLL per condition") -> go.Figure:
    """df: condition, nll, ci_lo, ci_hi (95% CI of the mean NLL over sequences)."""
    fig = go.Figure(
        go.Bar(
            x=df["condition"],
            y=df["nll"],
            marker_color="#4c78a8",
            error_y=dict(
                type="data", symmetric=False, array=df["ci_hi"] - df["nll"], arrayminus=df["nll"] - df["ci_lo"]
            ),
            hovertemplate="%{x}: %{y:.4f} nats<extra></extra>",
        )
    )
    lo = float(np.nanmin(df["ci_lo"])) if len(df) else 0.0
    hi = float(np.nanmax(df["ci_hi"])) if len(df) else 1.0
    pad = max(1e-3, 0.5 * (hi - lo))
    fig.update_yaxes(title=NLL, range=[lo - pad, hi + pad])
    fig.update_xaxes(title="condition")
    return _layout(fig, title)


def penalty_bars(df: pd.DataFrame | dict, title: str = "Penalty vs correct (95% paired bootstrap CI)") -> go.Figure:
    """df: condition, penalty, lo, hi; optional `run` column groups bars by saved run."""
    fig = go.Figure()
    groups = df.groupby("run", sort=False) if "run" in df else [("", df)]
    for run, part in groups:
        fig.add_trace(
            go.Bar(
                x=part["condition"],
                y=part["penalty"],
                name=str(run) or "penalty",
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=np.subtract(part["hi"], part["penalty"]),
                    arrayminus=np.subtract(part["penalty"], part["lo"]),
                ),
                hovertemplate="%{x}: %{y:+.4f} nats<extra></extra>",
            )
        )
    fig.add_hline(y=0, line_color="#888")
    fig.update_yaxes(title=PENALTY)
    fig.update_xaxes(title="condition")
    return _layout(fig, title, barmode="group", showlegend="run" in df)


def latency_bars(df: pd.DataFrame) -> go.Figure:
    """df: model, ms (median forward time)."""
    fig = go.Figure(
        go.Bar(
            x=df["model"],
            y=df["ms"],
            marker_color=["#e45756", "#4c78a8"][: len(df)],
            text=[f"{v:.1f} ms" for v in df["ms"]],
            textposition="outside",
        )
    )
    fig.update_yaxes(title="median forward time (ms per batch)")
    fig.update_xaxes(title="model")
    return _layout(fig, "Latency: dynamic model vs its Dense twin")


def blocks_bar(df: pd.DataFrame) -> go.Figure:
    """df: block, fraction (tokens processed / tokens in the batch)."""
    fig = go.Figure(go.Bar(x=df["block"], y=df["fraction"], marker_color="#54a24b"))
    fig.update_yaxes(title="fraction of tokens that ran the block", range=[0, 1.05])
    fig.update_xaxes(title="block index", dtick=1)
    return _layout(fig, "Blocks executed per token")


def flops_bar(df: pd.DataFrame) -> go.Figure:
    """df: part, gflops. A stacked horizontal bar: controllers vs the rest of the forward."""
    fig = go.Figure()
    for part, value in zip(df["part"], df["gflops"]):
        fig.add_trace(
            go.Bar(
                y=["forward"],
                x=[value],
                name=part,
                orientation="h",
                hovertemplate=f"{part}: %{{x:.4f}} GFLOP<extra></extra>",
            )
        )
    fig.update_xaxes(title="FLOPs of one forward (GFLOP)")
    fig.update_yaxes(title="")
    return _layout(fig, "Where the forward's FLOPs go", height=240, barmode="stack")


def study_retention(points: pd.DataFrame, summary: pd.DataFrame) -> go.Figure:
    """One point per model (seed) and condition on the gap-retention scale, where 0 is the global mean
    profile and 1 is the correct coefficients; beside them the mean over models with its 95% t interval.
    points: condition, seed (label), retention (None where undefined: left out).
    summary: condition, mean, lo, hi (lo and hi None for a single model)."""
    fig = go.Figure()
    order = list(dict.fromkeys(summary["condition"]))
    for seed, part in points.groupby("seed", sort=False):
        part = part[part["retention"].notna()]
        fig.add_trace(
            go.Scatter(
                x=part["condition"],
                y=part["retention"],
                mode="markers",
                name=f"seed {seed}",
                marker=dict(size=10, opacity=0.8),
                hovertemplate=f"seed {seed}, " + "%{x}: %{y:.1%}<extra></extra>",
            )
        )
    has_ci = summary["lo"].notna() & summary["hi"].notna()
    mean = summary["mean"].astype(float)
    fig.add_trace(
        go.Scatter(
            x=summary["condition"],
            y=mean,
            mode="markers",
            name="mean over models (95% t CI)",
            marker=dict(symbol="line-ew-open", size=28, color="#333", line=dict(width=3)),
            error_y=dict(
                type="data",
                symmetric=False,
                array=np.where(has_ci, summary["hi"].astype(float) - mean, 0.0),
                arrayminus=np.where(has_ci, mean - summary["lo"].astype(float), 0.0),
                color="#333",
            ),
            hovertemplate="mean %{x}: %{y:.1%}<extra></extra>",
        )
    )
    for y, label in ((0.0, "global mean (no layer identity)"), (1.0, "correct (per-token control)")):
        fig.add_hline(
            y=y, line_dash="dot", line_color="#888", annotation_text=label, annotation_position="bottom right"
        )
    values = np.concatenate([points["retention"].dropna().to_numpy(dtype=float), mean.dropna().to_numpy()])
    lo = min(-0.05, float(values.min()) - 0.05) if values.size else -0.05
    hi = max(1.05, float(values.max()) + 0.05) if values.size else 1.05
    fig.update_yaxes(title="gap retention (fraction: 0 = global mean, 1 = correct)", range=[lo, hi], tickformat=".0%")
    fig.update_xaxes(title="condition", categoryorder="array", categoryarray=order)
    return _layout(fig, "Gap retention per model across seeds", height=420, legend=dict(orientation="h", y=-0.25))
