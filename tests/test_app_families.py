"""MUDDPythia and Mixtral caches, made by real (tiny, random) models, open in every dashboard page, and
a replay from the lab runs on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from fca.engine.models.muddpythia import (
    MUDDPythiaConfig,
    dense_twin_config,
)
from fca.jobs.build import build_cache_from_corpus
from fca.tables import data
from fca.testing import write_random_checkpoint

from .helpers import write_corpus
from .test_app import PAGES, app_for, no_exceptions, render


def _model_dirs(root: Path, family: str, tokenizer) -> Path:
    if family == "muddpythia":
        config = MUDDPythiaConfig(vocab_size=300, dim=32, n_layer=3, n_head=2, intermediate_size=256, block_size=32)
        model_dir = write_random_checkpoint(root / "mudd", config, seed=0)
        write_random_checkpoint(root / "mudd-dense", dense_twin_config(config), seed=0)
    else:
        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
        model_dir = root / "mixtral"
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.fixture(scope="module", params=["muddpythia", "mixtral"])
def family_root(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        root = tmp_path_factory.mktemp(request.param)
        corpus = write_corpus(root / "prose.txt")
        tokenizer = data.train_tokenizer(data.split_documents(data.load_documents(corpus), 0)["train"], 300)
        model_dir = _model_dirs(root, request.param, tokenizer)
        for split in ("eval", "calibration"):
            build_cache_from_corpus(
                model_dir,
                corpus,
                split,
                root / split,
                num_seqs=6,
                seq_len=16,
                batch_size=3,
                device="cpu",
                show_progress=False,
            )
    return root


@pytest.mark.parametrize("page", PAGES)
def test_family_cache_in_every_page(page, family_root, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    at = render(app_for(monkeypatch, [family_root], family_root / "eval"), page)
    no_exceptions(at)
    assert not at.error, [e.value for e in at.error]
    if page == "views/execution.py":  # no audit report here: measure on the spot
        at.sidebar.selectbox(key="device").set_value("cpu")
        at.button(key="exec_measure").click().run()
        no_exceptions(at)
        assert not at.error, [e.value for e in at.error]
        said = " ".join(m.value for m in at.markdown)
        if (family_root / "mixtral").is_dir():  # top-2 of 4 experts: half of them skipped, not "nothing"
            assert "2.00 of 4 routed experts" in said and "50.0%" in said and "**: nothing is skipped" not in said
        else:
            assert "**: nothing is skipped" in said
    if page != "views/replay_lab.py":
        assert len(at.get("plotly_chart")) >= 1


def test_family_replay_from_the_lab(family_root, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    at = render(app_for(monkeypatch, [family_root], family_root / "eval"), "views/replay_lab.py")
    at.sidebar.selectbox(key="device").set_value("cpu")
    at.multiselect(key="lab_kinds").set_value(["cross_input", "static_layer"])
    at.number_input(key="lab_num_seqs").set_value(4)
    at.number_input(key="lab_batch").set_value(2)
    next(b for b in at.button if b.label == "Run").click().run()
    job = at.session_state["replay_job"]
    job.wait(120)
    assert job.record is not None, job.error
    results = job.record["results"]
    assert results["exactness"]["max_abs_logit_diff"] == 0.0
    assert results["conditions"]["cross_input"]["penalty"] != 0.0
    at.run()
    no_exceptions(at)
    # The result says how much routing each condition kept, for a model with routers only.
    result = at.dataframe[0].value.set_index("condition")  # the result's table (the saved runs' follows)
    assert "penalty 95% CI" not in result.columns  # (4 sequences: no interval, and no column saying so)
    routed = (family_root / "mixtral").is_dir()
    assert ("same experts" in result.columns) == routed and "tied choices" not in result.columns
    if routed:
        assert result.loc["correct", "same experts"] == 1.0 and 0 <= result.loc["cross_input", "same experts"] < 1


@pytest.mark.slow
def test_the_overview_shows_how_much_routing_each_condition_kept(family_root, monkeypatch, tmp_path):
    """An audit of a model with top-k routers: the Overview gives the report's routing table under the
    conditions; a model without routers has none."""
    import shutil
    from dataclasses import replace

    from fca.jobs.audit import run_audit
    from fca.tables.audit_report import Routing
    from fca.tables.report import write_report

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = next(p for p in family_root.iterdir() if p.name in ("mixtral", "mudd"))
    for name in (model_dir.name, "eval", "calibration"):  # a folder of its own: the other tests find no report
        shutil.copytree(family_root / name, tmp_path / name)
    report = run_audit(
        tmp_path / model_dir.name, tmp_path / "eval", tmp_path / "calibration", device="cpu", batch_size=3,
        latency_runs=1, sweep=(),
    )  # fmt: skip
    write_report(report, tmp_path / "audit.json")
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/overview.py")
    no_exceptions(at)
    said = [m.value for m in at.markdown if m.value.startswith("**Routing.**")]
    if model_dir.name == "mixtral":
        cross = 100 * report.routing.conditions["cross_input"].same_experts
        assert len(said) == 1 and f"| cross_input | {cross:.1f}% |" in said[0]
        assert "would be the same set for 16.7% of tokens and keep 50.0% of them" in said[0]
        figure = next(c for c in at.get("plotly_chart") if "Routing kept" in c.proto.spec)
        spec = json.loads(figure.proto.spec)
        lines = {t["name"]: t for t in spec["data"]}
        assert lines["cross_input"]["x"] == ["layer 0", "layer 1"] and "correct" not in lines
        cross = report.routing.conditions["cross_input"].same_experts_per_router
        assert lines["cross_input"]["y"] == pytest.approx(cross)
        assert "global_mean" in lines  # (read at the experts: no tie mark)
        # Its execution card: the experts each token runs (what an MoE skips), not a Dense twin's "n/a".
        assert [m.label for m in at.metric][2] == "Experts run per token" and at.metric[2].value == "2.00 of 4"
        # Routing that could not be read at the experts: one sentence, no table and no chart.
        note = "No routing figure is reported for any router: which experts ran could not be read (a_b: why)."
        write_report(replace(report, routing=Routing(not_reported=note)), tmp_path / "audit.json")
        at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/overview.py")
        no_exceptions(at)
        said = [m.value for m in at.markdown if m.value.startswith("**Routing.**")]
        assert said == ["**Routing.** No routing figure is reported for any router: which experts ran could not be "
                        "read \\(a\\_b: why\\)."]  # fmt: skip
        assert not any("Routing kept" in c.proto.spec for c in at.get("plotly_chart"))
        # The experts' note is the report's text: the Execution page shows it as text, never as a link.
        experts = replace(report.execution.experts, note="see [x](https://attacker.example/link)")
        write_report(replace(report, execution=replace(report.execution, experts=experts)), tmp_path / "audit.json")
        at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/execution.py")
        no_exceptions(at)
        assert "see \\[x](https:\u2060//attacker.example/link)" in [c.value for c in at.caption]
    else:
        assert said == [] and report.routing is None
        assert [m.label for m in at.metric][2] == "Time vs Dense twin"
