"""Overview: the audit card of the selected cache (variation, dependence, execution).

The first page a user sees, so it is drawn for a fast first chart. The browser starts loading plotly.js
(4.7 MB, most of the cold start) only when a chart arrives, and the server answers late while the
script is still busy; so the two charts are sent before the metric cards above them are filled (a
container keeps their place), and neither this page nor the sidebar imports pandas (a test checks).
"""

from __future__ import annotations

import json

import streamlit as st

from app import figures, resources
from app.views.common import download, guard, require_cache, teach
from fca.tables.report import exactness_sentences, render_markdown

sel = require_cache()
cache = sel.cache
st.title("Audit card")
teach(
    "An FCA audit asks three questions of a dynamic model. **Variation**: how much of the controller's "
    "coefficients is explained by *which layer and channel* they belong to, rather than by the token? "
    "**Dependence**: with the controllers removed, how much worse (in nats per token) does the model get "
    "when each token's coefficients are replaced by another sequence's, shuffled, or a fixed per-layer "
    "profile? **Execution**: does the dynamic model actually skip work or save time against its Dense twin?"
)

manifest = cache.manifest
report = None
if sel.report_path is not None:
    with guard("Audit report"):
        report = resources.report(str(sel.report_path), resources.file_stamp(sel.report_path))

if report is None:
    st.warning(
        "No audit report beside this cache, so only the variation figures (computed from the cache) are shown. "
        "Make one with the CLI:"
    )
    model = sel.model_dir or "MODEL_DIR"
    cal = sel.calibration.path if sel.calibration else "CALIBRATION_CACHE"
    st.code(
        f"python -m fca audit --model {model} --cache {cache.path} --calibration {cal} "
        f"{'--dense ' + str(sel.dense_dir) + ' ' if sel.dense_dir else ''}--json {cache.path.parent / 'audit.json'} "
        f"--markdown {cache.path.parent / 'audit.md'}",
        language="bash",
    )
    with guard("Cache statistics"):
        stats = resources.cache_stats(str(cache.path), cache.fingerprint)
        dec = stats["decomposition"]
        st.metric("Layer-identity share of variance", f"{100 * (dec['layer_identity_share'] or 0):.1f}%")
        sites = {"site": list(dec["per_site"]), "share": list(dec["per_site"].values())}
        st.plotly_chart(figures.share_by_site(sites, dec["layer_identity_share"]), key="overview_share")
    st.stop()

# Stale or foreign reports are shown, with the mismatch stated (they are still worth reading).
if report["model"]["fingerprint"] != manifest.model.fingerprint:
    st.error(
        f"This report is about model {report['model']['fingerprint'][:12]}, but the cache was made by "
        f"{manifest.model.fingerprint[:12]}: the numbers below do not describe this cache."
    )
elif report["cache"].get("fingerprint") not in (None, cache.fingerprint):
    st.warning(
        "The cache changed since this report was written (its fingerprint differs); rerun `python -m fca audit`."
    )

var, cond, exe, retention = (
    report["variance"],
    report["conditions"],
    report["execution"],
    report.get("gap_retention", {}),
)
rows = [
    {
        "condition": k,
        "nll": v["nll"],
        "penalty": v["penalty"],
        "lo": v["penalty_ci95"][0],
        "hi": v["penalty_ci95"][1],
        "gap_retention": retention.get(k),
    }
    for k, v in cond.items()
]
cards = st.container()  # the three metric cards, filled after the charts below are sent
left, right = st.columns(2)
with left:
    perturbed = [r for r in rows if r["condition"] != "correct"]
    st.plotly_chart(
        figures.penalty_bars({key: [r[key] for r in perturbed] for key in ("condition", "penalty", "lo", "hi")}),
        key="overview_penalty",
    )
with right:
    sites = {"site": list(var["per_site"]), "share": list(var["per_site"].values())}
    st.plotly_chart(figures.share_by_site(sites, var["layer_identity_share"]), key="overview_share")

with cards:
    c1, c2, c3 = st.columns(3)
with c1:
    st.subheader("1. Variation")
    st.metric(
        "Layer identity explains",
        f"{100 * (var['layer_identity_share'] or 0):.1f}% of variance",
        help="SS between slot (site x channel) means / SS total, within each coefficient family",
    )
    st.caption(
        "High: a fixed per-layer profile captures most of what the controller does. Low: coefficients vary "
        "mostly from token to token."
    )
with c2:
    st.subheader("2. Dependence")
    static = cond.get("static_layer", {})
    static_retention = retention.get("static_layer")
    st.metric(
        "Static-layer penalty",
        f"{static.get('penalty', float('nan')):+.4f} nats/token",
        help="NLL(static_layer) - NLL(correct): the cost of replacing every token's coefficients by the calibration mean",
    )
    shown = "undefined" if static_retention is None else f"{100 * static_retention:.1f}%"
    st.caption(
        f"Gap retention of the static profile: **{shown}** of the way from the global mean to correct. "
        "Near 100%: per-token control adds little beyond layer identity."
    )
with c3:
    st.subheader("3. Execution")
    ratio = exe.get("latency_ratio_vs_dense")
    st.metric(
        "Latency vs Dense twin",
        "not measured" if ratio is None else f"{ratio:.2f}x",
        help="median over interleaved runs of forward time (model / Dense twin), same device and batch",
    )
    st.caption(
        f"Blocks executed: {100 * exe['blocks_executed_fraction']:.0f}% per token; controllers take "
        f"{100 * exe['controller_flops_share']:.2f}% of the FLOPs. Below 1x would mean the dynamic model saves time."
    )

# A Markdown table, not st.dataframe: the first page then needs no data-grid bundle in the browser.
st.markdown(
    "| condition | NLL (nats) | penalty | 95% CI | gap retention |\n|---|---|---|---|---|\n"
    + "\n".join(
        f"| {r['condition']} | {r['nll']:.4f} | {r['penalty']:+.4f} | [{r['lo']:+.4f}, {r['hi']:+.4f}] | "
        + ("" if r["gap_retention"] is None else f"{100 * r['gap_retention']:.1f}%")
        + " |"
        for r in rows
    )
)

m, ex = report["model"], report["exactness"]
st.subheader("Model and data")
st.markdown(
    f"- **Model** `{m['name']}` ({m['model_type']}), {m['parameters']:,} parameters, {m['controller_parameters']:,} in controllers; "
    f"fingerprint `{m['fingerprint'][:16]}`\n"
    f"- **Evaluated cache** `{report['cache']['path']}`: {report['cache']['split']} split, {report['cache']['sequences']} x "
    f"{report['cache']['seq_len']} tokens, fingerprint `{str(report['cache'].get('fingerprint'))[:16]}`\n"
    f"- **Calibration cache** `{report['calibration']['path']}`: {report['calibration']['tokens']:,} tokens, fingerprint "
    f"`{str(report['calibration'].get('fingerprint'))[:16]}`\n"
    + (
        f"- **Dense twin** `{report['dense']['name']}`, fingerprint `{report['dense']['fingerprint'][:16]}`\n"
        if report.get("dense")
        else ""
    )
    + "".join(
        f"- **{sentence.split(':', 1)[0]}**:{sentence.split(':', 1)[1]}\n" for sentence in exactness_sentences(ex)
    )
)
with st.expander("What each figure means (the report's definitions)"):
    for key, value in report.get("definitions", {}).items():
        if isinstance(value, dict):
            st.markdown(
                f"**{key}**\n" + "\n".join(f"- `{k}`: {v}" for k, v in value.items() if not isinstance(v, dict))
            )
        else:
            st.markdown(f"**{key}**: {value}")

d1, d2, d3 = st.columns(3)
with d1:
    st.download_button(
        "Audit report (JSON)", json.dumps(report, indent=1), file_name="audit.json", mime="application/json"
    )
with d2:
    with guard("Markdown rendering"):
        st.download_button(
            "Audit report (Markdown)", render_markdown(report), file_name="audit.md", mime="text/markdown"
        )
with d3:
    download(rows, "conditions.csv", "Conditions (CSV)")
