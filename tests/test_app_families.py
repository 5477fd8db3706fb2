"""MUDDPythia and Mixtral caches, made by real (tiny, random) models, open in every dashboard page, and
a replay from the lab runs on them."""

from __future__ import annotations

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
