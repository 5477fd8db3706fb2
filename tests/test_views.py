"""The smaller defects of the pages, each checked where a reader met it: the definitions in words, whole
blocks said as whole numbers, a noisy measurement kept out of the headline (with a way back to the report's)."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from fca.tables.execution import blocks_of
from fca.tables.text import mapping_text, mappings_as_words
from tests.test_app import REPO, app_for, no_exceptions, render

DEMO = REPO / "cache" / "demo"


def test_mappings_in_a_definition_read_as_words():
    tolerances = {"float32": {"coefficient_rel": 0.0001, "nll_mean": 0.0001}, "float16": {"nll_mean": 0.005}}
    assert mapping_text(tolerances) == "float32 (coefficient_rel 0.0001, nll_mean 0.0001); float16 (nll_mean 0.005)"
    said = f"within the tolerances by model dtype {tolerances}, times {{'nll_seq': 50}}; a {{brace}} stays {{"
    assert mappings_as_words(said) == (
        "within the tolerances by model dtype float32 (coefficient_rel 0.0001, nll_mean 0.0001); float16 "
        "(nll_mean 0.005), times nll_seq 50; a {brace} stays {"
    )
    assert mappings_as_words("{__import__('os').system('true')}") == "{__import__('os').system('true')}"  # not run


def test_the_overviews_definitions_print_no_python_dicts(monkeypatch):
    at = app_for(monkeypatch, [REPO / "cache"], DEMO / "eval")
    at.run()
    no_exceptions(at)
    (expander,) = [e for e in at.expander if e.label.startswith("What each figure means")]
    said = "\n".join(m.value for m in expander.markdown)
    assert "{'" not in said and "'}" not in said
    assert "float32 (coefficient\\_rel 0.0001" in said or "float32 (coefficient_rel 0.0001" in said


def test_whole_blocks_are_said_as_whole_numbers(monkeypatch):
    assert (blocks_of(6.0, 6), blocks_of(4.3724, 6), blocks_of(5.999, 6)) == ("6 of 6", "4.37 of 6", "6 of 6")
    at = render(app_for(monkeypatch, [REPO / "cache"], DEMO / "eval"), "views/execution.py")
    no_exceptions(at)
    assert [m.value for m in at.metric if m.label == "Blocks executed"] == ["6 of 6"]


def test_a_noisy_measurement_is_not_the_headline_and_the_reports_figures_come_back(tiny_demo, tmp_path, monkeypatch):
    for name in ("featuregate", "dense", "eval", "calibration", "audit.json"):
        (shutil.copytree if (tiny_demo / name).is_dir() else shutil.copy)(tiny_demo / name, tmp_path / name)
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/execution.py")
    at.sidebar.selectbox(key="device").set_value("cpu").run()
    report_value = next(m.value for m in at.metric if m.label == "Time vs Dense twin")
    at.button(key="exec_measure").click().run()
    no_exceptions(at)
    kept = at.session_state["execution_measured"]
    ((key, measured),) = kept.items()
    timed = replace(measured.latency, latency_ratio_vs_dense=1.137, ratio_min=0.9, ratio_max=1.6)  # beside other work
    kept[key] = replace(measured, latency=timed)
    at.run()
    warning = next(w.value for w in at.warning if "too wide to trust" in w.value)
    assert "Their median was 1.137x" in warning
    assert [m.value for m in at.metric if m.label == "Time vs Dense twin"] == ["too noisy"]
    at.button(key="exec_show_report").click().run()
    no_exceptions(at)
    assert any("audit report beside the cache" in c.value for c in at.caption)
    assert [m.value for m in at.metric if m.label == "Time vs Dense twin"] == [report_value]
    assert not [b for b in at.button if b.key == "exec_show_report"]


@pytest.mark.slow
def test_the_execution_page_says_what_the_skip_demo_skips(monkeypatch):
    """The shipped mixture-of-depths demo: blocks per token, FLOPs and time against the Dense twin, and what
    each condition's replay ran, all as its audit records them."""
    import json

    skip = REPO / "cache" / "demo-skip"
    exe = json.loads((skip / "audit.json").read_text())["execution"]
    at = render(app_for(monkeypatch, [REPO / "cache"], skip / "eval"), "views/execution.py")
    no_exceptions(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Blocks executed"] == blocks_of(exe["blocks_executed_per_token"], exe["num_blocks"]) == "2.05 of 4"
    assert metrics["FLOPs vs Dense twin"] == f"{exe['flops_ratio_vs_dense']:.3f}x"
    said = " ".join(m.value for m in at.markdown)
    assert f"**{exe['flops_ratio_vs_dense']:.3f}x** the Dense twin's FLOPs" in said
    assert f"**{exe['latency_ratio_vs_dense']:.3f}x** its time" in said
    table = next(m.value for m in at.markdown if m.value.startswith("| condition | blocks per token |"))
    for name, row in exe["conditions"].items():
        assert f"| {name} | {blocks_of(row['blocks_executed_per_token'], exe['num_blocks'])} | " in table
    assert "| global_mean | 0 of 4 | 0.0% |" in table  # one grand mean score: below 0, no block runs
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    bars = next(f for f in specs if f["layout"]["title"]["text"].startswith("Blocks executed under each"))["data"][0]
    assert bars["y"] == [exe["conditions"][c]["blocks_executed_fraction"] for c in bars["x"]]
    lecture = app_for(monkeypatch, [REPO / "cache"], skip / "eval")
    lecture.switch_page("views/lecture.py")
    lecture.session_state["lecture_step"] = 1
    lecture.run()
    assert lecture.title[0].value == "2. And some blocks are skipped"
    assert "This model does skip work: a token ran 2.05 of 4 blocks" in " ".join(m.value for m in lecture.markdown)
