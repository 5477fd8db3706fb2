"""The dashboard: catalog functions, pure figures, one AppTest per page (demo-shaped and ragged
caches), a replay through the UI equal to the Python API, and the error paths."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fca.tables import catalog

REPO = Path(__file__).resolve().parent.parent
MAIN = str(REPO / "app" / "main.py")
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


def no_exceptions(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


# ------------------------------------------------------------------ library side: catalog, figures


def test_fca_imports_neither_streamlit_nor_plotly():
    code = (
        "import sys, fca, fca.tables.catalog, fca.jobs.runs, fca.jobs.audit, fca.tables.profiles, fca.tables.stats, fca.tables.store, fca.engine.execution;"
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
    assert broken.error and "unreadable manifest" in broken.error


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


def test_overview_and_sidebar_never_import_pandas(tiny_demo):
    """The first page's speed rests on this (see app/views/overview.py): in a fresh interpreter, the
    sidebar and the Overview draw their charts, cards and downloads without importing pandas."""
    code = (
        "import sys\n"
        "from streamlit.testing.v1 import AppTest\n"
        f"at = AppTest.from_file({MAIN!r}, default_timeout=60).run()\n"
        "assert not at.exception and not at.error, [e.value for e in (*at.exception, *at.error)]\n"
        "assert len(at.get('plotly_chart')) == 2 and len(at.metric) == 3 and len(at.get('download_button')) == 3\n"
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


KEY_WIDGETS = {
    "views/overview.py": lambda at: len(at.metric) == 3 and len(at.download_button) >= 2,
    "views/variance.py": lambda at: (
        at.radio(key="var_quantity") is not None and at.number_input(key="var_seq") is not None
    ),
    "views/profiles.py": lambda at: (
        at.number_input(key="prof_token") is not None and at.selectbox(key="prof_band") is not None
    ),
    "views/replay_lab.py": lambda at: (
        at.multiselect(key="lab_kinds") is not None and at.slider(key="lab_alpha") is not None
    ),
    "views/execution.py": lambda at: at.button(key="exec_measure") is not None and len(at.metric) == 3,
}


@pytest.mark.parametrize("page", PAGES)
def test_page_renders(page, tiny_demo, monkeypatch):
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), page)
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    assert at.sidebar.selectbox(key="cache").value == str(tiny_demo / "eval")
    assert at.sidebar.selectbox(key="device").options == ["auto", "cuda", "cpu"]
    assert at.title, "every page opens with a title and teaching text"
    assert KEY_WIDGETS[page](at)
    if page != "views/replay_lab.py":  # the lab draws charts once a run exists
        assert len(at.get("plotly_chart")) >= 1


def test_profiles_token_by_index(tiny_demo, monkeypatch):
    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/profiles.py")
    at.number_input(key="prof_token").set_value(5).run()
    no_exceptions(at)
    assert "position 5" in json.dumps([c.proto.spec for c in at.get("plotly_chart")])


def _ragged_caches(root: Path) -> Path:
    """MUDD-like sites of different widths (stream x source, per-channel families q/k/v/r) and an MoE
    router site, written with the library's own writer; no model beside them."""
    from fca.engine.sites import SiteSpec
    from fca.tables.store import CacheWriter, cache_schema, record_batch, spec_to_json

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
        at.radio(key="var_view").set_value(at.radio(key="var_view").options[1]).run()  # one panel per stream
        no_exceptions(at)
    if page == "views/replay_lab.py":  # no model beside the cache: said, not crashed
        assert any("model directory" in e.value for e in at.error)


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


# ------------------------------------------------------------------ replay through the UI


def test_ui_replay_equals_python_api(tiny_demo, monkeypatch):
    from fca.jobs.runs import run_replay

    at = render(app_for(monkeypatch, [tiny_demo], tiny_demo / "eval"), "views/replay_lab.py")
    at.sidebar.selectbox(key="device").set_value("cpu")
    at.multiselect(key="lab_kinds").set_value(["cross_input", "static_layer", "interpolate"])
    at.slider(key="lab_alpha").set_value(0.25)
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
    assert any(Path(ui["path"]).stem in v for v in at.dataframe[-1].value["run"].tolist())


def test_lab_replays_the_shipped_demo(tmp_path, monkeypatch):
    """The shipped demo, whichever machine wrote it, replays in the lab here with both checks shown."""
    demo = tmp_path / "demo"  # a copy, so the saved run does not land in the repository
    for part in ("featuregate", "eval", "calibration"):
        shutil.copytree(REPO / "cache" / "demo" / part, demo / part)
    at = render(app_for(monkeypatch, [tmp_path], demo / "eval"), "views/replay_lab.py")
    at.sidebar.selectbox(key="device").set_value("cpu")
    at.number_input(key="lab_num_seqs").set_value(8)
    at.number_input(key="lab_batch").set_value(4)
    next(b for b in at.button if b.label == "Run").click().run()
    job = at.session_state["replay_job"]
    job.wait(120)
    assert job.record is not None, job.error
    at.run()
    no_exceptions(at)
    shown = at.success[0].value
    assert "Replay mechanism" in shown and "max |difference| 0" in shown
    assert "Cache fidelity: coefficients computed on" in shown and "replayed on cpu" in shown
    assert job.record["results"]["exactness"]["fidelity"]["verdict"] in ("bit-identical", "within tolerance")


def test_cancel_stops_a_run(tiny_demo):
    from app.jobs import ReplayJob
    from fca.jobs.runs import run_replay

    settings = dict(
        model=str(tiny_demo / "featuregate"),
        cache=str(tiny_demo / "eval"),
        calibration=str(tiny_demo / "calibration"),
        conditions=["static_layer"],
        num_seqs=8,
        seed=0,
        device="cpu",
        batch_size=1,
        save=False,
    )
    job = ReplayJob(settings)
    job.stop.set()  # what the Cancel button does
    job.start(run_replay).wait(60)
    assert job.cancelled and job.record is None and job.error is None


# ------------------------------------------------------------------ error paths


def test_corrupt_part_file_shows_error_and_app_recovers(tiny_demo, tmp_path, monkeypatch):
    shutil.copytree(tiny_demo / "eval", tmp_path / "bad" / "eval")
    part = next((tmp_path / "bad" / "eval").glob("part-*.parquet"))
    part.write_bytes(b"this is not parquet" * 10)
    at = render(app_for(monkeypatch, [tmp_path, tiny_demo], tmp_path / "bad" / "eval"), "views/variance.py")
    no_exceptions(at)
    assert any("not a readable Parquet file" in e.value for e in at.error)
    at.sidebar.selectbox(key="cache").set_value(str(tiny_demo / "eval")).run()  # the app keeps working
    no_exceptions(at)
    assert not at.error and len(at.get("plotly_chart")) >= 1


def test_mismatched_model_fingerprint_shows_error(tiny_demo, tmp_path, monkeypatch):
    for name in ("featuregate", "eval", "calibration", "audit.json"):
        (shutil.copytree if (tiny_demo / name).is_dir() else shutil.copy)(tiny_demo / name, tmp_path / name)
    manifest = json.loads((tmp_path / "eval" / "manifest.json").read_text())
    manifest["model"]["fingerprint"] = "0" * 64
    (tmp_path / "eval" / "manifest.json").write_text(json.dumps(manifest))
    at = app_for(monkeypatch, [tmp_path], tmp_path / "eval")
    render(at, "views/overview.py")
    no_exceptions(at)
    assert any("different model" in e.value or "do not describe this cache" in e.value for e in at.error)
    render(at, "views/replay_lab.py")
    no_exceptions(at)
    assert any("made by a different model" in e.value for e in at.error), [e.value for e in at.error]
    render(at, "views/variance.py")  # the statistics do not need the model: still shown
    no_exceptions(at)
    assert len(at.get("plotly_chart")) >= 1
