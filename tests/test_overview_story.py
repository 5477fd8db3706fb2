"""The Overview's one-look story: the retention sentence and scale, the interpolation sweep (pure
functions on hand-made reports, a real tiny audit, the shipped demo), the token-text view, and the
Overview's suggested audit command."""

from __future__ import annotations

import copy
import html
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from app import figures
from fca.tables.audit_report import AuditReport
from fca.tables.report import read_report, render_markdown, retention_sentence
from fca.tables.study import build_study, study_from_files, without_sweep

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "cache" / "demo"
DEMO_JSON = json.loads((DEMO / "audit.json").read_text())
ORIGIN = ("split_seed", "corpus_fingerprint", "documents")


def typed(report: dict) -> AuditReport:
    """A hand-made report (the sections a test is about, in JSON form) completed from the shipped demo's:
    `model`, `cache` and `variance` fields replace the demo's one by one (a cache's origin fields only as
    given), other sections whole; given conditions replace the sweep and retention intervals that name
    the demo's, and rows without an NLL SD have none."""
    data = copy.deepcopy(DEMO_JSON)
    if "conditions" in report:
        for key in ("gap_retention_ci95", "interpolation_sweep"):
            data.pop(key)
        data["gap_retention"] = {}
    for key, value in report.items():
        if key == "cache":
            data[key] = {**{k: v for k, v in data[key].items() if k not in ORIGIN}, **value}
        elif key in ("model", "variance"):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    data["conditions"] = {name: {"nll_sd_over_sequences": None, **row} for name, row in data["conditions"].items()}
    return AuditReport.from_json(data, "hand-made report")


def row(nll: float, penalty: float, lo: float, hi: float) -> dict:
    return {"nll": nll, "penalty": penalty, "penalty_ci95": [lo, hi]}


# correct 3.0, global mean 4.0, static profile 3.58: the static profile keeps (4 - 3.58) / (4 - 3) = 42%.
CONDITIONS = {
    "correct": row(3.0, 0.0, 0.0, 0.0),
    "cross_input": row(3.9, 0.9, 0.85, 0.95),
    "static_layer": row(3.58, 0.58, 0.5, 0.6),
    "global_mean": row(4.0, 1.0, 0.9, 1.1),
    "interpolate:0.5": row(3.2, 0.2, 0.15, 0.25),
}
RETENTION = {"cross_input": 0.1, "static_layer": 0.42, "interpolate:0.5": 0.8}
SWEEP = [
    {"alpha": 1.0, "condition": "interpolate:1", **row(3.0, 0.0, 0.0, 0.0)},
    {"alpha": 0.0, "condition": "interpolate:0", **row(3.58, 0.58, 0.5, 0.6)},
    {"alpha": 0.5, "condition": "interpolate:0.5", **row(3.2, 0.2, 0.15, 0.25)},
]


# ------------------------------------------------------------------ pure: sentence and figures


def test_retention_sentence_in_plain_words():
    text = retention_sentence(typed({"conditions": CONDITIONS, "gap_retention": RETENTION}))
    assert text.startswith("A fixed per-layer profile keeps 42.0% of what per-token control is worth here")
    assert text.endswith("the paper's gated models kept 98.70-99.43% (arXiv:2607.26192).")  # paper.STATIC_RETENTION
    # of another architecture, the paper's range is a reference, not its own yardstick
    for model_type, qualified in (("featuregate", False), ("mixtral", True), ("muddpythia", True)):
        report = {"conditions": CONDITIONS, "gap_retention": RETENTION, "model": {"model_type": model_type}}
        assert ("not a result for this architecture" in retention_sentence(typed(report))) == qualified, model_type
    undefined = retention_sentence(typed({"conditions": CONDITIONS, "gap_retention": {"static_layer": None}}))
    assert "undefined" in undefined and "42%" not in undefined
    assert undefined.startswith("Per-token control is not clearly worth anything here")
    # A global mean significantly better than the own coefficients had read "not clearly worth anything" too.
    better = {**CONDITIONS, "global_mean": row(2.99, -0.0065, -0.0081, -0.005)}
    assert retention_sentence(typed({"conditions": better, "gap_retention": {"static_layer": None}})).startswith(
        "Removing per-token control lowers the NLL here: the global-mean profile scores better than the model's"
    )
    assert "lacks" in retention_sentence(typed({"conditions": {"correct": CONDITIONS["correct"]}, "gap_retention": {}}))
    # Beyond the scale's ends ("keeps 126%" of a tiny model read as nonsense): said in words, CI first.
    for static, retention, said in (
        (
            row(2.9, -0.1, -0.2, 0.05),
            1.26,
            "does as well as per-token control here (gap retention 126.0%; its penalty's CI",
        ),
        (row(2.9, -0.1, -0.2, -0.05), 1.26, "does better than the model's own per-token coefficients here (gap"),
        (row(4.1, 1.1, 1.0, 1.2), -0.1, "does worse here than the global-mean profile (gap retention -10.0%)"),
    ):
        report = {"conditions": {**CONDITIONS, "static_layer": static}, "gap_retention": {"static_layer": retention}}
        assert said in retention_sentence(typed(report))


def test_retention_sentence_at_the_scales_edges():
    """A global-mean CI that reaches 0 from below is "not clearly worth anything", not "lowers the NLL"; a
    retention of exactly 100% or 0% is said as a share, not as beating either end."""
    reaches = {**CONDITIONS, "global_mean": row(2.995, -0.005, -0.01, 0.002)}
    undefined = {"conditions": reaches, "gap_retention": {"static_layer": None}}
    assert retention_sentence(typed(undefined)).startswith("Per-token control is not clearly worth anything here")
    for retention, said in ((1.0, "keeps 100.0% of what"), (0.0, "keeps 0.0% of what")):
        report = {"conditions": CONDITIONS, "gap_retention": {"static_layer": retention}}
        assert retention_sentence(typed(report)).startswith(f"A fixed per-layer profile {said}"), retention


def test_retention_sentence_reads_the_interval_over_documents_and_retentions_own():
    """Where a report has CIs over documents, they decide, not the narrower ones over sequences: a global-mean
    penalty below 0 window by window but not over documents is "not clearly worth anything"; a static
    profile below correct window by window but not over documents does "as well as" per-token control; and
    a negative retention whose own CI reaches 0 is within noise of the global mean."""
    below = {**CONDITIONS, "global_mean": {**row(2.99, -0.01, -0.01, -0.005), "penalty_ci95_documents": [-0.02, 0.01]}}
    report = {"conditions": below, "gap_retention": {"static_layer": None}}
    assert retention_sentence(typed(report)).startswith("Per-token control is not clearly worth anything here")
    beats = {**CONDITIONS, "static_layer": {**row(2.9, -0.1, -0.2, -0.05), "penalty_ci95_documents": [-0.25, 0.05]}}
    report = {"conditions": beats, "gap_retention": {"static_layer": 1.26}}
    assert "does as well as per-token control here (gap retention 126.0%" in retention_sentence(typed(report))
    worse = {
        "conditions": {**CONDITIONS, "static_layer": row(4.1, 1.1, 1.0, 1.2)},
        "gap_retention": {"static_layer": -0.84},
    }
    noisy = {**worse, "gap_retention_ci95": {"static_layer": [-7.49, 0.28]}}
    assert (
        "does no better than the global-mean profile here (gap retention -84.0%, 95% CI -749.0% to 28.0%"
        in retention_sentence(typed(noisy))
    )
    clear = {**worse, "gap_retention_ci95": {"static_layer": [-1.2, -0.5]}}
    assert "does worse here than the global-mean profile (gap retention -84.0%)" in retention_sentence(typed(clear))


def test_each_familys_layer_identity_share_is_given_beside_the_pooled_one():
    from fca.tables.report import family_shares

    assert family_shares(typed({"variance": {"per_family": {"gate": 0.19}}}).variance) is None  # one family: its own
    assert (
        family_shares(typed({"variance": {"per_family": {"router": 0.081, "shared_expert_gate": 0.348}}}).variance)
        == "router 8.1%, shared_expert_gate 34.8%"
    )


def test_the_conditions_and_routing_tables_cell_by_cell():
    """Each column holds its own figure (a swapped bound, another condition's retention, or the overlap in
    the same-experts column would read as plausible numbers)."""
    from fca.tables.report import conditions_table, routing_table

    report = {"conditions": CONDITIONS, "gap_retention": {**RETENTION, "global_mean": 0.0}}
    lines = conditions_table(typed(report))
    assert lines[2:] == [
        "| correct | 3.0000 | +0.0000 | [+0.0000, +0.0000] |  |",
        "| cross_input | 3.9000 | +0.9000 | [+0.8500, +0.9500] | 10.0% |",
        "| static_layer | 3.5800 | +0.5800 | [+0.5000, +0.6000] | 42.0% |",
        "| global_mean | 4.0000 | +1.0000 | [+0.9000, +1.1000] |  |",  # (the scale's ends: no retention)
        "| interpolate:0.5 | 3.2000 | +0.2000 | [+0.1500, +0.2500] | 80.0% |",
    ]
    # With the intervals over documents: a column of their own, and retention's CI beside it.
    wider = {
        name: {**r, "penalty_ci95_documents": [r["penalty_ci95"][0] - 0.01, r["penalty_ci95"][1] + 0.02]}
        for name, r in CONDITIONS.items()
    }
    documents = {**report, "conditions": wider, "gap_retention_ci95": {"cross_input": [-0.05, 0.25]}}
    lines = conditions_table(typed(documents))
    assert "| penalty 95% CI (sequences) | penalty 95% CI (documents) | gap retention [95% CI] |" in lines[0]
    assert (
        lines[3]
        == "| cross_input | 3.9000 | +0.9000 | [+0.8500, +0.9500] | [+0.8400, +0.9700] | 10.0% [-5.0%, 25.0%] |"
    )
    assert lines[4] == "| static_layer | 3.5800 | +0.5800 | [+0.5000, +0.6000] | [+0.4900, +0.6200] | 42.0% |"
    narrow = conditions_table(typed(documents), both_intervals=False)  # the Overview's: the interval to quote only
    assert "| penalty 95% CI (documents) | gap retention [95% CI] |" in narrow[0] and len(narrow[1].split("|")) == 7
    assert narrow[3] == "| cross_input | 3.9000 | +0.9000 | [+0.8400, +0.9700] | 10.0% [-5.0%, 25.0%] |"
    assert conditions_table(typed(report), both_intervals=False) == conditions_table(
        typed(report)
    )  # nothing over documents
    figures = dict(same_experts=0.25, expert_overlap=0.5, weight_kept=0.45)
    per_router = {f"{figure}_per_router": [0.25, 1.0] for figure in figures}  # (not in the table)
    routing = {
        "routers": {"a.0": 2, "a.1": 2},
        "experts": {"a.0": 4, "a.1": 4},
        "chance": {"same_experts": 1 / 6, "expert_overlap": 0.5},
        "conditions": {
            "cross_input": {**figures, "routers_changed": ["a.0", "a.1"], **per_router},
            "cross_input@a.0": {**figures, "weight_kept": None, "routers_changed": ["a.0"], **per_router},
        },
    }
    table = routing_table(typed({"routing": routing}).routing)
    assert table[-2:] == [
        "| cross_input | 25.0% | 50.0% | 45.0% |",
        "| `cross_input@a.0` (1 of 2 routers) | 25.0% | 50.0% | – |",  # (no weights handed: no figure)
    ]
    assert "top-2" in table[1] and "2 routers" in table[1] and "16.7% of tokens and keep 50.0% of them" in table[1]
    assert "read from what each MoE layer's experts were handed" in table[1]
    # A condition on sites that are no router changes no routing: said, with no figures
    nothing = {key: None for key in figures} | {"routers_changed": []} | per_router
    quiet = routing_table(typed({"routing": {**routing, "conditions": {"cross_input@gate.x": nothing}}}).routing)
    assert quiet[-1] == "| `cross_input@gate.x` (no router changed) | – | – | – |"
    assert routing_table(typed({"conditions": CONDITIONS}).routing) == []
    # Routers whose selection could not be observed: one sentence, its names shown as written (not Markdown)
    note = "No routing figure is reported for 1 of 3 routers: which experts ran could not be read (m.2_x: why)."
    partly = routing_table(typed({"routing": {**routing, "not_reported": note}}).routing)
    assert partly[-2:] == ["", note.replace("_", "\\_").replace("(", "\\(").replace(")", "\\)")]
    assert routing_table(
        typed({"routing": {"not_reported": "No routing figure is reported for any router."}}).routing
    ) == [
        "",
        "**Routing.** No routing figure is reported for any router.",
    ]


def test_routing_summary_over_the_routers_a_condition_changes_and_chance_over_all():
    from fca.engine.routing import ROUTING_FIGURES
    from fca.engine.sites import SiteSpec
    from fca.tables.scoring import summarize_routing

    specs = {
        "a": SiteSpec(axes=(("expert", 4),), family="router"),
        "b": SiteSpec(axes=(("expert", 8),), family="router"),
    }
    shuffled = np.array([[0.2, 1.0], [0.4, 1.0], [0.6, 1.0]])  # [n = 3, S = 2]: router b untouched
    per_seq = {
        "correct": {f: np.ones((3, 2)) for f in ROUTING_FIGURES},
        "cross_input@a": dict.fromkeys(ROUTING_FIGURES, shuffled),
    }
    out = summarize_routing({"a": 2, "b": 2}, specs, per_seq)
    assert out["experts"] == {"a": 4, "b": 8}
    assert out["chance"] == {
        "same_experts": pytest.approx((1 / 6 + 1 / 28) / 2),
        "expert_overlap": pytest.approx(0.375),
    }
    row = out["conditions"]["cross_input@a"]
    assert row["routers_changed"] == ["a"] and row["same_experts"] == pytest.approx(0.4)
    assert row["same_experts_per_router"] == pytest.approx([0.4, 1.0])
    assert out["conditions"]["correct"]["routers_changed"] == ["a", "b"] and "not_reported" not in out
    untouched = summarize_routing({"a": 2, "b": 2}, specs, {"cross_input@c": dict.fromkeys(ROUTING_FIGURES, shuffled)})
    row = untouched["conditions"]["cross_input@c"]
    assert row["routers_changed"] == [] and row["same_experts"] is None and row["weight_kept"] is None
    # A router whose experts were handed no weights has no weight_kept (NaN -> null), the others keep theirs.
    unweighted = {**per_seq["cross_input@a"], "weight_kept": np.array([[np.nan, 0.5]] * 3)}
    row = summarize_routing({"a": 2, "b": 2}, specs, {"cross_input": unweighted})["conditions"]["cross_input"]
    assert row["weight_kept"] == 0.5 and row["weight_kept_per_router"] == [None, 0.5]
    # Routers whose selection could not be read: one sentence saying which and why; none observed: only it.
    out = summarize_routing({"a": 2}, specs, {"correct": {f: np.ones((3, 1)) for f in ROUTING_FIGURES}}, {"b": "why"})
    assert out["not_reported"] == (
        "No routing figure is reported for 1 of 2 routers: which experts ran could not be read at the experts (b: why)."
    )
    nothing = summarize_routing({}, specs, {}, {"a": "its family names no experts modules", "b": "its family names "
                                "no experts modules"})  # fmt: skip
    assert nothing == {
        "not_reported": "No routing figure is reported for any router: which experts ran could not be read at the "
        "experts (a, b: its family names no experts modules)."
    }


def test_nll_bars_draw_each_bound_where_it_is():
    """An asymmetric interval: the upper whisker reaches ci_hi, the lower ci_lo, and the axis clears the top."""
    import pandas as pd

    fig = figures.nll_bars(pd.DataFrame({"condition": ["a"], "nll": [3.0], "ci_lo": [2.5], "ci_hi": [3.2]}))
    error = fig.data[0].error_y
    assert list(error.array) == pytest.approx([0.2]) and list(error.arrayminus) == pytest.approx([0.5])
    assert fig.layout.yaxis.range[1] > 3.2


def test_a_cache_stored_below_float32_is_said_to_be_so_in_words_that_fit():
    """Lossless bfloat16 storage (of a bfloat16 model) had been called "reduced precision" like float16's."""
    from fca.tables.report import storage_sentence

    assert storage_sentence("float32") == ""
    assert "the model's own precision: the values it used, bit for bit" in storage_sentence("bfloat16")
    assert storage_sentence("float16") == " **Coefficients were stored in reduced precision (float16).**"


def test_retention_scale_places_every_condition_with_its_ci():
    fig = figures.retention_scale(CONDITIONS, RETENTION)
    by_label = {t.y[0]: t for t in fig.data}
    # anchors by their plain names, other conditions by their own; the sweep's conditions are left out
    assert set(by_label) == {
        "global mean (no layer identity)",
        "static profile (layer identity)",
        "correct (per-token control)",
        "cross_input",
    }
    static = by_label["static profile (layer identity)"]
    assert static.x[0] == 3.58 and static.text[0] == "42.0% kept"
    # CI = NLL_correct + paired penalty CI = [3.5, 3.6] around 3.58
    assert static.error_x.array[0] == pytest.approx(0.02) and static.error_x.arrayminus[0] == pytest.approx(0.08)
    assert by_label["correct (per-token control)"].text[0] == ""
    band = fig.layout.shapes[0]
    assert (band.x0, band.x1) == (3.0, 4.0)
    assert fig.layout.title.text and fig.layout.xaxis.title.text.startswith("NLL")
    # the title stands below the toolbar's line (the browser test checks the drawn layout at 1024 px)
    assert fig.layout.title.yref == "container" and fig.layout.title.y < 1


def test_sweep_curve_sorted_with_cis_and_anchor_lines():
    fig = figures.sweep_curve(SWEEP, CONDITIONS)
    curve = fig.data[0]
    assert list(curve.x) == [0.0, 0.5, 1.0] and list(curve.y) == [3.58, 3.2, 3.0]
    np.testing.assert_allclose(curve.error_y.array, [0.02, 0.05, 0.0], atol=1e-12)
    np.testing.assert_allclose(curve.error_y.arrayminus, [0.08, 0.05, 0.0], atol=1e-12)
    assert sorted(s.y0 for s in fig.layout.shapes) == [3.0, 3.58, 4.0]
    assert "alpha" in fig.layout.xaxis.title.text and "NLL" in fig.layout.yaxis.title.text


def test_what_the_intervals_resample_is_said():
    from fca.tables.report import documents_note, documents_sentence

    assert documents_note(256, None) is None  # a cache that does not record its documents: nothing to say
    assert documents_note(8, 1).startswith("All 8 evaluated windows lie in one document: too few for a CI")
    assert documents_note(32, 4).startswith("All 32 evaluated windows lie in only 4 documents: too few")
    assert documents_note(64, 9).startswith("All 64 evaluated windows lie in only 9 documents: too few")
    run, audit = documents_note(96, 10), documents_note(256, 37, retention_interval=True)
    assert run.startswith("The 96 evaluated windows are consecutive stretches of 10 documents")
    assert audit.endswith("Gap retention's CI resamples documents too.")
    assert "Gap retention" not in run  # (a replay run has no retention interval)
    older = {"sequences": 256, "split": "eval", "split_seed": 0, "corpus_fingerprint": None, "documents": None}  # a
    # corpus cache made before caches recorded their documents
    assert documents_sentence(typed({"cache": older})).startswith("This corpus cache was built before caches recorded")
    assert documents_sentence(typed({"cache": {**older, "split_seed": None}})) is None  # windows from memory
    assert (
        documents_sentence(typed({"cache": {k: v for k, v in older.items() if k not in ORIGIN}})) is None
    )  # a report of the shipped studies' form


def test_the_charts_draw_the_interval_over_documents_where_the_report_has_it():
    """The interval to quote: the retention scale and the sweep draw the CI over documents (wider here) once a
    report carries it, not the one over sequences."""
    wider = {
        name: {**r, "penalty_ci95_documents": [r["penalty_ci95"][0] - 0.1, r["penalty_ci95"][1] + 0.2]}
        for name, r in CONDITIONS.items()
    }
    static = {t.y[0]: t for t in figures.retention_scale(wider, RETENTION).data}["static profile (layer identity)"]
    assert static.error_x.array[0] == pytest.approx(0.22) and static.error_x.arrayminus[0] == pytest.approx(0.18)
    sweep = [{**r, "penalty_ci95_documents": [r["penalty_ci95"][0] - 0.1, r["penalty_ci95"][1] + 0.2]} for r in SWEEP]
    curve = figures.sweep_curve(sweep, wider).data[0]
    np.testing.assert_allclose(curve.error_y.array, [0.22, 0.25, 0.2], atol=1e-12)
    np.testing.assert_allclose(curve.error_y.arrayminus, [0.18, 0.15, 0.1], atol=1e-12)


def test_nll_bars_span_the_differences_and_pooled_label_off_the_bars():
    import pandas as pd

    df = pd.DataFrame({"condition": ["correct", "static"], "nll": [3.4, 3.9], "ci_lo": [3.3, 3.8], "ci_hi": [3.5, 4.0]})
    axis = figures.nll_bars(df).layout.yaxis
    # From 0, a gap of 0.5 nats on a level of 3.4 took an eighth of the axis; here it takes most of it.
    lo, hi = axis.range
    assert 3.1 < lo < 3.3 and 4.0 < hi < 4.2 and (3.9 - 3.4) / (hi - lo) > 0.5
    assert axis.title.text == f"NLL (nats / token); axis from {lo:.3g}"  # said where the axis starts
    one = pd.DataFrame({"condition": ["correct"], "nll": [3.4], "ci_lo": [np.nan], "ci_hi": [np.nan]})
    assert figures.nll_bars(one).layout.yaxis.range[0] < 3.4 < figures.nll_bars(one).layout.yaxis.range[1]
    fig = figures.share_by_site({"site": ["a", "b"], "share": [0.1, 0.3]}, 0.195)
    assert not fig.layout.annotations  # the label sat on a bar; it is a legend entry now
    assert any("19.5%" in (t.name or "") for t in fig.data)  # a percent, as every layer-identity share


def test_token_text_html_escapes_every_token_into_one_span():
    tokens = ["<b>", " a&b", 'say "hi"', "end\\n"]
    html, lo, hi = figures.token_text_html(tokens, [0.0, 1.0, 0.5, np.nan], ["t0 <x>", "t1", "t2", "t3"])
    assert html.count("<span ") == len(tokens) and "<b>" not in html
    assert "&lt;b&gt;" in html and " a&amp;b" in html and "&quot;hi&quot;" in html and "<br>" in html
    assert 'title="t0 &lt;x&gt;"' in html
    assert (lo, hi) == (0.0, 1.0)
    assert "rgb(255, 255, 255)" in html.split("<span ")[1]  # the lowest value is white
    assert figures.token_colour(1.0, 0.0, 1.0, diverging=False)[0] == (33, 102, 172)
    # diverging: white at 0, symmetric bound
    html, lo, hi = figures.token_text_html(["a", "b"], [-0.5, 0.25], diverging=True)
    assert (lo, hi) == (-0.5, 0.5)
    assert figures.token_colour(0.0, lo, hi, diverging=True)[0] == (255, 255, 255)
    assert figures.token_colour(0.5, lo, hi, diverging=True)[0] == (178, 24, 43)
    legend = figures.colour_legend_html(lo, hi, True, "deviation")
    assert "white = 0, equal to the static profile" in legend
    assert "white = 0.1 (lowest" in figures.colour_legend_html(0.1, 0.9, False, "coefficient")


# ------------------------------------------------------------------ the sweep in real audits


@pytest.mark.slow
def test_sweep_section_in_a_tiny_audit(tiny_demo):
    from fca.jobs.audit import run_audit

    report = run_audit(
        tiny_demo / "featuregate", tiny_demo / "eval", tiny_demo / "calibration", device="cpu", sweep=(1, 0, 0.5)
    )
    sweep = report.sweep
    assert [r.alpha for r in sweep] == [0.0, 0.5, 1.0]
    assert [r.condition for r in sweep] == ["interpolate:0", "interpolate:0.5", "interpolate:1"]
    c = report.conditions
    for r in sweep:
        assert (r.nll, r.penalty_ci95) == (c[r.condition].nll, c[r.condition].penalty_ci95)
        # (over documents only from 5 documents or more: the tiny demo has fewer)
        assert r.penalty_ci95_documents == c[r.condition].penalty_ci95_documents
    # the ends are the static profile and the own coefficients
    assert sweep[0].nll == pytest.approx(c["static_layer"].nll, abs=1e-6)
    assert sweep[-1].nll == pytest.approx(c["correct"].nll, abs=1e-9)
    assert "interpolate:0.5" in report.definitions["condition_specs"]
    text = render_markdown(report)
    assert "### Interpolation sweep" in text and "| 0.5 |" in text and retention_sentence(report) in text
    # a study leaves the sweep out, so it stays comparable with audits made without one
    stripped = without_sweep(report)
    assert set(stripped.conditions) == {"correct", "cross_input", "token_shuffle", "static_layer", "global_mean"}
    assert "interpolate:0.5" not in stripped.definitions["condition_specs"]

    other = replace(stripped, model=replace(stripped.model, fingerprint="another"))  # an audit made without a sweep
    if other.training is not None:  # (another model: another seed)
        other = replace(other, training={**other.training, "seed": other.training.get("seed", 0) + 1})
    assert other.interpolation_sweep is None and "interpolation_sweep" not in other.to_json()
    study = build_study([("a", report), ("b", other)])
    assert set(study["summary"]["conditions"]) == set(stripped.conditions)


@pytest.mark.slow
def test_definitions_say_what_was_run(tiny_demo):
    """No sweep, no sweep definition; conditions beyond the paper's five are defined; every condition is
    named in the Markdown (not an empty line for the specs)."""
    from fca.jobs.audit import run_audit

    extra = ["position_profile", "token_shuffle+independent", "static_layer@blocks.0.gate"]
    report = run_audit(
        tiny_demo / "featuregate", tiny_demo / "eval", tiny_demo / "calibration", device="cpu", sweep=(),
        extra_conditions=extra, latency_runs=1,
    )  # fmt: skip
    definitions = report.definitions
    assert "interpolation_sweep" not in definitions and set(definitions["extra_conditions"]) == set(extra)
    assert "one permutation per sequence and site" in definitions["extra_conditions"]["token_shuffle+independent"]
    assert "at blocks.0.gate only" in definitions["extra_conditions"]["static_layer@blocks.0.gate"]
    text = render_markdown(report)
    assert (
        "**condition_specs**: correct; cross_input; token_shuffle; static_layer; global_mean; position_profile" in text
    )


def test_shipped_markdown_reports_are_what_their_json_renders():
    """Every shipped audit.md is `fca report AUDIT.json` of the audit beside it: a change to the report's
    Markdown regenerates them (README, Multi-seed studies), or they would show what this version does not."""
    shipped = sorted((REPO / "cache").rglob("audit.json"))
    assert len(shipped) == 7  # the demo, the skip demo, and the two studies' five seeds
    for path in shipped:
        assert path.with_suffix(".md").read_text() == render_markdown(read_report(path)), path
    assert "| token id within slot | 67.3% | 3.84% |" in (DEMO / "audit.md").read_text()  # (shares in percent)


def test_shipped_demo_report_has_a_sweep_and_its_study_still_builds():
    report = json.loads((DEMO / "audit.json").read_text())
    sweep = report["interpolation_sweep"]
    assert [r["alpha"] for r in sweep] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert sweep[0]["nll"] == pytest.approx(report["conditions"]["static_layer"]["nll"], abs=1e-6)
    assert sweep[-1]["nll"] == pytest.approx(report["conditions"]["correct"]["nll"], abs=1e-9)
    assert "Interpolation sweep" in (DEMO / "audit.md").read_text()
    study_dir = REPO / "cache" / "demo-study"
    paths = [DEMO / "audit.json", study_dir / "seed1" / "audit.json", study_dir / "seed2" / "audit.json"]
    study = study_from_files(paths, relative_to=study_dir)
    shipped = json.loads((study_dir / "study.json").read_text())
    assert [r["audit"] for r in study["seeds"]] == [r["audit"] for r in shipped["seeds"]]
    assert all(not Path(r["audit"]).is_absolute() for r in shipped["seeds"])
    assert study["summary"]["conditions"] == shipped["summary"]["conditions"]


# ------------------------------------------------------------------ AppTest: Overview and token text


def _app(monkeypatch, roots: list[Path], default: Path):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("FCA_CACHE_ROOTS", ":".join(str(r) for r in roots))
    monkeypatch.setenv("FCA_DEFAULT_CACHE", str(default))
    return AppTest.from_file(str(REPO / "app" / "main.py"), default_timeout=60)


def _chart_titles(at) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def test_the_report_says_when_latency_runs_disagree():
    report = json.loads((DEMO / "audit.json").read_text())
    low, high = report["execution"]["ratio_min"], report["execution"]["ratio_max"]
    assert high / low < 1.25 and f"The runs ranged from {low:.3f}x to {high:.3f}x.\n" in render_markdown(typed(report))
    busy = {**report, "execution": {**report["execution"], "ratio_min": 0.61, "ratio_max": 1.02}}
    assert "ranged from 0.610x to 1.020x: too wide to trust; rerun the audit on an otherwise idle" in render_markdown(
        typed(busy)
    )


def test_overview_tells_the_story_of_the_shipped_demo(monkeypatch):
    at = _app(monkeypatch, [], DEMO / "eval").run()
    assert not at.exception, [e.value for e in at.exception]
    titles = _chart_titles(at)
    assert any(t.startswith("Retention scale") for t in titles)
    assert any(t.startswith("Interpolation sweep") for t in titles)
    report = json.loads((DEMO / "audit.json").read_text())
    assert any(retention_sentence(AuditReport.from_json(report)) in m.value for m in at.markdown)
    assert [m.value for m in at.metric][0].endswith("%")  # short values: the unit is in the label or help
    table = next(m.value for m in at.markdown if m.value.startswith("| condition"))
    assert "ci_lo" not in table and "penalty 95% CI" in table
    assert not any(m.value.strip() == "**condition_specs**" for m in at.markdown)
    specs = next(m.value for m in at.markdown if "`interpolate:0`" in m.value)
    assert "`interpolate:0`: kind interpolate, alpha 0.0, seed 0" in specs  # zeros are values, not absences
    assert not at.warning, [w.value for w in at.warning]  # 256 sequences: no caution about few of them
    # What global_mean used, as the Markdown says it (the page had no such line).
    gate = report["calibration"]["family_grand_means"]["gate"]
    assert f"global_mean gives every coefficient its family's calibration grand mean: gate {gate:.6g}." in [
        c.value for c in at.caption
    ]


def test_a_report_over_few_sequences_says_its_intervals_are_rough(tiny_demo, monkeypatch):
    """Three sequences give a percentile bootstrap 10 distinct means, yet a gap retention was reported as
    defined and quoted like any other: under 10 there is no interval, under 20 it is said to be rough."""
    report = json.loads((DEMO / "audit.json").read_text())
    assert "bootstrap interval" not in render_markdown(typed(report))
    rough = {**report, "cache": {**report["cache"], "sequences": 12}}
    assert "> Only 12 evaluated sequences: the bootstrap intervals over sequences" in render_markdown(typed(rough))
    few = {**report, "cache": {**report["cache"], "sequences": 3}}
    assert "> Only 3 evaluated sequences: too few for a bootstrap interval over sequences" in render_markdown(
        typed(few)
    )
    at = _app(monkeypatch, [tiny_demo], tiny_demo / "eval").run()  # the tiny demo's audit: 8 sequences
    assert not at.exception, [e.value for e in at.exception]
    assert [w.value for w in at.warning if w.value.startswith("Only 8 evaluated sequences: too few")]
    # ... and its penalties have none: the table says so, where it had raised on the null bounds
    assert json.loads((tiny_demo / "audit.json").read_text())["conditions"]["static_layer"]["penalty_ci95"] == [
        None,
        None,
    ]
    assert "none (under 10 sequences)" in (tiny_demo / "audit.md").read_text()


def test_overview_of_a_calibration_cache_points_to_its_evaluated_cache(monkeypatch, tmp_path):
    at = _app(monkeypatch, [], DEMO / "calibration").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.code  # the evaluated cache has a report: no second audit suggested
    assert any("`demo/eval` has an audit report: pick that cache" in w.value for w in at.warning)
    # Without a report beside them, the audit to run, with real paths, writing where it will be found.
    for name in ("featuregate", "eval", "calibration"):
        shutil.copytree(DEMO / name, tmp_path / name)
    at = _app(monkeypatch, [tmp_path], tmp_path / "calibration").run()
    assert not at.exception, [e.value for e in at.exception]
    command = at.code[0].value
    assert "CALIBRATION_CACHE" not in command and "MODEL_DIR" not in command
    assert f"--cache {tmp_path / 'eval'} --calibration {tmp_path / 'calibration'}" in command
    assert f"--json {tmp_path / 'audit.json'}" in command


def test_the_other_pages_of_a_calibration_cache_say_what_it_is(tiny_demo, monkeypatch):
    """A calibration cache is the static profile: the lab points to the evaluated cache it replays, and the
    profile pages use the cache's own mean (they said no calibration cache was found)."""
    at = _app(monkeypatch, [tiny_demo], tiny_demo / "calibration")
    at.switch_page("views/replay_lab.py")
    at.run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    assert "This is a calibration cache" in at.info[0].value and "Pick `eval` in the sidebar" in at.info[0].value
    at.switch_page("views/profiles.py")
    at.run()
    assert not at.exception and not at.warning, [w.value for w in at.warning]
    assert any("the static profile itself" in c.value for c in at.caption)
    at.switch_page("views/token_text.py")
    at.run()
    assert not at.exception and "deviation" in " ".join(at.radio(key="tt_mode").options)


def _page_html(at) -> list[str]:
    """The page's st.html bodies, without the style every page gets from app/main.py."""
    return [h.proto.body for h in at.get("html") if not h.proto.body.startswith("<style>")]


def test_token_text_page_colours_every_token(tiny_demo, monkeypatch):
    at = _app(monkeypatch, [tiny_demo], tiny_demo / "eval")
    at.switch_page("views/token_text.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    legend, text = _page_html(at)
    seq_len = json.loads((tiny_demo / "audit.json").read_text())["cache"]["seq_len"]
    assert text.count("<span ") == seq_len and "white =" in legend
    at.radio(key="tt_mode").set_value("deviation from the static profile").run()
    at.selectbox(key="tt_channel").set_value(1).run()
    assert not at.exception, [e.value for e in at.exception]
    legend, text = _page_html(at)
    assert "equal to the static profile" in legend and "channel attn.1" in legend  # (named as on Variance)
    assert text.count("<span ") == seq_len and "deviation" in text
    # The values themselves: channel 1 of the first site at position 2 of sequence 0, against the calibration
    # cache's mean of that channel (a deviation computed as coefficient + profile passed the checks above).
    from fca.tables.profiles import calibration_profiles
    from fca.tables.store import open_cache

    site = open_cache(tiny_demo / "eval").sites[0]
    value = float(open_cache(tiny_demo / "eval").read_seqs([0])[site][0, 2, 1])
    profile = float(calibration_profiles(open_cache(tiny_demo / "calibration")).static[site][1])
    title = html.unescape(re.search(r'title="(position 2: [^"]*)"', text)[1])
    assert title.endswith(
        f"| coefficient {value:.4f} | static profile {profile:.4f} | deviation {value - profile:+.4f}"
    )


def test_shipped_markdown_reports_are_their_json_rendered():
    """Each committed audit.md is what `fca report` renders from the audit.json beside it."""
    reports = sorted(REPO.glob("cache/*/audit.json")) + sorted(REPO.glob("cache/*/*/audit.json"))
    shipped = [(path, path.with_suffix(".md")) for path in reports if path.with_suffix(".md").is_file()]
    assert len(shipped) >= 6
    for json_path, markdown in shipped:
        assert render_markdown(read_report(json_path)) == markdown.read_text(), markdown
    # A calibration cache of another corpus (allowed: independent by construction) is said to be so.
    report = read_report(DEMO / "audit.json")
    assert ", from " not in render_markdown(report)
    other = replace(report, calibration=replace(report.calibration, corpus="other.txt"))
    assert "(calibration split, 32,768 tokens, from other.txt)" in render_markdown(other)


SWEPT = ["static_layer", "global_mean", "token_shuffle", *(f"interpolate:{a:g}" for a in (0, 0.25, 0.5, 0.75, 1))]


def test_a_sweeps_many_conditions_are_labelled_whole_on_their_side():
    """The lab's charts after a run with a sweep: eight "interpolate:"-long kinds in a chart half a page
    wide overlapped each other even broken after ":"; written whole and turned on their side they do not.
    The same helper labels the full-width compare chart and the study's axis."""
    import pandas as pd

    rows = {"condition": ["correct", *SWEPT], "nll": [3.0] * 9, "ci_lo": [2.9] * 9, "ci_hi": [3.1] * 9}
    for fig in (
        figures.nll_bars(pd.DataFrame(rows)),
        figures.penalty_bars(pd.DataFrame({"condition": SWEPT, "penalty": [0.1] * 8, "lo": [0] * 8, "hi": [0.2] * 8})),
    ):
        axis = fig.layout.xaxis
        assert axis.tickangle == -90 and "<br>" not in "".join(axis.ticktext)
        assert "interpolate:0.25" in axis.ticktext
        assert fig.layout.margin.b >= figures.TICK_CHAR_PX * len("interpolate:0.25")  # room for the longest
    # Four conditions of the Overview fit flat, broken after "_".
    four = {"condition": SWEPT[:3] + ["cross_input"], "penalty": [0.1] * 4, "lo": [0] * 4, "hi": [0.2] * 4}
    axis = figures.penalty_bars(four).layout.xaxis
    assert axis.tickangle == 0 and axis.ticktext[0] == "static_<br>layer"


def test_each_condition_has_one_colour_in_every_chart():
    """A condition's colour is the same in the retention scale, the penalty and NLL bars (the Overview's and
    the lab's, saved runs side by side too), the sweep and the routing chart."""
    import pandas as pd

    colour = figures.condition_colour
    assert len({colour(k) for k in figures.CONDITION_COLOURS}) == len(figures.CONDITION_COLOURS)
    assert colour("static_layer@blocks.0.gate") == colour("static_layer")
    assert colour("interpolate:0.25") == colour("interpolate")
    scale = {t.y[0]: t.marker.color for t in figures.retention_scale(CONDITIONS, RETENTION).data}
    assert scale["static profile (layer identity)"] == colour("static_layer")
    assert scale["cross_input"] == colour("cross_input") != scale["global mean (no layer identity)"]
    perturbed = [c for c in CONDITIONS if c != "correct" and not c.startswith("interpolate:")]
    bars = {
        "condition": perturbed,
        "penalty": [CONDITIONS[c]["penalty"] for c in perturbed],
        "lo": [0.0] * len(perturbed),
        "hi": [1.0] * len(perturbed),
    }
    assert list(figures.penalty_bars(bars).data[0].marker.color) == [colour(c) for c in perturbed]
    runs = pd.DataFrame({**bars, "run": ["a"] * len(perturbed)})
    runs = pd.concat([runs, runs.assign(run="b")])
    first, second = figures.penalty_bars(runs).data
    assert list(first.marker.color) == list(second.marker.color) == [colour(c) for c in perturbed]
    assert first.marker.pattern.shape != second.marker.pattern.shape  # runs told apart by their pattern
    nll = {"condition": list(CONDITIONS), "nll": [1.0] * len(CONDITIONS)}
    nll.update(ci_lo=nll["nll"], ci_hi=nll["nll"])
    assert list(figures.nll_bars(pd.DataFrame(nll)).data[0].marker.color) == [colour(c) for c in CONDITIONS]
    assert figures.sweep_curve(SWEEP, CONDITIONS).data[0].line.color == colour("interpolate")


def test_penalty_title_names_the_interval_drawn_and_latency_its_batch():
    import pandas as pd

    assert figures.penalty_title(True).endswith("(95% paired bootstrap CI over documents)")
    assert figures.penalty_title(False).endswith("(95% paired bootstrap CI over sequences)")
    latency = pd.DataFrame({"model": ["dynamic", "Dense twin"], "ms": [12.0, 11.0]})
    # (short enough to stand beside the plot: the longer title ran up to the chart's title)
    assert figures.latency_bars(latency, [8, 128]).layout.yaxis.title.text == "median ms per 8 x 128 tokens"
    assert figures.latency_bars(latency).layout.yaxis.title.text == "median ms per batch"
