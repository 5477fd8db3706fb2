"""A model held in memory, audited end to end from Python: sites declared from outside, caches built from
token windows, the audit and a saved replay run. A variant of the README's custom-model example."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fca
from fca.engine.adapters import SiteDeclaration
from fca.engine.families import Family
from fca.engine.loading import fingerprint_state
from fca.engine.sites import site_specs
from fca.jobs.build import as_windows
from fca.jobs.runs import run_replay
from fca.tables.errors import CacheError, ExactnessError

from .conftest import REPO


class Block(nn.Module):
    """h + MLP(h), its `groups` feature groups scaled by gates 2 * sigmoid(gate(h))."""

    def __init__(self, d: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.gate = nn.Linear(d, groups)  # the controller: logits [B, T, groups]
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, D = h.shape
        gates = 2 * torch.sigmoid(self.gate(h))  # [B, T, G]
        y = self.mlp(h).view(B, T, self.groups, D // self.groups) * gates[..., None]
        return h + y.view(B, T, D)


class TinyGatedLM(nn.Module):
    """Returns (logits, extras): a tuple, so the logits' place must be declared."""

    def __init__(self, vocab: int = 64, d: int = 16, n_blocks: int = 2, groups: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, groups) for _ in range(n_blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h), {"hidden": h}


@pytest.fixture
def adapted():
    model = TinyGatedLM().eval()
    fca.attach_sites(
        model,
        [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate", coefficient="gate logits")],
        blocks="blocks",
        output=0,
    )
    return model


@pytest.mark.slow
def test_custom_model_audited_end_to_end(adapted, tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, 8_000)  # a token stream; any tokenizer's ids will do
    fca.build_cache(adapted, tokens[:4_000], tmp_path / "eval", seq_len=32, split="eval")
    fca.build_cache(adapted, tokens[4_000:], tmp_path / "calibration", seq_len=32, split="calibration")
    report = fca.audit(adapted, tmp_path / "eval", tmp_path / "calibration", latency_runs=2, training={"seed": 7})

    assert report.model.name == "TinyGatedLM" and report.cache.sequences == 124
    # The seed given travels in the report, so a study of such audits shows it (it showed "?").
    from fca.tables.study import build_study

    assert report.training == {"seed": 7} and build_study([("a", report)])["seeds"][0]["seed"] == 7
    assert report.exactness.max_abs_logit_diff == 0.0
    assert report.exactness.fidelity.verdict == "bit-identical"
    # The five paper conditions and, as from the CLI, the interpolation sweep (alpha 0, 0.25, ..., 1).
    sweep = {f"interpolate:{a:g}" for a in (0, 0.25, 0.5, 0.75, 1)}
    assert set(report.conditions) == {"correct", "cross_input", "token_shuffle", "static_layer", "global_mean"} | sweep
    assert [row.alpha for row in report.sweep] == [0, 0.25, 0.5, 0.75, 1]
    assert set(report.variance.per_site) == {"blocks.0.gate", "blocks.1.gate"}
    assert report.execution.blocks_executed_fraction == 1.0
    assert report.execution.uncounted_ops == ()

    experiment = fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "calibration")
    record = run_replay(None, None, None, ["static_layer"], num_seqs=8, experiment=experiment, save=False)
    assert record["spec"]["model"] == "TinyGatedLM" and record["results"]["exactness"]["max_abs_logit_diff"] == 0.0
    assert record["results"]["conditions"]["correct"]["nll"] == pytest.approx(
        float(np.mean(experiment.run([fca.tables.conditions.Condition("correct")], 8).per_seq_nll["correct"]))
    )


@pytest.mark.slow
def test_the_dashboard_on_caches_of_a_model_held_in_memory(adapted, tmp_path, monkeypatch):
    """Before an audit, the Overview tells how to make one from Python (it read "...Make one with the CLI:. No
    model directory..."). After it, the Execution page says every block ran, but not that nothing was skipped:
    work a router skips inside a block is counted only for experts modules its family names (it had said "the
    controllers save no compute" of a custom model that routed each token to 1 of 3 experts)."""
    from fca.tables.report import write_report
    from tests.test_app import app_for, no_exceptions, render

    tokens = np.random.default_rng(7).integers(0, 64, 2_000)
    fca.build_cache(adapted, tokens[:1_000], tmp_path / "eval", seq_len=32, split="eval")
    fca.build_cache(adapted, tokens[1_000:], tmp_path / "calibration", seq_len=32, split="calibration")
    # Before an audit, the Overview says how to make one for caches of a model that has no directory.
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/overview.py")
    no_exceptions(at)
    said = " ".join(m.value for m in [*at.markdown, *at.info, *at.warning])
    assert "No audit report describes this cache yet. No model directory was found beside the caches" in said
    assert f'`write_report(report, "{tmp_path / "audit.json"}")` from Python' in said
    assert [c.value for c in at.sidebar.caption if c.value.startswith("No model directory beside this cache")] == [
        "No model directory beside this cache: replay and execution are unavailable. Its manifest names "
        f"`TinyGatedLM`: a model folder of that name (or a link to one) in `{tmp_path.name}/` would be used."
    ]
    report = fca.audit(adapted, tmp_path / "eval", tmp_path / "calibration", num_seqs=8, latency_runs=2, sweep=())
    write_report(report, tmp_path / "audit.json")
    at = render(app_for(monkeypatch, [tmp_path], tmp_path / "eval"), "views/execution.py")
    no_exceptions(at)
    said = " ".join(m.value for m in at.markdown)
    assert "**Every block ran for every token (2 of 2)**, as counted at block level." in said
    assert "save no compute" not in said and "`Family.expert_paths`); this one names none" in said


@pytest.mark.slow
def test_a_compiled_model_is_audited_on_caches_of_the_uncompiled_one(adapted, tmp_path):
    """Caches built with the model serve it compiled (`torch.compile`, whose module tree names everything
    `_orig_mod.`...): same sites and fingerprint, an exact Correct replay, the same conditions' NLLs, and the
    blocks counted (hooks added after compiling are not called by its graphs). Sites declared through the
    compiled model are the ones declared on the model."""
    import torch._dynamo

    torch._dynamo.reset()
    tokens = np.random.default_rng(8).integers(0, 64, 2_000)
    fca.build_cache(adapted, tokens[:1_000], tmp_path / "eval", seq_len=32, split="eval")
    fca.build_cache(adapted, tokens[1_000:], tmp_path / "calibration", seq_len=32, split="calibration")
    conditions = ["static_layer", "interpolate:0.5"]
    uncompiled = fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "calibration").run(conditions, 8)
    compiled = torch.compile(adapted, backend="eager")
    experiment = fca.Experiment.open(compiled, tmp_path / "eval", tmp_path / "calibration")
    results = experiment.run(conditions, 8)
    assert experiment.name == "TinyGatedLM" and results.exactness["max_abs_logit_diff"] == 0.0
    assert results.exactness["fidelity"]["verdict"] == "bit-identical"  # (in another environment: compiled)
    assert results.exactness["fidelity"]["differing_fields"] == ["numeric settings"]
    for name in conditions:
        assert np.array_equal(results.per_seq_nll[name], uncompiled.per_seq_nll[name])
    report = fca.audit(compiled, tmp_path / "eval", tmp_path / "calibration", num_seqs=8, latency_runs=1, sweep=())
    assert report.model.name == "TinyGatedLM" and report.model.model_type == "TinyGatedLM"
    assert report.execution.blocks_executed_fraction == 1.0 and report.execution.controller_flops > 0

    declared_compiled = torch.compile(TinyGatedLM().eval(), backend="eager")
    gate = SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate", coefficient="gate logits")
    assert fca.attach_sites(declared_compiled, [gate], blocks="blocks", output=0) is declared_compiled
    assert site_specs(declared_compiled) == site_specs(adapted)
    assert fingerprint_state(declared_compiled) == experiment.model_fingerprint


@pytest.mark.slow
def test_same_windows_give_the_same_cache(adapted, tmp_path):
    windows = np.random.default_rng(1).integers(0, 64, (6, 17))
    a = fca.build_cache(adapted, windows, tmp_path / "a", split="eval")
    b = fca.build_cache(adapted, torch.from_numpy(windows), tmp_path / "b", split="eval")
    c = fca.build_cache(adapted, windows, tmp_path / "c", split="eval", workers=2)
    assert fca.open_cache(a).fingerprint == fca.open_cache(b).fingerprint == fca.open_cache(c).fingerprint
    assert fca.open_cache(a).seq_len == 16 and fca.open_cache(a).vocab_size == 64


@pytest.mark.slow
def test_calibration_from_the_same_windows_is_refused(adapted, tmp_path):
    windows = np.random.default_rng(2).integers(0, 64, (6, 17))
    fca.build_cache(adapted, windows, tmp_path / "eval", split="eval")
    fca.build_cache(adapted, windows, tmp_path / "calibration", split="eval")
    with pytest.raises(CacheError, match="same split"):
        fca.audit(adapted, tmp_path / "eval", tmp_path / "calibration")
    # Another split name is only a label for windows given in memory: what the caches hold is compared.
    fca.build_cache(adapted, windows, tmp_path / "relabelled", split="calibration")
    with pytest.raises(CacheError, match=r"relabelled: shares text .*: 100\.0% of its 17-token stretches"):
        fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "relabelled")
    fresh = np.random.default_rng(3).integers(0, 64, (6, 17))
    fca.build_cache(adapted, np.concatenate([fresh[:4], windows[2:4]]), tmp_path / "overlap", split="calibration")
    with pytest.raises(CacheError, match=r"33\.3% of its 17-token stretches"):
        fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "overlap")
    fca.build_cache(adapted, fresh, tmp_path / "other", split="calibration")
    fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "other")  # other windows: independent


@pytest.mark.slow
def test_shared_text_is_found_across_window_boundaries(adapted, tmp_path):
    """The same text cut into windows at other offsets is refused as calibration; one window duplicated among
    hundreds (a repeated document, padding) is not a reason to refuse."""
    stream = np.random.default_rng(5).integers(0, 64, 400 * 64 + 1)
    fca.build_cache(adapted, stream[: 200 * 64 + 1], tmp_path / "eval", seq_len=64, split="eval")
    fca.build_cache(adapted, stream[10 : 200 * 64 + 11], tmp_path / "shifted", seq_len=64, split="calibration")
    with pytest.raises(CacheError, match=r"shifted: shares text"):
        fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "shifted")
    # The calibration text, plus one of the evaluated windows once: 0.5% of either cache's stretches.
    calibration = np.lib.stride_tricks.sliding_window_view(stream[200 * 64 + 1 :], 65)[::64]
    evaluated_window = stream[:65][None]
    fca.build_cache(adapted, np.concatenate([calibration, evaluated_window]), tmp_path / "one", split="calibration")
    fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "one")


@pytest.mark.slow
def test_a_shifted_copy_in_short_windows_is_found(tmp_path):
    """In 33-token windows, 32-token stretches (two per window) missed the evaluated text shifted by 2 tokens
    or more: half-window stretches find a copy at any shift, and disjoint text still passes."""
    model = TinyGatedLM(vocab=1024).eval()  # a subword-sized vocabulary: 32-token stretches wanted
    gate = SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate", coefficient="gate logits")
    fca.attach_sites(model, [gate], blocks="blocks", output=0)
    stream = np.random.default_rng(6).integers(0, 1024, 12_000)
    fca.build_cache(model, stream[:4_000], tmp_path / "eval", seq_len=32, split="eval")
    for shift in (2, 7, 16, 2_000):  # (the last: half of the evaluated text)
        fca.build_cache(model, stream[shift : shift + 4_000], tmp_path / f"s{shift}", seq_len=32, split="calibration")
        with pytest.raises(CacheError, match=rf"s{shift}: shares text .* of its 16-token stretches"):
            fca.Experiment.open(model, tmp_path / "eval", tmp_path / f"s{shift}")
    fca.build_cache(model, stream[6_000:10_000], tmp_path / "other", seq_len=32, split="calibration")
    fca.Experiment.open(model, tmp_path / "eval", tmp_path / "other")


@pytest.mark.slow
def test_a_run_is_judged_before_its_figures_are_returned(adapted, tmp_path):
    """`Experiment.run` refuses an inexact Correct replay rather than return figures, takes condition specs
    as text, and a model left in training mode is refused with what to do."""
    tokens = np.random.default_rng(4).integers(0, 64, 2_000)
    fca.build_cache(adapted, tokens[:1_000], tmp_path / "eval", seq_len=32, split="eval")
    fca.build_cache(adapted, tokens[1_000:], tmp_path / "calibration", seq_len=32, split="calibration")
    experiment = fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "calibration")
    results = experiment.run(["interpolate:0.5"], num_seqs=4)
    assert (
        results.exactness["max_abs_logit_diff"] == 0.0 and results.exactness["fidelity"]["verdict"] == "bit-identical"
    )
    assert set(results.per_seq_nll) == {"interpolate:0.5"}
    with pytest.raises(KeyError, match=r"no condition 'correct' in this run; it scored \['interpolate:0\.5'\]"):
        results.nll("correct")
    with pytest.raises(
        KeyError, match=r"unknown site\(s\) \['blocks\.9\.gate'\]; the sites: \['blocks\.0\.gate', 'blocks"
    ):
        experiment.run(["static_layer@blocks.9.gate"], num_seqs=4)
    # A block whose output depends on the call count: the replay of a pass cannot reproduce that pass.
    block = adapted.blocks[1]
    calls = {"n": 0}

    def drift(module, args, output):
        calls["n"] += 1
        return output + 1e-3 * calls["n"]

    handle = block.register_forward_hook(drift)
    try:
        with pytest.raises(ExactnessError):
            experiment.run(["static_layer"], num_seqs=4)
        assert experiment.run(["static_layer"], num_seqs=4, judge=False).max_abs_logit_diff > 0
    finally:
        handle.remove()
    with pytest.raises(ValueError, match=r"sweep: interpolation alphas must be numbers, got \['a'\]"):
        fca.audit(adapted, tmp_path / "eval", tmp_path / "calibration", num_seqs=4, sweep=("a",))
    adapted.train()
    with pytest.raises(ValueError, match=r"TinyGatedLM is in training mode; call model\.eval\(\)"):
        fca.capture(adapted, tokens[:64].reshape(2, 32))


def formulaic_text(sentences: int, seed: int = 0) -> np.ndarray:
    """Character ids of text that repeats formulas, as scripture does ("and it came to pass that")."""
    rng = np.random.default_rng(seed)
    words = "the lord said unto moses and aaron speak children israel land water light day night king people".split()
    formulas = ["and the lord spake unto moses saying ", "and it came to pass that ", "thus saith the lord of hosts "]
    text = "".join(
        (formulas[rng.integers(3)] if rng.random() < 0.3 else "")
        + " ".join(rng.choice(words, rng.integers(3, 9)))
        + ". "
        for _ in range(sentences)
    )
    alphabet = sorted(set(text))
    return np.array([alphabet.index(c) for c in text])


@pytest.mark.slow
def test_a_character_level_models_disjoint_splits_are_independent(adapted, tmp_path):
    """32 characters of formulaic text recur by chance between any two parts of it: the README's own example
    with character ids was refused (1.03% of the KJV's 32-character stretches recur between disjoint
    slices). A small vocabulary compares 64-token stretches, and a shifted copy is still refused."""
    chars = formulaic_text(6000)  # ~260,000 characters, 24 distinct
    fca.build_cache(adapted, chars[:100_000], tmp_path / "eval", seq_len=256, split="eval")
    fca.build_cache(adapted, chars[100_000:200_000], tmp_path / "calibration", seq_len=256, split="calibration")
    fca.Experiment.open(
        adapted, tmp_path / "eval", tmp_path / "calibration"
    )  # 4.7% of its 32-character stretches recur
    fca.build_cache(adapted, chars[10:50_010], tmp_path / "shifted", seq_len=256, split="calibration")
    with pytest.raises(CacheError, match=r"shifted: shares text .*: 9\d\.\d% of its 64-token stretches"):
        fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "shifted")


def test_windows_are_checked():
    assert as_windows(np.arange(10), seq_len=3).tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="seq_len"):
        as_windows(np.arange(10))
    with pytest.raises(ValueError, match="integers"):
        as_windows(np.zeros((2, 5)))
    assert as_windows(np.zeros((2, 5), dtype=int), seq_len=4).shape == (2, 5)
    with pytest.raises(ValueError, match=r"hold 99 \+ 1 tokens, not seq_len \+ 1 = 129"):  # (was a cache of T=99)
        as_windows(np.zeros((10, 100), dtype=int), seq_len=128)


def test_windows_beyond_the_models_vocabulary_are_refused_before_anything_is_written(tmp_path):
    """A tokenizer larger than the model's embedding (another model's) would fail inside the embedding
    lookup (a device assert on a GPU); the build refuses it first and leaves nothing behind."""
    model = fca.load_model(REPO / "cache" / "demo" / "featuregate")
    windows = np.full((2, 9), 5, dtype=np.int64)
    windows[1, 3] = 5000
    with pytest.raises(ValueError, match=r"token ids from 5 to 5000, but FeatureGateModel embeds ids in \[0, 2048\)"):
        fca.build_cache(model, windows, tmp_path / "c", split="eval")
    one_past = windows.copy()
    one_past[1, 3] = 2048  # the first id past the embedding's last row
    with pytest.raises(ValueError, match=r"token ids from 5 to 2048, but FeatureGateModel embeds ids in \[0, 2048\)"):
        fca.build_cache(model, one_past, tmp_path / "c", split="eval")
    # A model that names no embedding nor vocabulary is held to the width of its logits.
    adapted = TinyGatedLM().eval()
    fca.attach_sites(adapted, [SiteDeclaration("blocks.*.gate", (("group", 4),), "gate")], blocks="blocks", output=0)
    with pytest.raises(ValueError, match=r"token ids from 5 to 5000, but TinyGatedLM predicts ids in \[0, 64\)"):
        fca.build_cache(adapted, windows, tmp_path / "d", split="eval")
    assert list(tmp_path.iterdir()) == []


class PositionedLM(TinyGatedLM):
    """Learned positions: a context of 16 tokens, which nothing in the module states."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(16, 16)

    def forward(self, ids: torch.Tensor):
        h = self.embed(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(h), {"hidden": h}


def test_windows_longer_than_the_models_context_or_a_training_model_leave_nothing_behind(tmp_path):
    """Both failed inside the first record pass with the build's folder already begun (`<out>.partial/`);
    a window longer than the context as a bare IndexError."""
    model = PositionedLM().eval()
    fca.attach_sites(model, [SiteDeclaration("blocks.*.gate", (("group", 4),), "gate")], blocks="blocks", output=0)
    tokens = np.random.default_rng(0).integers(0, 64, 400)
    with pytest.raises(ValueError, match=r"PositionedLM fails on a window of 32 tokens, so nothing was written \("):
        fca.build_cache(model, tokens, tmp_path / "long", seq_len=32)
    with pytest.raises(ValueError, match=r"split 'calib': choose one of train, calibration, eval"):
        fca.build_cache(model, tokens, tmp_path / "typo", seq_len=16, split="calib")
    model.train()
    with pytest.raises(ValueError, match=r"PositionedLM is in training mode; call model\.eval\(\) before building"):
        fca.build_cache(model, tokens, tmp_path / "training", seq_len=16)
    assert list(tmp_path.iterdir()) == []
    fca.build_cache(model.eval(), tokens, tmp_path / "fits", seq_len=16)


def test_documents_end_with_the_tokenizers_own_end_token():
    """Mistral-style tokenizers (Mixtral) end documents with </s>, not <|endoftext|>; a tokenizer with none of
    the known end tokens uses the config's eos_token_id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fca.tables import data
    from fca.tables.errors import ModelLoadError

    vocab = {"</s>": 0, "in": 1, "the": 2, "beginning": 3, "[UNK]": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert data.encode_stream(["in the beginning", "the"], tokenizer).tolist() == [1, 2, 3, 0, 2, 0]
    bare = Tokenizer(models.WordLevel({"in": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ModelLoadError, match=r"model.json: no end-of-document token \(none of <\|endoftext\|>, </s>"):
        data.end_of_document(bare, "model.json")
    # A token none of the candidates names (DeepSeek's) is taken from the config's eos_token_id, an id or a
    # list; a chat model's configured end of turn yields to its end of document.
    deepseek = Tokenizer(models.WordLevel({"in": 0, "<｜end▁of▁sentence｜>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert data.end_of_document(deepseek, config_eos=1) == data.end_of_document(deepseek, config_eos=[1, 0]) == 1
    chat = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<|im_end|>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert data.end_of_document(chat, config_eos=1) == 0
    for unusable in (True, "1"):
        with pytest.raises(ModelLoadError, match="and no eos_token_id in the model's config.json"):
            data.end_of_document(deepseek, "model.json", config_eos=unusable)
    for outside in (7, -1):  # (OLMoE's default 50279 beside a small tokenizer had been "no eos_token_id")
        said = rf"and the eos_token_id {outside} of the model's config.json is not among its 3 ids\)"
        with pytest.raises(ModelLoadError, match=said):
            data.end_of_document(deepseek, "model.json", config_eos=outside)


class DepthRoutedLM(nn.Module):
    """Mixture-of-Depths routing: in each layer a router scores every token and only the `capacity` top-scored
    tokens of each sequence run that layer's block (the others pass it by on the residual stream), their block
    output scaled by sigmoid(score). The blocks really run for half of the tokens, and which half is decided by
    the router: the execution audit must count it, and a shuffled replay must change it."""

    fca_family = Family(
        "depth_routed", blocks=lambda model: list(model.blocks), coefficient_kind="router scores, one per token"
    )

    def __init__(self, vocab: int = 64, d: int = 16, n_layers: int = 2, capacity: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.capacity = capacity
        self.embed = nn.Embedding(vocab, d)
        self.routers = nn.ModuleList(nn.Linear(d, 1) for _ in range(n_layers))  # the controllers: [B, T, 1]
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(n_layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # [B, T, D]
        for router, block in zip(self.routers, self.blocks):
            scores = router(h)[..., 0]  # [B, T]
            chosen = scores.topk(self.capacity, dim=1).indices.sort(dim=1).values  # [B, C]
            rows = chosen[..., None].expand(-1, -1, h.shape[-1])  # [B, C, D]
            update = block(h.gather(1, rows)) * torch.sigmoid(scores.gather(1, chosen))[..., None]  # [B, C, D]
            h = h.scatter_add(1, rows, update)
        return self.head(h)  # [B, T, V]


@pytest.mark.slow
def test_a_model_that_skips_blocks_is_counted_as_it_runs(tmp_path):
    """No shipped model skips a block, so the execution audit's counting had only ever seen every block run.
    A Mixture-of-Depths model runs each block for 16 of a sequence's 32 tokens: the audit counts exactly that
    from the calls themselves, and the router's coefficients decide which tokens, so the Correct replay is
    exact while a shuffled one routes other tokens."""
    model = DepthRoutedLM().eval()
    fca.attach_sites(
        model, [SiteDeclaration(path="routers.*", axes=(("score", 1),), family="router", coefficient="router score")]
    )
    tokens = np.random.default_rng(6).integers(0, 64, 4_000)
    # Windows shorter than the router's capacity: refused in one line by the first probe (the vocabulary's,
    # which had probed 2 tokens whatever the windows, so this model could not be cached at all).
    with pytest.raises(ValueError, match=r"short: DepthRoutedLM fails on a window of 8 tokens, so nothing was"):
        fca.build_cache(model, tokens[:900], tmp_path / "short", seq_len=8, split="eval")
    assert not (tmp_path / "short").exists()
    fca.build_cache(model, tokens[:2_000], tmp_path / "eval", seq_len=32, split="eval")
    fca.build_cache(model, tokens[2_000:], tmp_path / "calibration", seq_len=32, split="calibration")
    report = fca.audit(model, tmp_path / "eval", tmp_path / "calibration", num_seqs=16, latency_runs=2, sweep=())

    assert report.exactness.max_abs_logit_diff == 0.0
    execution = report.execution
    probe_tokens = 8 * 32  # the first 8 evaluated sequences
    assert execution.tokens == probe_tokens and execution.tokens_per_block == (8 * 16, 8 * 16)
    assert execution.blocks_executed_per_token == 1.0 and execution.blocks_executed_fraction == 0.5
    assert 0 < execution.controller_flops_share < 0.05  # a 16 -> 1 router beside 16 -> 32 -> 16 blocks
    assert "Blocks executed per token: 1.00 of 2 (50.0%)" in fca.tables.report.render_markdown(report)
    # Shuffled scores route other tokens through the blocks: the model depends on which tokens its router picks.
    nll = {name: row.nll for name, row in report.conditions.items()}
    assert nll["token_shuffle"] > nll["correct"] + 1e-3


@pytest.mark.slow
def test_a_runs_seed_and_every_batchs_exactness_reach_its_results(adapted, tmp_path):
    """The run's seed draws cross_input's derangement (another seed, other partners); and the mechanism check
    reports the largest difference over all batches, not the last batch's (a first batch off by 1e-3 and
    exact ones after had read as exact)."""
    tokens = np.random.default_rng(8).integers(0, 64, 2_000)
    fca.build_cache(adapted, tokens[:1_000], tmp_path / "eval", seq_len=32, split="eval")
    fca.build_cache(adapted, tokens[1_000:], tmp_path / "calibration", seq_len=32, split="calibration")
    experiment = fca.Experiment.open(adapted, tmp_path / "eval", tmp_path / "calibration")
    nll = [experiment.run(["cross_input"], num_seqs=8, seed=seed).per_seq_nll["cross_input"] for seed in (1, 2)]
    assert not np.array_equal(*nll)
    calls = {"n": 0}

    def first_call_off(module, args, output):
        calls["n"] += 1
        return output + 1e-3 if calls["n"] == 1 else output  # the first batch's live pass only

    handle = adapted.blocks[1].register_forward_hook(first_call_off)
    try:
        results = experiment.run(["static_layer"], num_seqs=6, batch_size=2, judge=False)
    finally:
        handle.remove()
    assert results.max_abs_logit_diff > 1e-4
