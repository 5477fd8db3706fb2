"""Lecture: the audit of the selected cache told in six steps, one full-width chart and a sentence or two
each, for a lecture hall. Next / Previous (or the arrow keys) move between steps; a step whose figure the
cache or its report lacks says so instead of drawing an empty chart.

The steps read what the other pages read (the cache, its audit report, a study that includes that report),
so every figure here is one the Overview, Variance, Execution or Study page shows in detail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import streamlit as st

from app import figures, resources
from app.views.common import (
    Selection,
    figure_caption,
    guard,
    require_cache,
    selection,
    share_text,
    study_retention_frames,
)
from app.views.common import chart as figure_chart
from fca.tables import paper
from fca.tables import study as studies
from fca.tables.audit_report import AuditReport
from fca.tables.execution import blocks_of, compare_audits
from fca.tables.report import retention_sentence

STEP_KEY = "lecture_step"
TOKENS_SHOWN = 32  # positions of the first sequence in step 1: every label legible on a projected chart


def chart(fig, key: str, conditions=None) -> None:
    figure_chart(fig, key, figure_caption(selection(), conditions=conditions))


def no_data(why: str) -> None:
    st.info(f"This step has no figure for this cache: {why}")


def _report(sel: Selection) -> AuditReport | None:
    if sel.report_path is None:
        return None
    report = None
    with guard("Audit report"):
        report = resources.report(str(sel.report_path), resources.file_stamp(sel.report_path))
    return report


NO_REPORT = "it has no audit report (the Overview gives the command that makes one)."


def step_variation(sel: Selection, report: AuditReport | None) -> None:
    cache = sel.cache
    data = resources.sequence(str(cache.path), cache.fingerprint, 0)
    span = slice(0, min(cache.seq_len, TOKENS_SHOWN))
    ids = tuple(int(t) for t in data["token"][span])
    tokens = resources.decode_tokens(str(sel.model_dir) if sel.model_dir else "", ids)
    sites = list(cache.manifest.sites)
    import pandas as pd

    z = pd.DataFrame({site: data[site][span].mean(1) for site in sites}, index=range(span.start, span.stop)).T
    spread = float(np.mean([data[site][span].mean(1).std() for site in sites]))
    st.markdown(
        f"Each cell is one site's coefficients at one token of sequence 0, averaged over its channels. Along a row "
        f"the colour changes from token to token (a typical SD of {spread:.3g} across these tokens): the controller "
        "does give every token its own coefficients."
        + (
            f" Yet which layer and channel a coefficient belongs to explains {share_text(share)} of their variance."
            if report is not None and (share := report.variance.layer_identity_share) is not None
            else ""
        )
    )
    chart(
        figures.token_layer_heatmap(z, tokens, figures.COEFFICIENT, "Sequence 0: mean coefficient per site and token"),
        "lecture_variation",
    )


def step_execution(sel: Selection, report: AuditReport | None) -> None:
    if report is None:
        return no_data(NO_REPORT)
    exe = report.execution
    per_block = exe.tokens_per_block
    ratio = exe.latency_ratio_vs_dense
    if exe.blocks_executed_fraction < 1:  # a router that decides: this model's inference is dynamic
        st.markdown(
            f"This model does skip work: a token ran {blocks_of(exe.blocks_executed_per_token, exe.num_blocks)} "
            "blocks on average, counted at the blocks that ran"
            + (f", {exe.flops_ratio_vs_dense:.3f}x its Dense twin's FLOPs" if exe.flops_ratio_vs_dense else "")
            + (f", and it took {ratio:.3f}x its time" if ratio is not None else "")
            + f" (the paper's models: every block, {paper.LATENCY_VS_DENSE:.3f}x)."
        )
    else:
        st.markdown(
            f"Varying coefficients are not skipped work: each block ran for {100 * exe.blocks_executed_fraction:.0f}% "
            "of the tokens, counted at the blocks that ran"
            + (f", and the model took {ratio:.3f}x its Dense twin's time" if ratio is not None else "")
            + f" (the paper: every block, {paper.LATENCY_VS_DENSE:.3f}x)."
        )
    blocks = {"block": list(range(len(per_block))), "fraction": [n / exe.tokens for n in per_block]}
    import pandas as pd

    chart(figures.blocks_bar(pd.DataFrame(blocks)), "lecture_execution")


def step_replay(sel: Selection, report: AuditReport | None) -> None:
    if report is None:
        return no_data(NO_REPORT)
    cond = report.conditions
    perturbed = [c for c in cond if c != "correct" and not c.startswith("interpolate:")]
    if not perturbed:
        return no_data("its report has no condition besides correct.")
    over_documents = all(cond[c].penalty_ci95_documents is not None for c in perturbed)
    intervals = [cond[c].quoted_interval for c in perturbed]
    bars = {
        "condition": perturbed,
        "penalty": [cond[c].penalty for c in perturbed],
        "lo": [lo for lo, _ in intervals],
        "hi": [hi for _, hi in intervals],
    }
    st.markdown(
        "Now remove the controller and replay the frozen model with each token's coefficients reassigned: another "
        "sequence's (cross_input), the same tokens' shuffled (token_shuffle), a fixed per-layer profile "
        "(static_layer), one number per family (global_mean). Each bar is how many nats per token that costs."
    )
    chart(figures.penalty_bars(bars, figures.penalty_title(over_documents)), "lecture_replay", list(cond))
    if sel.model_dir is not None:
        st.page_link("views/replay_lab.py", label="Run a replay now, in the Replay lab", icon=":material/science:")


def step_static(sel: Selection, report: AuditReport | None) -> None:
    if report is None:
        return no_data(NO_REPORT)
    cond = report.conditions
    if not all(k in cond for k in ("correct", "global_mean", "static_layer")):
        return no_data("its report lacks the correct, static_layer or global_mean condition.")
    st.markdown(retention_sentence(report))
    drawn = report.to_json()["conditions"]  # (the chart is shared with saved runs: their JSON form)
    chart(figures.retention_scale(drawn, report.gap_retention), "lecture_static", list(cond))
    st.caption(paper.citation_sentence() + " Its band: the static-profile retention of its two gated models.")


def step_sweep(sel: Selection, report: AuditReport | None) -> None:
    if report is None:
        return no_data(NO_REPORT)
    if not report.sweep:
        return no_data("its report has no interpolation sweep (`python -m fca audit` adds one by default).")
    st.markdown(
        "Between the static profile (alpha 0) and each token's own coefficients (alpha 1): how much per-token "
        "variation does the model need to get its NLL back?"
    )
    drawn = report.to_json()  # (the chart is shared with saved runs: their JSON form)
    chart(
        figures.sweep_curve(drawn["interpolation_sweep"], drawn["conditions"]), "lecture_sweep", list(report.conditions)
    )


def study_of(sel: Selection) -> tuple[Path, dict] | None:
    """The first study under the roots that includes the selected cache's audit report."""
    if sel.report_path is None:
        return None
    wanted = Path(sel.report_path).resolve()
    for path in studies.find_studies(sel.roots):
        study = None
        with guard("Study"):
            study = resources.study(str(path), resources.file_stamp(path))
        if study and any((path.parent / row["audit"]).resolve() == wanted for row in study["seeds"]):
            return path, study
    return None


def step_seeds(sel: Selection, report: AuditReport | None) -> None:
    found = study_of(sel)
    if found is None:
        return no_data(
            "no study under the configured roots includes this cache's audit (the Study page says how to make one)."
        )
    path, study = found
    points, summary = study_retention_frames(study)
    if summary.empty:
        return no_data(f"the study {path.parent.name} has no gap retention.")
    st.markdown(
        f"Is it this model or this seed? {study['num_models']} models of the same configuration, trained from "
        "different seeds, each placed on the gap-retention scale, with the paper's range beside them."
    )
    seeds = ", ".join(dict.fromkeys(points["seed"]))
    figure_chart(
        figures.study_retention(points, summary),
        "lecture_seeds",
        figure_caption(sel, conditions=list(summary["condition"]), seed=f"{seeds} ({path.parent.name})"),
    )


# The two shipped demos: a controller that only rescales (FeatureGate) and a router that skips blocks.
DEMOS = {"FeatureGate (rescales)": "demo", "Mixture-of-depths (skips)": "demo-skip"}
CACHE_ROOT = Path(__file__).resolve().parents[2] / "cache"


def step_parameters_vs_inference(sel: Selection, report: AuditReport | None) -> None:
    paths = {label: CACHE_ROOT / name / "audit.json" for label, name in DEMOS.items()}
    missing = [str(p.relative_to(CACHE_ROOT.parent)) for p in paths.values() if not p.is_file()]
    if missing:
        return no_data(f"it needs both shipped demos' audits, and {', '.join(missing)} is not there.")
    rows = compare_audits(list(paths.values()), list(paths))
    st.markdown(
        "Dynamic parameters are not dynamic inference. Both models give every token its own coefficients, and "
        "both need them (their penalties); only the one whose router decides which blocks run saves work, and "
        "replayed with other decisions it runs what those decisions say."
    )

    def percent(value) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    def times(value) -> str:
        return "n/a" if value is None else f"{value:.3f}x"

    figures_shown = {
        "1. layer-identity share of the coefficients": lambda r: percent(r["layer_identity_share"]),
        "2. static_layer penalty (nats/token)": lambda r: f"{r['penalty'].get('static_layer', float('nan')):+.4f}",
        "2. static_layer gap retention": lambda r: percent(r["gap_retention_static_layer"]),
        "3. blocks executed per token": lambda r: blocks_of(r["blocks_executed_per_token"], r["num_blocks"]),
        "3. FLOPs vs Dense twin": lambda r: times(r["flops_ratio_vs_dense"]),
        "3. time vs Dense twin": lambda r: times(r["latency_ratio_vs_dense"]),
    }
    lines = ["| figure | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    for name, cell in figures_shown.items():
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in rows) + " |")
    st.markdown("\n".join(lines))
    executed = [
        {"model": r["label"], "condition": c, "fraction": f}
        for r in rows
        for c, f in r["blocks_executed_fraction_under"].items()
    ]
    if executed:
        figure_chart(
            figures.executed_by_condition(executed, "Blocks executed under each condition: rescaling vs skipping"),
            "lecture_parameters_vs_inference",
            "audits cache/demo/audit.json and cache/demo-skip/audit.json | conditions "
            + ", ".join(dict.fromkeys(e["condition"] for e in executed)),
        )
    if lacking := [r["label"] for r in rows if not r["blocks_executed_fraction_under"]]:
        st.caption(
            f"{', '.join(lacking)}: its audit does not record what ran under each condition (an audit made before "
            "audits counted it), so it has no bars here; `python -m fca audit` records it."
        )
    st.caption(
        "Read from the two shipped audits (cache/demo and cache/demo-skip), whatever cache is selected; the Overview "
        "and Execution pages of each give every figure in detail."
    )


STEPS = [
    ("Coefficients vary from token to token", step_variation),
    ("Yet every block runs", step_execution),
    ("Freeze the controller and replay", step_replay),
    ("What the static profile keeps, beside the paper", step_static),
    ("The interpolation sweep", step_sweep),
    ("Seeds", step_seeds),
    ("Parameters vs inference: a controller that rescales beside one that skips", step_parameters_vs_inference),
]


def move(by: int) -> None:
    st.session_state[STEP_KEY] = min(len(STEPS) - 1, max(0, st.session_state.get(STEP_KEY, 0) + by))


sel = require_cache()
step = min(len(STEPS) - 1, max(0, int(st.session_state.get(STEP_KEY, 0))))
st.session_state[STEP_KEY] = step
title, draw = STEPS[step]
report_shown = _report(sel)
if draw is step_execution and report_shown is not None and report_shown.execution.blocks_executed_fraction < 1:
    title = "And some blocks are skipped"  # (a router that decides: the step says what this model does)
st.title(f"{step + 1}. {title}")
with st.container(horizontal=True):
    st.button(
        "Previous",
        key="lecture_previous",
        icon=":material/arrow_back:",
        on_click=move,
        args=(-1,),
        disabled=step == 0,
        shortcut="Left",
    )
    st.button(
        "Next",
        key="lecture_next",
        icon=":material/arrow_forward:",
        on_click=move,
        args=(1,),
        disabled=step == len(STEPS) - 1,
        shortcut="Right",
        type="primary",
    )
    st.caption(f"step {step + 1} of {len(STEPS)} (arrow keys: left, right)")
with guard("This step"):
    draw(sel, report_shown)
