"""The dashboard: catalog functions, pure figures, one AppTest per page (demo-shaped and ragged
caches), a replay through the UI equal to the Python API, and the error paths."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fca.tables import catalog

REPO = Path(__file__).resolve().parent.parent
MAIN = str(REPO / "app" / "main.py")
CUDA = torch.cuda.is_available()
PAGES = ["views/overview.py", "views/variance.py", "views/profiles.py", "views/replay_lab.py", "views/execution.py"]


def app_for(monkeypatch, roots: list[Path], default: Path | None = None):
    import os

    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("FCA_CACHE_ROOTS", os.pathsep.join(str(r) for r in roots))
    if default is not None:
        monkeypatch.setenv("FCA_DEFAULT_CACHE", str(default))
    return AppTest.from_file(MAIN, default_timeout=60)


def render(at, page: str):
    if page != "views/overview.py":
        at.switch_page(page)
    return at.run()


def _decoded(values):
    """A plotly figure's numeric array as sent to the browser: a list, or {"dtype", "bdata": base64 of the values}."""
    import base64

    return np.frombuffer(base64.b64decode(values["bdata"]), values["dtype"]) if isinstance(values, dict) else values


def no_exceptions(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


# ------------------------------------------------------------------ library side: catalog, figures


@pytest.mark.slow
def test_fca_imports_neither_streamlit_nor_plotly():
    """Every module of the library, the CLI included, imported in a fresh interpreter."""
    code = (
        "import importlib, pkgutil, sys, fca;"
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(fca.__path__, 'fca.') if m.name != 'fca.__main__'];"
        "assert 'fca.cli' in sys.modules and 'fca.jobs.distributed' in sys.modules;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('streamlit', 'plotly')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_catalog_finds_everything(tiny_demo, tmp_path):
    entries = catalog.discover_caches([tiny_demo])
    labels = {e.label: e for e in entries}
    assert set(labels) == {"eval", "calibration"}
    ev = labels["eval"]
    assert ev.split == "eval" and ev.num_seqs == 8 and ev.seq_len == 16 and ev.error is None
    assert catalog.find_model_dir(ev.path) == tiny_demo / "featuregate"
    assert catalog.find_calibration(ev, entries).path == tiny_demo / "calibration"
    assert catalog.find_calibration(labels["calibration"], entries) is None  # never itself, never the same split
    # Nor a split of the same corpus drawn with another seed (it shares documents with the evaluated one).
    assert ev.split_seed == 0 and ev.corpus_fingerprint is not None
    reseeded = dataclasses.replace(labels["calibration"], split_seed=1)
    assert catalog.find_calibration(ev, [ev, reseeded]) is None
    elsewhere = dataclasses.replace(reseeded, corpus_fingerprint="another corpus")
    assert catalog.find_calibration(ev, [ev, elsewhere]) == elsewhere
    assert catalog.find_dense_twin(tiny_demo / "featuregate") == tiny_demo / "dense"
    assert catalog.find_dense_twin(tiny_demo / "dense") is None
    assert catalog.find_report(ev.path) == tiny_demo / "audit.json"
    assert catalog.path_allowed(tiny_demo / "eval", [tiny_demo])
    assert not catalog.path_allowed(tiny_demo / ".." / "elsewhere", [tiny_demo])
    # A cache built later appears on the next scan; unfinished builds and saved runs never do.
    shutil.copytree(tiny_demo / "eval", tmp_path / "late" / "eval")
    (tmp_path / "late" / "x.partial").mkdir()
    (tmp_path / "late" / "x.partial" / "manifest.json").write_text("{}")
    assert [e.label for e in catalog.discover_caches([tmp_path])] == ["late/eval"]
    (tmp_path / "late" / "broken").mkdir()
    (tmp_path / "late" / "broken" / "manifest.json").write_text("{not json")
    broken = [e for e in catalog.discover_caches([tmp_path]) if e.label == "late/broken"][0]
    assert broken.error.startswith(f"{tmp_path / 'late' / 'broken' / 'manifest.json'}: not a readable manifest (")
    # A manifest that parses but is malformed: the file named once (it was named twice).
    (tmp_path / "late" / "broken" / "manifest.json").write_text('{"num_seqs": "many"}')
    broken = [e for e in catalog.discover_caches([tmp_path]) if e.label == "late/broken"][0]
    assert broken.error.count("manifest.json") == 1, broken.error


def test_the_report_path_suggested_for_a_cache_is_where_its_report_is_found(tmp_path):
    """With `audit.json` taken by another cache, the Overview suggests `audit-<name>.json`; the sidebar
    must then find that report for this cache, and never another cache's."""
    for name in ("eval", "eval2", "eval-b"):
        (tmp_path / name).mkdir()
    assert catalog.free_report_path(tmp_path, "eval2") == tmp_path / "audit.json"
    (tmp_path / "audit.json").write_text(json.dumps({"cache": {"path": "x/eval"}}))
    suggested = catalog.free_report_path(tmp_path, "eval2")
    assert suggested == tmp_path / "audit-eval2.json"
    suggested.write_text(json.dumps({"cache": {"path": "x/eval2"}}))
    assert catalog.free_report_path(tmp_path, "eval2") == tmp_path / "audit-eval2-2.json"
    assert catalog.find_report(tmp_path / "eval") == tmp_path / "audit.json"
    assert catalog.find_report(tmp_path / "eval2") == suggested
    assert catalog.find_report(tmp_path / "eval-b") is None  # audit-eval-2.json would be eval's, not eval-b's
    (tmp_path / "audit-eval-b-2.json").write_text(json.dumps({"cache": {"path": "x/eval-b"}}))
    assert catalog.find_report(tmp_path / "eval-b") == tmp_path / "audit-eval-b-2.json"
    # Damaged files: one that is no JSON object is found when no readable report is (the page then says why
    # it cannot be read; a truncated report had read "Audit report: none"), never before a readable one; an
    # object that names no cache path is this cache's, refused (one line) when the page reads it.
    (tmp_path / "audit-eval-b-2.json").write_text("[]")
    assert catalog.find_report(tmp_path / "eval-b") == tmp_path / "audit-eval-b-2.json"
    (tmp_path / "audit-eval-b.json").write_text(json.dumps({"cache": {"path": "x/eval-b"}}))
    (tmp_path / "audit.json").write_text('{"cache": {"pa')
    assert catalog.find_report(tmp_path / "eval-b") == tmp_path / "audit-eval-b.json"
    (tmp_path / "audit-eval-b.json").unlink()
    (tmp_path / "audit-eval-b-2.json").write_text(json.dumps({"cache": "x"}))
    assert catalog.find_report(tmp_path / "eval-b") == tmp_path / "audit-eval-b-2.json"


@pytest.mark.slow
def test_the_sidebar_never_offers_the_dense_twin_as_the_caches_model(tiny_demo, monkeypatch):
    """The twin has no controllers, so it cannot have made the cache: choosing it only failed a run later."""
    at = app_for(monkeypatch, [tiny_demo], tiny_demo / "eval").run()
    no_exceptions(at)
    models = at.sidebar.selectbox(key=f"model::{tiny_demo / 'eval'}")
    assert [Path(m).name for m in models.options] == ["featuregate"]


def test_without_the_caches_named_model_the_dense_twin_is_still_not_offered(tiny_demo, tmp_path, monkeypatch):
    """With the named folder moved away, every folder beside the cache was offered, the twin first (as
    'dense' sorts before the other's new name), and a run failed with "made by a different model"."""
    root = tmp_path / "moved"
    for name, to in (("eval", "eval"), ("dense", "dense"), ("featuregate", "gated")):
        shutil.copytree(tiny_demo / name, root / to)
    at = app_for(monkeypatch, [root], root / "eval").run()
    no_exceptions(at)
    models = at.sidebar.selectbox(key=f"model::{root / 'eval'}")
    assert models.options == ["gated (not named by the cache)"]


def test_dense_twin_needs_same_sizes():
    gated = {"model_type": "featuregate", "gated": True, "d_model": 32, "n_layers": 2, "init_seed": 0}
    assert catalog.is_dense_twin(gated, {**gated, "gated": False, "init_seed": 3})
    assert not catalog.is_dense_twin(gated, {**gated, "gated": False, "d_model": 64})
    mudd = {"model_type": "muddpythia", "dense": True, "dim": 64, "n_layer": 4}
    assert catalog.is_dense_twin(mudd, {**mudd, "dense": False, "dynamic_dense": False})


def test_figures_are_pure_and_titled():
    from app import figures

    ragged = pd.DataFrame(
        {
            "site": ["a", "a", "b", "b", "b"],
            "channel": [0, 1, 0, 1, 2],
            "value": [1.0, 2, 3, 4, 5],
            "label": list("xyzuv"),
        }
    )
    fig = figures.slot_heatmap(ragged, "coefficient", "t")
    z = np.array(fig.data[0].z, dtype=float)
    assert z.shape == (2, 3) and np.isnan(z[0, 2]) and z[1, 2] == 5  # the narrow site is padded, not stretched
    conditions = pd.DataFrame(
        {
            "condition": ["x", "y"],
            "nll": [1.0, 1.1],
            "ci_lo": [0.9, 1.0],
            "ci_hi": [1.1, 1.2],
            "penalty": [0.0, 0.1],
            "lo": [0.0, 0.05],
            "hi": [0.0, 0.15],
        }
    )
    for fig in (
        fig,
        figures.nll_bars(conditions),
        figures.penalty_bars(conditions),
        figures.factor_bars(pd.DataFrame({"factor": ["site", "token"], "share": [0.2, None]})),
    ):
        assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
    # shares in percent, as everywhere in the app and the report; an undefined one said so
    assert figures.factor_bars(pd.DataFrame({"factor": ["site", "token"], "share": [0.2, None]})).data[0].text == (
        "20.0%",
        "n/a",
    )

    # The Overview passes plain dicts of columns (it draws before pandas is imported): same figures.
    def same(a, b) -> bool:
        def arrays(trace):
            errors = [trace.error_y.array, trace.error_y.arrayminus] if trace.error_y.array is not None else []
            return [np.asarray(trace.x).astype(str), *(np.asarray(v, dtype=float) for v in [trace.y, *errors])]

        return a.layout == b.layout and all(
            np.array_equal(u, v) for u, v in zip(arrays(a.data[0]), arrays(b.data[0]), strict=True)
        )

    columns = {k: conditions[k].tolist() for k in ("condition", "penalty", "lo", "hi")}
    assert same(figures.penalty_bars(columns), figures.penalty_bars(conditions))
    sites = {"site": ["a", "b"], "share": [0.3, 0.6]}
    assert same(figures.share_by_site(sites, 0.4), figures.share_by_site(pd.DataFrame(sites), 0.4))
    # Conditions naming sites: short tick lines (turned on their side, they took most of the height) and a
    # taller chart; the compare legend's run names on lines that fit, whole.
    plain = figures.nll_bars(conditions)  # one line of labels: the height and margin it always had
    assert (plain.layout.height, plain.layout.margin.b) == (366 + figures.TICK_LINE, 46 + figures.TICK_LINE)
    named = ["correct", "static_layer@l.2.gate", "token_shuffle@l.0.gate,l.5.gate", "global_mean@a,b,c,d"]
    rows = {"condition": named, "nll": [1.0] * 4, "ci_lo": [0.9] * 4, "ci_hi": [1.1] * 4}
    bars = figures.nll_bars(pd.DataFrame(rows))
    # Four conditions in a chart half a screen wide: each kind broken after "_" and ":" too.
    assert list(bars.layout.xaxis.ticktext) == [
        "correct", "static_<br>layer<br>@l.2.gate", "token_<br>shuffle<br>@l.0.gate,<br>l.5.gate",
        "global_<br>mean<br>@4 sites",
    ]  # fmt: skip
    assert list(bars.layout.xaxis.tickvals) == named and bars.layout.xaxis.tickangle == 0
    assert bars.layout.height - plain.layout.height == 3 * figures.TICK_LINE
    three = figures.nll_bars(pd.DataFrame({**rows, "condition": ["x@a,b,c", "y", "z", "w"]}))
    assert three.layout.xaxis.ticktext[0] == "x<br>@a,<br>b,<br>c"  # up to three sites listed
    run = "static_layer@l.2.gate + interpolate:0.6@l.0.gate,l.5.gate + global_mean, n=16, seed 0"
    compared = figures.penalty_bars(pd.DataFrame({"condition": named[1:], "penalty": [0.1] * 3, "lo": [0] * 3,
                                                  "hi": [0.2] * 3, "run": [run] * 3}))  # fmt: skip
    lines = compared.data[0].name.split("<br>")
    assert " ".join(lines) == run and lines[-1] == "n=16, seed 0"
    assert all(len(line) <= figures.LEGEND_CHARS for line in lines) and len(lines) == 3
    # The compare chart labels its conditions the same way (three: kinds on one line), and its legend sits
    # below them, taller by its lines.
    assert list(compared.layout.xaxis.ticktext) == [
        t.replace("_<br>", "_").replace(":<br>", ":") for t in bars.layout.xaxis.ticktext[1:]
    ]
    ticks, plot = 3 * figures.TICK_LINE, 228
    assert compared.layout.legend.y == pytest.approx(-(76 + ticks) / plot)
    assert compared.layout.margin.b == 76 + ticks + 10 + figures.LEGEND_ROW + 2 * figures.TICK_LINE
    # A run name is broken only between conditions or before "n=": a line takes a condition while it fits.
    for a, joined in ((figures.LEGEND_CHARS - 5, True), (figures.LEGEND_CHARS - 4, False)):  # "a… + b," 56 / 57
        lines = figures._wrap_run_name("a" * a + " + b, n=1, seed 0").split("<br>")
        assert lines == (["a" * a + " + b,", "n=1, seed 0"] if joined else ["a" * a + " +", "b, n=1, seed 0"])


@pytest.mark.slow
def test_overview_and_sidebar_never_import_pandas(tiny_demo):
    """The first page's speed rests on this (see app/views/overview.py): in a fresh interpreter, the
    sidebar and the Overview draw their charts, cards and downloads without importing pandas."""
    code = (
        "import sys\n"
        "from streamlit.testing.v1 import AppTest\n"
        f"at = AppTest.from_file({MAIN!r}, default_timeout=60).run()\n"
        "assert not at.exception and not at.error, [e.value for e in (*at.exception, *at.error)]\n"
        # retention scale, penalties, shares (the fixture's report has no interpolation sweep)
        # (three downloads of the report, and each chart's three for slides)
        "assert len(at.get('plotly_chart')) == 3 and len(at.metric) == 3 and len(at.get('download_button')) == 3 + 9\n"
        "assert 'pandas' not in sys.modules, 'the overview imported pandas'\n"
    )
    env = {**os.environ, "FCA_CACHE_ROOTS": str(tiny_demo), "FCA_DEFAULT_CACHE": str(tiny_demo / "eval")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_csv_download_of_rows_matches_dataframe():
    """The Overview writes its CSV from row dicts (no pandas); it must read back like the DataFrame path."""
    import io

    from app.views.common import csv_bytes

    rows = [
        {"condition": "correct", "nll": 3.5, "gap_retention": None},
        {"condition": "static_layer", "nll": 3.9, "gap_retention": 0.42},
    ]
    assert csv_bytes(rows) == csv_bytes(pd.DataFrame(rows))
    back = pd.read_csv(io.BytesIO(csv_bytes(rows)))
    assert list(back.columns) == ["condition", "nll", "gap_retention"] and back["nll"].tolist() == [3.5, 3.9]


# ------------------------------------------------------------------ one AppTest per page


VARIANCE_SECTIONS = ["Site x channel", "Distributions per site", "One sequence: token x layer"]
EXECUTION_METRICS = ["Time vs Dense twin", "Blocks executed", "Controller FLOPs share"]
KEY_WIDGETS = {
    "views/overview.py": lambda at: len(at.metric) == 3 and len(at.download_button) >= 2,
    "views/variance.py": lambda at: (
        at.radio(key="var_quantity") is not None and [t.label for t in at.tabs] == VARIANCE_SECTIONS
    ),
    "views/profiles.py": lambda at: (
        at.number_input(key="prof_token") is not None and at.selectbox(key="prof_band") is not None
    ),
    "views/replay_lab.py": lambda at: (
        at.multiselect(key="lab_kinds") is not None and at.slider(key="lab_alpha") is not None
    ),
    "views/execution.py": lambda at: (
        at.button(key="exec_measure") is not None
        and [m.label for m in at.metric] in (EXECUTION_METRICS, [*EXECUTION_METRICS, "FLOPs vs Dense twin"])
    ),
}


@pytest.mark.parametrize("page", PAGES)
def test_page_renders(page, tiny_demo, monkeypatch):
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), page)
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    assert at.sidebar.selectbox(key="cache").value == str(tiny_demo / "eval")
    assert at.sidebar.selectbox(key="device").options == (["auto", "cuda", "cpu"] if CUDA else ["auto", "cpu"])
    assert at.title, "every page opens with a title and teaching text"
    assert KEY_WIDGETS[page](at)
    if page != "views/replay_lab.py":  # the lab draws charts once a run exists
        assert len(at.get("plotly_chart")) >= 1


def test_profiles_token_by_index(tiny_demo, monkeypatch):
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/profiles.py")
    at.number_input(key="prof_token").set_value(5).run()
    no_exceptions(at)
    assert "position 5" in json.dumps([c.proto.spec for c in at.get("plotly_chart")])
    # The heatmap is a lazy tab: drawn only once opened, and then the token view is not run.
    titles = lambda: [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]  # noqa: E731
    assert not any("deviation from the" in t for t in titles()) and len(titles()) == 2
    at.session_state["prof_section"] = "Every token: deviation heatmap"
    at.run()
    no_exceptions(at)
    assert len(titles()) == 1 and "deviation from the" in titles()[0].replace("<br>", " ")
    assert not [n for n in at.number_input if n.key == "prof_token"]


def _ragged_caches(root: Path) -> Path:
    """MUDD-like sites of different widths (stream x source, per-channel families q/k/v/r) and an MoE
    router site, written with the library's own writer; no model beside them."""
    from fca.engine.sites import SiteSpec
    from fca.tables.schema import cache_schema, record_batch, spec_to_json
    from fca.tables.writer import CacheWriter

    specs = {
        f"layers.{i}": SiteSpec(
            axes=(("stream", 4), ("source", i + 2)),
            family="mudd",
            channel_families=tuple(s for s in "qkvr" for _ in range(i + 2)),
        )
        for i in range(3)
    }
    specs["moe.router"] = SiteSpec(axes=(("expert", 5),), family="router")
    rng = np.random.default_rng(0)
    n, T = 4, 8
    for split in ("eval", "calibration"):
        plan = {
            "schema_version": 1,
            "model": {"path": "mudd", "model_type": "muddpythia", "fingerprint": "f" * 64},
            "tokenizer": {"vocab_size": 50},
            "corpus": {"name": "synthetic", "split": split},
            "seq_len": T,
            "num_seqs": n,
            "num_tokens": n * T,
            "coefficient_dtype": "float32",
            "sites": {k: spec_to_json(s) for k, s in specs.items()},
        }
        schema = cache_schema(specs)
        writer = CacheWriter(root / split, plan, schema, seqs_per_part=2)
        for lo in (0, 2):
            tokens = rng.integers(0, 50, size=(2, T))
            coefficients = {k: rng.normal(size=(2, T, s.num_channels)).astype(np.float32) for k, s in specs.items()}
            writer.write(record_batch(schema, np.arange(lo, lo + 2), tokens, tokens, np.ones((2, T)), coefficients), 2)
        writer.finish()
    return root


@pytest.mark.parametrize("page", PAGES)
def test_ragged_cache_opens_in_every_page(page, tmp_path, monkeypatch):
    root = _ragged_caches(tmp_path / "ragged")
    at = render(app_for(monkeypatch, [root], root / "eval"), page)
    no_exceptions(at)
    if page in ("views/variance.py", "views/profiles.py", "views/overview.py"):
        assert not at.error, [e.value for e in at.error]
        assert len(at.get("plotly_chart")) >= 1
    if page == "views/variance.py":
        at.selectbox(key="var_view").set_value(at.selectbox(key="var_view").options[1]).run()  # one panel per stream
        no_exceptions(at)
        for section in VARIANCE_SECTIONS[1:]:  # the other (lazy) sections, on sites of different widths
            at.session_state["var_section"] = section
            at.run()
            no_exceptions(at)
            assert not at.error and len(at.get("plotly_chart")) >= 3, section
    if page == "views/replay_lab.py":  # no model beside the cache: said, not crashed
        assert any("model directory" in e.value for e in at.error)


def test_a_cache_of_one_sequence_opens_in_the_replay_lab(tiny_demo, tmp_path, monkeypatch):
    from fca.jobs.build import build_cache_from_corpus

    root = tmp_path / "one"
    shutil.copytree(tiny_demo / "featuregate", root / "featuregate")
    shutil.copytree(tiny_demo / "calibration", root / "calibration")
    build_cache_from_corpus(
        root / "featuregate", tiny_demo / "corpus.txt", "eval", root / "eval", num_seqs=1, batch_size=1,
        device="cpu", show_progress=False,
    )  # fmt: skip
    at = render(app_for(monkeypatch, [root], root / "eval"), "views/replay_lab.py")
    no_exceptions(at)
    sequences = at.number_input(key="lab_num_seqs")
    assert (sequences.min, sequences.max, sequences.value) == (1, 1, 1)


def test_lab_settings_survive_a_visit_to_another_page(tiny_demo, monkeypatch):
    """Streamlit forgets a widget's value when its page is left; the lab's form comes back as it was left."""
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/replay_lab.py")
    assert at.slider(key="lab_alpha").disabled  # alpha is interpolate's: idle until it is chosen
    at.multiselect(key="lab_kinds").set_value(["interpolate"])
    at.multiselect(key="lab_sites").set_value([at.multiselect(key="lab_sites").options[-1]])
    at.number_input(key="lab_num_seqs").set_value(4)
    at.number_input(key="lab_seed").set_value(7)
    at.run()
    at.slider(key="lab_alpha").set_value(0.25).run()
    chosen = {k: at.session_state[k] for k in ("lab_kinds", "lab_sites", "lab_num_seqs", "lab_seed", "lab_alpha")}
    assert not at.slider(key="lab_alpha").disabled
    render(at, "views/variance.py")
    at = render(at, "views/replay_lab.py")
    no_exceptions(at)
    assert {k: at.session_state[k] for k in chosen} == chosen
    assert at.number_input(key="lab_num_seqs").value == 4 and at.slider(key="lab_alpha").value == 0.25
    assert "--num-seqs 4 " in at.code[0].value and "--seed 7" in at.code[0].value
    # One option a line, the first too (beside the program's name it ran past the box at 800 px), and a line
    # still too long for the box wraps in it rather than scrolling sideways.
    assert at.code[0].value.startswith("python -m fca replay \\\n    --model ") and at.code[0].proto.wrap_lines


def test_a_page_opened_while_torch_is_being_imported_offers_devices(tiny_demo, monkeypatch):
    """The warm-up thread imports torch; a page run meanwhile found the half-made module in sys.modules,
    asked it for `torch.cuda` and failed (seen in Chromium). A half-imported torch counts as not loaded."""
    import importlib.machinery
    import types

    half_made = types.ModuleType("torch")  # as Python leaves it mid-import: spec marked, no `cuda` yet
    half_made.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    half_made.__spec__._initializing = True
    at = app_for(monkeypatch, [tiny_demo], tiny_demo / "eval")
    monkeypatch.setitem(sys.modules, "torch", half_made)
    at.run()
    monkeypatch.setitem(sys.modules, "torch", torch)
    no_exceptions(at)
    driver = not sys.platform.startswith("linux") or Path("/proc/driver/nvidia").exists()
    assert ("cuda" in at.sidebar.selectbox(key="device").options) == driver


@pytest.mark.slow
def test_warm_up_fills_the_caches_once_in_the_background(tiny_demo, tmp_path, monkeypatch):
    """After a page is sent, the statistics, calibration profiles and model the other pages need are
    computed in a background thread, once per selection; the pages then find them cached."""
    import threading

    from app import resources
    from fca.tables.store import open_cache

    for name in ("eval", "calibration"):  # copies: no other test's warm-up touches these paths
        shutil.copytree(tiny_demo / name, tmp_path / name)
    streamed, models = [], []
    real_moments = resources.cache_moments
    mine = (tmp_path / "eval", tmp_path / "calibration")
    monkeypatch.setattr(
        resources,
        "cache_moments",
        lambda cache: (cache.path in mine and streamed.append(cache.path)) or real_moments(cache),
    )
    monkeypatch.setattr(resources, "experiment", lambda model_dir, device, *caches: models.append((model_dir, device)))
    monkeypatch.setattr(resources, "WARM_UP_DELAY_S", 0.0)
    shutil.copytree(tiny_demo / "featuregate", tmp_path / "featuregate")
    assert 0 < resources.model_bytes(tmp_path / "featuregate") <= resources.WARM_UP_MAX_MODEL_BYTES
    cache, calibration = open_cache(tmp_path / "eval"), open_cache(tmp_path / "calibration")

    def warm_up_and_wait(device: str) -> None:
        resources.warm_up(cache, tmp_path / "featuregate", device, calibration)
        for thread in [t for t in threading.enumerate() if t.name == "fca-warm-up"]:
            thread.join(60)

    for _ in range(2):
        warm_up_and_wait("cpu")
    assert streamed == list(mine) and (tmp_path / "featuregate", "cpu") in models
    assert models.count((tmp_path / "featuregate", "cpu")) == 1, "started once per selection"
    resources.cache_stats(str(cache.path), cache.fingerprint)
    resources.profiles(str(calibration.path), calibration.fingerprint)
    assert streamed == list(mine), "the pages found the statistics cached"
    monkeypatch.setattr(resources, "WARM_UP_MAX_MODEL_BYTES", 0)  # a model above the limit is left to the page
    warm_up_and_wait("cuda")
    assert (tmp_path / "featuregate", "cuda") not in models
    # In a server, Streamlit warned "missing ScriptRunContext" twice per warm-up: dropped for that thread only.
    import logging

    logger = logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context")
    record = logger.makeRecord(
        logger.name, logging.WARNING, __file__, 0, "Thread %r: missing ScriptRunContext!", ("x",), None
    )
    passed = {}
    for name in (resources.WARM_UP_THREAD, "a page"):
        thread = threading.Thread(target=lambda n=name: passed.__setitem__(n, bool(logger.filter(record))), name=name)
        thread.start()
        thread.join()
    assert passed == {resources.WARM_UP_THREAD: False, "a page": True}


# ------------------------------------------------------------------ replay through the UI


@pytest.mark.slow
def test_ui_replay_equals_python_api(tiny_demo, monkeypatch):
    from fca.jobs.runs import run_replay

    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/replay_lab.py")
    at.sidebar.selectbox(key="device").set_value("cpu")
    at.multiselect(key="lab_kinds").set_value(["cross_input", "static_layer", "interpolate"]).run()
    at.slider(key="lab_alpha").set_value(0.25)  # (enabled once interpolate is chosen)
    at.number_input(key="lab_num_seqs").set_value(4)
    at.number_input(key="lab_batch").set_value(2)
    at.number_input(key="lab_seed").set_value(3)
    next(b for b in at.button if b.label == "Run").click().run()
    no_exceptions(at)
    job = at.session_state["replay_job"]
    job.wait(60)
    assert job.record is not None, job.error
    at.run()
    no_exceptions(at)
    assert len(at.get("plotly_chart")) >= 2 and at.success
    api = run_replay(
        tiny_demo / "featuregate",
        tiny_demo / "eval",
        tiny_demo / "calibration",
        ["cross_input", "static_layer", "interpolate:0.25"],
        num_seqs=4,
        seed=3,
        device="cpu",
        batch_size=2,
        save=False,
    )
    ui = job.record
    assert ui["spec"]["conditions"] == api["spec"]["conditions"]
    assert ui["results"]["per_sequence_nll"] == api["results"]["per_sequence_nll"]  # identical, not merely close
    assert Path(ui["path"]).is_file() and Path(ui["path"]).parent == tiny_demo / "eval.runs"
    from fca.tables.runs import run_label

    assert run_label(ui["spec"]) in at.dataframe[-1].value["run"].tolist()  # runs are named by what they ran


@pytest.mark.slow
def test_lab_replays_the_shipped_demo(tmp_path, monkeypatch):
    """The shipped demo, whichever machine wrote it, replays in the lab here with both checks shown."""
    demo = tmp_path / "demo"  # a copy, so the saved run does not land in the repository
    for part in ("featuregate", "eval", "calibration"):
        shutil.copytree(REPO / "cache" / "demo" / part, demo / part)
    at = render(app_for(monkeypatch, [tmp_path], demo / "eval"), "views/replay_lab.py")
    at.sidebar.selectbox(key="device").set_value("cpu")
    from fca.tables.report import FEW_SEQUENCES
    from fca.tables.scoring import MIN_DOCUMENTS
    from fca.tables.store import open_cache

    default = at.number_input(key="lab_num_seqs").value  # the default run gives figures to quote
    assert default >= FEW_SEQUENCES and len(set(open_cache(demo / "eval").window_documents(default))) >= MIN_DOCUMENTS
    at.number_input(key="lab_batch").set_value(12)  # (not the build's 16: the last batch is partial)
    next(b for b in at.button if b.label == "Run").click().run()  # the default run: 96 windows, 10 chapters
    job = at.session_state["replay_job"]
    job.wait(240)
    assert job.record is not None, job.error
    at.run()
    no_exceptions(at)
    shown = at.success[0].value
    assert "Replay mechanism" in shown and "max |difference| 0" in shown
    assert "Cache fidelity: coefficients computed on" in shown and "replayed on cpu" in shown
    assert job.record["results"]["exactness"]["fidelity"]["verdict"] in ("bit-identical", "within tolerance")
    # Its windows' documents: the penalty's CI over them in the table and the chart (the interval to quote).
    conditions = job.record["results"]["conditions"]
    assert job.record["results"]["documents"] == MIN_DOCUMENTS
    table = at.dataframe[0].value.set_index("condition")
    lo, hi = conditions["static_layer"]["penalty_ci95_documents"]
    assert table.loc["static_layer", "penalty 95% CI"] == f"{lo:.4f} to {hi:.4f}"  # the one interval shown
    assert table.columns.tolist() == ["NLL", "penalty", "penalty 95% CI", "gap retention"]  # (fits 800 px)
    results = job.record["results"]
    kept, (low, high) = results["gap_retention"]["static_layer"], results["gap_retention_ci95"]["static_layer"]
    assert table.loc["static_layer", "gap retention"] == f"{100 * kept:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
    assert "The 96 evaluated windows are consecutive stretches of 10 documents" in " ".join(c.value for c in at.caption)
    bars = json.loads(next(c for c in at.get("plotly_chart") if "Penalty vs correct" in c.proto.spec).proto.spec)
    assert "over documents" in json.dumps(bars["layout"]["title"])
    static = bars["data"][0]["x"].index("static_layer")
    assert _decoded(bars["data"][0]["error_y"]["array"])[static] == pytest.approx(
        hi - conditions["static_layer"]["penalty"]
    )


def test_cancel_stops_a_run(tiny_demo):
    from app.jobs import ReplayJob
    from fca.jobs.runs import run_replay

    job = ReplayJob(_lab_settings(tiny_demo, num_seqs=8, batch_size=1, save=False))
    job.stop.set()  # what the Cancel button does
    job.start(run_replay).wait(60)
    assert job.cancelled and job.record is None and job.error is None


def test_two_runs_on_one_model_take_turns(tiny_demo, monkeypatch):
    """Two tabs running the same selection share one model object, whose sites a replay switches for each
    forward: the selection's lock makes the runs take turns (never two inside a replay at once), and each
    gives the figures of a run alone."""
    import threading

    from app import resources
    from app.jobs import BATCH_DELAY_ENV, ReplayJob
    from fca.jobs.runs import run_replay
    from fca.tables.store import open_cache

    monkeypatch.setenv(BATCH_DELAY_ENV, "0.05")  # 4 batches of 0.05 s each: two runs would overlap
    selection = (
        tiny_demo / "featuregate",
        "cpu",
        open_cache(tiny_demo / "eval"),
        open_cache(tiny_demo / "calibration"),
    )
    settings = _lab_settings(tiny_demo, conditions=["token_shuffle", "static_layer"], batch_size=1, save=False)
    inside, most, count = [0], [0], threading.Lock()

    def counted_run(**kwargs) -> dict:
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            return run_replay(**kwargs)
        finally:
            with count:
                inside[0] -= 1

    jobs = [
        ReplayJob(settings).start(counted_run, open_experiment=lambda: resources.experiment(*selection, None))
        for _ in range(2)
    ]
    for job in jobs:
        job.wait(120)
    assert [job.error for job in jobs] == [None, None] and most[0] == 1
    assert resources.experiment(*selection, None)[1] is resources.experiment(*selection, None)[1]
    alone = ReplayJob(settings).start(run_replay)
    alone.wait(120)
    # (as JSON: eight sequences give NaN intervals, and NaN != NaN)
    assert all(
        json.dumps(job.record["results"]["conditions"]) == json.dumps(alone.record["results"]["conditions"])
        for job in jobs
    )


# ------------------------------------------------------------------ error paths


def test_corrupt_part_file_shows_error_and_app_recovers(tiny_demo, tmp_path, monkeypatch):
    shutil.copytree(tiny_demo / "eval", tmp_path / "bad" / "eval")
    part = next((tmp_path / "bad" / "eval").glob("part-*.parquet"))
    part.write_bytes(b"this is not parquet" * 10)
    at = render(app_for(monkeypatch, [tmp_path, tiny_demo], tmp_path / "bad" / "eval"), "views/variance.py")
    no_exceptions(at)
    assert any("not the part the manifest records" in e.value for e in at.error)
    at.sidebar.selectbox(key="cache").set_value(str(tiny_demo / "eval")).run()  # the app keeps working
    no_exceptions(at)
    assert not at.error and len(at.get("plotly_chart")) >= 1


@pytest.mark.parametrize("page", ["views/profiles.py", "views/token_text.py"])
def test_a_part_changed_in_place_is_refused_by_the_sequence_views(page, tiny_demo, tmp_path, monkeypatch):
    """One byte changed inside a part (same size, so only its hash tells): the pages that read single
    sequences refuse it as the statistics pages do, instead of showing the changed values."""
    for name in ("featuregate", "eval", "calibration"):
        shutil.copytree(tiny_demo / name, tmp_path / name)
    part = next((tmp_path / "eval").glob("part-*.parquet"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), page)
    no_exceptions(at)
    assert any("contents do not match the manifest's sha256" in e.value for e in at.error), [e.value for e in at.error]


@pytest.mark.parametrize("page", ["views/overview.py", "views/execution.py"])
def test_a_damaged_report_is_one_error_and_the_page_goes_on(page, tiny_demo, tmp_path, monkeypatch):
    """A report that names this cache but lacks the sections a page reads is refused when loaded (one
    st.error naming the file), not a KeyError halfway down the page."""
    for name in ("featuregate", "eval", "calibration"):
        shutil.copytree(tiny_demo / name, tmp_path / name)
    (tmp_path / "audit.json").write_text(json.dumps({"cache": {"path": str(tmp_path / "eval")}}))
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), page)
    no_exceptions(at)
    assert any("audit.json: not an FCA audit report" in e.value for e in at.error), [e.value for e in at.error]
    # Cut short (a disk filled while it was copied): said so, where it had been shown as "Audit report: none".
    shipped = (tiny_demo / "audit.json").read_text()
    (tmp_path / "audit.json").write_text(shipped[: len(shipped) // 2])
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), page)
    no_exceptions(at)
    assert any("audit.json: not a readable audit report (" in e.value for e in at.error), [e.value for e in at.error]
    # ... and not then that there is no report (the messages contradicted each other).
    notes = [m.value for m in (*at.warning, *at.info)]
    assert not [n for n in notes if n.startswith("No audit report")], notes
    said = "No readable audit report for this cache" if page.endswith("overview.py") else "could not be read"
    assert any(said in n for n in notes), notes
    if page.endswith("overview.py"):  # and how to make one again
        assert any("audit.json` cannot be read; to audit it again, beside it:" in n for n in notes), notes
        assert any("python -m fca audit --model" in c.value for c in at.code)
    if page.endswith("overview.py"):  # its calibration cache no longer sends the reader to the damaged report
        at = render(app_for(monkeypatch, [tmp_path], tmp_path / "calibration"), page)
        notes = [m.value for m in at.warning]
        assert not [n for n in notes if "has an audit report" in n] and any("not audited yet" in n for n in notes)


def test_execution_without_a_model_does_not_offer_a_measurement(tiny_demo, tmp_path, monkeypatch):
    """A cache with no model folder beside it: "Measure now" is disabled, and the page said to press it."""
    for name in ("eval", "calibration"):
        shutil.copytree(tiny_demo / name, tmp_path / name)
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/execution.py")
    no_exceptions(at)
    assert at.button(key="exec_measure").disabled
    notes = [m.value for m in at.info]
    assert notes and not [n for n in notes if "Press **Measure now**" in n], notes
    assert "Nor is the model that made it beside it" in notes[0]


def test_mismatched_model_fingerprint_shows_error(tiny_demo, tmp_path, monkeypatch):
    for name in ("featuregate", "eval", "calibration", "audit.json"):
        (shutil.copytree if (tiny_demo / name).is_dir() else shutil.copy)(tiny_demo / name, tmp_path / name)
    for split in ("eval", "calibration"):  # both caches say another model made them (so they still pair)
        manifest = json.loads((tmp_path / split / "manifest.json").read_text())
        manifest["model"]["fingerprint"] = "0" * 64
        (tmp_path / split / "manifest.json").write_text(json.dumps(manifest))
    at = app_for(monkeypatch, [tmp_path], tmp_path / "eval")
    render(at, "views/overview.py")
    no_exceptions(at)
    assert any("different model" in e.value or "do not describe this cache" in e.value for e in at.error)
    render(at, "views/replay_lab.py")  # drawn without the model; the run that loads it says so
    no_exceptions(at)
    next(b for b in at.button if b.label == "Run").click().run()
    at.session_state["replay_job"].wait(60)
    at.run()
    no_exceptions(at)
    assert any("made by a different model" in e.value for e in at.error), [e.value for e in at.error]
    render(at, "views/variance.py")  # the statistics do not need the model: still shown
    no_exceptions(at)
    assert len(at.get("plotly_chart")) >= 1


# ------------------------------------------------------------------ issue 12: figures, fragments, sidebar, state


def _charts(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_heatmaps_label_the_tokens_that_fit_and_centre_diverging_scales_on_zero():
    from app import figures

    tokens = [f"t{i}" for i in range(64)]
    z = pd.DataFrame(np.linspace(-1, 3, 3 * 64).reshape(3, 64), index=["a", "b", "c"], columns=range(10, 74))
    diverging = figures.token_layer_heatmap(z, tokens, "mean deviation (0 = white)", "t", diverging=True)
    trace = diverging.data[0]
    assert trace.zmid == 0 and trace.zmin == -trace.zmax == -3  # symmetric around the neutral value
    assert trace.colorbar.title.text == "mean deviation (0 = white)"
    # 64 tokens: every 6th labelled (all of them ran together on an 800 px screen), the step on the axis
    assert list(diverging.layout.xaxis.tickvals) == [f"{p}:{t}" for p, t in zip(range(10, 74), tokens)][::6]
    assert "every 6th labelled" in diverging.layout.xaxis.title.text
    magnitude = figures.token_layer_heatmap(z.abs(), tokens, "RMS deviation (>= 0)", "t").data[0]
    assert magnitude.zmid is None and "RdBu" not in str(magnitude.colorscale)  # sequential for magnitudes

    dev = figures.deviation_heatmap(np.ones((64, 4)) - 0.5, ["s0/x", "s0/y", "s1/x", "s1/y"], tokens, "t", first=5)
    assert dev.data[0].zmid == 0 and "0 = white" in dev.data[0].colorbar.title.text
    # beside slot names, a narrower plot: every 7th
    assert len(dev.layout.xaxis.tickvals) == 10 and dev.layout.xaxis.ticktext[:2] == ("5:t0", "12:t7")
    assert len(dev.layout.shapes) == 1  # one divider between the two sites


def test_slot_heatmap_groups_the_channel_axis():
    from app import figures

    labels = [f"attn.{i}" for i in range(6)] + [f"mlp.{i}" for i in range(6)]
    df = pd.DataFrame(
        {
            "site": [s for s in ("b0", "b1") for _ in labels],
            "channel": list(range(12)) * 2,
            "label": labels * 2,
            "value": np.arange(24.0),
        }
    )
    fig = figures.slot_heatmap(df, "mean coefficient over tokens (unitless)", "t")
    assert list(fig.layout.xaxis.ticktext) == labels and list(fig.layout.xaxis.tickvals) == list(range(12))
    assert [s.x0 for s in fig.layout.shapes] == [5.5]  # the attn | mlp divider
    assert fig.layout.xaxis.title.text == "channel: columns attn 0-5 | mlp 6-11"
    assert fig.data[0].colorbar.title.text.replace("<br>", " ") == "mean coefficient over tokens (unitless)"
    assert figures.channel_groups(["q", "q", "k"]) == [("q", 0, 1), ("k", 2, 2)]


def test_token_strip_labels_a_few_spread_tokens_and_the_chosen_one():
    from app import figures

    T = 128
    strip = pd.DataFrame({"pos": np.arange(T), "token": [f"w{i}" for i in range(T)], "deviation": np.arange(T) % 7})
    fig = figures.token_strip(strip, chosen=3, max_labels=16)
    text = list(fig.data[0].text)
    shown = [i for i, t in enumerate(text) if t]
    assert 3 in shown and len(shown) <= 16
    assert all(b - a >= T // 16 for a, b in zip(shown, shown[1:]))  # spaced: labels cannot pile up
    assert list(fig.data[0].customdata) == strip["token"].tolist()  # every token is in the hover


def test_flops_bar_states_the_controller_share():
    from app import figures

    fig = figures.flops_bar(pd.DataFrame({"part": ["controllers", "rest of the model"], "gflops": [0.0283, 6.241]}))
    assert sum(t.x[0] for t in fig.data) == pytest.approx(100)
    assert "controllers: 0.45%" in fig.layout.annotations[0].text
    # Each legend entry on two short lines (on one, "rest of the model: ..." ran past the chart at 800 px).
    assert [t.name for t in fig.data] == [
        "controllers: 0.45%<br>(0.0283 GFLOP)",
        "rest of the model: 99.55%<br>(6.2410 GFLOP)",
    ]


def test_variance_page_controls_and_colour_scales(tiny_demo, monkeypatch):
    from fca.tables.store import open_cache

    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/variance.py")
    no_exceptions(at)
    # The factor chart ticks each within-slot factor's chance level (the token id's is the largest: most groups).
    factors = next(c for c in _charts(at) if "What explains the variance" in json.dumps(c))
    ticks = next(t for t in factors["data"] if t.get("name") == "chance level")
    chance = dict(zip(ticks["y"], ticks["x"]))
    assert chance["site"] is None and chance["residual after slot"] is None
    assert 0 < chance["position within slot"] < chance["token id within slot"] < 0.5
    # Lazy tabs: only the open section runs (the first by default); opening another runs it instead.
    assert at.radio(key="var_quantity") is not None and not [n for n in at.number_input if n.key == "var_seq"]
    at.session_state["var_section"] = VARIANCE_SECTIONS[1]
    at.run()
    no_exceptions(at)
    assert any(c["data"][0]["type"] == "box" for c in _charts(at)) and not [
        r for r in at.radio if r.key == "var_quantity"
    ]
    # A cache smaller than the sample is not called a sample of itself.
    tokens = open_cache(tiny_demo / "eval").num_seqs * open_cache(tiny_demo / "eval").seq_len
    assert [c.value for c in at.caption if c.value.startswith(f"Quantiles over all {tokens:,} tokens of the cache.")]
    at.session_state["var_section"] = VARIANCE_SECTIONS[2]
    at.run()
    assert at.number_input(key="var_seq") is not None
    at.selectbox(key="var_summary").set_value("mean deviation from slot mean (SDs)").run()
    no_exceptions(at)
    tokens = next(c for c in _charts(at) if "token x layer" in json.dumps(c) or "deviation" in json.dumps(c))
    heat = next(t for t in tokens["data"] if t["type"] == "heatmap")
    assert heat["zmid"] == 0 and "0 = white" in heat["colorbar"]["title"]["text"]
    at.selectbox(key="var_summary").set_value("RMS deviation from slot mean (SDs)").run()
    at.session_state["var_section"] = VARIANCE_SECTIONS[0]
    at.run()
    # Per slot, the layer-identity share in percent, as everywhere else on the page (it was a fraction).
    at.radio(key="var_quantity").set_value("layer-identity share").run()
    no_exceptions(at)
    heat = next(t for c in _charts(at) for t in c["data"] if t["type"] == "heatmap")
    z = heat["z"]  # (plotly sends a numpy array as typed bytes)
    shares = (
        np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]) if isinstance(z, dict) else np.array(z, float)
    )
    assert "(%)" in heat["colorbar"]["title"]["text"] and 1 < np.nanmax(shares) <= 100
    at.radio(key="var_quantity").set_value("standard deviation").run()
    no_exceptions(at)
    assert not at.error


@pytest.mark.slow
def test_settings_survive_other_tabs_and_pages(tiny_demo, monkeypatch):
    """A widget not drawn in a run (a lazy tab left closed, another page) lost its value: set to standard
    deviation, the Variance quantity came back as the mean after a look at another tab, and a sequence
    picked in Token text was 0 again after a visit to the Overview."""
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/variance.py")
    at.radio(key="var_quantity").set_value("standard deviation").run()
    at.session_state["var_section"] = VARIANCE_SECTIONS[2]
    at.run()
    at.number_input(key="var_seq").set_value(5).run()
    at.selectbox(key="var_summary").set_value("RMS deviation from slot mean (SDs)").run()
    at.session_state["var_section"] = VARIANCE_SECTIONS[0]
    at.run()
    no_exceptions(at)
    assert at.radio(key="var_quantity").value == "standard deviation"
    at.session_state["var_section"] = VARIANCE_SECTIONS[2]
    at.run()
    assert at.number_input(key="var_seq").value == 5
    assert at.selectbox(key="var_summary").value == "RMS deviation from slot mean (SDs)"
    render(at, "views/token_text.py")
    at.number_input(key="tt_seq").set_value(3).run()
    at.radio(key="tt_mode").set_value(at.radio(key="tt_mode").options[-1]).run()
    chosen = at.radio(key="tt_mode").value
    render(at, "views/overview.py")
    render(at, "views/token_text.py")
    no_exceptions(at)
    assert at.number_input(key="tt_seq").value == 3 and at.radio(key="tt_mode").value == chosen
    render(at, "views/profiles.py")
    at.number_input(key="prof_seq").set_value(2).run()
    at.number_input(key="prof_token").set_value(7).run()
    render(at, "views/variance.py")
    render(at, "views/profiles.py")
    no_exceptions(at)
    assert at.number_input(key="prof_seq").value == 2 and at.number_input(key="prof_token").value == 7
    # The open tab too: Variance and Profiles came back on their first tab after another page.
    at.session_state["prof_section"] = "Every token: deviation heatmap"
    at.run()
    render(at, "views/variance.py")
    at.session_state["var_section"] = VARIANCE_SECTIONS[2]
    at.run()
    render(at, "views/token_text.py")
    render(at, "views/variance.py")
    no_exceptions(at)
    assert at.session_state["var_section"] == VARIANCE_SECTIONS[2] and at.number_input(key="var_seq").value == 5
    render(at, "views/profiles.py")
    assert at.session_state["prof_section"] == "Every token: deviation heatmap"


def test_a_kept_setting_that_does_not_fit_the_next_cache_gives_way(tiny_demo, tmp_path, monkeypatch):
    """Sequence 7 of an 8-sequence cache, kept while another cache of 4 sequences is opened, is its default."""
    from fca.jobs.build import build_cache_from_corpus

    build_cache_from_corpus(
        tiny_demo / "featuregate", next(tiny_demo.glob("*.txt")), "eval", tmp_path / "small", num_seqs=4,
        batch_size=4, device="cpu", show_progress=False,
    )  # fmt: skip
    at = render(app_for(monkeypatch, [tiny_demo, tmp_path], tiny_demo / "eval"), "views/token_text.py")
    at.number_input(key="tt_seq").set_value(7).run()
    at.sidebar.selectbox(key="cache").set_value(str(tmp_path / "small")).run()
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    assert at.number_input(key="tt_seq").value == 0
    # Channels are named as the Variance and Profiles pages name them (channel 1 was "1" here, "attn.1" there).
    from fca.tables.store import open_cache

    labels = open_cache(tmp_path / "small").site_specs[at.selectbox(key="tt_site").value].channel_labels
    assert labels and at.selectbox(key="tt_channel").options[1:] == list(labels)
    at.selectbox(key="tt_channel").set_value(1).run()
    no_exceptions(at)
    assert f"channel {labels[1]}: coefficient value" in json.dumps([h.proto.body for h in at.get("html")])


def test_profiles_empty_sites_says_all_are_shown(tiny_demo, monkeypatch):
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/profiles.py")
    at.multiselect(key="prof_sites").set_value([]).run()
    no_exceptions(at)
    assert any("No site chosen: showing all" in c.value for c in at.caption)
    at.selectbox(key="prof_band").set_value("25-75%").run()
    at.number_input(key="prof_token").set_value(3).run()
    no_exceptions(at)
    assert "position 3" in json.dumps(_charts(at))


def test_execution_says_when_its_timed_runs_spread_too_widely(tiny_demo, tmp_path, monkeypatch):
    """Measured beside other work, the runs ranged from 0.96x to 1.28x and the page showed their median
    as the figure, with nothing to say it was noise (the report's Markdown said so; the page did not)."""
    for name in ("featuregate", "dense", "eval", "calibration", "audit.json"):
        (shutil.copytree if (tiny_demo / name).is_dir() else shutil.copy)(tiny_demo / name, tmp_path / name)
    report = json.loads((tmp_path / "audit.json").read_text())
    for low, high, noisy in ((0.98, 1.2, False), (0.96, 1.28, True)):  # (the tiny audit's own runs vary)
        report["execution"].update(ratio_min=low, ratio_max=high)
        (tmp_path / "audit.json").write_text(json.dumps(report))
        at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/execution.py")
        no_exceptions(at)
        said = [w.value for w in at.warning if "too wide to trust" in w.value]
        median = report["execution"]["latency_ratio_vs_dense"]
        assert said == ([f"The timed runs ranged from {low:.2f}x to {high:.2f}x: too wide to trust. Other work "
                         "shared the machine while they ran (a replay, a build, a second tab); measure again when "
                         f"it is idle. Their median was {median:.3f}x."] if noisy else [])  # fmt: skip
        shown = [m.value for m in at.metric if m.label == "Time vs Dense twin"]
        assert shown == (["too noisy"] if noisy else [f"{median:.3f}x"])  # (the median: in the warning)


def test_execution_of_a_model_that_skips_blocks_says_so_and_draws_them(tiny_demo, tmp_path, monkeypatch):
    """The page's branch for skipped blocks (no shipped model skips any) had never been drawn: an audit whose
    second block ran for half the tokens says so, per block."""
    for name in ("featuregate", "dense", "eval", "calibration", "audit.json"):
        (shutil.copytree if (tiny_demo / name).is_dir() else shutil.copy)(tiny_demo / name, tmp_path / name)
    report = json.loads((tmp_path / "audit.json").read_text())
    exe = report["execution"]
    tokens = exe["tokens"]
    exe["tokens_per_block"] = [tokens, tokens // 2] + [tokens] * (exe["num_blocks"] - 2)
    exe["blocks_executed_per_token"] = sum(exe["tokens_per_block"]) / tokens
    exe["uncounted_ops"] = ["aten._int_mm"]  # and a product the FLOP counter could not count
    (tmp_path / "audit.json").write_text(json.dumps(report))
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/execution.py")
    no_exceptions(at)
    assert [w.value for w in at.warning if w.value.startswith("Not counted: aten._int_mm (this torch's")]
    said = " ".join(m.value for m in at.markdown)
    assert f"**Some blocks were skipped**: a token ran {exe['blocks_executed_per_token']:.2f} of" in said
    blocks = next(c for c in _charts(at) if "Blocks executed per token" in json.dumps(c["layout"]))
    assert blocks["data"][0]["text"][:2] == ["100%", "50%"]


def test_an_undefined_layer_identity_share_is_not_shown_as_zero(tiny_demo, tmp_path, monkeypatch):
    """Where the coefficients do not vary the audit writes a null share; the Overview had shown it as 0.0%,
    the opposite of what it means (the Markdown report says "undefined")."""
    from app.views.common import share_text

    assert (share_text(None), share_text(0.0), share_text(0.8766)) == ("n/a", "0.0%", "87.7%")
    for name in ("featuregate", "dense", "eval", "calibration", "audit.json"):
        (shutil.copytree if (tiny_demo / name).is_dir() else shutil.copy)(tiny_demo / name, tmp_path / name)
    report = json.loads((tmp_path / "audit.json").read_text())
    report["variance"]["layer_identity_share"] = None
    report["variance"]["per_site"] = dict.fromkeys(report["variance"]["per_site"])
    (tmp_path / "audit.json").write_text(json.dumps(report))
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/overview.py")
    no_exceptions(at)
    assert [m.value for m in at.metric if m.label == "Layer-identity share"] == ["n/a"]


@pytest.mark.slow
def test_execution_measurement_belongs_to_its_cache(tiny_demo, tmp_path, monkeypatch):
    other = tmp_path / "other"
    for name in ("featuregate", "dense", "eval", "calibration", "audit.json"):
        (shutil.copytree if (tiny_demo / name).is_dir() else shutil.copy)(tiny_demo / name, other / name)
    report = json.loads((other / "audit.json").read_text())
    report["execution"]["controller_flops_share"] = 0.1234  # marks this cache's report
    report["cache"]["fingerprint"] = "0" * 64  # as if the cache had been rebuilt since
    (other / "audit.json").write_text(json.dumps(report))
    # Root tmp_path, so the copy is listed as `other/eval`, not a second `eval` (the box matches labels).
    at = render(app_for(monkeypatch, [tiny_demo, tmp_path], tiny_demo / "eval"), "views/execution.py")
    at.sidebar.selectbox(key="device").set_value("cpu").run()
    at.button(key="exec_measure").click().run()
    no_exceptions(at)
    assert any("measured just now" in c.value for c in at.caption)
    at.sidebar.selectbox(key="cache").set_value(str(other / "eval")).run()
    no_exceptions(at)
    assert not any("measured just now" in c.value for c in at.caption)
    assert any("audit report beside the cache" in c.value for c in at.caption)
    assert at.metric[2].value == "12.34%"  # the new cache's report, not the previous measurement
    assert [w.value for w in at.warning if "before this cache was rebuilt" in w.value]
    at.sidebar.selectbox(key="cache").set_value(str(tiny_demo / "eval")).run()
    assert any("measured just now" in c.value for c in at.caption)  # kept for the cache it measured


def test_sidebar_matches_typed_paths_and_explains_missing_ones(tiny_demo, tmp_path, monkeypatch):
    from app.views.common import match_typed, typed_outside, typed_problem

    root = tmp_path / "root"
    shutil.copytree(tiny_demo / "eval", root / "local" / "eval")
    listed = [str(root / "local" / "eval"), str(REPO / "cache" / "demo" / "eval")]
    for typed, path in {
        "local/eval/": root / "local" / "eval",  # a label, relative to its root
        f"{root}/local/eval//": root / "local" / "eval",
        " local/eval ": root / "local" / "eval",
        "cache/demo/eval/": REPO / "cache" / "demo" / "eval",  # relative to the repository, as in the issue
    }.items():
        assert match_typed(typed, [root], listed, REPO) == str(path), typed
    assert match_typed("cache/demo/nope", [root], listed, REPO) is None

    # Where relative paths are read from is said only of a relative path (an absolute one names its folder).
    assert typed_problem(str(root / "missing"), [root], REPO) == f"there is no folder {root / 'missing'}."
    assert typed_problem("local/missing", [root], REPO).startswith(
        f"there is no folder local/missing (relative paths are read from {REPO})"
    )
    # A folder that does not exist is a typo more often than not: said so, and, outside the roots, that too
    # (as of a folder that is there, outside the roots).
    assert not typed_outside(str(tmp_path / "nowhere"), [root], REPO)
    assert typed_outside(str(tmp_path), [root], REPO)  # a folder that is there, outside the roots: said so
    assert typed_problem(str(tmp_path / "nowhere"), [root], REPO) == (
        f"there is no folder {tmp_path / 'nowhere'}; it is also outside the configured roots "
        "(set FCA_CACHE_ROOTS to allow it)."
    )
    assert "not a cache" in typed_problem("local", [root], REPO)
    assert typed_problem("local/eval/", [root], REPO) is None
    # Text the system cannot look up was an exception box (RuntimeError, ValueError, OSError).
    for odd in ("~nosuchuser/x", "a\0b", "x" * 300, "local/" + "y" * 300):
        assert match_typed(odd, [root], listed, REPO) is None, odd
        typed_outside(odd, [root], REPO)  # answers (it raised RuntimeError, ValueError or OSError)
        problem = typed_problem(odd, [root], REPO)
        assert problem.startswith("there is no folder") or "is not a path: a path cannot hold a NUL" in problem

    # AppTest cannot type into the box; what it can do: a cache built while the page is open appears
    # when asked (or on a rerun after the 2 s re-scan).
    at = app_for(monkeypatch, [root], root / "local" / "eval").run()
    assert "local/eval (eval, 8 seq)" in at.sidebar.selectbox(key="cache").options
    shutil.copytree(tiny_demo / "eval", root / "new" / "eval")
    at.sidebar.button(key="cache_rescan").click().run()
    assert "new/eval (eval, 8 seq)" in at.sidebar.selectbox(key="cache").options
    (root / "bad").mkdir()
    (root / "bad" / "manifest.json").write_text("{not json")  # listed as such (it was "(?, 0 seq)")
    at.sidebar.button(key="cache_rescan").click().run()
    assert any(o.startswith("bad (unreadable: not valid JSON (") for o in at.sidebar.selectbox(key="cache").options)


@pytest.mark.slow
def test_a_default_cache_that_is_not_listed_is_said_and_another_is_shown(tiny_demo, tmp_path, monkeypatch):
    """The repository's own cache folder is always a root, so the shipped demo is what is shown instead."""
    root = tmp_path / "root"
    shutil.copytree(tiny_demo / "eval", root / "eval")
    (root / "notes").mkdir()
    for default, why in (
        (root / "evl", "there is no such folder"),
        (root / "notes", "the folder has no manifest.json"),
        (tiny_demo / "eval", "it is outside the configured roots (add its folder to FCA_CACHE_ROOTS)"),
    ):
        at = app_for(monkeypatch, [root], default).run()
        no_exceptions(at)
        said = [w.value for w in at.sidebar.warning]
        assert said == [f"FCA_DEFAULT_CACHE={default}: {why}; another cache is selected instead."]
        assert at.sidebar.selectbox(key="cache").value == str(REPO / "cache" / "demo" / "eval")
    at = app_for(monkeypatch, [root], root / "eval").run()
    assert not at.sidebar.warning and at.sidebar.selectbox(key="cache").value == str(root / "eval")
    at = app_for(monkeypatch, [root, tmp_path / "roots"], root / "eval").run()  # a mistyped root is said too
    said = f"FCA_CACHE_ROOTS names {tmp_path / 'roots'}: no such folder, so no cache is listed from it."
    assert [w.value for w in at.sidebar.warning] == [said]
    for odd in ("~nosuchuser/x", "/" + "y" * 300):  # no such user, a name too long: no exception box
        at = app_for(monkeypatch, [root, Path(odd)], Path(odd)).run()
        no_exceptions(at)
        assert any("FCA_CACHE_ROOTS names" in w.value for w in at.sidebar.warning)


# ------------------------------------------------------------------ the Replay lab's state


def _lab_copy(tiny_demo: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny demo, so runs saved here are the only ones its lab lists."""
    root = tmp_path / "lab"
    for part in ("featuregate", "eval", "calibration"):
        shutil.copytree(tiny_demo / part, root / part)
    return root


def _lab_settings(root: Path, **kw) -> dict:
    settings = dict(
        model=str(root / "featuregate"),
        cache=str(root / "eval"),
        calibration=str(root / "calibration"),
        conditions=["static_layer"],
        num_seqs=4,
        seed=0,
        device="cpu",
        batch_size=2,
    )
    return {**settings, **kw}


LAB_WIDGETS = ["lab_kinds", "lab_sites", "lab_sweep", "lab_alpha", "lab_independent", "lab_num_seqs", "lab_seed"]


def test_lab_run_labels_and_csv_rows_are_plain():
    from fca.tables.runs import run_label, run_labels, saved_run_rows, sweep_conditions

    spec = {"conditions": ["correct", "static_layer", "global_mean"], "num_seqs": 16, "seed": 3, "batch_size": 2}
    assert run_label(spec) == "static_layer + global_mean, n=16, seed 3"
    assert run_label({**spec, "conditions": ["correct"]}) == "correct, n=16, seed 3"
    sweep = ["correct", *[c.spec for c in sweep_conditions(["layers.0.gate"], 3)]]
    assert run_label({**spec, "conditions": sweep}) == "interpolate:0,0.25,0.5,0.75,1@layers.0.gate, n=16, seed 3"
    # The Result heading is Markdown, where `x@y.z` became a mailto link: names of sites are code there.
    from fca.tables.report import condition_cell

    mixed = {**spec, "conditions": ["correct", "static_layer@layers.2.gate", "global_mean", *sweep[1:]]}
    assert run_label(mixed, condition_cell) == (
        "`static_layer@layers.2.gate` + global_mean + `interpolate:0,0.25,0.5,0.75,1@layers.0.gate`, n=16, seed 3"
    )
    results = {
        "conditions": {
            "correct": {"nll": 3.0, "penalty": 0.0, "penalty_ci95": [0.0, 0.0]},
            "static_layer": {"nll": 3.5, "penalty": 0.5, "penalty_ci95": [0.4, 0.6]},
        },
        "per_sequence_nll": {"correct": [2.0, 4.0], "static_layer": [3.0, 4.0]},
    }
    records = [{"spec": spec, "results": results, "created": f"2025-01-02T03:04:0{i}Z"} for i in range(2)]
    labels = run_labels(records)
    assert len(set(labels)) == 2 and all(x.startswith("static_layer + global_mean, n=16, seed 3 (") for x in labels)
    rows = saved_run_rows(records)
    assert [r["run"] for r in rows] == [labels[0]] * 2 + [labels[1]] * 2
    columns = list(rows[0])
    assert {"run", "sequences", "seed", "batch size", "penalty 95% CI low", "penalty 95% CI high"} <= set(columns)
    assert not {"ci_lo", "ci_hi", "lo", "hi"} & set(columns)
    correct = rows[0]
    # two sequences (2 and 4) give no interval: their bootstrap means, 2, 3 or 4, would call [2, 4] a 95% CI
    assert np.isnan([correct["NLL 95% CI low"], correct["NLL 95% CI high"]]).all() and correct["sequences"] == 16
    assert (correct["seed"], correct["batch size"]) == (
        records[0]["spec"]["seed"],
        records[0]["spec"].get("batch_size"),
    )
    assert "gap retention" not in columns  # no global_mean, no gap
    from fca.tables.runs import condition_rows

    results["conditions"]["global_mean"] = {"nll": 4.0, "penalty": 1.0, "penalty_ci95": [0.5, 1.5]}
    retention = {r["condition"]: r["gap retention"] for r in condition_rows({"spec": spec, "results": results})}
    assert retention == {"correct": None, "static_layer": 0.5, "global_mean": None}  # (4 - 3.5) / (4 - 3)


def test_saved_runs_list_newest_first_across_time_stamp_precisions(tmp_path):
    """Records of earlier versions carry whole seconds, ours milliseconds: the list orders them by time,
    not by file name ('05Z' sorted after '05.900Z'); a record without a readable time comes last."""
    from fca.tables.runs import list_runs, save_run

    results = {"conditions": {"correct": {"nll": 1.0, "penalty": 0.0, "penalty_ci95": [0.0, 0.0]}}}
    stamps = ["2026-12-01T23:00:05.900Z", "2026-12-01T23:00:05Z", "2026-12-01T23:00:06.010Z", "not a time"]
    for n, created in enumerate(stamps):
        save_run(
            tmp_path / "c",
            {"spec": {"conditions": ["correct"], "num_seqs": n + 1, "seed": 0}, "results": results, "created": created},
        )
    assert [r["created"] for r in list_runs(tmp_path / "c")] == [stamps[2], stamps[0], stamps[1], stamps[3]]


def test_saved_runs_with_a_damaged_field_are_skipped():
    """These passed the record check and then failed the Replay lab's table (an exception box)."""
    from fca.tables.runs import is_run_record

    good = {
        "spec": {"conditions": ["correct", "static_layer"], "num_seqs": 2, "seed": 3},
        "results": {
            "conditions": {"static_layer": {"nll": 1.0, "penalty": 0.1, "penalty_ci95": [0.0, 0.2]}},
            "per_sequence_nll": {"static_layer": [1.0, 1.0]},
        },
    }
    assert is_run_record(good)
    for damage in (
        lambda r: r["spec"].pop("seed"),
        lambda r: r["spec"].update(seed="x"),
        lambda r: r["spec"].update(conditions=[5, None]),
        lambda r: r["results"]["per_sequence_nll"].update(static_layer=None),
        lambda r: r["results"]["per_sequence_nll"].update(static_layer=["x"]),
        lambda r: r["results"]["conditions"]["static_layer"].update(nll=True),  # (a bool is no number)
        lambda r: r["results"]["per_sequence_nll"].update(static_layer=[1.0, False]),
        lambda r: r["results"].update(routing={"conditions": {"static_layer": {"tied": 0.5}}}),
    ):
        record = json.loads(json.dumps(good))
        damage(record)
        assert not is_run_record(record), record


def test_a_runs_nll_interval_is_the_runs_own_bootstrap():
    """The NLL CI of a saved run resamples its sequences with the run's seed, as the audit's penalty CIs."""
    from fca.tables.runs import condition_rows
    from fca.tables.stats import paired_bootstrap_ci

    values = [3.0, 3.5, 2.5, 4.0, 3.2, 2.9, 3.8, 3.1, 3.3, 2.7, 3.6, 3.4]
    record = {
        "spec": {"conditions": ["correct"], "num_seqs": 12, "seed": 3},
        "results": {
            "conditions": {"correct": {"nll": float(np.mean(values)), "penalty": 0.0, "penalty_ci95": [0.0, 0.0]}},
            "per_sequence_nll": {"correct": values},
        },
    }
    row = condition_rows(record)[0]
    ours = (row["NLL 95% CI low"], row["NLL 95% CI high"])
    assert ours == paired_bootstrap_ci(np.array(values), 2000, 3) != paired_bootstrap_ci(np.array(values), 2000, 4)
    assert "penalty 95% CI low (documents)" not in row  # a run whose cache records no documents
    record["results"]["conditions"]["correct"]["penalty_ci95_documents"] = [-0.5, 0.25]
    row = condition_rows(record)[0]
    assert (row["penalty 95% CI low (documents)"], row["penalty 95% CI high (documents)"]) == (-0.5, 0.25)


def test_lab_sweep_points_and_figure():
    from app.figures import sweep_curve
    from fca.tables.runs import sweep_points

    conditions = {"correct": {"nll": 3.0, "penalty": 0.0, "penalty_ci95": [0.0, 0.0]}}
    assert sweep_points(conditions) == []
    for alpha, nll in [(1.0, 3.0), (0.0, 3.4), (0.5, 3.2)]:
        conditions[f"interpolate:{alpha:g}"] = {
            "nll": nll,
            "penalty": nll - 3.0,
            "penalty_ci95": [nll - 3.1, nll - 2.9],
        }
    conditions["interpolate:0.5@blocks.0.gate"] = {"nll": 3.1, "penalty": 0.1, "penalty_ci95": [0.0, 0.2]}
    sweep = sweep_points(conditions)  # the sites most interpolations share, by alpha
    assert [(row["alpha"], row["nll"]) for row in sweep] == [(0.0, 3.4), (0.5, 3.2), (1.0, 3.0)]
    fig = sweep_curve(sweep, conditions)
    assert list(fig.data[0].x) == [0.0, 0.5, 1.0] and list(fig.data[0].y) == [3.4, 3.2, 3.0]
    assert "alpha" in fig.layout.xaxis.title.text and fig.layout.title.text


def test_lab_form_is_locked_while_a_run_is_in_flight(tiny_demo, tmp_path, monkeypatch):
    import threading

    from app.jobs import ReplayJob

    root = _lab_copy(tiny_demo, tmp_path)
    at = render(app_for(monkeypatch, [root], root / "eval"), "views/replay_lab.py")
    gate = threading.Event()
    job = ReplayJob(_lab_settings(root), total=4)
    job.start(lambda **kw: gate.wait(60) and None)  # in flight until the gate opens
    try:
        at.session_state["replay_job"] = job
        at.run()
        no_exceptions(at)
        widgets = [*at.multiselect, *at.checkbox, *at.slider, *at.number_input]
        lab = [w for w in widgets if (w.key or "").startswith("lab_")]
        assert {w.key for w in lab} >= set(LAB_WIDGETS) and all(w.disabled for w in lab)
        assert at.number_input(key="lab_batch").disabled and at.button(key="lab_run").disabled
        assert at.button(key="lab_cancel") is not None and not at.button(key="lab_cancel").disabled
        assert any("Preview, not yet run" in c.value for c in at.caption)
    finally:
        gate.set()
        job.wait(60)
    at.run()
    no_exceptions(at)
    assert not at.button(key="lab_run").disabled and not at.multiselect(key="lab_kinds").disabled


@pytest.mark.slow
def test_lab_results_show_their_own_settings_and_join_the_comparison(tiny_demo, tmp_path, monkeypatch):
    """Cancel, then two runs: each result shows its record's settings and command (not the form's), a
    stale "cancelled" note goes when a run starts or belongs to another cache, and each new run joins
    "Compare runs" by its name."""
    from app.jobs import ReplayJob
    from fca.tables.report import condition_cell
    from fca.tables.runs import run_label

    root = _lab_copy(tiny_demo, tmp_path)
    at = render(app_for(monkeypatch, [root], root / "eval"), "views/replay_lab.py")
    at.sidebar.selectbox(key="device").set_value("cpu").run()
    elsewhere = _lab_settings(root, cache=str(tmp_path / "another" / "eval"))
    at.session_state["replay_job"] = ReplayJob(elsewhere, done=1, total=4, cancelled=True)
    at.run()
    assert not at.warning, "a finished run of another cache says nothing here"
    cancelled = ReplayJob(_lab_settings(root), done=2, total=4, cancelled=True)
    at.session_state["replay_job"] = cancelled
    at.run()
    assert [w.value for w in at.warning] == ["Cancelled after 2 of 4 sequences; nothing was saved."]

    def run_lab(seed: int) -> dict:
        at.number_input(key="lab_num_seqs").set_value(4)
        at.number_input(key="lab_seed").set_value(seed)
        at.button(key="lab_run").click().run()
        no_exceptions(at)
        assert not at.warning, "the previous run's note is gone once a new run starts"
        job = at.session_state["replay_job"]
        job.wait(60)
        assert job.record is not None, job.error
        at.run()
        no_exceptions(at)
        return job.record

    first = run_lab(seed=3)
    # In the build's batches by default: the cache, made on this machine, is held to bit-identity (in batches
    # of 2, the old default, a lab run judged the shipped demo "within tolerance").
    from fca.tables.store import open_cache

    assert first["spec"]["batch_size"] == open_cache(root / "eval").environment["batch_size"] != 2
    assert first["results"]["exactness"]["fidelity"]["verdict"] == "bit-identical"
    # The result's table (the first grid; the saved runs' follows); the values are the record's.
    shown = at.dataframe[0].value.set_index("condition")
    # 4 sequences: no interval, and no interval column (the caption says so; a column saying "none (under 10
    # sequences)" on every row scrolled sideways at 800 px); the NLL's interval is drawn in its chart.
    assert shown.columns.tolist() == ["NLL", "penalty", "gap retention"]
    static = first["results"]["conditions"]["static_layer"]
    assert shown.loc["static_layer", "penalty"] == static["penalty"]
    assert np.isnan(static["penalty_ci95"]).all()
    at.number_input(key="lab_seed").set_value(4).run()  # the form moves on; the result shown must not
    assert any("seed **3**" in m.value for m in at.markdown)
    # 4 of the tiny cache's 8 sequences: said so, and that 4 give no intervals.
    assert any("on the first **4** of the cache's 8 sequences" in m.value for m in at.markdown)
    assert [w.value for w in at.warning if w.value.startswith("Only 4 evaluated sequences: too few for a bootstrap")]
    assert any("without CIs (under 10 sequences)" in c.value for c in at.caption)  # (nor a chart title naming one)
    commands = [c.value for c in at.code]
    assert any("--seed 4" in c for c in commands) and any("--seed 3" in c for c in commands)
    result_command = next(c for c in commands if "--seed 3" in c)
    assert all(c.proto.wrap_lines for c in at.code)  # the result's command wraps in its box as the preview does
    assert f"--num-seqs {first['spec']['num_seqs']}" in result_command
    assert f"--batch {first['spec']['batch_size']}" in result_command
    assert at.subheader[0].value == f"Result: {run_label(first['spec'], condition_cell)}"
    compare = at.multiselect(key=f"lab_compare::{root / 'eval'}")
    assert compare.value == [Path(first["path"]).stem]
    compare.set_value([]).run()  # the user clears the comparison; the next run still joins it
    second = run_lab(seed=5)
    compare = at.multiselect(key=f"lab_compare::{root / 'eval'}")
    assert compare.value == [Path(second["path"]).stem]
    assert at.subheader[0].value == f"Result: {run_label(second['spec'], condition_cell)}"
    assert run_label(second["spec"]) == "static_layer + global_mean, n=4, seed 5"
    assert len(at.get("plotly_chart")) >= 3


def test_lab_interpolation_sweep_in_one_run(tiny_demo, tmp_path, monkeypatch):
    from fca.tables.runs import sweep_conditions

    root = _lab_copy(tiny_demo, tmp_path)
    at = render(app_for(monkeypatch, [root], root / "eval"), "views/replay_lab.py")
    at.sidebar.selectbox(key="device").set_value("cpu")
    at.multiselect(key="lab_kinds").set_value(["static_layer"])
    at.checkbox(key="lab_sweep").check().run()
    assert at.slider(key="lab_alpha").disabled  # the sweep sets the alphas
    sweep = [c.spec for c in sweep_conditions()]  # interpolate:0 ... interpolate:1
    assert " ".join(sweep) in at.code[0].value
    at.number_input(key="lab_num_seqs").set_value(4)
    at.button(key="lab_run").click().run()
    job = at.session_state["replay_job"]
    job.wait(60)
    assert job.record is not None, job.error
    at.run()
    no_exceptions(at)
    names = list(job.record["results"]["conditions"])
    assert names == ["correct", "static_layer", *sweep]
    nll = job.record["results"]["conditions"]
    assert nll[sweep[0]]["nll"] == pytest.approx(nll["static_layer"]["nll"])  # alpha 0: the static profile
    assert nll[sweep[-1]]["nll"] == pytest.approx(nll["correct"]["nll"])  # alpha 1: each token's own coefficients
    assert at.get("plotly_chart")  # the sweep is drawn with the result


def test_a_calibration_cache_opened_says_what_it_is_not_that_things_are_missing(tiny_demo, monkeypatch):
    """Opened on its own, the calibration cache has no calibration cache and no report of its own: said as
    such (the sidebar had "none found", the Execution page "No audit report beside this cache" with the
    demo's audit.json beside it)."""
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "calibration"), "views/execution.py")
    no_exceptions(at)
    assert "Calibration: `none: this is a calibration split`" in " ".join(c.value for c in at.sidebar.caption)
    assert any("No audit report describes this cache" in i.value for i in at.info)


def test_the_overview_quotes_the_shipped_demos_intervals_over_documents(monkeypatch):
    """The demo's windows are 37 chapters: the Overview's table and penalty chart give the CIs over them (the
    per-window ones are too narrow), and a caption says why."""
    report = json.loads((REPO / "cache" / "demo" / "audit.json").read_text())
    at = app_for(monkeypatch, [REPO / "cache"], REPO / "cache" / "demo" / "eval").run()
    no_exceptions(at)
    table = next(m.value for m in at.markdown if m.value.startswith("| condition |"))
    assert "| penalty 95% CI (documents) |" in table and "(sequences)" not in table
    lo, hi = report["conditions"]["static_layer"]["penalty_ci95_documents"]
    # (gap retention right after the condition: at 800 px the NLL, last, is what scrolls out of sight)
    assert f"| static_layer | 42.3% [40.4%, 44.0%] | +0.4456 | [{lo:+.4f}, {hi:+.4f}] | 3.8853 |" in table
    assert any("consecutive stretches of 37 documents" in c.value for c in at.caption)
    bars = next(c for c in at.get("plotly_chart") if '"Penalty vs correct' in c.proto.spec)
    penalty = json.loads(bars.proto.spec)["data"][0]
    static = penalty["x"].index("static_layer")
    y = _decoded(penalty["y"])[static]
    assert _decoded(penalty["error_y"]["array"])[static] == pytest.approx(hi - y)
    assert _decoded(penalty["error_y"]["arrayminus"])[static] == pytest.approx(y - lo)


def test_the_labs_saved_runs_are_read_again_only_when_a_run_or_the_cache_changes(tmp_path):
    """The Replay lab lists a cache's saved runs on every rerun; the listing is kept until a run file or the
    cache's manifest changes, and then read again (a new run is listed, one of other contents is not)."""
    from app import resources
    from fca.tables.runs import save_run
    from fca.tables.store import open_cache
    from fca.tables.writer import CacheWriter

    from .test_writer import _plan_and_schema, _write_pairs

    plan, schema = _plan_and_schema(4)
    cache = _write_pairs(CacheWriter(tmp_path / "c", plan, schema, 2), 0, 4).finish()
    results = {"conditions": {"correct": {"nll": 1.0, "penalty": 0.0, "penalty_ci95": [0.0, 0.0]}}}

    def run(created: str, fingerprint: str) -> None:
        spec = {"conditions": ["correct"], "num_seqs": 4, "seed": 0, "cache_fingerprint": fingerprint}
        save_run(cache, {"spec": spec, "results": results, "created": created})

    run("2026-01-01T00:00:01Z", open_cache(cache).fingerprint)
    first = resources.saved_runs(cache)
    assert [r["created"] for r in first] == ["2026-01-01T00:00:01Z"]
    assert resources.saved_runs(cache) == first
    run("2026-01-01T00:00:02Z", open_cache(cache).fingerprint)
    assert [r["created"][-3:] for r in resources.saved_runs(cache)] == ["02Z", "01Z"]
    plan, schema = _plan_and_schema(6)  # rebuilt: its runs are of the old contents
    _write_pairs(CacheWriter(cache, plan, schema, 2, overwrite=True), 0, 6).finish()
    assert resources.saved_runs(cache) == []
