"""End to end for the other families: build-cache and audit through the CLI, unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from fca.cli import main
from fca.engine.models.muddpythia import (
    MUDDPythiaConfig,
    dense_twin_config,
)
from fca.tables import data
from fca.tables.conditions import derangement
from fca.tables.store import open_cache
from fca.testing import write_random_checkpoint

from .helpers import write_corpus

pytestmark = pytest.mark.slow  # each test trains or audits a model of its family end to end

VOCAB = 300


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    corpus = write_corpus(root / "prose.txt")
    tokenizer = data.train_tokenizer(data.split_documents(data.load_documents(corpus), 0)["train"], VOCAB)
    return root, corpus, tokenizer


def _audit(root, corpus, model_dir, dense_dir=None) -> dict:
    for split in ("eval", "calibration"):
        assert (
            main(
                [
                    "build-cache",
                    "--model",
                    str(model_dir),
                    "--corpus",
                    str(corpus),
                    "--split",
                    split,
                    "--out",
                    str(root / f"{model_dir.name}-{split}"),
                    "--num-seqs",
                    "6",
                    "--seq-len",
                    "16",
                    "--batch",
                    "3",
                    "--device",
                    "cpu",
                ]
            )
            == 0
        )
    args = [
        "audit",
        "--model",
        str(model_dir),
        "--cache",
        str(root / f"{model_dir.name}-eval"),
        "--calibration",
        str(root / f"{model_dir.name}-calibration"),
        "--json",
        str(root / f"{model_dir.name}.json"),
        "--device",
        "cpu",
        "--batch",
        "3",
    ]
    assert main(args + (["--dense", str(dense_dir)] if dense_dir else [])) == 0
    return json.loads((root / f"{model_dir.name}.json").read_text())


def test_muddpythia_audit(corpus_and_tokenizer, capsys):
    root, corpus, tokenizer = corpus_and_tokenizer
    config = MUDDPythiaConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layer=3,
        n_head=2,
        intermediate_size=256,
        block_size=32,
        use_qk_norm=True,
        expand_last=True,
        round64=True,
    )
    model_dir = write_random_checkpoint(root / "mudd", config, seed=0)
    dense_dir = write_random_checkpoint(root / "mudd-dense", dense_twin_config(config), seed=0)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    report = _audit(root, corpus, model_dir, dense_dir)
    assert report["exactness"]["max_abs_logit_diff"] == 0.0
    assert set(report["definitions"]["global_mean_families"]) >= {"q", "k", "v", "r"}
    assert set(report["variance"]["per_site"]) == {"dense.0", "dense.1", "dense.2"}
    assert report["execution"]["blocks_executed_fraction"] == 1.0 and report["execution"]["latency_ratio_vs_dense"] > 0
    assert report["conditions"]["cross_input"]["penalty"] != 0.0
    # The calibration means global_mean used, one per stream; and `inspect` names the streams (it said "dense").
    assert set(report["calibration"]["family_grand_means"]) == {"q", "k", "v", "r"}
    assert report["definitions"]["coefficient"].startswith("dense-connection weights: the dynamic dw plus the static")
    assert main(["inspect", str(root / "mudd-eval")]) == 0
    assert "  dense.0: K=8 axes=[['stream', 4], ['source', 2]] family=q,k,v,r" in capsys.readouterr().out


def test_mixtral_audit(corpus_and_tokenizer, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, corpus, tokenizer = corpus_and_tokenizer
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
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
    report = _audit(root, corpus, model_dir)
    assert report["exactness"]["max_abs_logit_diff"] == 0.0
    experts = report["execution"]["experts"]
    assert (
        experts["experts_available"] == 4 and experts["top_k"] == 2 and experts["expert_fraction"] == pytest.approx(0.5)
    )
    assert "router" in report["definitions"]["global_mean_families"]
    assert report["conditions"]["static_layer"]["penalty"] != 0.0
    assert experts["shared_experts"] is False and report["execution"]["uncounted_ops"] == []
    from fca.tables.report import AuditReport, render_markdown

    typed = AuditReport.from_json(report, "mixtral.json")  # (routers and experts: no shipped report has them)
    assert typed.to_json() == report and typed.routing.conditions["cross_input"].routers_changed == tuple(
        typed.routing.routers
    )
    markdown = render_markdown(typed)
    assert "- Experts run per token: 2.00 of 4 routed experts per MoE layer (top-2: 50.0% of them), counted from the " \
        "dispatched indices.\n" in markdown  # fmt: skip
    assert (
        "- Latency vs a Dense twin: not measured (an MoE model has none here; its conditional work is the experts"
        in markdown
    )
    # Routing agreement, against an oracle of its own: the top-2 experts of another sequence's cached logits.
    routing = report["routing"]
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert routing["routers"] == dict.fromkeys(routers, 2)
    cache = open_cache(root / "mixtral-eval")
    rows = cache.read_seqs(list(range(6)))
    partner = derangement(6, 0)

    def top2(logits):  # [.., E] -> sets (random logits: no ties)
        return np.sort(np.argsort(-logits, axis=-1)[..., :2], axis=-1)

    same = [(top2(rows[s]) == top2(rows[s][partner])).all(-1).mean() for s in routers]
    cross = routing["conditions"]["cross_input"]
    assert cross["same_experts_per_router"] == pytest.approx(same, abs=1e-12)
    assert cross["same_experts"] == pytest.approx(np.mean(same), abs=1e-12)
    assert 0 < cross["same_experts"] < cross["expert_overlap"] < 1
    correct = routing["conditions"]["correct"]
    assert (correct["same_experts"], correct["expert_overlap"], correct["weight_kept"]) == (1.0, 1.0, 1.0)
    assert correct["same_experts_per_router"] == [1.0, 1.0] and correct["routers_changed"] == routers
    assert all("tied" not in row for row in routing["conditions"].values())  # (ties are what ran)
    assert set(routing["conditions"]) == set(report["conditions"]) and "routing" in report["definitions"]
    assert "| cross_input | " + f"{100 * cross['same_experts']:.1f}% |" in markdown
    # a condition naming a site is code in the tables (else Markdown renders "x@a.b.c" as an e-mail link)
    from fca.tables.report import condition_cell

    assert condition_cell("token_shuffle@model.layers.0.mlp.gate") == "`token_shuffle@model.layers.0.mlp.gate`"
    assert condition_cell("cross_input") == "cross_input"
    assert "read from what each MoE layer's experts were handed in the replay" in markdown
    assert "not_reported" not in routing and "No routing figure" not in markdown  # (every router observed)
    # top-2 of 4 experts drawn at random: the same pair 1 time in C(4, 2) = 6, half of them kept
    assert routing["chance"] == {"same_experts": pytest.approx(1 / 6), "expert_overlap": 0.5}
    assert routing["experts"] == dict.fromkeys(routers, 4)
    assert "would be the same set for 16.7% of tokens and keep 50.0% of them." in markdown
    replay = ["replay", "--model", str(model_dir), "--cache", str(root / "mixtral-eval"), "--calibration",
              str(root / "mixtral-calibration"), "--conditions", "global_mean", "token_shuffle@model.layers.0.mlp.gate", "--no-save", "--device", "cpu"]  # fmt: skip
    capsys.readouterr()
    assert main(replay) == 0
    said = capsys.readouterr().out
    lines = {line.split()[0]: line for line in said.splitlines() if "same experts" in line}
    assert lines["correct"].endswith("same experts 100.0%, kept 100.0%, weight kept 100.0%")
    gm = routing["conditions"]["global_mean"]  # (the audit's: the same sequences, profiles and seed)
    assert lines["global_mean"].endswith(
        f"same experts {100 * gm['same_experts']:.1f}%, kept {100 * gm['expert_overlap']:.1f}%, weight kept "
        f"{100 * gm['weight_kept']:.1f}%"
    )
    assert said.rstrip().endswith("Experts drawn at random: 16.7% and 50.0%.")
    assert lines["token_shuffle@model.layers.0.mlp.gate"].endswith("(1 of 2 routers)")  # (what it is taken over)
    # A study of such audits averages the routing kept, beside the penalties.
    from fca.tables.study import build_study, format_spread
    from fca.tables.study import render_markdown as render_study_markdown

    other = json.loads(json.dumps(report))
    other["routing"]["conditions"]["cross_input"]["same_experts"] = cross["same_experts"] + 0.1
    other["model"]["fingerprint"] = "another seed's"  # (a study refuses one model twice)
    study = build_study([("a.json", typed), ("b.json", AuditReport.from_json(other))])
    kept = study["summary"]["conditions"]["cross_input"]["same_experts"]
    assert kept["n"] == 2 and kept["mean"] == pytest.approx(cross["same_experts"] + 0.05)
    assert "interpolate:0.5" not in study["summary"]["conditions"]  # (the sweep is not averaged)
    studied = render_study_markdown(study)
    assert (
        "| condition | NLL (nats/token) | penalty vs correct (nats/token) | gap retention | same experts |" in studied
    )
    same = format_spread(study["summary"]["conditions"]["global_mean"]["same_experts"], 1, percent=True)
    assert f"| {same} |" in studied  # (read at the experts, ties as they fell: no mark)
