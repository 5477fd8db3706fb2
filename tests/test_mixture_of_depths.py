"""Mixture of depths: blocks that really skip tokens, replayed with their router removed, and the execution
audit that counts what ran, down to the shipped second demo (cache/demo-skip/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fca
from fca.engine.execution import ExecutionTally, blocks_executed, controller_flops, model_blocks
from fca.engine.models.mixture_of_depths import (
    MixtureOfDepthsConfig,
    MixtureOfDepthsModel,
    Selection,
    build_mixture_of_depths,
    capacity_loss,
)
from fca.engine.replay import run_conditions
from fca.tables.catalog import find_dense_twin
from fca.tables.conditions import Condition, condition_coefficients, derangement, parse_condition
from fca.tables.execution import compare_audits
from fca.tables.profiles import calibration_profiles
from fca.tables.store import open_cache

REPO = Path(__file__).resolve().parents[1]
SKIP_DEMO = REPO / "cache" / "demo-skip"
FEATUREGATE_DEMO = REPO / "cache" / "demo"
TINY = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=2, max_seq_len=16)


def tiny(**kw) -> MixtureOfDepthsModel:
    return build_mixture_of_depths(MixtureOfDepthsConfig(**{**TINY, **kw})).eval()


def ids(batch: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, 16), generator=torch.Generator().manual_seed(seed))


def test_correct_replay_is_exact_and_some_tokens_skip():
    model, x = tiny(), ids()
    live = model(x).logits.detach()
    coefficients = fca.capture(model, x)
    assert list(coefficients) == ["blocks.0.router", "blocks.1.router", "blocks.2.router"]
    assert all(c.shape == (4, 16, 1) for c in coefficients.values())
    run = np.concatenate([c > 0 for c in coefficients.values()])
    assert 0 < run.mean() < 1  # a fresh router sends about half the tokens through
    assert float((fca.replay(model, x, coefficients) - live).abs().max()) == 0.0


def test_the_router_is_removed_under_replay():
    model, x = tiny(), ids()
    coefficients = fca.capture(model, x)
    live = model(x).logits.detach()
    calls = []
    for block in model.blocks:
        block.router.controller.register_forward_hook(lambda *a: calls.append(1))
        with torch.no_grad():
            block.router.controller.proj.weight.fill_(float("nan"))
            block.router.controller.proj.bias.fill_(float("nan"))
    assert float((fca.replay(model, x, coefficients) - live).abs().max()) == 0.0
    assert calls == []
    assert blocks_executed(model, x)["blocks_executed_fraction"] == 0.0  # live, NaN scores run nothing


def test_blocks_run_on_the_selected_tokens_only():
    model, x = tiny(), ids()
    scores = fca.capture(model, x)
    seen = []  # what each block's body, and its first projection, were called with
    for block in model.blocks:
        block.body.register_forward_pre_hook(lambda m, args: seen.append(("body", tuple(args[0].shape))))
        block.body.attn.qkv.register_forward_pre_hook(lambda m, args: seen.append(("qkv", tuple(args[0].shape))))
    counted = blocks_executed(model, x)
    selected = [int((s > 0).sum()) for s in scores.values()]
    assert counted["tokens_per_block"] == selected
    assert seen == [(part, (n, 32)) for n in selected for part in ("body", "qkv")]
    assert counted["blocks_executed_fraction"] == pytest.approx(sum(selected) / (3 * 64))
    dense = tiny(routed=False)
    assert blocks_executed(dense, x)["blocks_executed_fraction"] == 1.0
    assert controller_flops(model, x)["total_flops"] < controller_flops(dense, x)["total_flops"]


def test_skipped_tokens_change_nothing_and_attention_is_among_selected_tokens():
    """A block's output for the tokens it runs equals attention over the selected tokens alone, computed by hand
    sequence by sequence; a skipped token passes it unchanged."""
    model, x = tiny(), ids(batch=3)
    block = model.blocks[1]
    h = model.tok_emb(x) + model.pos_emb(torch.arange(16))
    h, _ = model.blocks[0](h)
    with torch.no_grad():
        out, scores = block(h)
        run = scores[..., 0] > 0
        assert torch.equal(out[~run], h[~run])
        for b in range(3):
            chosen = h[b][run[b]][None]  # [1, n, D]
            update = block.body(chosen)  # the Dense path over the selected tokens of this sequence only
            expected = chosen + torch.sigmoid(scores[b][run[b]])[None] * update
            torch.testing.assert_close(out[b][run[b]], expected[0], atol=1e-6, rtol=1e-5)


def test_the_decision_is_causal():
    model, x = tiny(), ids(batch=2)
    changed = x.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 97
    before, after = fca.capture(model, x), fca.capture(model, changed)
    for name in before:
        assert np.array_equal(before[name][:, :9], after[name][:, :9]), name
        assert not np.array_equal(before[name][:, 9:], after[name][:, 9:]), name


def test_a_static_score_runs_every_token_or_none():
    model, x = tiny(), ids()
    sites = fca.capture(model, x)
    profile = {name: np.array([0.5 if i != 1 else -0.5], np.float32) for i, name in enumerate(sites)}
    tally = ExecutionTally(model, ["static"], 4)
    with tally.counting(4):
        fca.replay(model, x, profile)
    assert tally.last.tolist() == [[16, 0, 16]] * 4


def test_selection_pads_each_sequence_left_aligned():
    run = torch.tensor([[True, False, True, True], [False, False, False, True]])
    selection = Selection.of(run)
    assert selection.width == 3 and selection.tokens == 4
    packed = torch.arange(4.0)[:, None]  # [N, 1]
    assert selection.pad(packed)[..., 0].tolist() == [[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]
    assert torch.equal(selection.unpad(selection.pad(packed)), packed)
    assert selection.tokens_per_sequence().tolist() == [3, 1]


def test_capacity_loss_targets_the_share_of_highest_scores():
    scores = torch.tensor([3.0, -1.0, 0.5, -2.0]).view(1, 4, 1).requires_grad_()
    loss = capacity_loss(scores, 0.5)
    loss.backward()
    # targets 1, 0, 1, 0: the gradient pushes the two highest up and the other two down
    assert (scores.grad.view(-1) * torch.tensor([1.0, -1.0, 1.0, -1.0]) < 0).all()
    model = build_mixture_of_depths(MixtureOfDepthsConfig(**TINY)).train()
    with_aux = model(ids(), labels=ids()).loss
    model.config.capacity_loss_weight = 0.0
    assert float(with_aux.detach()) != float(model(ids(), labels=ids()).loss.detach())


# ---------------------------------------------------------------- what ran under each condition, from a cache


@pytest.fixture(scope="module")
def tiny_skip(tmp_path_factory):
    """A tiny mixture-of-depths model directory (random init), its Dense twin and both caches."""
    from fca.engine.loading import save_model
    from fca.jobs.build import build_cache_from_corpus
    from fca.tables import data

    from .helpers import write_corpus

    root = tmp_path_factory.mktemp("tiny_skip")
    corpus = write_corpus(root / "corpus.txt")
    tokenizer = data.train_tokenizer(data.split_documents(data.load_documents(corpus), seed=0)["train"], 300)
    sizes = {**TINY, "vocab_size": tokenizer.get_vocab_size()}
    save_model(build_mixture_of_depths(MixtureOfDepthsConfig(**sizes)), root / "mod", tokenizer)
    save_model(build_mixture_of_depths(MixtureOfDepthsConfig(**sizes, routed=False)), root / "dense", tokenizer)
    for split in ("eval", "calibration"):
        build_cache_from_corpus(
            root / "mod", corpus, split, root / split, num_seqs=12, seq_len=16, batch_size=4, show_progress=False
        )
    return root


def expected_execution(cache, profiles, condition: Condition, seqs: list[int]) -> np.ndarray:
    """[n, L] tokens each block runs under `condition`, by the rule (score > 0) on the scores it feeds."""
    coefficients = cache.coefficients(seqs)
    other = cache.coefficients([seqs[i] for i in derangement(len(seqs), 0)])
    fed = condition_coefficients(condition, coefficients, list(range(len(seqs))), profiles, other)
    T = cache.seq_len
    return np.stack(
        [(np.broadcast_to(fed[s], (len(seqs), T, 1)) > 0).sum((1, 2)) for s in cache.sites], axis=1
    )  # [n, L]


@pytest.mark.slow
def test_each_condition_runs_what_its_fed_scores_decide(tiny_skip):
    model = fca.load_model(tiny_skip / "mod")
    cache, calibration = open_cache(tiny_skip / "eval"), open_cache(tiny_skip / "calibration")
    profiles = calibration_profiles(calibration)
    conditions = [
        Condition(kind) for kind in ("correct", "cross_input", "token_shuffle", "static_layer", "global_mean")
    ]
    results = run_conditions(model, cache, conditions, profiles, batch_size=4)
    seqs = list(range(cache.num_seqs))
    for c in conditions:
        assert np.array_equal(results.executed[c.name], expected_execution(cache, profiles, c, seqs)), c.name
    assert results.max_abs_logit_diff == 0.0
    static = results.executed["static_layer"]  # one decision per block for every token
    assert set(np.unique(static)) <= {0, cache.seq_len}


@pytest.mark.slow
def test_the_audit_reports_flops_and_what_each_condition_ran(tiny_skip, tmp_path):
    from fca.cli import main

    out = tmp_path / "audit.json"
    args = ["audit", "--model", str(tiny_skip / "mod"), "--cache", str(tiny_skip / "eval")]
    args += ["--calibration", str(tiny_skip / "calibration"), "--dense", str(tiny_skip / "dense")]
    assert (
        main([*args, "--device", "cpu", "--sweep", "none", "--json", str(out), "--markdown", str(tmp_path / "a.md")])
        == 0
    )
    report = json.loads(out.read_text())
    exe = report["execution"]
    assert exe["flops_ratio_vs_dense"] < 1 and exe["blocks_executed_fraction"] < 1
    assert set(exe["conditions"]) == {"correct", "cross_input", "token_shuffle", "static_layer", "global_mean"}
    correct = exe["conditions"]["correct"]
    cache = open_cache(tiny_skip / "eval")
    scores = np.concatenate([cache.coefficients(list(range(12)))[s] for s in cache.sites])
    assert correct["blocks_executed_fraction"] == pytest.approx(float((scores > 0).mean()))
    markdown = (tmp_path / "a.md").read_text()
    assert "FLOPs per token vs the Dense twin" in markdown and "| static_layer |" in markdown
    assert find_dense_twin(tiny_skip / "mod") == tiny_skip / "dense"


# ---------------------------------------------------------------- the shipped second demo


def test_the_shipped_skip_demo_is_small_and_found_beside_its_twin():
    size = sum(p.stat().st_size for p in SKIP_DEMO.rglob("*") if p.is_file() and ".runs" not in p.parts[-2])
    assert size <= 15 * 2**20
    assert find_dense_twin(SKIP_DEMO / "mod") == SKIP_DEMO / "dense"
    assert open_cache(SKIP_DEMO / "eval").manifest.model.path == "mod"


@pytest.mark.slow
def test_every_execution_figure_of_the_shipped_skip_demo_is_recomputed_from_its_caches():
    """Blocks executed and FLOPs of the audit's probe, and the tokens each block ran under every condition,
    from the cached scores by the model's rule (score > 0), and FLOPs by counting the shipped models again."""
    report = json.loads((SKIP_DEMO / "audit.json").read_text())
    exe = report["execution"]
    cache, calibration = open_cache(SKIP_DEMO / "eval"), open_cache(SKIP_DEMO / "calibration")
    T, n = cache.seq_len, report["cache"]["sequences"]
    probe = list(range(exe["batch_shape"][0]))  # the audit's probe: the first evaluated sequences
    scores = cache.coefficients(probe)
    per_block = [int((scores[s] > 0).sum()) for s in cache.sites]
    assert exe["tokens_per_block"] == per_block
    assert exe["blocks_executed_fraction"] == pytest.approx(sum(per_block) / (len(probe) * T * len(per_block)))
    model, dense = fca.load_model(SKIP_DEMO / "mod"), fca.load_model(SKIP_DEMO / "dense")
    ids = torch.from_numpy(cache.read_seqs(probe, sites=[])["token"].astype(np.int64))
    flops, dense_flops = controller_flops(model, ids), controller_flops(dense, ids)
    assert flops["total_flops"] == exe["total_flops"] and flops["controller_flops"] == exe["controller_flops"]
    assert exe["flops_ratio_vs_dense"] == pytest.approx(flops["total_flops"] / dense_flops["total_flops"])
    assert exe["flops_ratio_vs_dense"] < 1
    assert len(model_blocks(model)) == exe["num_blocks"]
    profiles = calibration_profiles(calibration)
    for name, row in exe["conditions"].items():
        counted = expected_execution(cache, profiles, parse_condition(name), list(range(n)))
        assert row["tokens_per_block"] == counted.sum(0).tolist(), name
        assert row["blocks_executed_fraction"] == pytest.approx(counted.sum() / (n * T * exe["num_blocks"])), name
    # (the latency ratio is a timing, measured on the machine that ran the audit: not recomputable from caches)


@pytest.mark.slow
def test_the_shipped_skip_demo_replays_here(tmp_path):
    from fca.cli import main

    shipped = json.loads((SKIP_DEMO / "audit.json").read_text())
    out = tmp_path / "audit.json"
    args = ["audit", "--model", str(SKIP_DEMO / "mod"), "--cache", str(SKIP_DEMO / "eval")]
    args += ["--calibration", str(SKIP_DEMO / "calibration"), "--device", "cpu", "--sweep", "none"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["exactness"]["max_abs_logit_diff"] == 0.0
    assert report["exactness"]["fidelity"]["verdict"] in ("bit-identical", "within tolerance")
    for name, row in shipped["conditions"].items():
        if name in report["conditions"]:
            assert report["conditions"][name]["nll"] == pytest.approx(row["nll"], abs=1e-4), name
    for name, row in report["execution"]["conditions"].items():  # (the sweep's were not run here)
        assert row["tokens_per_block"] == shipped["execution"]["conditions"][name]["tokens_per_block"], name


def test_the_two_demos_side_by_side():
    featuregate, skipping = compare_audits([FEATUREGATE_DEMO / "audit.json", SKIP_DEMO / "audit.json"])
    assert (featuregate["label"], skipping["label"]) == ("demo", "demo-skip")
    assert featuregate["blocks_executed_fraction"] == 1.0
    assert skipping["blocks_executed_fraction"] < 0.9 and skipping["flops_ratio_vs_dense"] < 0.9
    assert set(skipping["penalty"]) == {"correct", "cross_input", "token_shuffle", "static_layer", "global_mean"}
    assert 0 <= skipping["layer_identity_share"] <= 1
    assert set(skipping["blocks_executed_fraction_under"]) == set(skipping["penalty"])


@pytest.mark.slow
def test_the_sidebar_opens_the_skip_demo(monkeypatch):
    from .test_app import app_for, no_exceptions, render

    at = app_for(monkeypatch, [], SKIP_DEMO / "eval").run()
    no_exceptions(at)
    options = [o for box in at.sidebar.selectbox for o in box.options]
    assert {"cache/demo-skip/eval (eval, 256 seq)", "cache/demo/eval (eval, 256 seq)"} <= set(options)
    assert "mod" in options  # the model beside the cache, by the name its manifest records
    at = render(at, "views/execution.py")
    no_exceptions(at)
    text = " ".join(m.value for m in at.markdown)
    assert "Some blocks were skipped" in text and "2.05 of 4" in text
