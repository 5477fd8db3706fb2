"""Execution: what the dynamic model actually runs and costs, against its Dense twin."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from app import figures, resources
from app.views.common import chart, download, guard, require_cache, teach
from fca.tables import catalog
from fca.tables.audit_report import Execution
from fca.tables.execution import blocks_of
from fca.tables.report import condition_cell, latency_is_noisy, report_mismatch
from fca.tables.text import markdown_code, markdown_text

MEASURED_KEY = "execution_measured"
# Families whose controllers scale or mix what every block computes (gates, dynamic dense weights): when
# every block runs, nothing at all is skipped. Other models may skip work inside a block.
RESCALING_FAMILIES = ("featuregate", "muddpythia")
PROBE_SEQS = 8  # sequences of the cache in the timing batch (as in `python -m fca audit`)

sel = require_cache()
cache = sel.cache
st.title("Actual execution")
teach(
    "A controller that gates or routes can only save compute if the model actually skips work. This page shows "
    "**blocks executed** per token (counted with forward hooks: 100% means nothing is skipped), the **controller "
    "FLOPs** as a share of the forward, and the **latency** of the dynamic model against its Dense twin (same sizes, "
    "no controller): the median of interleaved timing ratios, where above 1x means the dynamic model is slower."
)

report_exe, report_stale = None, None
if sel.report_path is not None:
    with guard("Audit report"):
        report = resources.report(str(sel.report_path), resources.file_stamp(sel.report_path))
        report_exe = report.execution
        report_stale = {  # as the Overview says it
            "model": "was written for another model than the one that made this cache",
            "cache": "was written before this cache was rebuilt (its fingerprint differs)",
        }.get(report_mismatch(report, cache.manifest.model.fingerprint, cache.fingerprint))

# A measurement belongs to what was measured: this cache, these weights, this device, this Dense twin.
# Keyed so, a switch of cache (or model) shows that selection's report, and switching back shows the
# measurement again.
weights = catalog.weights_path(sel.model_dir) if sel.model_dir is not None else None
measured_key = (
    str(cache.path),
    cache.fingerprint,
    str(sel.model_dir),
    resources.file_stamp(weights) if weights is not None else "",
    sel.device,
    str(sel.dense_dir),
)
left, right = st.columns([2, 1])
with right:
    measure = st.button(
        "Measure now" + ("" if sel.device == "auto" else f" on {sel.device}"),
        key="exec_measure",
        disabled=sel.model_dir is None,
        help=f"times {PROBE_SEQS} sequences of this cache through the model"
        + (
            " and its Dense twin (5 interleaved runs)"
            if sel.dense_dir
            else " (no Dense twin beside it to time against)"
        ),
    )
if measure:
    with guard("Measurement"), st.spinner("Timing the model" + (" and its Dense twin…" if sel.dense_dir else "…")):
        experiment, lock = resources.experiment(sel.model_dir, sel.device, cache, sel.calibration_cache, sel.dense_dir)
        with lock:
            result = Execution.read(experiment.measure_execution(runs=5), "execution")
        st.session_state.setdefault(MEASURED_KEY, {})[measured_key] = result


def show_report() -> None:
    """Back to the audit report's figures: this selection's measurement is forgotten (a callback)."""
    st.session_state.get(MEASURED_KEY, {}).pop(measured_key, None)


measured = st.session_state.get(MEASURED_KEY, {}).get(measured_key)
exe = measured or report_exe
with left:
    st.caption(
        "Source: "
        + (
            f"measured just now in this session (cache {markdown_code(sel.entry.label if sel.entry else cache.path)})"
            if measured
            else "the audit report beside the cache"
            if report_exe
            else "nothing yet"
        )
    )
with right:
    if measured and report_exe:
        st.button("Show the audit report's figures", key="exec_show_report", type="tertiary", on_click=show_report)
if exe is None:
    # (a report that is there but unreadable has had its error shown above: not "no report")
    found = (
        "The audit report beside this cache could not be read."
        if sel.report_path
        else "No audit report describes this cache (one beside it may describe another cache of its folder)."
    )
    st.info(
        f"{found} Press **Measure now** to time the model here."
        if sel.model_dir is not None
        else f"{found} Nor is the model that made it beside it, so nothing can be timed here: open a cache that "
        "sits beside its model's folder, or audit this one with `python -m fca audit --model DIR ...`."
    )
    st.stop()
if not measured and report_stale:
    st.warning(f"The audit report beside the cache {report_stale}; press **Measure now** for figures of this one.")

flops_ratio = exe.flops_ratio_vs_dense  # (none in the released reports of early audits)
c1, c2, c3, *c4 = st.columns(4 if flops_ratio is not None else 3)
timed = exe.latency
ratio = exe.latency_ratio_vs_dense
noisy = timed is not None and latency_is_noisy(timed)
if noisy:
    st.warning(
        f"The timed runs ranged from {timed.ratio_min:.2f}x to {timed.ratio_max:.2f}x: too wide to trust. Other "
        "work shared the machine while they ran (a replay, a build, a second tab); measure again when it is idle."
        + (
            " Their median was " + f"{ratio:.3f}x; the audit report's figures are a click away (above)."
            if measured and report_exe
            else f" Their median was {ratio:.3f}x."
        )
    )
c1.metric(
    "Time vs Dense twin",  # (as on the Overview, where a longer label was cut at 800 px)
    # A figure its own warning calls untrustworthy is not the headline: the median is in the warning.
    "not measured" if ratio is None else "too noisy" if noisy else f"{ratio:.3f}x",
    help=None
    if timed is None
    else f"median {ratio:.3f}x; range over runs {timed.ratio_min:.2f}-{timed.ratio_max:.2f}; "
    f"batch {list(timed.batch_shape)} on {timed.device}",
)
c2.metric(
    "Blocks executed",  # (per token: said in its help; the longer label was cut at 800 px)
    blocks_of(exe.blocks_executed_per_token, exe.num_blocks),
    help="blocks a token runs, on average, of the model's blocks (counted with forward hooks)",
)
c3.metric("Controller FLOPs share", f"{100 * exe.controller_flops_share:.2f}%")
if c4:
    c4[0].metric(
        "FLOPs vs Dense twin",
        f"{flops_ratio:.3f}x",
        help="FLOPs of one forward of the model / its Dense twin's on the same batch"
        + (
            f": {exe.flops_per_token / 1e6:.2f} M against {exe.dense_flops_per_token / 1e6:.2f} M per token"
            if exe.flops_per_token and exe.dense_flops_per_token
            else ""
        ),
    )

fractions = np.asarray(exe.tokens_per_block) / exe.tokens
share = 100 * exe.controller_flops_share
skipped = bool((fractions < 1).any())
experts = exe.experts
blocks = exe.num_blocks
if skipped:
    said = (
        f"**Some blocks were skipped**: a token ran {blocks_of(exe.blocks_executed_per_token, blocks)} "
        "blocks on average (per block below)."
    )
elif experts:  # a router selects experts inside every block: the skipping happens there
    said = (
        f"**Every block ran for every token ({blocks} of {blocks})**; inside them each "
        f"token ran {experts.experts_run_per_token_mean:.2f} of {experts.experts_available:.0f} routed "
        f"experts per MoE layer ({100 * experts.expert_fraction:.1f}%); the others were skipped"
        + ("; a shared expert runs for every token besides." if experts.shared_experts else ".")
    )
elif cache.manifest.model.model_type in RESCALING_FAMILIES:
    said = (
        f"**Every block ran for every token ({blocks} of {blocks})**: nothing is "
        "skipped, so the controllers save no compute; they only rescale what every block computes."
    )
else:  # a model of the user's own: what its controllers do inside a block is not known here
    said = (
        f"**Every block ran for every token ({blocks} of {blocks})**, as counted at "
        "block level. Work a router skips inside a block (experts it does not pick) is counted only when the "
        "model's family names its experts modules (`Family.expert_paths`); this one names none."
    )
st.markdown(said + f" The controllers themselves cost **{share:.2f}%** of the forward's FLOPs.")
if exe.uncounted_ops:
    st.warning(
        f"Not counted: {', '.join(exe.uncounted_ops)} (this torch's FLOP counter has no formula for them), so "
        "their work is missing from the controllers' FLOPs and from the forward's."
    )
charts = st.columns(2)
if timed is not None:
    lat = pd.DataFrame({"model": ["dynamic", "Dense twin"], "ms": [timed.model_ms_median, timed.dense_ms_median]})
    batch = list(timed.batch_shape)  # (sequences, tokens): a time per batch means nothing without it
    chart(figures.latency_bars(lat, batch), key="exec_latency", where=charts[0])
    charts[0].caption(
        "Bars: each model's median time for one forward of "
        + (f"{batch[0]} sequences x {batch[1]} tokens" if batch else "the timed batch")
        + f" on {timed.device} ("
        + ("measured just now" if measured else "as the audit report recorded it")
        + "). The ratio above is the median of per-pair ratios, which is robust to a busy machine; on a noisy one "
        "the two need not agree."
    )
else:
    charts[0].info("No Dense twin was found beside the model, so latency was not compared.")
flops = pd.DataFrame(
    {
        "part": ["controllers", "rest of the model"],
        "gflops": [exe.controller_flops / 1e9, (exe.total_flops - exe.controller_flops) / 1e9],
    }
)
chart(figures.flops_bar(flops), key="exec_flops", where=charts[1])
if skipped:  # six identical bars at 100% say less than the sentence above
    chart(figures.blocks_bar(pd.DataFrame({"block": range(blocks), "fraction": fractions})), key="exec_blocks")
if skipped and (flops_ratio is not None or ratio is not None):
    st.markdown(
        "What skipping saves: "
        + "; ".join(
            part
            for part in (
                f"**{flops_ratio:.3f}x** the Dense twin's FLOPs" if flops_ratio is not None else "",
                f"**{ratio:.3f}x** its time" + (" (noisy, see above)" if noisy else "") if ratio is not None else "",
            )
            if part
        )
        + f" ({blocks_of(exe.blocks_executed_per_token, blocks)} blocks per token)."
    )
if exe.note:
    st.caption(markdown_text(exe.note))  # (the family's own words on what it counts; from a file)
under = exe.conditions or {}  # the audit's tally of what each condition's replay ran
if under:
    st.subheader("What runs under each condition")
    st.caption(
        "Blocks each condition's replay ran, counted at the blocks over every evaluated sequence: the router is "
        "removed and fed the condition's decisions, so what runs follows the coefficients, not the tokens."
        if skipped
        else "Blocks each condition's replay ran, counted at the blocks over every evaluated sequence: a model whose "
        "controllers only rescale runs every block under every condition."
    )
    lines = ["| condition | blocks per token | blocks executed | per block |", "|---|---|---|---|"]
    for name, row in under.items():
        per_block = ", ".join(f"{100 * f:.0f}%" for f in row.per_block_fraction)
        lines.append(
            f"| {condition_cell(name)} | {blocks_of(row.blocks_executed_per_token, blocks)} | "
            f"{100 * row.blocks_executed_fraction:.1f}% | {per_block} |"
        )
    st.markdown("\n".join(lines))
    shown = [n for n in under if not n.startswith("interpolate:")]
    rows = [
        {"model": cache.manifest.model.model_type, "condition": n, "fraction": under[n].blocks_executed_fraction}
        for n in shown
    ]
    chart(figures.executed_by_condition(rows), key="exec_conditions")
if experts:
    if experts.note:
        st.caption(markdown_text(experts.note))  # (the family's words, read from the report)
    st.json(experts.to_json(), expanded=False)
figures_csv = {k: v for k, v in exe.to_json().items() if not isinstance(v, (list, dict))}
download(pd.DataFrame([figures_csv]), "execution.csv")
