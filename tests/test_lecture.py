"""The paper beside the model (fca.tables.paper, the charts' band, the report's table) and the Lecture page."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from app import figures
from app.jobs import QUICK_BATCH
from fca.tables import paper
from fca.tables.audit_report import AuditReport
from fca.tables.report import read_report, render_markdown
from tests.test_app import REPO, app_for, no_exceptions

DEMO = REPO / "cache" / "demo"
LECTURE = "views/lecture.py"


def demo_report() -> AuditReport:
    return read_report(DEMO / "audit.json")


def demo_json() -> dict:
    """The shipped demo's report in its JSON form (the charts take a report's sections so)."""
    return json.loads((DEMO / "audit.json").read_text())


# ------------------------------------------------------------------ the paper's figures beside the model's


def test_comparison_rows_set_the_reports_figures_beside_the_papers():
    report = demo_report()
    rows = {r["figure"]: r for r in paper.comparison_rows(report)}
    static = rows["static-layer gap retention"]
    lo, hi = report.gap_retention_ci95["static_layer"]
    assert static["this_model"] == (
        f"{100 * report.gap_retention['static_layer']:.1f}% (95% CI {100 * lo:.1f}% to {100 * hi:.1f}%)"
    )
    assert static["paper"].startswith("98.70% and 99.43%")
    assert rows["cross_input penalty vs correct"]["this_model"] == (
        f"{report.conditions['cross_input'].penalty:+.4f} nats"
    )
    assert rows["cross_input penalty vs correct"]["paper"] == "MUDDPythia-1.4B: +1.9067 nats"
    assert rows["token_shuffle penalty vs correct"]["paper"] == "MUDDPythia-1.4B: +2.9637 nats"
    assert rows["layer-identity share of the coefficient variance"] == {
        "question": "variation",
        "figure": "layer-identity share of the coefficient variance",
        "this_model": "19.5%",
        "paper": "87-96%",
    }
    assert rows["time vs the Dense twin"]["this_model"] == "1.043x"
    assert rows["time vs the Dense twin"]["paper"] == "1.308x (+30.8%)"
    # A figure the report lacks is said to be missing, never shown as 0.
    lacking = replace(
        report,
        conditions={k: v for k, v in report.conditions.items() if k != "cross_input"},
        gap_retention={k: v for k, v in report.gap_retention.items() if k != "cross_input"},
        execution=replace(report.execution, latency=None),
    )
    rows = {r["figure"]: r for r in paper.comparison_rows(lacking)}
    assert rows["cross_input penalty vs correct"]["this_model"] == "not in this report"
    assert rows["time vs the Dense twin"]["this_model"] == "not measured"


def test_the_markdown_report_cites_the_paper_beside_its_table():
    text = render_markdown(demo_report())
    assert "## This model beside the paper" in text
    assert "| dependence | static-layer gap retention | 42.3% (95% CI 40.4% to 44.0%) | 98.70% and 99.43%" in text
    assert "arXiv:2607.26192" in text
    assert "(arXiv:2607.26192)" in (DEMO / "audit.md").read_text()  # the shipped one, re-rendered


def test_the_retention_scale_draws_the_papers_range_on_its_nll_axis():
    report = demo_json()
    cond = report["conditions"]
    fig = figures.retention_scale(cond, report["gap_retention"])
    band = [s for s in fig.layout.shapes if s.fillcolor == figures.PAPER_COLOUR]
    assert len(band) == 1
    gm, correct = cond["global_mean"]["nll"], cond["correct"]["nll"]
    # Hand-computed: NLL_gm - r * (NLL_gm - NLL_correct) at r = 99.43% and 98.70%.
    assert band[0].x0 == pytest.approx(gm - 0.9943 * (gm - correct))
    assert band[0].x1 == pytest.approx(gm - 0.9870 * (gm - correct))
    assert any("98.70-99.43%" in a.text for a in fig.layout.annotations)
    # No gap (global mean not worse than correct): no place for the paper's range, so no band.
    flat = json.loads(json.dumps(cond))
    flat["global_mean"]["nll"] = flat["correct"]["nll"]
    assert not [s for s in figures.retention_scale(flat, {}).layout.shapes if s.fillcolor == figures.PAPER_COLOUR]


def test_the_study_chart_draws_the_papers_range():
    points = pd.DataFrame({"condition": ["static_layer"] * 2, "seed": ["0", "1"], "retention": [0.41, 0.43]})
    summary = pd.DataFrame({"condition": ["static_layer"], "mean": [0.42], "lo": [0.40], "hi": [0.44]})
    fig = figures.study_retention(points, summary)
    band = [s for s in fig.layout.shapes if s.fillcolor == figures.PAPER_COLOUR]
    assert [(b.y0, b.y1) for b in band] == [(0.987, 0.9943)]
    assert any("arXiv:2607.26192" in a.text for a in fig.layout.annotations)


def test_the_overview_sets_the_demo_beside_the_paper(monkeypatch):
    at = app_for(monkeypatch, [REPO / "cache"], DEMO / "eval").run()
    no_exceptions(at)
    table = next(m.value for m in at.markdown if m.value.startswith("| question |"))
    assert "| dependence | static-layer gap retention | 42.3%" in table and "98.70% and 99.43%" in table
    assert any("arXiv:2607.26192" in c.value for c in at.caption)


# ------------------------------------------------------------------ the Lecture page


def test_the_lecture_walks_the_shipped_demo_in_seven_steps(monkeypatch):
    at = app_for(monkeypatch, [REPO / "cache"], DEMO / "eval")
    at.switch_page(LECTURE)
    at.run()
    no_exceptions(at)
    assert at.button(key="lecture_previous").disabled
    charts, infos = [], []
    titles = [at.title[0].value]
    charts.append(len(at.get("plotly_chart")))
    while not at.button(key="lecture_next").disabled:
        at.button(key="lecture_next").click().run()
        no_exceptions(at)
        assert not at.error, [e.value for e in at.error]
        titles.append(at.title[0].value)
        charts.append(len(at.get("plotly_chart")))
        infos.append([i.value for i in at.info])
    assert titles == [
        "1. Coefficients vary from token to token",
        "2. Yet every block runs",
        "3. Freeze the controller and replay",
        "4. What the static profile keeps, beside the paper",
        "5. The interpolation sweep",
        "6. Seeds",
        "7. Parameters vs inference: a controller that rescales beside one that skips",
    ]
    assert charts == [1] * 7, "one full-width chart per step: the demo has every step's data"
    assert not any(infos)
    # The last step sets the two shipped demos side by side, read from their audits.
    demo, skip = (json.loads((REPO / "cache" / d / "audit.json").read_text()) for d in ("demo", "demo-skip"))
    table = next(m.value for m in at.markdown if m.value.startswith("| figure |"))
    assert "| 3. blocks executed per token | 6 of 6 | " in table
    assert f"| {skip['execution']['blocks_executed_per_token']:.2f} of {skip['execution']['num_blocks']} |" in table
    assert f"{skip['execution']['flops_ratio_vs_dense']:.3f}x" in table
    assert (
        f"{demo['execution']['latency_ratio_vs_dense']:.3f}x | {skip['execution']['latency_ratio_vs_dense']:.3f}x"
        in table
    )
    bars = json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
    under = skip["execution"]["conditions"]
    skipping = next(b for b in bars if "skips" in b["name"])
    assert skipping["x"] == [c for c in under if not c.startswith("interpolate")]
    assert skipping["y"] == [under[c]["blocks_executed_fraction"] for c in skipping["x"]]
    rescaling = [b for b in bars if "rescales" in b["name"]]
    if "conditions" in demo["execution"]:  # (its audit may predate the per-condition tally: then said, no bars)
        assert rescaling[0]["y"] == [
            demo["execution"]["conditions"][c]["blocks_executed_fraction"] for c in rescaling[0]["x"]
        ]
    else:
        assert not rescaling and any("does not record what ran under each condition" in c.value for c in at.caption)
    at.button(key="lecture_previous").click().run()
    # The step before is the demo study's seeds, with the paper's band.
    seeds = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert any(s.get("fillcolor") == figures.PAPER_COLOUR for s in seeds["layout"]["shapes"])
    assert at.title[0].value == titles[-2]


def test_the_lecture_says_which_steps_a_cache_without_report_or_study_lacks(tiny_demo, tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "demo"
    shutil.copytree(tiny_demo, root, ignore=shutil.ignore_patterns("audit.json", "audit.md"))
    at = app_for(monkeypatch, [root], root / "eval")
    at.switch_page(LECTURE)
    at.run()
    no_exceptions(at)
    assert len(at.get("plotly_chart")) == 1  # step 1 needs only the cache
    lacking = []
    while not at.button(key="lecture_next").disabled:
        at.button(key="lecture_next").click().run()
        no_exceptions(at)
        if at.title[0].value.startswith("7. Parameters vs inference"):  # the shipped demos' audits, on any cache
            assert len(at.get("plotly_chart")) == 1
            continue
        assert not at.get("plotly_chart")
        lacking.append(at.info[0].value)
    assert len(lacking) == 5
    assert all(m.startswith("This step has no figure for this cache: ") for m in lacking)
    assert "no audit report" in lacking[0] and "no study" in lacking[-1]


# ------------------------------------------------------------------ figures for slides


def test_the_renderer_loads_nothing_from_the_network():
    from kaleido import PageGenerator

    from app import export

    options = export.renderer_options()
    page = PageGenerator(plotly=options["plotlyjs"], mathjax=options["mathjax"]).generate_index()
    assert "http" not in page and export.PLOTLY_JS.as_uri() in page


def test_a_figure_for_slides_carries_its_caption_on_white():
    report = demo_json()
    fig = figures.retention_scale(report["conditions"], report["gap_retention"])
    slide = figures.for_slides(fig, "model featuregate | cache demo/eval | 256 sequences")
    assert slide.layout.height == fig.layout.height + figures.CAPTION_ROW
    assert slide.layout.paper_bgcolor == "white" and slide.layout.font.color == figures.SLIDE_TEXT
    assert slide.layout.annotations[-1].text == "model featuregate | cache demo/eval | 256 sequences"
    assert len(fig.layout.annotations) == len(slide.layout.annotations) - 1  # the page's figure is untouched


@pytest.mark.slow
def test_figures_render_as_svg_and_png_at_2x_and_3x_on_this_machine():
    import struct

    from app import export

    report = demo_json()
    fig = figures.for_slides(figures.retention_scale(report["conditions"], report["gap_retention"]), "a caption")
    svg = export.image_bytes(fig, "svg").decode()
    assert svg.startswith("<svg") and "a caption" in svg and "98.70-99.43%" in svg
    for scale in (2, 3):
        png = export.image_bytes(fig, "png", scale)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert (width, height) == (export.WIDTH * scale, fig.layout.height * scale)


# ------------------------------------------------------------------ gap retention in `fca replay`


@pytest.mark.slow
def test_fca_replay_prints_gap_retention_with_its_ci(tiny_demo, capsys):
    from fca.cli import main
    from fca.jobs.runs import run_replay

    conditions = ["correct", "static_layer", "cross_input", "global_mean"]
    paths = [str(tiny_demo / d) for d in ("featuregate", "eval", "calibration")]
    record = run_replay(*paths, conditions, num_seqs=12, seed=3, device="cpu", save=False)
    retention, intervals = record["results"]["gap_retention"], record["results"]["gap_retention_ci95"]
    assert set(retention) == {"static_layer", "cross_input"}
    args = ["replay", "--model", paths[0], "--cache", paths[1], "--calibration", paths[2], "--num-seqs", "12"]
    args += ["--seed", "3", "--device", "cpu", "--no-save", "--conditions", *conditions]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gap retention (0% = global mean, 100% = correct):" in out or "gap retention: undefined" in out
    for name, value in retention.items():
        if value is not None and name in intervals:
            lo, hi = intervals[name]
            assert f"  {name}: {100 * value:.1f}% [95% CI {100 * lo:.1f}% to {100 * hi:.1f}%]" in out
    assert any(" [95% CI " in line for line in out.splitlines()) == bool(intervals)
    # Without global_mean the retention is said to be undefined, not left out.
    assert main([*args[:-4], "correct", "static_layer"]) == 0
    assert "gap retention: not defined for this run (it needs correct and global_mean" in capsys.readouterr().out


# ------------------------------------------------------------------ presenter view


def test_presenter_figures_set_every_text_at_16px_or_more():
    report = demo_json()
    for fig in (
        figures.retention_scale(report["conditions"], report["gap_retention"]),
        figures.sweep_curve(report["interpolation_sweep"], report["conditions"]),
        figures.share_by_site({"site": ["a", "b"], "share": [0.1, 0.2]}, 0.15),
    ):
        shown = figures.for_presenter(fig, 16)
        assert shown.layout.font.size == 16 and shown.layout.xaxis.tickfont.size == 16
        assert all(a.font.size >= 16 for a in shown.layout.annotations)
        assert "<br>" not in shown.layout.title.text and shown.layout.title.font.size >= 20
        assert fig.layout.font.size is None  # the page's own figure is untouched


def test_presenter_view_hides_the_prose_and_enlarges_chart_text(monkeypatch):
    at = app_for(monkeypatch, [REPO / "cache"], DEMO / "eval")
    at.run()
    teaching = [m.value for m in at.markdown if m.value.startswith("An FCA audit asks three questions")]
    assert teaching
    at.session_state["fca_display"] = "presenter"
    at.run()
    no_exceptions(at)
    assert not [m.value for m in at.markdown if m.value.startswith("An FCA audit asks three questions")]
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert spec["layout"]["font"]["size"] == 16


# ------------------------------------------------------------------ lab presets and quick mode


def test_lab_presets_and_quick_mode_set_the_form(tiny_demo, monkeypatch):
    at = app_for(monkeypatch, [tiny_demo], tiny_demo / "eval")
    at.switch_page("views/replay_lab.py")
    at.run()
    no_exceptions(at)
    at.button(key="lab_preset::The paper's experiment").click().run()
    assert at.multiselect(key="lab_kinds").value == ["cross_input", "token_shuffle", "static_layer", "global_mean"]
    assert at.multiselect(key="lab_sites").value == [] and not at.checkbox(key="lab_sweep").value
    at.button(key="lab_preset::Freeze one layer").click().run()
    assert at.multiselect(key="lab_sites").value == ["blocks.0.gate"]
    assert at.multiselect(key="lab_kinds").value == ["static_layer", "global_mean"]
    at.button(key="lab_preset::Interpolation sweep").click().run()
    assert at.checkbox(key="lab_sweep").value and at.multiselect(key="lab_sites").value == []
    at.button(key="lab_quick").click().run()
    assert at.number_input(key="lab_num_seqs").value == 8  # the tiny demo has 8 sequences (fewer than 10)
    assert at.number_input(key="lab_batch").value == QUICK_BATCH == 2  # progress after every 2 sequences
    no_exceptions(at)


def test_a_quick_run_reports_progress_after_every_small_batch_and_names_its_loading_steps(tiny_demo):
    """The quick mode's count moves after each batch of QUICK_BATCH sequences (4 times for 8 sequences), and
    each loading step is named by the job while it runs (the progress line shows it)."""
    from app.jobs import ReplayJob
    from fca.jobs.runs import run_replay
    from tests.test_app import _lab_settings

    reported: list[tuple[int, int]] = []

    class Counted(ReplayJob):
        def progress(self, done: int, total: int) -> None:
            reported.append((done, total))
            super().progress(done, total)

    settings = _lab_settings(tiny_demo, num_seqs=8, batch_size=QUICK_BATCH, save=False)
    named: list[str] = []
    job = Counted(settings, total=8)
    job.start(
        run_replay, preparing=[("torch", lambda: named.append(job.step)), ("code", lambda: named.append(job.step))]
    )
    job.wait(120)
    assert job.record is not None, job.error
    assert named == ["torch", "code"]
    assert reported == [(2, 8), (4, 8), (6, 8), (8, 8)]


def test_lab_charts_name_the_sites_a_run_froze(tiny_demo, tmp_path, monkeypatch):
    from tests.test_app import _lab_copy

    root = _lab_copy(tiny_demo, tmp_path)
    at = app_for(monkeypatch, [root], root / "eval")
    at.switch_page("views/replay_lab.py")
    at.run()
    at.sidebar.selectbox(key="device").set_value("cpu").run()
    at.button(key="lab_preset::Freeze one layer").click().run()
    at.button(key="lab_quick").click().run()
    at.button(key="lab_run").click().run()
    job = at.session_state["replay_job"]
    job.wait(120)
    assert job.record is not None, job.error
    at.run()
    no_exceptions(at)
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"].replace("<br>", " ") for c in at.get("plotly_chart")]
    assert sum("site frozen blocks.0.gate" in t for t in titles) == 2, titles  # the NLL and penalty charts
    at.button(key="lab_preset::The paper's experiment").click().run()  # every site: no note
    at.button(key="lab_run").click().run()
    at.session_state["replay_job"].wait(120)
    at.run()
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"].replace("<br>", " ") for c in at.get("plotly_chart")]
    assert titles and not any("frozen" in t for t in titles)
