"""The Study page (AppTest, as in tests/test_app.py): a study of real tiny audits shows its table and
figure; the seed picker opens a seed's cache in the other pages, or shows its audit when only the
audit was kept; with no study the page says how to make one. Plus the page's pure figure."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.test_app import REPO, app_for, no_exceptions, render
from tests.test_study import build_tiny_study

PAGE = "views/study.py"


@pytest.fixture(scope="session")
def tiny_study(tmp_path_factory) -> Path:
    return build_tiny_study(tmp_path_factory)


def pick_study(at, study_dir: Path):
    """Choose `study_dir`'s study in the page's selectbox (the repository's own cache/ may hold others)."""
    return at.selectbox(key="study_file").set_value(str((study_dir / "study.json").resolve())).run()


def test_study_page_shows_seeds_and_opens_a_seed_in_the_other_pages(tiny_study, monkeypatch):
    at = render(app_for(monkeypatch, [tiny_study], tiny_study / "seed1" / "eval"), PAGE)
    no_exceptions(at)
    pick_study(at, tiny_study)
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    assert at.title[0].value == "Study across seeds"
    study = json.loads((tiny_study / "study.json").read_text())
    table = at.dataframe[0].value.set_index("figure")  # one column per seed, one row per figure
    assert table.columns.tolist() == ["seed 1", "seed 2"]
    assert table.loc["NLL correct"].tolist() == [f"{r['nll']['correct']:.4f}" for r in study["seeds"]]
    assert table.loc["retention static_layer"].tolist() == ["–", "–"]  # undefined: tiny models, no gap to retain
    assert table.loc["layer-id share"].tolist() == [
        f"{100 * r['layer_identity_share']:.1f}%" for r in study["seeds"]
    ]  # a percent, as the summary and every page
    assert table.loc["latency x"].tolist() == [f"{r['latency_ratio_vs_dense']:.3f}x" for r in study["seeds"]]
    # What each seed is, in a line above the table (in it, names and paths made the columns scroll sideways at
    # 800 px): its model, fingerprint, training device and audit.
    assert not set(table.index) & {"model", "fingerprint", "trained on", "audit"}
    # The figures' column wider than its longest name needs (sized exactly, "token_shuffle" lost a letter).
    figure_column = json.loads(at.dataframe[0].proto.columns)["figure"]
    assert figure_column["width"] >= 7 * max(map(len, table.index)) + 16 and figure_column["pinned"], figure_column
    seeds_said = next(m.value for m in at.markdown if m.value.startswith("- **seed 1**"))
    for r, line in zip(study["seeds"], seeds_said.splitlines(), strict=True):
        assert line.startswith(f"- **seed {r['seed']}**: `featuregate` ({r['fingerprint'][:12]})"), line
        assert line.endswith(f", audit `{r['audit']}`") and ", trained on " in line, line
    chart = json.loads(at.get("plotly_chart")[0].proto.spec)
    seeds = [t for t in chart["data"] if t["name"].startswith("seed ") and t.get("showlegend") is False]
    assert [t["name"] for t in seeds] == ["seed 1", "seed 2"]  # one point per seed and condition
    assert seeds[1]["y"] == [study["seeds"][1]["gap_retention"][c] for c in seeds[1]["x"]]
    # Pick seed 2 and open it: the sidebar now selects its evaluated cache and the Overview shows it.
    at.selectbox(key=f"study_seed:{at.selectbox(key='study_file').value}").set_value(1).run()
    at.button(key="study_open").click().run()
    no_exceptions(at)
    assert at.session_state["cache"] == str((tiny_study / "seed2" / "eval").resolve())
    assert at.sidebar.selectbox(key="cache").value == str((tiny_study / "seed2" / "eval").resolve())
    assert at.title[0].value == "Audit card" and len(at.metric) == 3
    assert not at.error, [e.value for e in at.error]


def test_a_seed_without_caches_shows_its_audit_in_place(tiny_study, tmp_path, monkeypatch):
    """The committed form of a study: study.json, study.md and each seed's audit, no models or caches."""
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in ("study.json", "study.md"):
        shutil.copy(tiny_study / name, kept / name)
    for seed in (1, 2):
        (kept / f"seed{seed}").mkdir()
        shutil.copy(tiny_study / f"seed{seed}" / "audit.json", kept / f"seed{seed}" / "audit.json")
    at = render(app_for(monkeypatch, [tmp_path]), PAGE)
    assert "kept/study.json" in at.selectbox(key="study_file").options  # labelled relative to its root
    pick_study(at, kept)
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    assert not any(b.key == "study_open" for b in at.button), "nothing to open: no cache of this seed here"
    shown = "\n".join(m.value for m in at.markdown)
    fingerprint = json.loads((kept / "seed1" / "audit.json").read_text())["model"]["fingerprint"]
    assert "# FCA audit: featuregate" in shown and fingerprint[:16] in shown
    # Under the page's own headings: the report's two levels down (its title was larger than the page's).
    assert "\n### FCA audit: featuregate" in "\n" + shown and "\n#### 1. Coefficient variation" in shown


def test_a_seed_whose_cache_path_names_another_models_cache_does_not_open_it(tiny_study, tmp_path, monkeypatch):
    """An audit written into another seed's folder names that seed's cache (the path is the audit's folder
    plus the cache folder's name): the page opened it as this seed's."""
    moved = tmp_path / "moved"
    shutil.copytree(tiny_study, moved)
    study = json.loads((moved / "study.json").read_text())
    study["seeds"][1]["evaluated_cache"] = str(Path("seed1") / "eval")  # seed 2's row, seed 1's cache
    (moved / "study.json").write_text(json.dumps(study))
    at = render(app_for(monkeypatch, [moved]), PAGE)
    pick_study(at, moved)
    at.selectbox(key=f"study_seed:{at.selectbox(key='study_file').value}").set_value(1).run()
    no_exceptions(at)
    assert not any(b.key == "study_open" for b in at.button)
    assert any("holds another model's cache" in w.value for w in at.warning), [w.value for w in at.warning]


def test_a_study_of_one_model_claims_no_spread(tiny_study, tmp_path, monkeypatch):
    from fca.cli import main

    one = tmp_path / "one"
    assert main(["study", str(tiny_study / "seed1" / "audit.json"), "--json", str(one / "study.json")]) == 0
    at = pick_study(render(app_for(monkeypatch, [tmp_path]), PAGE), one)
    no_exceptions(at)
    assert at.subheader[0].value == "Across 1 model"
    assert any("need at least two" in c.value for c in at.caption)
    assert not any("Student t interval" in c.value for c in at.caption)
    chart = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert "mean over models (no interval: one model)" in [t["name"] for t in chart["data"]]
    assert any("not among the caches this dashboard lists" in c.value for c in at.caption)


@pytest.mark.parametrize(
    ("name", "seeds", "retention"),
    [("demo-study", [0, 1, 2], 0.417), ("kjv-34m-study", [0, 1, 2], 0.510)],
)
def test_shipped_studies_show_their_seeds(name, seeds, retention, monkeypatch):
    """Both committed studies render from the repository's own cache root: the demo's three seeds
    (trained on a CPU and a GPU) and the larger configuration's (trained and audited on an H200)."""
    from tests.test_app import REPO

    root = REPO / "cache"
    at = render(app_for(monkeypatch, [root], root / "demo" / "eval"), PAGE)
    pick_study(at, root / name)
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    table = at.dataframe[0].value.set_index("figure")
    assert table.columns.tolist() == [f"seed {s}" for s in seeds]
    study = json.loads((root / name / "study.json").read_text())
    assert study["summary"]["conditions"]["static_layer"]["gap_retention"]["mean"] == pytest.approx(retention, abs=5e-4)
    assert table.loc["retention static_layer"].tolist() == [
        f"{100 * r['gap_retention']['static_layer']:.1f}%" for r in study["seeds"]
    ]


def test_no_study_explains_how_to_make_one(tmp_path, monkeypatch):
    from fca.tables import study

    monkeypatch.setattr(study, "find_studies", lambda roots: [])  # the repository's cache/ may hold a study
    at = render(app_for(monkeypatch, [tmp_path]), PAGE)
    no_exceptions(at)
    assert any("No study found" in i.value for i in at.info)
    assert any("python -m fca demo-study" in c.value for c in at.code)


def test_a_file_that_is_not_a_study_is_an_error_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "study.json").write_text(json.dumps({"hello": 1}))
    at = render(app_for(monkeypatch, [tmp_path]), PAGE)
    pick_study(at, tmp_path / "odd")
    no_exceptions(at)
    assert any("not an FCA study" in e.value for e in at.error)
    damaged = json.loads((REPO / "cache" / "demo-study" / "study.json").read_text())
    del damaged["seeds"][0]["penalty"]  # a field the page reads: an exception box before
    (tmp_path / "odd" / "study.json").write_text(json.dumps(damaged))
    at = render(app_for(monkeypatch, [tmp_path]), PAGE)
    pick_study(at, tmp_path / "odd")
    no_exceptions(at)
    assert any("not an FCA study (a field cannot be read: no 'penalty')" in e.value for e in at.error)


def test_study_retention_figure_is_pure_and_titled():
    from app import figures

    points = pd.DataFrame(
        {
            "condition": ["static_layer", "cross_input"] * 2,
            "seed": ["0", "0", "1", "1"],
            "retention": [0.42, 0.01, 0.5, None],
        }
    )
    summary = pd.DataFrame(
        {"condition": ["cross_input", "static_layer"], "mean": [0.01, 0.46], "lo": [None, 0.2], "hi": [None, 0.72]}
    )
    fig = figures.study_retention(points, summary)
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
    mean, *rest = fig.data  # the mean first, so that the seeds' points are drawn on top of it
    seeds, entries = rest[:2], rest[2:]  # the seeds' points, then their legend entries
    assert [t.name for t in seeds] == [t.name for t in entries] == ["seed 0", "seed 1"]
    assert all(t.showlegend is False for t in seeds) and all(t.x == (None,) for t in entries)
    assert mean.legendrank > 1000 and all(t.legendrank is None for t in rest)  # listed last (default rank 1000)
    assert list(seeds[1].y) == [0.5]  # an undefined retention is left out, not drawn at 0
    assert list(mean.error_y.array) == pytest.approx([0.0, 0.26])
    assert list(mean.error_y.arrayminus) == pytest.approx([0.0, 0.26])
    assert fig.layout.yaxis.range[0] <= 0 and fig.layout.yaxis.range[1] >= 1
    # Each line's label at its right end, beside the plot, level with it (over a condition, it floated off
    # its line and read as that condition's): tests/test_figures.py holds the rest.
    labels = {
        a.text.split("<br>")[0]: (a.xref, a.x, a.y, a.yanchor) for a in fig.layout.annotations if "paper" not in a.text
    }
    assert labels == {"global mean": ("paper", 1, 0.0, "middle"), "correct": ("paper", 1, 1.0, "middle")}
    # Each seed beside the others (at one x, seed 0 lay hidden under the rest) and none at the mean's x
    # (its marker and interval bar covered the middle seed of three), in its own symbol too.
    assert list(fig.layout.xaxis.ticktext) == ["cross_input", "static_layer"] and list(mean.x) == [0, 1]
    assert list(seeds[0].x) == pytest.approx([0.88, -0.12]) and list(seeds[1].x) == pytest.approx([1.12])
    assert seeds[0].marker.symbol != seeds[1].marker.symbol
    assert figures.seed_offsets(3) == pytest.approx([-0.12, 0.12, 0.2]) and 0 not in figures.seed_offsets(5)
    # Each point in its condition's colour, the one it has in every chart.
    assert list(seeds[0].marker.color) == [
        figures.condition_colour("static_layer"),
        figures.condition_colour("cross_input"),
    ]


def test_study_page_does_not_show_the_sidebars_cache_error(tiny_study, tmp_path, monkeypatch):
    """The Study page reads study files, not the sidebar's cache: a cache that cannot be used is no error
    of this page (the other pages still say it)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{")  # listed, and selected first, but unreadable
    at = render(app_for(monkeypatch, [tiny_study, tmp_path], broken), PAGE)
    no_exceptions(at)
    assert at.title[0].value == "Study across seeds"
    assert not [e.value for e in at.error if "cannot be used" in e.value]
    at.switch_page("views/overview.py").run()
    assert [e.value for e in at.error if e.value.startswith("This cache cannot be used: ")]
