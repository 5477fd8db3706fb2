"""The variance decomposition against a two-pass float64 computation on the stored values, where the
coefficients vary little around their mean (a zero-initialised controller early in training looks like this):
means 1 and 100, spreads down to 1e-5, through `fca.build_cache` and `fca.audit`, and the moments' merges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fca
from fca.engine.adapters import SiteDeclaration
from fca.tables.profiles import slot_layout
from fca.tables.stats import Moments, SlotLayout, merge_moment_arrays, moments_arrays, variance_decomposition
from fca.tables.store import open_cache

from .test_in_memory import TinyGatedLM

TOLERANCE = 1e-9  # relative, against the two-pass figures
SPREADS = [(1.0, 1e-5), (1.0, 1e-4), (100.0, 1e-4), (100.0, 1e-5)]


def two_pass(values: np.ndarray, tokens: np.ndarray, layout: SlotLayout) -> dict:
    """The decomposition from its definitions (README, "What is measured, exactly"), each sum of squares
    taken around means computed first. values [n, T, C] as stored, tokens [n, T]."""
    n, T, C = values.shape
    fam = np.asarray(layout.families)
    flat = values.astype(np.float64).reshape(-1, C)  # [N, C]
    # Around one stored value per family first: exact for float32 values, and it keeps the second pass's
    # rounding relative to the spread (the figures do not depend on it).
    flat = flat - np.array([flat[0, layout.families.index(f)] for f in layout.families])
    grand = np.array([flat[:, fam == f].mean() for f in layout.families])  # [C] each slot's family grand mean
    slot_mean = flat.mean(0)  # [C]
    around_grand, within = flat - grand, flat - slot_mean
    ss_total_slot = (around_grand**2).sum(0)  # [C]
    ss_between_slot = len(flat) * (slot_mean - grand) ** 2  # [C]
    total = ss_total_slot.sum()

    def within_groups(keys: np.ndarray) -> float:  # keys [N]: the group of each row
        return sum((keys == g).sum() * (within[keys == g].mean(0) ** 2).sum() for g in np.unique(keys))

    ss_site = 0.0
    for s in layout.sites:
        sl = layout.site_slice(s)
        for f in dict.fromkeys(layout.families[sl]):
            cols = np.flatnonzero(fam[sl] == f) + sl.start
            ss_site += len(flat) * len(cols) * (slot_mean[cols].mean() - grand[cols[0]]) ** 2
    return {
        "layer_identity_share": ss_between_slot.sum() / total,
        "per_family": {f: ss_between_slot[fam == f].sum() / ss_total_slot[fam == f].sum() for f in set(fam)},
        "per_site": {
            s: ss_between_slot[layout.site_slice(s)].sum() / ss_total_slot[layout.site_slice(s)].sum()
            for s in layout.sites
        },
        "per_slot_share": list(ss_between_slot / ss_total_slot),
        "factors": {
            "site": ss_site / total,
            "channel_within_site": (ss_between_slot.sum() - ss_site) / total,
            "position_within_slot": within_groups(np.tile(np.arange(T), n)) / total,
            "token_id_within_slot": within_groups(tokens.reshape(-1)) / total,
            "sequence_within_slot": within_groups(np.repeat(np.arange(n), T)) / total,
            "residual_after_slot": (within**2).sum() / total,
        },
    }


def relative_errors(got: dict, expected: dict) -> dict[str, float]:
    """name -> |got - expected| / |expected| of every share and factor (inf where one is None)."""
    pairs = {"layer_identity_share": (got["layer_identity_share"], expected["layer_identity_share"])}
    for group in ("per_family", "per_site", "factors"):
        pairs |= {f"{group}.{k}": (got[group][k], v) for k, v in expected[group].items()}
    pairs |= {f"slot {j}": (g, e) for j, (g, e) in enumerate(zip(got["per_slot_share"], expected["per_slot_share"]))}
    return {k: np.inf if g is None else abs(g - e) / abs(e) for k, (g, e) in pairs.items()}


def gated_model(mean: float, spread: float, bias: torch.Tensor | None = None) -> torch.nn.Module:
    """A gated LM whose gate logits (its coefficients) are `mean` plus a spread of about `spread` within each
    slot and between slots: the gate layers' weights and biases set to that scale (`bias` [4]: the biases)."""
    model = TinyGatedLM().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:  # hidden states of about unit size per feature: W h has sd ~ spread
            gate = block.gate
            gate.weight.copy_(spread * torch.randn(gate.weight.shape, generator=g) / gate.in_features**0.5)
            gate.bias.copy_(mean + spread * torch.randn(gate.out_features, generator=g) if bias is None else bias)
    fca.attach_sites(
        model,
        [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate", coefficient="gate logits")],
        blocks="blocks",
        output=0,
    )
    return model


def stored_values(path) -> tuple[np.ndarray, np.ndarray, SlotLayout]:
    cache = open_cache(path)
    layout = slot_layout(cache)
    rows = cache.read_seqs(range(cache.num_seqs))
    return np.concatenate([rows[s] for s in layout.sites], axis=2), rows["token"], layout


@pytest.mark.slow
@pytest.mark.parametrize("mean, spread", SPREADS)
def test_an_audits_shares_match_two_pass_figures_on_its_stored_coefficients(mean, spread, tmp_path):
    """At mean 100 and spread 1e-5, raw sums of x and x^2 reported the layer-identity share as undefined
    where the two-pass share is about one half."""
    model = gated_model(mean, spread)
    tokens = np.random.default_rng(0).integers(0, 64, 2 * 48 * 17)
    fca.build_cache(model, tokens[: 48 * 17], tmp_path / "eval", seq_len=16, batch_size=8)
    fca.build_cache(model, tokens[48 * 17 :], tmp_path / "cal", seq_len=16, split="calibration", batch_size=8)
    values, ids, layout = stored_values(tmp_path / "eval")
    assert values.std(axis=(0, 1)).max() < 10 * spread and abs(values.mean() - mean) < 10 * spread  # as built
    report = fca.audit(model, tmp_path / "eval", tmp_path / "cal", latency_runs=1, sweep=(), batch_size=8)
    expected = two_pass(values, ids, layout)
    assert 0.05 < expected["layer_identity_share"] < 0.95  # both slot and token effects present
    errors = relative_errors(report.variance.to_json(), expected)
    assert max(errors.values()) <= TOLERANCE, {k: v for k, v in errors.items() if v > TOLERANCE}


@pytest.mark.slow
def test_a_share_is_undefined_only_where_the_coefficients_do_not_vary(tmp_path):
    """Coefficients constant within each slot but not between slots: all variance is layer identity (it was
    reported undefined, judged against their magnitude). Constant everywhere: undefined."""
    tokens = np.random.default_rng(0).integers(0, 64, 16 * 17)
    shares = []
    for step in (1e-5, 0.0):  # between slots; none within
        model = gated_model(100.0, 0.0, bias=100.0 + step * torch.arange(4.0))
        ev, cal = tmp_path / f"eval{step}", tmp_path / f"cal{step}"
        fca.build_cache(model, tokens, ev, seq_len=16)
        fca.build_cache(model, tokens[::-1].copy(), cal, seq_len=16, split="calibration")
        report = fca.audit(model, ev, cal, latency_runs=1, sweep=())
        shares.append(report.variance.layer_identity_share)
    assert shares == [1.0, None]


@pytest.mark.parametrize("mean, spread", SPREADS)
def test_merged_moments_of_parts_match_two_pass_figures(mean, spread):
    """Moments of blocks written as a build writes them (per-site blocks of whole sequences, each block its
    own shift), stored and merged in part order, against the two-pass figures of the float32 values."""
    rng = np.random.default_rng(2)
    n, T, C, vocab = 24, 12, 6, 9
    layout = SlotLayout(["a", "b"], [4, 2], ["g", "g", "g", "r", "r", "r"])
    tokens = rng.integers(0, vocab, (n, T))
    slot = rng.normal(0, spread, C)
    values = mean + slot + spread * (rng.normal(0, 1, (n, T, C)) + np.sin(tokens)[..., None])
    values = values.astype(np.float32)  # as stored
    parts = []
    for lo in range(0, n, 5):  # parts of 5 sequences, the first ones each of two pieces
        part = None
        for a, b in ((lo, min(n, lo + 3)), (lo + 3, min(n, lo + 5))):
            if a >= b:
                continue
            piece = Moments(C, T, vocab)
            piece.add(values[a:b], tokens[a:b])
            part = piece if part is None else part.merge(piece)
        arrays = moments_arrays(part)
        seen = np.flatnonzero(part.tok_count > 0)
        arrays.update(tok_ids=seen, tok_count=part.tok_count[seen], tok_sum=part.tok_sum[seen])
        parts.append(arrays)
    merged, with_tokens = merge_moment_arrays(iter(parts), C, T, vocab)
    assert with_tokens and merged.count == n * T
    expected = two_pass(values, tokens, layout)
    errors = relative_errors(variance_decomposition(merged, layout), expected)
    assert max(errors.values()) <= TOLERANCE, {k: v for k, v in errors.items() if v > TOLERANCE}
    np.testing.assert_allclose(merged.slot_mean, values.astype(np.float64).mean((0, 1)), rtol=1e-15, atol=0)
    np.testing.assert_allclose(merged.slot_var, values.astype(np.float64).var((0, 1)), rtol=1e-9)


def test_moments_read_from_files_without_a_shift_are_sums_around_zero():
    """The shipped demo's moments files hold raw sums (no `shift`): read as sums around 0."""
    rng = np.random.default_rng(3)
    values = rng.normal(1.0, 0.3, (4, 5, 3)).astype(np.float32)
    m = Moments(3, 5, None)
    m.add(values, np.zeros((4, 5), int))
    raw = moments_arrays(m.reshifted(np.zeros(3)))
    del raw["shift"]
    read, _ = merge_moment_arrays(iter([raw]), 3, 5, None)
    np.testing.assert_array_equal(read.shift, 0.0)
    np.testing.assert_allclose(read.slot_mean, m.slot_mean, rtol=1e-15)
    np.testing.assert_allclose(read.slot_var, m.slot_var, rtol=1e-12)
