"""Pure figure builders: a table in, a plotly Figure out. No Streamlit, no I/O, so every chart can be
built and checked in a plain test. Every axis has a title, with its unit where it has one
(coefficients are unitless multipliers; NLL is in nats per token; time in milliseconds).

A table is a pandas DataFrame; the builders that only read columns by name (`share_by_site`,
`penalty_bars` without runs) also take a dict of equal-length lists, which lets the Overview draw its
charts before pandas is imported (see app/views/overview.py).
"""

from __future__ import annotations

import functools
import html
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fca.tables import paper
from fca.tables.scoring import quoted_interval

if TYPE_CHECKING:
    import pandas as pd

# `themed` sets fonts, grid and text for the page's theme; our template adds the colour cycle (Vega's
# tableau10, whose colours the single-series charts below use too) and the type sizes. A named plotly
# template such as "plotly_white" would build defaults for every trace type on first use, delaying the
# first page of a fresh server.
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
# One colour per condition kind, the same in every chart of every page (the retention scale, the bars, the
# sweep, routing, the study): a condition recognised by its colour in one chart is that condition in the
# next. Keyed by kind: `static_layer@blocks.0.gate` and `interpolate:0.25` take their kind's colour.
CONDITION_COLOURS = {
    "correct": "#54a24b",
    "static_layer": "#4c78a8",
    "global_mean": "#9d755d",
    "cross_input": "#e45756",
    "token_shuffle": "#f58518",
    "position_profile": "#b279a2",
    "interpolate": "#72b7b2",
}
OTHER_CONDITION = "#bab0ac"  # a kind this table does not know (a newer library's)


# Plotly draws a subset of HTML in every label it shows (hover text, ticks, legend, titles, annotations), and
# `<a href=...>` there is a live link: the names these charts show come from caches, reports and runs.
_NOT_FORMATTING = re.compile(r"<(?!/?(?:br|b|i|em|sub|sup|extra)\s*/?>)", re.IGNORECASE)


def plain_labels(fig: go.Figure) -> go.Figure:
    """`fig` with every `<` in its strings that opens no line break or emphasis of ours shown as the
    character (`&lt;`, which plotly draws as text): a figure holding none is returned as it is."""
    spec = fig.to_dict()
    return go.Figure(spec) if _escape_tags(spec) else fig


def _escape_tags(value: dict | list | np.ndarray) -> bool:
    """Escape, in place, the markup in every string inside `value` (dicts, lists, object arrays); whether any was."""
    if isinstance(value, np.ndarray):
        value, items = value.reshape(-1), enumerate(value.reshape(-1).tolist())  # (object arrays: a view)
    else:
        items = list(value.items() if isinstance(value, dict) else enumerate(value))
    changed = False
    for key, item in items:
        if isinstance(item, str) and "<" in item:
            value[key] = _NOT_FORMATTING.sub("&lt;", item)
            changed |= value[key] != item
        elif isinstance(item, tuple):
            value[key] = list(item)
            changed |= _escape_tags(value[key])
        elif isinstance(item, np.ndarray) and item.dtype.kind in "OU":
            # A copy: the figure's arrays may be read-only views of the caller's (a DataFrame's column), and
            # fixed-width text may not hold an escaped string.
            copy = item.astype(object)
            if _escape_tags(copy):
                value[key], changed = copy, True
        elif isinstance(item, (dict, list)):
            changed |= _escape_tags(item)
    return changed


def text_labels(build):
    """A figure builder whose figure shows its strings as text (`plain_labels`)."""

    @functools.wraps(build)
    def built(*args, **kwargs) -> go.Figure:
        return plain_labels(build(*args, **kwargs))

    return built


def condition_kind(name: str) -> str:
    """`static_layer@blocks.0.gate` -> `static_layer`, `interpolate:0.25` -> `interpolate`."""
    return str(name).partition("@")[0].partition(":")[0]


def condition_colour(name: str) -> str:
    return CONDITION_COLOURS.get(condition_kind(name), OTHER_CONDITION)


# Chart text: 14 px (titles 17 px, crowded tick labels no smaller than MIN_TEXT_PX), legible when projected.
TEXT_PX, TITLE_PX, SUBTITLE_PX, MIN_TEXT_PX = 14, 17, 13, 12
TEMPLATE = {
    "layout": {
        "colorway": COLORWAY,
        "hoverlabel": {"align": "left"},
        "font": {"size": TEXT_PX},
        "title": {"font": {"size": TITLE_PX}},
    }
}
# Marks drawn in the colours below are redrawn in each theme's own (`themed`): figures are built for a white
# background, in these, and a dark page swaps them for light ones (dark dividers, whiskers and labels
# vanished on a dark page).
INK = "#222222"  # marks drawn like text: dividers, chance ticks, means, whiskers, token labels (15.9:1 on white)
MUTED = "#595959"  # reference lines and their labels (7.0:1 on white)
BAND_FILL = "rgba(76,120,168,0.2)"  # the calibration band
GAP_FILL = "rgba(76,120,168,0.08)"  # the retention scale's gap between global mean and correct
# The plotly toolbar sits on the figure's top edge; titles stand on their own lines below it (on the
# toolbar's line they were covered by it; a vertical toolbar at the right edge covers colour bars and
# legends instead). Pixels: the toolbar's line, a title line, a one-line horizontal legend.
TOOLBAR_HEIGHT, TITLE_LINE, SUBTITLE_LINE, LEGEND_ROW = 48, 22, 18, 28
LEGEND_CHARS = 56  # characters per legend line below such a chart (smaller type, and the width of the plot)
SHARE = "layer-identity share (%)"  # (of the coefficient variance: short, beside a narrow chart)
COEFFICIENT = "coefficient value (unitless)"
NLL = "NLL (nats / token)"
PENALTY = "penalty vs correct (nats / token)"
DEVIATION = "deviation from static profile (calibration SDs)"


def colorbar(title: str) -> dict:
    """A colour bar whose title, written along it, is wrapped so it never runs past the bar's ends (where
    it would reach the toolbar and the title)."""
    return dict(title=dict(text="<br>".join(textwrap.wrap(title, 26)), side="right"))


def _title_parts(title: str) -> tuple[str, str]:
    """(title, detail): a title's closing parenthesis is its detail, drawn as a subtitle line below it, so
    that the title itself stays on one line in a chart half a 1024 px page wide (wrapped, it took 2-3)."""
    main, _, detail = title.partition(" (")
    return (main, detail[:-1]) if detail.endswith(")") else (title, "")


def _title_height(title: str) -> int:
    """Pixels from the figure's top to below its title (the toolbar's line, the title, its detail, a gap)."""
    return TOOLBAR_HEIGHT + TITLE_LINE + (SUBTITLE_LINE if _title_parts(title)[1] else 0) + 12


def _layout(fig: go.Figure, title: str, height: int = 380, legend_row: int = 0, **kwargs) -> go.Figure:
    """Title on one line, its parenthesised detail on a subtitle line below (`_title_parts`), placed below the
    toolbar's line, above the plot area; `legend_row`: a horizontal legend of that many rows sits between the
    title and the plot."""
    main, detail = _title_parts(title)
    title_height = _title_height(title) + LEGEND_ROW * legend_row
    margin = kwargs.setdefault("margin", dict(l=60, r=20, t=title_height, b=60))
    margin["t"] = max(margin.get("t", 0), title_height)
    title_below_toolbar = dict(
        text=main,
        subtitle=dict(text=detail, font=dict(size=SUBTITLE_PX)),
        x=0.5,
        xanchor="center",
        xref="container",  # the figure's centre: the plot area's is off-centre beside long axis labels
        y=1 - TOOLBAR_HEIGHT / height,
        yanchor="top",
        yref="container",
    )
    if legend_row:
        kwargs["legend"] = dict(
            orientation="h", x=0, xanchor="left", y=1, yanchor="bottom"
        )  # (from the left: the whole width to fill before a row wraps)
    fig.update_layout(template=TEMPLATE, title=title_below_toolbar, height=height, **kwargs)
    return fig


@text_labels
def share_by_site(df: pd.DataFrame | dict, pooled: float | None = None) -> go.Figure:
    """df: site, share (fractions, drawn as percent like every layer-identity share in the app). Bars per
    site, a dashed line at the pooled share, named in the legend (a label on the line sat on the bars)."""
    fig = go.Figure(
        go.Bar(
            x=df["site"],
            y=df["share"],
            name="per site",
            marker_color="#4c78a8",
            hovertemplate="%{x}: %{y:.1%}<extra></extra>",
        )
    )
    if pooled is not None:
        fig.add_hline(y=pooled, line_dash="dash", line_color="#e45756")
        fig.add_trace(  # legend entry only: an hline has none
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                line=dict(dash="dash", color="#e45756"),
                name=f"pooled over all sites: {100 * pooled:.1f}%",
            )
        )
    fig.update_yaxes(title=SHARE, range=[0, 1], tickformat=".0%")
    fig.update_xaxes(title="site (layer)")
    return _layout(
        fig,
        "Layer-identity share per site",
        showlegend=pooled is not None,
        # at the figure's foot, below the turned site names and the axis title: inside the plot it covered
        # the y ticks of a narrow chart, and above it the legend met the title
        legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, xanchor="left", x=0),
        height=420,
        margin=dict(l=60, r=20, b=140),
    )


@text_labels
def factor_bars(df: pd.DataFrame) -> go.Figure:
    """df: factor, share (None allowed: shown as 'n/a'), and optionally chance (the share a factor of that
    many groups takes with no effect; None where it does not apply). Horizontal bars, one per factor, a
    tick at each chance level."""
    shares = np.array([np.nan if v is None else float(v) for v in df["share"]])
    fig = go.Figure(
        go.Bar(
            y=df["factor"],
            x=np.nan_to_num(shares),
            orientation="h",
            marker_color="#72b7b2",
            name="share",
            text=[f"{100 * v:.1f}%" if np.isfinite(v) else "n/a" for v in shares],
            textposition="outside",
            cliponaxis=False,  # the value of a bar near the axis end is written past the plot area
            hovertemplate="%{y}: %{x:.1%}<extra></extra>",
        )
    )
    if "chance" in df and df["chance"].notna().any():
        chance = [None if v is None or v != v else float(v) for v in df["chance"]]  # (None: no tick)
        fig.add_trace(
            go.Scatter(
                y=df["factor"],
                x=chance,
                mode="markers",
                marker=dict(symbol="line-ns-open", size=18, color=INK, line=dict(width=2.5, color=INK)),
                name="chance level",
                hovertemplate="%{y}: %{x:.2%} with no effect (the groups' number alone)<extra></extra>",
            )
        )
        # at the figure's foot, below the axis title (just under the plot, it sat on the title)
        fig.update_layout(legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0, entrywidth=90))
    # in percent, as every share in the app and the report (beside long factor names: a short title)
    fig.update_xaxes(title="share of variance (%)", range=[0, 1.15], tickformat=".0%")
    fig.update_yaxes(title=dict(text="factor", standoff=10), autorange="reversed", automargin=True)
    # right margin: the value written past the longest bar
    # (a 34-character first line, "What explains the variance (shares", ran past a chart at 800 px)
    return _layout(fig, "What explains the variance (shares overlap)", height=420, margin=dict(l=60, r=50, b=100))


def channel_groups(labels: list[str]) -> list[tuple[str, int, int]]:
    """(group, first, last) runs of channel labels sharing the part before the first '.' (attn.0-5 |
    mlp.0-5): where the axis draws its dividers."""
    runs: list[tuple[str, int, int]] = []
    for k, label in enumerate(labels):
        group = str(label).split(".", 1)[0]
        if runs and runs[-1][0] == group:
            runs[-1] = (group, runs[-1][1], k)
        else:
            runs.append((group, k, k))
    return runs


@text_labels
def slot_heatmap(df: pd.DataFrame, value_title: str, title: str, diverging: bool = False) -> go.Figure:
    """df: site, channel (int), value, label. Sites may have different widths (ragged): the missing
    cells are NaN and show blank. The channel axis is labelled by the channel labels where every site
    of that width shares them (attn.0 ... mlp.5), with a divider between label groups. Magnitudes use a
    sequential scale; `diverging` (signed values around 0) a red-blue one centred on 0."""
    sites = list(dict.fromkeys(df["site"]))
    width = int(df["channel"].max()) + 1 if len(df) else 0
    z = np.full((len(sites), width), np.nan)
    text = np.full((len(sites), width), "", dtype=object)
    row = {s: i for i, s in enumerate(sites)}
    r = df["site"].map(row).to_numpy()
    c = df["channel"].to_numpy(dtype=int)
    z[r, c] = df["value"].to_numpy(dtype=float)
    text[r, c] = df["label"].astype(str).to_numpy()
    # One label per column only when the sites agree on it (ragged or differently named sites: index).
    columns = [set(text[:, k]) - {""} for k in range(width)]
    shared = all(len(names) == 1 for names in columns)
    ticks = [next(iter(names)) for names in columns] if shared else [str(k) for k in range(width)]
    scale = dict(colorscale="RdBu_r", zmid=0) if diverging else dict(colorscale="Viridis")
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(width)),
            y=sites,
            customdata=text,
            colorbar=colorbar(value_title),
            hovertemplate="%{y} channel %{x} (%{customdata}): %{z:.4f}<extra></extra>",
            hoverongaps=False,
            **scale,
        )
    )
    groups = channel_groups(ticks) if shared else []
    for _, first, _ in groups[1:]:
        fig.add_vline(x=first - 0.5, line_color=INK, line_width=2)
    fig.update_xaxes(
        # Column numbers, which the ticks' labels (attn.0 ... mlp.5) do not show: the CSV's `channel`.
        title="channel: columns " + " | ".join(f"{g} {a}-{b}" for g, a, b in groups) if len(groups) > 1 else "channel",
        tickmode="array",
        tickvals=list(range(width)),
        ticktext=ticks,
    )
    fig.update_yaxes(title="site (layer)", autorange="reversed")
    return _layout(fig, title, height=max(300, 60 + 28 * len(sites)))


@text_labels
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
    fig.update_layout(coloraxis=dict(colorscale="Viridis", cmin=lo, cmax=hi, colorbar=colorbar(value_title)))
    return _layout(fig, title, height=max(300, 60 + 28 * len(sites)))


@text_labels
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
            marker=dict(symbol="line-ew-open", size=12, color=MUTED),
            name="1% / 99%",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=df["site"],
            y=df["q99"],
            mode="markers",
            marker=dict(symbol="line-ew-open", size=12, color=MUTED),
            showlegend=False,
        )
    )
    fig.update_yaxes(title=COEFFICIENT)
    fig.update_xaxes(title="site (layer)")
    return _layout(fig, "Coefficients per site (box 25-75%, whiskers 5-95%)")


# Upright token labels: one per TOKEN_TICK_PX pixels (a line of TOKEN_TICK_FONT type) along the plot of a
# full-width heatmap on an 800 px screen with the sidebar open (TOKEN_PLOT_PX: 218 px measured, beside the
# site names and the colour bar), the narrowest it is read on; where the tokens are more than that holds,
# every k-th is labelled (every one of 32 ran together there) and the hover names each.
TOKEN_TICK_FONT, TOKEN_TICK_PX, TOKEN_PLOT_PX = 13, 17, 210
SLOT_ROWS_PLOT_PX = 160  # the same beside slot names ("blocks.0.gate/attn.0", wider than a site's): 168 measured


def token_step(count: int, plot_px: int = TOKEN_PLOT_PX) -> int:
    """Every how many tokens one is labelled so that the labels fit `plot_px`: 1 (all) where they do."""
    return max(1, -(-count * TOKEN_TICK_PX // plot_px))


def ordinal(n: int) -> str:
    """2 -> "2nd", 3 -> "3rd", 11 -> "11th"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def token_axis(fig: go.Figure, labels: list[str], plot_px: int = TOKEN_PLOT_PX) -> None:
    """The token axis: every `token_step`-th token labelled, upright (its position in the label, so the
    unlabelled ones can be counted), the step said in the axis title."""
    step = token_step(len(labels), plot_px)
    shown = labels[::step]
    fig.update_xaxes(
        title="position: decoded token" + (f" (every {ordinal(step)} labelled; hover for each)" if step > 1 else ""),
        type="category",
        tickmode="array",
        tickvals=shown,
        ticktext=shown,
        tickangle=-90,
        tickfont=dict(size=TOKEN_TICK_FONT),
    )


@text_labels
def token_layer_heatmap(
    z: pd.DataFrame, tokens: list[str], value_title: str, title: str, diverging: bool = False
) -> go.Figure:
    """z: rows = sites, columns = positions. `tokens`: the decoded token at each position (x labels).
    `diverging`: signed values whose neutral is 0 (red-blue, white at 0, symmetric range); otherwise a
    sequential scale (levels and magnitudes such as an SD or an RMS deviation)."""
    positions = [int(c) for c in z.columns]
    labels = [f"{p}:{t}" for p, t in zip(positions, tokens)]
    values = z.to_numpy(dtype=float)
    if diverging:
        bound = float(np.nanmax(np.abs(values))) if values.size and np.isfinite(values).any() else 1.0
        scale = dict(colorscale="RdBu_r", zmid=0, zmin=-bound, zmax=bound)
    else:
        scale = dict(colorscale="Viridis")
    fig = go.Figure(
        go.Heatmap(
            z=values,
            x=labels,
            y=list(z.index),
            colorbar=colorbar(value_title),
            hovertemplate="%{y} @ %{x}: %{z:.4f}<extra></extra>",
            **scale,
        )
    )
    token_axis(fig, labels)
    fig.update_yaxes(title="site (layer)", autorange="reversed")
    return _layout(fig, title, height=max(360, 200 + 28 * len(z.index)), margin=dict(l=60, r=20, t=50, b=110))


@text_labels
def profile_lines(df: pd.DataFrame, token_label: str, band: str = "") -> go.Figure:
    """df: slot (label 'site/channel'), live, static, lo, hi. The chosen token's coefficients against the
    calibration mean and its quantile band (`band`: its name in the legend, e.g. "5-95%"), slot by slot."""
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
            fillcolor=BAND_FILL,
            name=f"calibration band ({band} of tokens)" if band else "calibration band",
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
    # upright: at -60 degrees neighbouring slot names ran into each other at 800 px
    fig.update_xaxes(title="slot (site / channel, in execution order)", type="category", tickangle=-90)
    fig.update_yaxes(title=COEFFICIENT)
    return _layout(
        fig,
        "One token vs the static profile",
        height=480,
        legend_row=3,  # (plotly wraps a row into equal columns: at 1024 px three rows; two ran onto the title)
    )


@text_labels
def deviation_heatmap(z: np.ndarray, slots: list[str], tokens: list[str], title: str, first: int = 0) -> go.Figure:
    """z: [t, C] standardised deviation (live - static) / calibration SD of positions first..first+t-1;
    drawn with slots as rows and positions as columns, so long sequences run along the page. Signed,
    so red-blue centred on 0 (white: the token gets exactly the static profile); a line between sites."""
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
            colorbar=colorbar(DEVIATION + " (0 = white)"),
            hovertemplate="%{x} / %{y}: %{z:.2f} SD<extra></extra>",
        )
    )
    token_axis(fig, labels, SLOT_ROWS_PLOT_PX)
    sites = [str(s).split("/", 1)[0] for s in slots]
    for i in range(1, len(sites)):
        if sites[i] != sites[i - 1]:
            fig.add_hline(y=i - 0.5, line_color=INK, line_width=1)
    fig.update_yaxes(title="slot (site / channel)", autorange="reversed", type="category")
    return _layout(fig, title, height=min(1000, max(400, 200 + 11 * len(slots))), margin=dict(l=60, r=20, t=50, b=110))


@text_labels
def token_strip(df: pd.DataFrame, chosen: int | None = None, max_labels: int = 16) -> go.Figure:
    """df: pos, token, deviation. One point per token; click a point to choose that token. Text labels
    only for the chosen token and the most deviating ones, at least len/max_labels positions apart (all
    labels at once pile up); every token is in the hover."""
    pos = df["pos"].to_numpy()
    dev = np.nan_to_num(df["deviation"].to_numpy(dtype=float), nan=-np.inf)
    gap = max(1, len(pos) // max_labels)
    labelled: list[int] = [] if chosen is None else [i for i, p in enumerate(pos) if p == chosen]
    for i in np.argsort(-dev, kind="stable"):
        if len(labelled) >= max_labels:
            break
        if all(abs(int(pos[i]) - int(pos[j])) >= gap for j in labelled):
            labelled.append(int(i))
    text = ["" for _ in pos]
    tokens = [str(t) for t in df["token"]]
    for i in labelled:
        text[i] = tokens[i]
    colors = ["#e45756" if p == chosen else "#4c78a8" for p in pos]
    fig = go.Figure(
        go.Scatter(
            x=pos,
            y=df["deviation"],
            mode="markers+text",
            text=text,
            textposition="top center",
            marker=dict(size=9, color=colors),
            textfont=dict(size=MIN_TEXT_PX, color=INK),
            customdata=tokens,
            hovertemplate="position %{x} %{customdata}: %{y:.2f} SD<extra></extra>",
            cliponaxis=False,
        )
    )
    fig.update_xaxes(title="position in the sequence (token index)")
    fig.update_yaxes(title="RMS deviation from static profile (SDs)", rangemode="tozero")
    return _layout(fig, "Tokens of the sequence (click one to inspect it)", height=320)


TICK_LINE = 14  # pixels per line of a tick label
TICK_SITES = 3  # a condition's sites listed in its tick label up to this many, else counted
# Beyond this many conditions a kind's name breaks after its "_" or ":" too: in a chart half a 1024 px
# screen wide, four names on one line each ran into each other ("cross_inp|token_shuf|static_la").
TICK_ROOMY = 3
# The plot area's width (pixels) of a chart half a 1024 px page wide and of one the page's whole width:
# what a condition's tick label must share with the others'. Labels whose longest line is wider than its
# share (a sweep's "interpolate:" among eight conditions) are written whole and turned on their side.
HALF_PLOT_PX, FULL_PLOT_PX = 185, 480
TICK_FONT = MIN_TEXT_PX  # pixels: a crowded axis's type, smaller than the rest (four conditions at 800 px ran together)
TICK_CHAR_PX = 6.5  # the width of a tick label's character at that size, on average


def condition_ticks(fig: go.Figure, names, plot_px: int = HALF_PLOT_PX, positions=None) -> int:
    """Label the x axis's conditions on short lines, the sites below the kind (`static_layer` /
    `@blocks.0.gate,` / `blocks.5.gate`; more than TICK_SITES sites counted; the kind itself broken after
    "_" and ":" when more than TICK_ROOMY conditions share the axis), and return the pixels the labels
    take. At full length, names of sites were turned on their side and took most of the chart's height.
    Where even the kinds' short lines are wider than a condition's share of `plot_px`, each label is written
    on one line turned on its side (flat, they overlapped). `positions`: the conditions' x values where the
    axis is numeric (default: the names, a category axis). The hover keeps each condition's whole name."""
    names = list(dict.fromkeys(str(n) for n in names))
    crowded = len(names) > TICK_ROOMY
    texts = []
    for name in names:
        kind, _, sites = name.partition("@")
        if crowded:
            kind = kind.replace("_", "_<br>").replace(":", ":<br>")
        listed = sites.split(",") if sites else []
        if len(listed) > TICK_SITES:
            listed = [f"{len(listed)} sites"]
        texts.append(kind + ("<br>@" + ",<br>".join(listed) if listed else ""))
    # The kinds' lines decide (a sweep's "interpolate:" eight times over overlapped); the sites' lines are
    # narrower than they were at full length, and turned on their side they took most of the chart again.
    widest = max((len(line) for text in texts for line in text.split("<br>@")[0].split("<br>")), default=0)
    turned = bool(names) and widest * TICK_CHAR_PX > plot_px / len(names)
    if turned:
        texts = [text.replace("<br>", "") for text in texts]
    fig.update_xaxes(
        tickmode="array",
        tickvals=list(positions) if positions is not None else names,
        ticktext=texts,
        tickangle=-90 if turned else 0,
        tickfont=dict(size=TICK_FONT) if turned or crowded else None,
    )
    if turned:
        return round(TICK_CHAR_PX * max(len(text) for text in texts)) + 6
    return TICK_LINE * max((t.count("<br>") + 1 for t in texts), default=1)


def _wrap_run_name(name: str) -> str:
    """A run's name (`fca.tables.runs.run_label`) on lines of at most LEGEND_CHARS where it can be broken
    between its conditions and before "n=..., seed ...", never inside one."""
    lines: list[str] = []
    for chunk in re.split(r"(?<= \+) |(?<=,) (?=n=)", name):
        if lines and len(lines[-1]) + 1 + len(chunk) <= LEGEND_CHARS:
            lines[-1] += " " + chunk
        else:
            lines.append(chunk)
    return "<br>".join(lines)


@text_labels
def nll_bars(df: pd.DataFrame, title: str = "NLL per condition") -> go.Figure:
    """df: condition, nll, ci_lo, ci_hi (95% CI of the mean NLL over sequences)."""
    fig = go.Figure(
        go.Bar(
            x=df["condition"],
            y=df["nll"],
            marker_color=[condition_colour(c) for c in df["condition"]],
            error_y=dict(
                type="data", symmetric=False, array=df["ci_hi"] - df["nll"], arrayminus=df["nll"] - df["ci_lo"]
            ),
            hovertemplate="%{x}: %{y:.4f} nats<extra></extra>",
        )
    )
    # The axis spans the values and their intervals, not 0 to the top: the conditions differ by hundredths of a
    # nat on a level of about 3 to 6, and from 0 every bar looked the same. The axis title says where it starts.
    ends = np.concatenate([df["nll"], df["ci_lo"], df["ci_hi"]]).astype(float) if len(df) else np.array([])
    ends = ends[np.isfinite(ends)]  # (one sequence gives no CI: NaN)
    lo, hi = (float(ends.min()), float(ends.max())) if ends.size else (0.0, 1.0)
    pad = 0.15 * (hi - lo) if hi > lo else max(0.05 * abs(hi), 0.01)
    start = lo - pad
    fig.update_yaxes(title=f"{NLL}; axis from {start:.3g}" if start > 0 else NLL, range=[start, hi + pad])
    fig.update_xaxes(title="condition")
    ticks = condition_ticks(fig, df["condition"])
    return _layout(fig, title, height=366 + ticks, margin=dict(l=60, r=20, b=46 + ticks))


def penalty_title(over_documents: bool, prefix: str = "Penalty vs correct") -> str:
    """The penalty chart's title, naming the interval its whiskers draw: over documents where every
    condition has one (`fca.tables.scoring.quoted_interval`), else over sequences."""
    return f"{prefix} (95% paired bootstrap CI {'over documents' if over_documents else 'over sequences'})"


# Saved runs side by side: the bars keep their condition's colour, and each run its own fill pattern.
RUN_PATTERNS = ("", "/", ".", "x", "\\", "+", "-", "|")


@text_labels
def penalty_bars(df: pd.DataFrame | dict, title: str = penalty_title(False)) -> go.Figure:
    """df: condition, penalty, lo, hi; optional `run` column groups bars by saved run (full page wide)."""
    fig = go.Figure()
    groups = df.groupby("run", sort=False) if "run" in df else [("", df)]
    for i, (run, part) in enumerate(groups):
        pattern = RUN_PATTERNS[i % len(RUN_PATTERNS)]
        fig.add_trace(
            go.Bar(
                x=part["condition"],
                y=part["penalty"],
                # a run's whole name, on lines that fit a chart half a page wide (it ran off the edge)
                name=_wrap_run_name(str(run)) or "penalty",
                marker=dict(
                    color=[condition_colour(c) for c in part["condition"]],
                    pattern=dict(shape=pattern, fgcolor=INK, fgopacity=0.6, solidity=0.35) if run else None,
                ),
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=np.subtract(part["hi"], part["penalty"]),
                    arrayminus=np.subtract(part["penalty"], part["lo"]),
                ),
                hovertemplate=("" if not run else f"{run}<br>") + "%{x}: %{y:+.4f} nats<extra></extra>",
            )
        )
    fig.add_hline(y=0, line_color=MUTED)
    fig.update_yaxes(title=PENALTY)
    fig.update_xaxes(title="condition")
    ticks = condition_ticks(fig, df["condition"], plot_px=FULL_PLOT_PX if "run" in df else HALF_PLOT_PX)
    if "run" not in df:
        return _layout(
            fig, title, height=366 + ticks, barmode="group", showlegend=False, margin=dict(l=60, r=20, b=46 + ticks)
        )
    # Runs are named by what they ran, at length: beside the plot their legend left it 90 px wide on a
    # 1024 px screen. Below it (and below the condition labels), one run per row, told by its pattern.
    plot, below_axis = 228, 76 + ticks
    extra_lines = sum(trace.name.count("<br>") for trace in fig.data)
    bottom = below_axis + 10 + LEGEND_ROW * len(fig.data) + TICK_LINE * extra_lines  # pixels
    return _layout(
        fig,
        title,
        height=TOOLBAR_HEIGHT + 2 * TITLE_LINE + 12 + plot + bottom,
        barmode="group",
        showlegend=True,
        legend=dict(orientation="v", yanchor="top", y=-below_axis / plot, x=0),
        margin=dict(l=60, r=20, b=bottom),
    )


@text_labels
def latency_bars(df: pd.DataFrame, batch: Sequence[int] | None = None) -> go.Figure:
    """df: model, ms (median forward time); batch: the timed batch's shape (sequences, tokens), named on
    the axis, since a time per batch means nothing without its batch (a new measurement may use another)."""
    fig = go.Figure(
        go.Bar(
            x=df["model"],
            y=df["ms"],
            marker_color=["#e45756", "#4c78a8"][: len(df)],
            text=[f"{v:.1f} ms" for v in df["ms"]],
            textposition="outside",
        )
    )
    # Short enough to stand beside the plot: "median forward time (ms per batch of 8 x 128 tokens)" ran
    # higher than the plot, up to the chart's title.
    per = f"{batch[0]} x {batch[1]} tokens" if batch is not None and len(batch) == 2 else "batch"
    fig.update_yaxes(title=f"median ms per {per}")
    fig.update_xaxes(title="model")
    return _layout(fig, "Latency vs the Dense twin")


@text_labels
def blocks_bar(df: pd.DataFrame) -> go.Figure:
    """df: block, fraction (tokens processed / tokens in the batch). Worth drawing only when some block
    was skipped (the Execution page says "every block ran for every token" in words otherwise)."""
    fig = go.Figure(
        go.Bar(
            x=df["block"],
            y=df["fraction"],
            marker_color="#54a24b",
            text=[f"{v:.0%}" for v in df["fraction"]],
            textposition="outside",
        )
    )
    fig.update_yaxes(title="fraction of tokens that ran the block", range=[0, 1.1], tickformat=".0%")
    fig.update_xaxes(title="block index", dtick=1)
    return _layout(fig, "Blocks executed per token")


@text_labels
def flops_bar(df: pd.DataFrame) -> go.Figure:
    """df: part, gflops (controllers first). One stacked bar of 100% of the forward's FLOPs, each part's
    share annotated: a controller share under 1% is a sliver, so the numbers are written beside it."""
    total = float(np.sum(df["gflops"])) or 1.0
    colors = ["#e45756", "#bab0ac", *COLORWAY]
    fig = go.Figure()
    for i, (part, value) in enumerate(zip(df["part"], df["gflops"])):
        share = 100 * float(value) / total
        fig.add_trace(
            go.Bar(
                y=["forward"],
                x=[share],
                name=f"{part}: {share:.2f}%<br>({float(value):.4f} GFLOP)",  # (on one line, cut at 800 px)
                orientation="h",
                marker_color=colors[i % len(colors)],
                hovertemplate=f"{part}: {share:.2f}% of the forward, {float(value):.4f} GFLOP<extra></extra>",
            )
        )
    if len(df):
        first = str(df["part"].iloc[0])
        share = 100 * float(df["gflops"].iloc[0]) / total
        fig.add_annotation(
            x=share,
            y="forward",
            text=f"{first}: {share:.2f}%",
            showarrow=True,
            arrowhead=2,
            ax=60,
            ay=-45,
            font=dict(size=13),
        )
    fig.update_xaxes(title="share of one forward's FLOPs (%)", range=[0, 100], ticksuffix="%")
    fig.update_yaxes(title="", showticklabels=False)
    return _layout(
        fig,
        "Where the forward's FLOPs go",
        height=300,
        barmode="stack",
        legend=dict(orientation="h", y=-1.1),  # below the axis title, not over it
        margin=dict(l=20, r=20, t=70, b=150),
    )


REFERENCE_LABEL_PX = 130  # the study chart's right margin: its reference lines' names, "(no layer identity)"
SEED_SYMBOLS = ("circle", "diamond", "square", "triangle-up", "x", "star", "cross", "pentagon")
SEED_GAP, SEED_STEP = 0.12, 0.08  # a seed's distance from its condition's x (the mean's), and between seeds


def seed_offsets(n: int) -> list[float]:
    """x offsets of n seeds from their condition's x, in seed order: the first n // 2 to its left, the rest
    to its right, none at 0 (where the mean stands)."""
    left = n // 2
    return [-(SEED_GAP + SEED_STEP * (left - 1 - j)) for j in range(left)] + [
        SEED_GAP + SEED_STEP * j for j in range(n - left)
    ]


@text_labels
def study_retention(points: pd.DataFrame, summary: pd.DataFrame) -> go.Figure:
    """One point per model (seed) and condition on the gap-retention scale, where 0 is the global mean
    profile and 1 is the correct coefficients; beside them the mean over models with its 95% t interval.
    points: condition, seed (label), retention (None where undefined: left out).
    summary: condition, mean, lo, hi (lo and hi None for a single model)."""
    fig = go.Figure()
    order = list(dict.fromkeys(summary["condition"]))
    where = {c: i for i, c in enumerate(order)}  # a numeric axis, so each seed can stand beside the others
    has_ci = summary["lo"].notna() & summary["hi"].notna()
    mean = summary["mean"].astype(float)
    fig.add_trace(
        go.Scatter(
            x=[where[c] for c in summary["condition"]],
            y=mean,
            customdata=summary["condition"],
            mode="markers",
            name="mean over models (95% t CI)" if has_ci.any() else "mean over models (no interval: one model)",
            marker=dict(symbol="line-ew-open", size=28, color=INK, line=dict(width=3)),
            error_y=dict(
                type="data",
                symmetric=False,
                array=np.where(has_ci, summary["hi"].astype(float) - mean, 0.0),
                arrayminus=np.where(has_ci, mean - summary["lo"].astype(float), 0.0),
                color=INK,
            ),
            hovertemplate="mean %{customdata}: %{y:.1%}<extra></extra>",
            legendrank=2000,  # listed last
        )
    )
    # Seeds of one configuration land close together: at one x they hid each other (seed 0 under the
    # rest), so each seed stands at its own offset, with its own symbol; none at the condition's own x,
    # where the mean's marker and interval bar covered the middle seed. Colour is the condition's, as in
    # every chart, so a seed's legend entry is grey.
    seeds = list(dict.fromkeys(points["seed"]))
    offsets = seed_offsets(len(seeds))
    for i, seed in enumerate(seeds):
        part = points[(points["seed"] == seed) & points["retention"].notna()]
        symbol = SEED_SYMBOLS[i % len(SEED_SYMBOLS)]
        fig.add_trace(
            go.Scatter(
                x=[where[c] + offsets[i] for c in part["condition"]],
                y=part["retention"],
                customdata=part["condition"],
                mode="markers",
                name=f"seed {seed}",
                legendgroup=f"seed {seed}",
                showlegend=False,
                marker=dict(
                    size=10,
                    opacity=0.9,
                    symbol=symbol,
                    color=[condition_colour(c) for c in part["condition"]],
                    line=dict(width=1, color=INK),
                ),
                hovertemplate=f"seed {seed}, " + "%{customdata}: %{y:.1%}<extra></extra>",
            )
        )
    for i, seed in enumerate(seeds):  # the legend's entries
        symbol = SEED_SYMBOLS[i % len(SEED_SYMBOLS)]
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"seed {seed}",
                legendgroup=f"seed {seed}",
                marker=dict(size=10, symbol=symbol, color="#bab0ac", line=dict(width=1, color=INK)),
            )
        )
    # Each reference line named at its right end, beside the plot, level with the line: over a condition in
    # the plot, a label read as that condition's and floated off its line by the label's own height.
    for y, label in ((0.0, "global mean<br>(no layer identity)"), (1.0, "correct<br>(per-token control)")):
        fig.add_hline(y=y, line_dash="dot", line_color=MUTED)
        fig.add_annotation(
            x=1,
            xref="paper",
            xanchor="left",
            xshift=4,
            y=y,
            yanchor="middle",
            align="left",
            text=label,
            showarrow=False,
            font=dict(size=SUBTITLE_PX, color=MUTED),
        )
    lo_paper, hi_paper = paper.STATIC_RETENTION
    fig.add_hrect(y0=lo_paper, y1=hi_paper, fillcolor=PAPER_COLOUR, line_width=0, layer="below")
    fig.add_annotation(
        x=-0.5,
        xanchor="left",
        y=1.0,
        yanchor="bottom",  # above the band and the correct line (whose label hangs below it)
        text=f"the paper's static profiles: {100 * lo_paper:.2f}-{100 * hi_paper:.2f}% ({paper.CITATION})",
        showarrow=False,
        font=dict(size=SUBTITLE_PX, color=PAPER_TEXT),
    )
    values = np.concatenate([points["retention"].dropna().to_numpy(dtype=float), mean.dropna().to_numpy()])
    lo = min(-0.05, float(values.min()) - 0.05) if values.size else -0.05
    hi = max(1.1, float(values.max()) + 0.05) if values.size else 1.1  # (room for the paper's label)
    fig.update_yaxes(title="gap retention (0% = global mean, 100% = correct)", range=[lo, hi], tickformat=".0%")
    ticks = condition_ticks(fig, order, plot_px=FULL_PLOT_PX, positions=range(len(order)))
    fig.update_xaxes(title="condition", range=[-0.5, len(order) - 0.5])
    return _layout(
        fig,
        "Gap retention per model across seeds",
        height=406 + ticks,
        legend=dict(orientation="h", yanchor="top", y=-(70 + ticks) / 260),
        margin=dict(l=60, r=REFERENCE_LABEL_PX, b=100 + ticks),
    )


STORY_MARGIN = dict(l=60, r=50, t=0, b=60)  # t: what the title needs (_layout)
ANCHORS = ("global_mean", "static_layer", "correct")
ANCHOR_TEXT = {
    "global_mean": "global mean (no layer identity)",
    "static_layer": "static profile (layer identity)",
    "correct": "correct (per-token control)",
}


def _story_layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    return _layout(fig, title, height=height, margin=dict(STORY_MARGIN))


def _nll_interval(conditions: dict, name: str) -> tuple[float, float]:
    """The 95% interval of a condition's NLL from its paired penalty CI (over documents where the report
    has it): NLL_correct + [lo, hi]. Paired, so it is the uncertainty of the condition's distance from
    correct (what the scale is about)."""
    lo, hi = quoted_interval(conditions[name])
    row = conditions[name]
    base = conditions["correct"]["nll"] if "correct" in conditions else row["nll"] - row["penalty"]
    return base + lo, base + hi


@text_labels
def retention_scale(conditions: dict, gap_retention: dict | None = None) -> go.Figure:
    """One NLL axis from the global-mean profile through the static profile to correct, every condition
    of a report placed on it (one row each, anchors first) with its 95% paired CI.
    conditions: a report's `conditions` {name: {nll, penalty, penalty_ci95}}; gap_retention: its
    `gap_retention` {name: fraction or None}. Conditions of an interpolation sweep are left out (they
    have their own chart)."""
    retention = gap_retention or {}
    names = [n for n in ANCHORS if n in conditions]
    names += [n for n in conditions if n not in ANCHORS and not n.startswith("interpolate:")]
    fig = go.Figure()
    if "correct" in conditions and "global_mean" in conditions:
        x0, x1 = conditions["correct"]["nll"], conditions["global_mean"]["nll"]
        fig.add_vrect(
            x0=min(x0, x1),
            x1=max(x0, x1),
            fillcolor=GAP_FILL,
            line_width=0,
        )
        # Named above the plot, from the band's left end: inside it, on the global mean's row, the name ran
        # into the global mean's marker at the band's other end on a narrow chart (800 px).
        fig.add_annotation(
            x=min(x0, x1),
            xanchor="left",
            y=1,
            yref="paper",
            yanchor="bottom",
            text="what per-token control is worth",
            showarrow=False,
            font=dict(size=SUBTITLE_PX, color=MUTED),
        )
    paper_band(fig, conditions)
    intervals = {name: _nll_interval(conditions, name) for name in names}
    left = min((lo for lo, _ in intervals.values()), default=0.0)
    right = max((hi for _, hi in intervals.values()), default=1.0)
    for name in names:
        row = conditions[name]
        lo, hi = intervals[name]
        kept = retention.get(name)
        label = "undefined" if kept is None else f"{100 * kept:.1f}% kept"
        label = "" if name in ("correct", "global_mean") else label
        anchor = name in ANCHORS
        fig.add_trace(
            go.Scatter(
                x=[row["nll"]],
                y=[ANCHOR_TEXT.get(name, name)],
                mode="markers+text",
                text=[label],
                # ("1.1% kept" centred on a point at the right end ran past the chart's edge: cut to "1.1% kep")
                textposition="top left" if row["nll"] > left + 0.75 * (right - left) else "top center",
                cliponaxis=False,
                marker=dict(
                    size=13 if anchor else 10, symbol="diamond" if anchor else "circle", color=condition_colour(name)
                ),
                error_x=dict(type="data", symmetric=False, array=[hi - row["nll"]], arrayminus=[row["nll"] - lo]),
                showlegend=False,
                hovertemplate=f"{name}: NLL %{{x:.4f}} nats (95% CI {lo:.4f} to {hi:.4f})"
                + (f"<br>gap retention {label}" if label else "")
                + "<extra></extra>",
            )
        )
    fig.update_xaxes(title="NLL (nats / token; lower is better)")  # the caption below explains the bars
    order = [ANCHOR_TEXT.get(n, n) for n in reversed(names)]
    fig.update_yaxes(title="", type="category", categoryorder="array", categoryarray=order)
    title = "Retention scale (from global mean to correct)"
    return _layout(
        fig,
        title,
        height=max(260, 110 + 45 * len(names)) + BAND_LABEL,
        margin=dict(STORY_MARGIN, t=_title_height(title) + BAND_LABEL),  # room for the band's name
    )


BAND_LABEL = 18  # pixels: the line above the retention scale's plot that names its band
PAPER_COLOUR = "rgba(178,121,162,0.28)"  # the paper's range, in every chart that draws it
PAPER_TEXT = "#7b4a70"  # its label: 7.0:1 on white


def paper_band(fig: go.Figure, conditions: dict) -> None:
    """On an NLL axis (x): where a condition keeping the paper's static-layer retention range would sit, i.e.
    NLL_gm - r * (NLL_gm - NLL_correct) for r in the range; drawn only where this model's gap is positive."""
    if "correct" not in conditions or "global_mean" not in conditions:
        return
    correct, global_mean = conditions["correct"]["nll"], conditions["global_mean"]["nll"]
    if not global_mean > correct:
        return
    x0, x1 = (global_mean - r * (global_mean - correct) for r in paper.STATIC_RETENTION)
    lo, hi = (f"{100 * r:.2f}" for r in paper.STATIC_RETENTION)
    fig.add_vrect(
        x0=min(x0, x1),
        x1=max(x0, x1),
        fillcolor=PAPER_COLOUR,
        line_width=0,
        layer="below",
        name=f"the paper's static profiles ({lo}-{hi}% kept, {paper.CITATION})",
        showlegend=False,
    )
    fig.add_annotation(
        x=max(x0, x1),
        xanchor="left",
        y=0,
        yref="paper",
        yanchor="bottom",
        text=f"paper: {lo}-{hi}%",
        showarrow=False,
        font=dict(size=SUBTITLE_PX, color=PAPER_TEXT),
    )


SWEEP_TITLE = "Interpolation sweep (static profile to own coefficients)"


@text_labels
def sweep_curve(sweep: list[dict], conditions: dict | None = None, title: str = SWEEP_TITLE) -> go.Figure:
    """NLL against alpha for `interpolate:alpha` = alpha * own + (1 - alpha) * static profile, with 95%
    paired CIs. sweep: a report's `interpolation_sweep` [{alpha, nll, penalty, penalty_ci95}];
    conditions: the report's `conditions`, for reference lines at global mean, static profile and correct."""
    rows = sorted(sweep, key=lambda r: r["alpha"])
    x = [r["alpha"] for r in rows]
    y = [r["nll"] for r in rows]
    base = [r["nll"] - r["penalty"] for r in rows]  # NLL_correct, the same for every row
    lo = [b + quoted_interval(r)[0] for b, r in zip(base, rows)]
    hi = [b + quoted_interval(r)[1] for b, r in zip(base, rows)]
    fig = go.Figure(
        go.Scatter(
            x=x,
            y=y,
            mode="lines+markers",
            marker=dict(size=9, color=condition_colour("interpolate")),
            line=dict(color=condition_colour("interpolate")),
            name="interpolate:alpha",
            error_y=dict(type="data", symmetric=False, array=np.subtract(hi, y), arrayminus=np.subtract(y, lo)),
            customdata=np.stack([lo, hi], axis=-1) if rows else None,
            hovertemplate="alpha %{x:g}: NLL %{y:.4f} nats (95% CI %{customdata[0]:.4f} to %{customdata[1]:.4f})"
            "<extra></extra>",
        )
    )
    for name in ANCHORS:
        if conditions and name in conditions:
            fig.add_hline(
                y=conditions[name]["nll"],
                line_dash="dot",
                line_color=MUTED,
                annotation_text=ANCHOR_TEXT[name],
                annotation_position="top right" if name != "correct" else "bottom right",
            )
    fig.update_xaxes(title="alpha (0 = static profile, 1 = own coefficients)", range=[-0.05, 1.05], dtick=0.25)
    fig.update_yaxes(title=NLL)
    return _story_layout(fig, title, height=380)


@text_labels
def routing_by_router(routing: dict, leave_out: Sequence[str] = ()) -> go.Figure:
    """Share of tokens kept on their own top-k experts, per router in execution order, one line per
    condition (Correct, always 100%, and `leave_out` left out), with a dashed line at chance. routing: a
    report's or saved run's `routing` section (`fca.tables.scoring.summarize_routing`)."""
    routers = list(routing["routers"])
    short = [_router_label(name) for name in routers]
    fig = go.Figure()
    for name, row in routing["conditions"].items():
        if name == "correct" or name in leave_out or row["same_experts"] is None:  # (None: it changes no router)
            continue
        fig.add_trace(
            go.Scatter(
                x=short,
                y=row["same_experts_per_router"],
                mode="lines+markers",
                name=name,
                marker=dict(color=condition_colour(name)),
                line=dict(color=condition_colour(name)),
                customdata=routers,
                hovertemplate=f"{name}<br>%{{customdata}}: %{{y:.1%}} of tokens on the same experts<extra></extra>",
            )
        )
    chance = (routing.get("chance") or {}).get("same_experts")
    if chance is not None:
        fig.add_hline(
            y=chance,
            line_dash="dash",
            line_color=MUTED,
            annotation_text="experts drawn at random",
            annotation_position="bottom left",
        )
    fig.update_xaxes(title="router (execution order)")
    fig.update_yaxes(title="tokens on the same experts (share)", range=[0, 1.05], tickformat=".0%")
    # The legend below the plot: a row above it (legend_row) held two or three conditions and wrapped onto
    # the title.
    legend = dict(orientation="h", x=0, xanchor="left", y=-0.3, yanchor="top")
    return _layout(fig, "Routing kept, router by router", height=460, legend=legend, margin=dict(l=60, r=20, b=140))


def _router_label(site: str) -> str:
    """A router's name as an axis label: its layer number where the name has one ("model.layers.3.mlp.gate"
    -> "layer 3"), else the name itself."""
    numbers = [part for part in site.split(".") if part.isdigit()]
    return f"layer {numbers[0]}" if len(numbers) == 1 else site


# Token text: HTML, not a plotly chart, so that the text reads as text (every token legible, in order).
# Sequential scale for magnitudes (white = the lowest value shown), diverging scale centred on 0 for
# deviations (white = equal to the static profile).
_WHITE, _BLUE, _RED = (255, 255, 255), (33, 102, 172), (178, 24, 43)


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b))


def token_colour(value: float, lo: float, hi: float, diverging: bool) -> tuple[tuple[int, int, int], float]:
    """(rgb, strength in [0, 1]) of one value. Sequential: white at `lo`, blue at `hi`. Diverging:
    `hi` is the bound, blue at -hi, white at 0, red at +hi."""
    if not np.isfinite(value):
        return _WHITE, 0.0
    if diverging:
        t = float(np.clip(value / hi, -1.0, 1.0)) if hi > 0 else 0.0
        return _mix(_WHITE, _RED if t > 0 else _BLUE, abs(t)), abs(t)
    t = float(np.clip((value - lo) / (hi - lo), 0.0, 1.0)) if hi > lo else 0.0
    return _mix(_WHITE, _BLUE, t), t


def token_text_html(
    tokens: list[str], values, titles: list[str] | None = None, diverging: bool = False, bound: float | None = None
) -> tuple[str, float, float]:
    """The text as one `<span>` per token (escaped; background = the token's value; `title` = hover text).
    tokens: decoded tokens (`\\n` shown as a line break); values: [T] floats; titles: [T] hover texts.
    Returns (html, lo, hi): the scale's ends (diverging: -bound, +bound, bound = max |value| unless given)."""
    from html import escape

    v = np.asarray(values, dtype=float)
    finite = v[np.isfinite(v)]
    if diverging:
        hi = float(bound) if bound is not None else (float(np.abs(finite).max()) if finite.size else 0.0)
        lo = -hi
    else:
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    spans = []
    for i, (token, value) in enumerate(zip(tokens, v)):
        rgb, strength = token_colour(value, lo, hi, diverging)
        text = escape(token).replace("\\n", "\u21b5<br>")  # decode_tokens shows a newline as the two chars \n
        title = escape(titles[i] if titles else f"{i}: {value:.4f}", quote=True)
        spans.append(
            f'<span title="{title}" style="background:rgb{rgb};color:{"#fff" if strength > 0.6 else "#111"};'
            f'padding:2px 1px;border-radius:3px">{text}</span>'
        )
    body = "".join(spans)
    return f'<div style="white-space:pre-wrap;line-height:2.1;font-size:1.05rem">{body}</div>', lo, hi


def colour_legend_html(lo: float, hi: float, diverging: bool, what: str) -> str:
    """A gradient bar with its ends and what white means."""
    from html import escape

    if diverging:
        gradient = f"rgb{_BLUE}, rgb{_WHITE}, rgb{_RED}"
        ends = f"{lo:+.3g} (below the static profile) | white = 0, equal to the static profile | {hi:+.3g} (above)"
    else:
        gradient = f"rgb{_WHITE}, rgb{_BLUE}"
        ends = f"white = {lo:.3g} (lowest in this sequence) | blue = {hi:.3g} (highest)"
    return (
        f'<div style="font-size:0.85rem">{escape(what)}<div style="height:12px;max-width:420px;border:1px solid #ccc;'
        f'background:linear-gradient(to right, {gradient})"></div>{escape(ends)}</div>'
    )


SLIDE_TEXT = "#1a1a1a"  # 17.4:1 on white
SLIDE_GRID = "#d9d9d9"
CAPTION_ROW = 30  # pixels below the figure for its caption line


def for_slides(fig: go.Figure, caption: str) -> go.Figure:
    """A copy of `fig` for a slide or a paper: white background, near-black text (the dashboard's theme
    does not travel with the file), and `caption` as a line at its foot saying what it shows."""
    out = go.Figure(fig)
    height = (out.layout.height or 450) + CAPTION_ROW
    margin = out.layout.margin
    top = margin.t if margin.t is not None else 80
    bottom = (margin.b if margin.b is not None else 60) + CAPTION_ROW
    left = margin.l if margin.l is not None else 60
    out.update_layout(
        height=height,
        margin=dict(b=bottom),
        paper_bgcolor="white",
        plot_bgcolor="white",
        font=dict(color=SLIDE_TEXT),
    )
    if out.layout.title.text:  # on one line: wrapped for half a 1024 px page, a slide's figure is wider
        out.layout.title.text = out.layout.title.text.replace("<br>", " ")
    out.update_xaxes(gridcolor=SLIDE_GRID, linecolor=SLIDE_TEXT, zerolinecolor=SLIDE_GRID)
    out.update_yaxes(gridcolor=SLIDE_GRID, linecolor=SLIDE_TEXT, zerolinecolor=SLIDE_GRID)
    plot_height = max(1, height - top - bottom)
    out.add_annotation(  # (annotations place by the plot area only: the figure's foot-left in its terms)
        text=caption,
        x=0,
        xref="paper",
        xanchor="left",
        xshift=10 - left,
        y=-(bottom - 6) / plot_height,
        yref="paper",
        yanchor="bottom",
        showarrow=False,
        font=dict(size=12, color=SLIDE_TEXT),
    )
    return out


def for_presenter(fig: go.Figure, size: int) -> go.Figure:
    """A copy of `fig` whose every text (ticks, axis titles, legend, annotations, colour bars) is at least
    `size` px and whose title is on one line (a projected chart is read from far away)."""
    out = go.Figure(fig)
    out.update_layout(font=dict(size=size), legend=dict(font=dict(size=size)))
    if out.layout.title.text:
        out.layout.title.text = out.layout.title.text.replace("<br>", " ")
        out.layout.title.font.size = max(size + 4, out.layout.title.font.size or 0)
        out.layout.title.subtitle.font.size = max(size, out.layout.title.subtitle.font.size or 0)
    out.update_xaxes(tickfont_size=size, title_font_size=size)
    out.update_yaxes(tickfont_size=size, title_font_size=size)
    for note in out.layout.annotations:
        note.font.size = max(size, note.font.size or 0)
    for trace in out.data:
        if "textfont" in trace:
            trace.textfont.size = max(size, trace.textfont.size or 0)
        if "colorbar" in trace:
            trace.colorbar.tickfont.size = size
            trace.colorbar.title.font.size = size
    return out


@dataclass(frozen=True)
class ChartTheme:
    """A page theme's chart colours: the text, the grid, and what each of the figures' light-background colours
    (INK, MUTED, ...) becomes. Charts are transparent: the page's own background is theirs."""

    text: str
    grid: str
    swap: dict = field(default_factory=dict)


FONT = '"Source Sans", "Source Sans Pro", sans-serif'  # the dashboard's own type
THEMES = {
    # Contrast on the dashboard's pages: light #ffffff, dark #171614 (Streamlit's dark theme).
    "light": ChartTheme(text="#1f2430", grid="#e3e5e8"),  # text 15.7:1
    "dark": ChartTheme(
        text="#e6e8eb",  # 14.9:1
        grid="#3a3d42",
        swap={
            INK: "#e6e8eb",
            MUTED: "#a9afb8",  # 8.1:1
            PAPER_TEXT: "#e3b5d9",  # 10.0:1
            PAPER_COLOUR: "rgba(178,121,162,0.42)",
            BAND_FILL: "rgba(114,160,214,0.38)",
            GAP_FILL: "rgba(114,160,214,0.14)",
        },
    ),
}


def themed(fig: go.Figure, theme: str = "light") -> go.Figure:
    """A copy of `fig` drawn for a page in `theme` ("light" or "dark"): transparent over the page, in the
    theme's text, grid and lines, and every colour of `ChartTheme.swap` replaced (on a dark page, the marks
    drawn in INK or MUTED turn light). Error bars without a colour of their own take INK's."""
    chosen = THEMES[theme]
    spec = fig.to_dict()
    for trace in spec.get("data", []):
        for bars in ("error_x", "error_y"):
            if bars in trace and "color" not in trace[bars]:
                trace[bars]["color"] = INK  # (plotly's default, #444, is dark on a dark page)
    _swap_colours(spec, chosen.swap)
    out = go.Figure(spec)
    out.update_layout(
        paper_bgcolor="rgba(0,0,0,0)",
        plot_bgcolor="rgba(0,0,0,0)",
        font=dict(family=FONT, color=chosen.text),
        legend=dict(bgcolor="rgba(0,0,0,0)"),
    )
    # automargin: long tick labels (the retention scale's condition names) widen the margin instead of being cut
    axes = dict(gridcolor=chosen.grid, zerolinecolor=chosen.grid, linecolor=chosen.grid, automargin=True)
    out.update_xaxes(**axes)
    out.update_yaxes(**axes)
    return out


def _swap_colours(value: dict | list, swap: dict) -> None:
    """Replace, in place, every string in `value` (dicts and lists) that is a key of `swap` by its value."""
    if not swap:
        return
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in list(items):
        if isinstance(item, str) and item in swap:
            value[key] = swap[item]
        elif isinstance(item, (dict, list)):
            _swap_colours(item, swap)


@text_labels
def executed_by_condition(rows: list[dict], title: str = "Blocks executed under each condition") -> go.Figure:
    """rows: {model, condition, fraction} (blocks executed / (tokens x blocks) during that condition's replay).
    One group of bars per condition, one bar per model: a model that only rescales runs 100% under every
    condition; one whose router decides runs what the fed decisions say."""
    fig = go.Figure()
    models = list(dict.fromkeys(r["model"] for r in rows))
    for i, model in enumerate(models):
        part = [r for r in rows if r["model"] == model]
        fig.add_trace(
            go.Bar(
                x=[r["condition"] for r in part],
                y=[r["fraction"] for r in part],
                name=str(model),
                marker_color=COLORWAY[i % len(COLORWAY)],
                text=[f"{r['fraction']:.0%}" for r in part],
                textposition="outside",
                hovertemplate="%{x}: %{y:.1%} of the blocks ran<extra>" + html.escape(str(model)) + "</extra>",
            )
        )
    fig.update_yaxes(title="blocks executed (share of tokens x blocks)", range=[0, 1.15], tickformat=".0%")
    fig.update_layout(barmode="group")
    return _layout(fig, title, legend_row=1)
