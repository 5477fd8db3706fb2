"""Variance: how much of the coefficients' variation is layer identity, and what explains the rest."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from app import figures, resources
from app.views.common import chart, download, guard, in_range, keep, one_of, require_cache, share_text, teach
from fca.tables.profiles import slot_deviation

# Positions shown at once in the token x layer heatmap: every label stays legible on a 1024 px screen.
WINDOW = 32

sel = require_cache()
cache = sel.cache
st.title("Coefficient variation")
teach(
    "Every coefficient sits in a *slot* (a site, i.e. a layer's controller, and one of its channels). The "
    "**layer-identity share** is the fraction of the coefficients' variance explained by the slot alone: if it "
    "is high, a fixed per-layer profile would reproduce most of what the controller outputs. The factor chart "
    "splits that further and shows how much position, token id and sequence explain *within* a slot "
    "(overlapping shares of the same total, so they need not add up). A grouping explains some variance even "
    "when it has no effect, more the more groups it has (every token id is a group): each within-slot factor's "
    "tick marks that chance level."
)

stats = None
with guard("Cache statistics"):
    stats = resources.cache_stats(str(cache.path), cache.fingerprint)
if stats is None:
    st.stop()

# Each chart with controls is a fragment: its widgets rerun that chart only, not the page and sidebar.
QUANTITIES = {  # shown per slot: colour bar title, column name in slots.csv
    "mean": ("mean coefficient over tokens (unitless)", "mean_coefficient"),
    "standard deviation": ("SD of the coefficient over tokens (unitless)", "sd_coefficient"),
    "layer-identity share": ("layer-identity share of the slot (%)", "layer_identity_share_percent"),
}
CELLS = {  # token x layer cell value: colour bar title, diverging (signed around 0)
    "mean over channels": ("mean coefficient over the site's channels (unitless)", False),
    "SD over channels": ("SD over the site's channels (unitless, >= 0)", False),
    "mean deviation from slot mean (SDs)": ("mean deviation from slot mean, SDs (0 = white)", True),
    "RMS deviation from slot mean (SDs)": ("RMS deviation from slot mean, SDs (>= 0)", False),
}


@st.cache_resource(show_spinner=False, max_entries=8)
def overview_figures(path: str, fingerprint: str) -> dict:
    """The two charts above the sections and their tables, built once per cache: every section opened reruns
    the page, and these do not change with it. (The cached figures are only read: `chart` draws copies.)"""
    dec = resources.cache_stats(path, fingerprint)["decomposition"]
    per_site = pd.DataFrame({"site": list(dec["per_site"]), "share": list(dec["per_site"].values())})
    chance = dec.get("chance_levels", {})
    factors = pd.DataFrame(
        {
            "factor": [k.replace("_", " ") for k in dec["factors"]],
            "share": list(dec["factors"].values()),
            "chance": [chance.get(k) for k in dec["factors"]],
        }
    )
    return {
        "per_site": per_site,
        "factors": factors,
        "share_chart": figures.share_by_site(per_site, dec["layer_identity_share"]),
        "factor_chart": figures.factor_bars(factors),
    }


def overview_charts() -> None:
    dec = stats["decomposition"]
    families = {f: v for f, v in dec["per_family"].items()}
    cols = st.columns(1 + min(len(families), 4))
    cols[0].metric(
        "Layer-identity share (pooled)",
        share_text(dec["layer_identity_share"]),
        help=f"over {dec['num_tokens']:,} tokens of this cache",
    )
    if len(families) > 1:
        for col, (f, v) in zip(cols[1:], families.items()):
            col.metric(f"family {f}", share_text(v))

    built = overview_figures(str(cache.path), cache.fingerprint)
    left, right = st.columns(2)
    with left:
        chart(built["share_chart"], key="var_share")
        download(built["per_site"], "layer_identity_per_site.csv")
    with right:
        chart(built["factor_chart"], key="var_factors")
        download(built["factors"], "variance_factors.csv")


@st.fragment
def slot_section() -> None:
    with guard("Site x channel"):  # inside: a fragment's own rerun bypasses guards around its call
        _slot_section()


def _slot_section() -> None:
    # Site x channel: sites may have different widths (MUDD layer i has C*(i+2) channels, MoE routers
    # one per expert), so the table is long (site, channel) and the figure pads with blanks.
    dec = stats["decomposition"]
    keep("var_quantity", next(iter(QUANTITIES)), one_of(QUANTITIES))
    # Radio buttons, not a select box: a select box's list closes when the page scrolls just as it opens, so
    # the first click on a box below the fold (scrolled into view by that click, or still moving) did nothing.
    quantity = st.radio("Show per slot", list(QUANTITIES), key="var_quantity", horizontal=True)
    color_title, column = QUANTITIES[quantity]
    values = {
        "mean": stats["slot_mean"],
        "standard deviation": stats["slot_sd"],
        # in percent, as every layer-identity share on these pages
        "layer-identity share": 100
        * np.array([np.nan if s is None else s for s in dec["per_slot_share"]], dtype=float),
    }[quantity]
    rows, structured = [], []
    offset = 0
    for site, spec in cache.manifest.sites.items():
        K = spec.num_channels
        labels = spec.channel_names()
        fams = spec.families_per_channel()
        axes = spec.axes
        for k in range(K):
            rows.append(
                {"site": site, "channel": k, "label": labels[k], "family": fams[k], "value": float(values[offset + k])}
            )
            if len(axes) == 2:  # row-major flattening (README, adapters, `axes`): k = a * size_1 + b
                a, b = divmod(k, int(axes[1][1]))
                group = fams[k] if spec.channel_families else f"{axes[0][0]} {a}"
                structured.append({"site": site, "group": group, "index": b, "value": float(values[offset + k])})
        offset += K
    slots = pd.DataFrame(rows)
    view = "flat channels"
    if structured:
        first_axes = next(spec.axes for spec in cache.manifest.sites.values() if len(spec.axes) == 2)
        layouts = ["flat channels", f"one panel per {first_axes[0][0]} (x = {first_axes[1][0]})"]
        keep("var_view", layouts[0], one_of(layouts))
        view = st.selectbox("Layout", layouts, key="var_view")
    if view == "flat channels":
        chart(
            figures.slot_heatmap(slots, color_title, f"{quantity.capitalize()} of each site's channels"),
            key="var_heatmap",
        )
    else:
        chart(
            figures.axis_heatmaps(
                pd.DataFrame(structured), color_title, f"{quantity.capitalize()} per {first_axes[0][0]}"
            ),
            key="var_axes",
        )
    download(slots.rename(columns={"value": column}), "slots.csv", key="dl-slots")


def distributions() -> None:
    quant = resources.site_quantiles(str(cache.path), cache.fingerprint)
    sampled = int(quant["sampled_tokens"].iloc[0])
    over = (
        f"all {sampled:,} tokens of the cache"
        if sampled >= cache.num_seqs * cache.seq_len
        else f"the first {sampled:,} tokens per site (the first sequences of the cache), so that this chart costs "
        "the same on caches of any size"
    )
    st.caption(
        f"Quantiles over {over}. Each box spans the 25-75% quantiles with the median as its line and the mean "
        "dashed; whiskers reach 5% and 95%, ticks 1% and 99%."
    )
    chart(figures.site_distributions(quant), key="var_dist")
    download(quant, "site_distributions.csv")


@st.fragment
def sequence_section() -> None:
    with guard("Sequence view"):
        _sequence_section()


def _sequence_section() -> None:
    st.caption(
        "Each cell summarises one site's coefficients at one token. Vertical stripes mean a token moves every "
        "layer at once; horizontal bands mean a layer behaves the same for every token."
    )
    c1, c2, c3 = st.columns([1, 2, 2])
    keep("var_seq", 0, in_range(0, cache.num_seqs - 1))
    keep("var_summary", next(iter(CELLS)), one_of(CELLS))
    seq = int(c1.number_input("Sequence", 0, cache.num_seqs - 1, key="var_seq", help=f"0 to {cache.num_seqs - 1}"))
    summary = c2.selectbox("Cell value", list(CELLS), key="var_summary")
    color_title, diverging = CELLS[summary]
    T = cache.seq_len
    start = 0
    if T > WINDOW:
        keep("var_window", 0, in_range(0, T - WINDOW))
        start = c3.slider("First position shown", 0, T - WINDOW, step=max(1, WINDOW // 4), key="var_window")
    data = resources.sequence(str(cache.path), cache.fingerprint, seq)
    span = slice(start, min(T, start + WINDOW))
    tokens = resources.decode_tokens(
        str(sel.model_dir) if sel.model_dir else "", tuple(int(t) for t in data["token"][span])
    )
    matrix = {}
    for site in stats["sites"]:
        v = data[site][span]  # [t, K]
        if summary.startswith("mean over"):
            matrix[site] = v.mean(1)
        elif summary.startswith("SD"):
            matrix[site] = v.std(1)
        else:
            slots = stats["site_slots"][site]
            standardised = slot_deviation(v, stats["slot_mean"][slots], stats["slot_sd"][slots])  # [t, K]
            matrix[site] = standardised.mean(1) if diverging else np.sqrt((standardised**2).mean(1))
    z = pd.DataFrame(matrix, index=range(span.start, span.stop)).T
    chart(
        figures.token_layer_heatmap(z, tokens, color_title, f"Sequence {seq}: {summary}", diverging=diverging),
        key="var_tokens",
    )
    out = z.T.reset_index(names="position")
    out.insert(1, "token", tokens)
    download(out, f"sequence_{seq}_token_x_layer.csv", key="dl-sequence")


with guard("Cache statistics"):
    overview_charts()
# Lazy tabs: only the open one runs and is drawn (three charts fewer on a first visit).
SECTIONS = ["Site x channel", "Distributions per site", "One sequence: token x layer"]
keep("var_section", SECTIONS[0], one_of(SECTIONS))  # the open tab, as left (another page forgot it)
slots_tab, distributions_tab, sequence_tab = st.tabs(SECTIONS, key="var_section", on_change="rerun")
if slots_tab.open:
    with slots_tab:
        slot_section()
if distributions_tab.open:
    with distributions_tab, guard("Distributions"):
        distributions()
if sequence_tab.open:
    with sequence_tab:
        sequence_section()
