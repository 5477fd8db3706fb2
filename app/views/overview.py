"""Overview: the audit card of the selected cache (variation, dependence, execution).

The first page a user sees, so it is drawn for a fast first chart. The browser starts loading plotly.js
(4.7 MB, most of the cold start) only when a chart arrives, and the server answers late while the
script is still busy; so the two charts are sent before the metric cards above them are filled (a
container keeps their place), and neither this page nor the sidebar imports pandas (a test checks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import streamlit as st

from app import figures, resources
from app.views.common import Selection, download, figure_caption, guard, require_cache, share_text, teach
from app.views.common import chart as figure_chart
from fca.tables import catalog, paper
from fca.tables.report import (
    ReportError,
    conditions_table,
    documents_sentence,
    exactness_sentences,
    family_shares,
    few_sequences_caution,
    global_mean_sentence,
    read_report,
    render_markdown,
    report_mismatch,
    retention_sentence,
    routing_table,
)
from fca.tables.text import mappings_as_words, markdown_code, markdown_text


def chart(fig, key: str) -> None:
    """A chart with its downloads for slides, captioned with the report's conditions (none without one)."""
    conditions = list(report.conditions) if report is not None else None
    figure_chart(fig, key, figure_caption(sel, conditions=conditions))


def shown_path(path: Path) -> str:
    """A path as a user types it in a shell at the repository root: relative when it is below it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else str(path)
    except ValueError:  # another drive (Windows)
        return str(path)


def _readable(report_path: Path) -> bool:
    try:
        read_report(report_path)
    except ReportError:
        return False
    return True


def suggest_audit(sel: Selection) -> tuple[str, str | None]:
    """(explanation, command or None): the audit to run for the selected cache, with real paths from
    the catalog. A calibration cache is the static profile's source, not what is audited: the command
    then audits an evaluated cache of the same model against it."""
    cache = sel.cache
    model = shown_path(sel.model_dir) if sel.model_dir else None
    if sel.is_calibration:
        evaluated = sel.evaluated_caches()
        if not evaluated:
            return (
                "This is a calibration cache: it provides the static profile, and an audit evaluates another "
                "split of the same model. Build an evaluated cache first (`python -m fca build-cache --split eval`).",
                None,
            )
        target, calibration = evaluated[0].path, cache.path
        found = catalog.find_report(target)
        if found is not None and _readable(found):  # (a damaged one: audit again, below)
            return (
                f"This is a calibration cache: it provides the static profile. Its model's evaluated cache "
                f"{markdown_code(evaluated[0].label)} has an audit report: pick that cache in the sidebar to see it.",
                None,
            )
        why = (
            f"This is a calibration cache: it provides the static profile. Its model's evaluated cache is "
            f"{markdown_code(evaluated[0].label)}, not audited yet"
        )
        how = "; to audit it:"
    elif sel.calibration is None:
        return (
            "An audit needs a calibration cache of the same model (an independent split) for the static "
            "profile, and none was found. Build one with `python -m fca build-cache --split calibration`.",
            None,
        )
    else:
        target, calibration = cache.path, sel.calibration.path
        why, how = "No audit report describes this cache yet", ". Make one with the CLI:"
        if sel.report_path is not None:  # there, but unreadable (its error is shown above)
            why = f"Its audit report {markdown_code(shown_path(sel.report_path))} cannot be read"
            how = "; to audit it again, beside it:"
    if model is None:  # (a model held in memory has none: its caches were built from Python)
        return (
            f"{why}. No model directory was found beside the caches, so the command cannot be given here: run "
            f"`python -m fca audit --model DIR` where the model is, or, for a model held in memory, "
            f'`fca.audit(model, ...)` and `write_report(report, "{shown_path(target.parent / "audit.json")}")` '
            "from Python (README: Your own model, audited end to end from Python).",
            None,
        )
    out = catalog.free_report_path(target.parent, target.name)
    dense = f"--dense {shown_path(sel.dense_dir)} " if sel.dense_dir else ""
    command = (
        f"python -m fca audit --model {model} --cache {shown_path(target)} --calibration {shown_path(calibration)} "
        f"{dense}--json {shown_path(out)} --markdown {shown_path(out.with_suffix('.md'))}"
    )
    return why + how, command


def definition_lines(value: dict) -> str:
    """A definitions entry as a Markdown list; nested dicts (the condition specs) as `name`: key value."""
    lines = []
    for k, v in value.items():
        if isinstance(v, dict):
            v = markdown_text(", ".join(f"{kk} {vv}" for kk, vv in v.items() if vv is not None and vv is not False))
        elif isinstance(v, list):
            v = ", ".join(markdown_code(x) for x in v)
        else:
            v = markdown_text(mappings_as_words(str(v)))
        lines.append(f"- {markdown_code(k)}: {v}")
    return "\n".join(lines)


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
    why, command = suggest_audit(sel)
    st.warning(
        ("No readable" if sel.report_path is not None else "No")
        + " audit report for this cache, so only the variation figures (computed from the cache) are shown. "
        + why
    )
    if command:
        st.code(command, language="bash")
    with guard("Cache statistics"):
        stats = resources.cache_stats(str(cache.path), cache.fingerprint)
        dec = stats["decomposition"]
        st.metric(
            "Layer-identity share",
            share_text(dec["layer_identity_share"]),
            help="share of the coefficient variance explained by the site and channel alone",
        )
        sites = {"site": list(dec["per_site"]), "share": list(dec["per_site"].values())}
        chart(figures.share_by_site(sites, dec["layer_identity_share"]), "overview_share")
    st.stop()

# Stale or foreign reports are shown, with the mismatch stated (they are still worth reading).
mismatch = report_mismatch(report, manifest.model.fingerprint, cache.fingerprint)
if mismatch == "model":
    st.error(
        f"This report is about model {markdown_code(report.model.fingerprint[:12])}, but the cache was made by "
        f"{manifest.model.fingerprint[:12]}: the numbers below do not describe this cache."
    )
elif mismatch == "cache":
    st.warning(
        "The cache changed since this report was written (its fingerprint differs); rerun `python -m fca audit`."
    )

var, cond, exe, retention = report.variance, report.conditions, report.execution, report.gap_retention
# The charts are shared with the Replay lab's saved runs, whose sections have the report's JSON form.
drawn = report.to_json()
# Every condition has an interval over documents, or none does: the one quoted_interval, the charts and the
# table then use.
over_documents = all(row.penalty_ci95_documents is not None for row in cond.values())
# Column names say what they hold (the CSV download uses them as they are).
rows = [
    {
        "condition": k,
        "nll_nats": v.nll,
        "penalty_nats": v.penalty,
        "penalty_ci95_low": v.penalty_ci95[0],
        "penalty_ci95_high": v.penalty_ci95[1],
        **(
            {
                "penalty_ci95_documents_low": v.penalty_ci95_documents[0],
                "penalty_ci95_documents_high": v.penalty_ci95_documents[1],
            }
            if v.penalty_ci95_documents is not None
            else {}
        ),
        "gap_retention": retention.get(k),
        **(
            {"gap_retention_ci95_low": ci[0], "gap_retention_ci95_high": ci[1]}
            if (ci := report.retention_interval(k))
            else {}
        ),
    }
    for k, v in cond.items()
]
sweep = report.sweep
cards = st.container()  # the three metric cards, filled after the charts below are sent
st.subheader("The story in one look")
st.markdown(f"**{retention_sentence(report)}**")
chart(figures.retention_scale(drawn["conditions"], retention), "overview_retention")
st.caption(
    "Gap retention = (NLL global mean - NLL condition) / (NLL global mean - NLL correct): 0% is no better than one "
    "number per coefficient family, 100% as good as each token's own coefficients. Bars: 95% paired bootstrap CI "
    "of the penalty vs correct (resampling whole documents where the cache records them), drawn around the "
    "condition's NLL."
)
if sweep:
    chart(figures.sweep_curve(drawn["interpolation_sweep"], drawn["conditions"]), "overview_sweep")
    st.caption(
        "Each point replays alpha x own coefficients + (1 - alpha) x static profile at every site and token. "
        "A curve that falls mostly near alpha = 1 means only the exact per-token values help; one that falls "
        "early means a little per-token variation recovers most of the gap."
    )
else:
    st.caption("This report has no interpolation sweep; `python -m fca audit` adds one (`--sweep 0,0.25,0.5,0.75,1`).")
left, right = st.columns(2)
with left:
    perturbed = [r for r in rows if r["condition"] != "correct" and not r["condition"].startswith("interpolate:")]
    intervals = [cond[r["condition"]].quoted_interval for r in perturbed]  # (over documents where known)
    bars = {"condition": [r["condition"] for r in perturbed], "penalty": [r["penalty_nats"] for r in perturbed]}
    bars.update(lo=[lo for lo, _ in intervals], hi=[hi for _, hi in intervals])
    chart(figures.penalty_bars(bars, figures.penalty_title(over_documents)), "overview_penalty")
with right:
    sites = {"site": list(var.per_site), "share": list(var.per_site.values())}
    chart(figures.share_by_site(sites, var.layer_identity_share), "overview_share")

with cards:
    c1, c2, c3 = st.columns(3)
with c1:
    st.markdown("#### 1. Variation")  # (a subheader wrapped at 1024 px and set its card lower)
    st.metric(
        "Layer-identity share",
        share_text(var.layer_identity_share),
        help="Share of the coefficient variance explained by the site and channel alone: SS between slot "
        "(site x channel) means / SS total, within each coefficient family",
    )
    st.caption(
        "High: a fixed per-layer profile captures most of what the controller does. Low: coefficients vary "
        "mostly from token to token." + (f" Within each family: {each}." if (each := family_shares(var)) else "")
    )
with c2:
    st.markdown("#### 2. Dependence")  # (a subheader wrapped at 1024 px and set its card lower)
    static = cond.get("static_layer")
    static_retention = retention.get("static_layer")
    st.metric(  # the unit in the label: "+0.446 nats" was cut to "+0.446 ..." in a card 800 px screens give
        "Static penalty (nats)",
        f"{static.penalty if static is not None else float('nan'):+.3f}",
        help="Static-profile penalty in nats per token: NLL(static_layer) - NLL(correct), the cost of replacing "
        "every token's coefficients by the calibration mean of its site and channel",
    )
    shown = "undefined" if static_retention is None else f"{100 * static_retention:.1f}%"
    st.caption(
        f"Gap retention of the static profile: **{shown}** of the way from the global mean to correct. "
        "Near 100%: per-token control adds little beyond layer identity."
    )
with c3:
    st.markdown("#### 3. Execution")  # (a subheader wrapped at 1024 px and set its card lower)
    ratio, experts = exe.latency_ratio_vs_dense, exe.experts
    if ratio is None and experts:  # an MoE model: what it skips is experts, and it has no Dense twin here
        st.metric(
            "Experts run per token",
            f"{experts.experts_run_per_token_mean:.2f} of {experts.experts_available:g}",
            help="routed experts each token is dispatched to per MoE layer, counted from the dispatched indices",
        )
        st.caption(
            f"{100 * experts.expert_fraction:.0f}% of the routed experts run per token: the MoE's conditional "
            f"work. Blocks executed: {100 * exe.blocks_executed_fraction:.0f}%; controllers take "
            f"{100 * exe.controller_flops_share:.2f}% of the FLOPs."
        )
    else:
        st.metric(  # (short: "Latency vs Dense twin" was cut in a card 800 px screens give)
            "Time vs Dense twin",
            "n/a" if ratio is None else f"{ratio:.3f}x",
            help="Latency: the median over interleaved runs of forward time (model / Dense twin), same device and batch"
            + (f" ({' x '.join(map(str, exe.latency.batch_shape))} tokens)" if exe.latency else ""),
        )
        st.caption(
            f"Blocks executed: {100 * exe.blocks_executed_fraction:.0f}% per token; controllers take "
            f"{100 * exe.controller_flops_share:.2f}% of the FLOPs. Below 1x would mean the dynamic model saves "
            "time."
        )

# A Markdown table, not st.dataframe: the first page then needs no data-grid bundle in the browser.
# (both intervals would not fit 1024 px; the retention first: at 800 px the NLL is what scrolls out of sight)
st.markdown("\n".join(conditions_table(report, both_intervals=False, retention_first=True)))
if documents := documents_sentence(report):
    # (the table shows the one over documents)
    st.caption(
        documents + (" The report (Markdown and JSON) gives the interval over sequences too." if over_documents else "")
    )
if used := global_mean_sentence(report):
    st.caption(used)
if routing := routing_table(report.routing):  # (a model with routers: how much routing each condition kept, or why not)
    st.markdown("\n".join(routing))
    if report.routing.conditions is not None:  # (none where no router's selection could be observed)
        swept = [row.condition for row in report.sweep]
        chart(figures.routing_by_router(drawn["routing"], leave_out=swept), "overview_routing")  # (sweep: its table)
if caution := few_sequences_caution(report.cache.sequences):
    st.warning(caution)
st.subheader("This model beside the paper")
st.markdown("\n".join(paper.comparison_markdown(report)[2:-2]))  # (the heading above; the citation below)
st.caption(paper.citation_sentence() + " The band on the retention scale marks its static-profile range.")

m, ex, evaluated, calibration, dense = report.model, report.exactness, report.cache, report.calibration, report.dense
st.subheader("Model and data")
c, t = markdown_code, markdown_text  # (the report's strings come from a file: shown as code or text)
st.markdown(
    f"- **Model** {c(m.name)} ({t(m.model_type)}), {m.parameters:,} parameters, "
    f"{m.controller_parameters:,} in controllers; fingerprint {c(m.fingerprint[:16])}\n"
    f"- **Evaluated cache** {c(evaluated.path)}: {t(evaluated.split)} split, "
    f"{evaluated.sequences} x {evaluated.seq_len} tokens, fingerprint {c(str(evaluated.fingerprint)[:16])}\n"
    f"- **Calibration cache** {c(calibration.path)}: {calibration.tokens:,} tokens, "
    f"fingerprint {c(str(calibration.fingerprint)[:16])}\n"
    + (f"- **Dense twin** {c(dense.name)}, fingerprint {c(dense.fingerprint[:16])}\n" if dense else "")
    + "".join(
        f"- **{t(sentence.split(':', 1)[0])}**:{t(sentence.split(':', 1)[1])}\n" for sentence in exactness_sentences(ex)
    )
)
st.caption(
    'The exactness checks as measured when this report was written, on the machine it names as "replayed on" '
    '("now" is that run); a run in the Replay lab measures both again here.'
)
with st.expander("What each figure means (the report's definitions)"):
    for key, value in report.definitions.items():
        if isinstance(value, dict):
            st.markdown(f"**{markdown_text(key.replace('_', ' '))}**\n" + definition_lines(value))
        else:
            st.markdown(f"**{markdown_text(key)}**: {markdown_text(mappings_as_words(str(value)))}")

# One row that wraps: in three columns, "Audit report (Markdown)" was cut at 800 px.
with st.container(horizontal=True):
    st.download_button(
        "Audit report (JSON)", json.dumps(drawn, indent=1), file_name="audit.json", mime="application/json"
    )
    with guard("Markdown rendering"):
        st.download_button(
            "Audit report (Markdown)", render_markdown(report), file_name="audit.md", mime="text/markdown"
        )
    download(rows, "conditions.csv", "Conditions (CSV)")
