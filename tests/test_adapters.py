"""Adapters: sites declared by module path on any model, and the built-in Hugging Face MoE adapters.

Tiny random MoE models are built from the transformers config classes, saved to a temporary
directory and loaded back through `fca.load_model` (local files only, hub offline).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from torch import nn

import fca
from fca.engine.adapters import (
    SiteDeclaration,
    SiteDeclarationError,
    attach_sites,
    detach_sites,
)
from fca.engine.families import family_of
from fca.engine.loading import fingerprint_state
from fca.engine.models import expert_execution
from fca.engine.models.hf_moe import adapt_moe
from fca.engine.sites import find_sites, model_logits
from fca.jobs.experiment import Experiment
from fca.tables.errors import CacheError, ModelLoadError

B, T, E, TOP_K, VOCAB = 2, 8, 4, 2, 100
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=TOP_K,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=E, **COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=E, **COMMON),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        num_experts=E, moe_intermediate_size=32, shared_expert_intermediate_size=32, **COMMON
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=E, moe_intermediate_size=32, head_dim=8, **COMMON),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: on a busy machine intra-op threads only add synchronisation waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe_dir(request, tmp_path_factory) -> tuple[Path, str]:
    """A tiny random MoE checkpoint on disk and the fingerprint of the unadapted model."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, fingerprint_state(model)


def load(path: Path) -> nn.Module:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return fca.load_model(path)


@pytest.fixture(scope="module")
def moe(moe_dir) -> nn.Module:
    """The checkpoint loaded through `fca.load_model`, shared by the tests of one family."""
    return load(moe_dir[0])


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))


def routers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: site.controller for name, site in find_sites(model).items()}


def test_correct_replay_is_exact(moe, moe_dir, ids):
    model = moe
    assert fingerprint_state(model) == moe_dir[1]  # the wrapper is invisible in the weights
    assert family_of(model).coefficient_kind == "router logits"
    live = model_logits(model(ids))
    coefficients = fca.capture(model, ids)
    router_sites = [n for n, s in find_sites(model).items() if s.spec.family == "router"]
    assert router_sites == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    for name in router_sites:
        assert coefficients[name].shape == (B, T, E) and coefficients[name].dtype == np.float32
        assert "router logits" in find_sites(model)[name].spec.coefficient
    replayed = fca.replay(model, ids, coefficients)
    assert (replayed - live).abs().max().item() <= 1e-6


def test_a_bfloat16_load_is_the_model_transformers_loads(moe_dir):
    """`--dtype bfloat16` is the model `from_pretrained(dtype=torch.bfloat16)` gives its users: parameters in
    bfloat16, the rotary frequencies (computed, not saved) in float32. Rounded to bfloat16 with the weights,
    they gave other logits under the same weights fingerprint."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        ours = fca.load_model(moe_dir[0], dtype=torch.bfloat16)
        theirs = adapt_moe(transformers.AutoModelForCausalLM.from_pretrained(moe_dir[0], dtype=torch.bfloat16).eval())
    assert {n: b.dtype for n, b in ours.named_buffers()} == {n: b.dtype for n, b in theirs.named_buffers()}
    assert {b.dtype for b in ours.buffers()} == {torch.float32} and {p.dtype for p in ours.parameters()} == {
        torch.bfloat16
    }
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model_logits(ours(ids)), model_logits(theirs(ids)))
    assert fingerprint_state(ours) == fingerprint_state(theirs)


def test_loading_prints_nothing_of_transformers(moe_dir, capfd):
    """transformers' "Loading weights" bars had come among the command's own progress lines."""
    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    load(moe_dir[0])
    assert capfd.readouterr().err == "" and hf_logging.is_progress_bar_enabled()  # (put back as found)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_a_checkpoint_saved_with_router_logits_on_replays(model_type, ids, tmp_path):
    """`output_router_logits: true` (left by training with the load-balancing loss) made the model gather every
    router's output; in replay no router runs, and the first replay died in transformers with an IndexError."""
    config = CONFIGS[model_type]()
    config.output_router_logits = True
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load(tmp_path)
    live = model_logits(model(ids))
    assert torch.equal(fca.replay(model, ids, fca.capture(model, ids)), live)


def test_router_never_runs_in_replay(moe_dir, ids):
    model = load(moe_dir[0])
    coefficients = fca.capture(model, ids)
    reference = fca.replay(model, ids, coefficients)
    calls = []
    handles = [r.register_forward_hook(lambda *_, n=n: calls.append(n)) for n, r in routers(model).items()]
    try:
        replayed = fca.replay(model, ids, coefficients)
    finally:
        for h in handles:
            h.remove()
    assert calls == [] and torch.equal(replayed, reference)
    with torch.no_grad():
        for router in routers(model).values():
            router.weight.fill_(math.nan)
    assert torch.equal(fca.replay(model, ids, coefficients), reference)  # the poisoned routers never ran
    assert torch.isnan(model_logits(model(ids))).any()  # ... while the live model does use them


def test_conditions_change_outputs_and_routing(moe, ids):
    model = moe
    coefficients = fca.capture(model, ids)
    correct = fca.replay(model, ids, coefficients)
    cross_input = {k: v[::-1].copy() for k, v in coefficients.items()}  # the derangement of 2 sequences
    static = {k: v.mean(axis=(0, 1)) for k, v in coefficients.items()}  # per-site mean profile [K]
    for condition in (cross_input, static):
        assert (fca.replay(model, ids, condition) - correct).abs().max().item() > 1e-4
    # Top-k selection follows the replayed logits: one static profile routes every token alike.
    from fca.engine.sites import site_modes, tensor_provider

    with site_modes(model, "replay", provider=tensor_provider({k: torch.as_tensor(v) for k, v in static.items()})):
        frozen = expert_execution(model, ids)
    assert all(layer["experts_hit"] == TOP_K for layer in frozen["layers"].values())


def test_expert_execution_and_blocks(moe, ids):
    model = moe
    report = expert_execution(model, ids)
    assert report["moe_layers"] == 2 and report["top_k"] == TOP_K and report["experts_available"] == E
    assert report["experts_run_per_token_mean"] == TOP_K and report["expert_fraction"] == TOP_K / E
    assert all(layer["tokens"] == B * T for layer in report["layers"].values())
    assert "expert-level" in report["note"]
    assert len(model.fca_blocks()) == 2


def test_wrong_path_lists_candidates():
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).eval()
    declaration = SiteDeclaration(
        path="model.layers.*.mlp.router", axes=(("expert", E),), family="router", token_layout="flat"
    )
    with pytest.raises(
        SiteDeclarationError, match=r"model\.layers\.\*\.mlp\.router.*candidates: .*model\.layers\.0\.mlp\.gate"
    ) as err:
        attach_sites(model, [declaration])
    assert "\n" not in str(err.value)
    gates = SiteDeclaration(path="model.layers.*.mlp.gate", axes=(("expert", E),), family="router", token_layout="flat")
    with pytest.raises(SiteDeclarationError, match=r"blocks='model\.layerz': no module .* candidates: .*model\.layers"):
        attach_sites(model, [gates], blocks="model.layerz")
    assert not find_sites(model)  # nothing was swapped


def test_spec_that_does_not_fit_is_a_clear_error(ids):
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).eval()
    wrong_axes = SiteDeclaration(
        path="model.layers.*.mlp.gate",
        axes=(("expert", E + 1),),
        family="router",
        output=0,
        token_layout="flat",
        rebuild=lambda c, m: c,
    )
    attach_sites(model, [wrong_axes])
    with pytest.raises(
        SiteDeclarationError,
        match=r"Tensor\[16, 4\] does not fit .*trailing dims \[5\].*returned "
        r"tuple\(Tensor\[16, 4\], Tensor\[16, 2\], Tensor\[16, 2\]\)",
    ) as err:
        fca.capture(model, ids)
    assert "\n" not in str(err.value)
    with pytest.raises(SiteDeclarationError, match="needs rebuild"):
        SiteDeclaration(path="x", axes=(("e", 2),), family="f", output=0)


class GatedBlock(nn.Module):
    """A user's own dynamic block: a gating Linear scales the MLP output per feature group."""

    def __init__(self, d: int, groups: int, flat: bool) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gate = nn.Linear(d, groups)
        self.flat, self.groups = flat, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Bx, Tx, D = x.shape
        logits = self.gate(x.reshape(Bx * Tx, D) if self.flat else x).reshape(Bx, Tx, self.groups)  # [B, T, G]
        y = self.mlp(x).view(Bx, Tx, self.groups, D // self.groups)  # [B, T, G, D/G]
        return x + (y * torch.sigmoid(logits).unsqueeze(-1)).view(Bx, Tx, D)


class TinyUserModel(nn.Module):
    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(GatedBlock(16, 4, flat) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # [B, T, V]


class InPlaceGatedBlock(GatedBlock):
    """A block that writes into what its gate returned (`sigmoid_`), a common idiom."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Bx, Tx, D = x.shape
        gates = self.gate(x).sigmoid_()  # [B, T, G], the gate's own output tensor
        return x + (self.mlp(x).view(Bx, Tx, self.groups, -1) * gates.unsqueeze(-1)).view(Bx, Tx, D)


def test_a_model_writing_into_its_coefficients_changes_neither_capture_nor_the_callers_arrays(ids):
    """The capture held the values after the model's `sigmoid_` (Correct replay then missed the live run
    by 0.3), replay wrote into the caller's numpy arrays, and a broadcast profile failed inside torch."""
    torch.manual_seed(0)
    model = TinyUserModel(flat=False)
    model.blocks = nn.ModuleList(InPlaceGatedBlock(16, 4, False) for _ in range(2))
    model.eval()
    with torch.no_grad():
        live = model(ids)
        first_logits = model.blocks[0].gate(model.embed(ids))  # [B, T, 4], before any sigmoid
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    coefficients = fca.capture(model, ids)
    assert np.array_equal(coefficients["blocks.0.gate"], first_logits.numpy())
    kept = {name: values.copy() for name, values in coefficients.items()}
    assert (fca.replay(model, ids, coefficients) - live).abs().max().item() == 0
    assert all(np.array_equal(kept[name], coefficients[name]) for name in kept)
    profile = {name: values.mean((0, 1)) for name, values in coefficients.items()}  # [K] each
    assert fca.replay(model, ids, profile).shape == live.shape
    wider = {name: values.astype(np.float64) for name, values in profile.items()}  # cast, so a copy: not shared
    assert fca.replay(model, ids, wider).shape == live.shape  # still a broadcast view until made its own


def test_replay_refuses_what_capture_refuses(ids):
    """Coefficients that are not floating point, and a site consumed twice in one forward, are refused in
    replay as in capture (they were cast, or fed twice, without a word)."""
    model = TinyUserModel(flat=False).eval()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    coefficients = fca.capture(model, ids)
    for dtype in (np.int64, np.bool_, np.complex64):
        wrong = {**coefficients, "blocks.1.gate": coefficients["blocks.1.gate"].astype(dtype)}
        with pytest.raises(ValueError, match=r"site 'blocks\.1\.gate': replay coefficients must be floating point"):
            fca.replay(model, ids, wrong)

    class TwiceGatedBlock(GatedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(super().forward(x))  # the gate runs twice

    shared = TinyUserModel(flat=False).eval()
    shared.blocks[0] = TwiceGatedBlock(16, 4, False).eval()
    attach_sites(shared, [SiteDeclaration(path="blocks.0.gate", axes=(("group", 4),), family="gate")])
    for run in (lambda: fca.capture(shared, ids), lambda: fca.replay(shared, ids, {"blocks.0.gate": np.zeros(4)})):
        with pytest.raises(ValueError, match=r"site 'blocks\.0\.gate' ran twice in one forward pass"):
            run()


def test_a_per_sequence_controller_is_told_coefficients_are_per_token(ids):
    """Its [B, K] output had been answered with "one scalar per token: declare axes=()", which fails again."""

    class PooledGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x.mean(1))  # [B, 4]: one vector per sequence

    model = TinyUserModel(flat=False).eval()
    model.blocks[0].gate = PooledGate()
    for axes in ((("group", 4),), ()):
        attached = TinyUserModel(flat=False).eval()
        attached.blocks[0].gate = PooledGate()
        attach_sites(attached, [SiteDeclaration(path="blocks.0.gate", axes=axes, family="gate")])
        with pytest.raises(SiteDeclarationError, match=rf"must begin with \[{B}, {T}\]; per-sequence or pooled"):
            fca.capture(attached, ids)
    per_token = TinyUserModel(flat=False).eval()  # [B, T, 4] declared as 5 channels: per token, not per sequence
    attach_sites(per_token, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 5),), family="gate")])
    with pytest.raises(SiteDeclarationError) as err:
        fca.capture(per_token, ids)
    assert "per-sequence" not in str(err.value)


class SliceGate(nn.Module):
    """A controller without parameters: its first four features are the gates."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :4]


def test_a_controller_without_parameters_forgets_its_dtype_on_any_move(ids):
    """Nothing tells whether a move changed what such a controller produces, so any move forgets it."""
    model = TinyUserModel(flat=False).eval()
    for block in model.blocks:
        block.gate = SliceGate()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    fca.capture(model, ids)
    assert all(site._produced_dtype == torch.float32 for site in find_sites(model).values())
    model.to(torch.bfloat16)
    assert all(site._produced_dtype is None for site in find_sites(model).values())


def test_finite_coefficients_that_overflow_the_model_are_returned_not_refused(ids):
    """Only non-finite coefficients are refused; what the model makes of finite ones is the caller's figure
    (replay runs refuse non-finite NLLs per condition)."""
    torch.manual_seed(0)
    model = TinyUserModel(flat=False)
    model.blocks = nn.ModuleList(ScalarGatedBlock(16) for _ in range(2))
    model.eval()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(), family="gate")])
    huge = {name: np.full_like(values, 3e38) for name, values in fca.capture(model, ids).items()}
    assert not torch.isfinite(fca.replay(model, ids, huge)).all()


@pytest.mark.parametrize("layout", ["batched", "flat"])
def test_user_model_with_glob_path_end_to_end(layout, ids):
    torch.manual_seed(0)
    model = TinyUserModel(flat=layout == "flat").eval()
    plain = model(ids).detach()
    attach_sites(
        model,
        [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate", token_layout=layout)],
        blocks="blocks",
    )
    assert list(find_sites(model)) == ["blocks.0.gate", "blocks.1.gate"] and len(model.fca_blocks()) == 2
    coefficients = fca.capture(model, ids)
    assert coefficients["blocks.0.gate"].shape == (B, T, 4)
    gates = [site.controller for site in find_sites(model).values()]
    calls = []
    handles = [g.register_forward_hook(lambda *_: calls.append(1)) for g in gates]
    try:
        replayed = fca.replay(model, ids, coefficients)
    finally:
        for h in handles:
            h.remove()
    assert calls == [] and (replayed - plain).abs().max().item() <= 1e-6
    cross_input = {k: v[::-1].copy() for k, v in coefficients.items()}
    assert (fca.replay(model, ids, cross_input) - plain).abs().max().item() > 1e-4
    # Weights keep their plain names, and detaching restores the original module tree.
    assert "blocks.0.gate.weight" in model.state_dict()
    model.load_state_dict(TinyUserModel(flat=layout == "flat").state_dict())
    detach_sites(model)
    assert not find_sites(model) and isinstance(model.blocks[0].gate, nn.Linear)


def _controller_calls(model) -> list:
    """Appends to the returned list on every call of a site's controller."""
    calls: list = []
    for site in find_sites(model).values():
        site.controller.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_a_controller_shared_by_the_blocks_is_one_site_per_block_and_removed_from_all(ids):
    """`named_modules` lists a module reached twice once; every block's use is still its own site, so no
    block keeps calling the live controller in replay."""
    torch.manual_seed(0)
    model = TinyUserModel(flat=False).eval()
    model.blocks[1].gate = model.blocks[0].gate  # one controller for both blocks
    plain = model(ids).detach()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    assert list(find_sites(model)) == ["blocks.0.gate", "blocks.1.gate"]
    coefficients = fca.capture(model, ids)
    assert not np.array_equal(coefficients["blocks.0.gate"], coefficients["blocks.1.gate"])
    calls = _controller_calls(model)
    assert (fca.replay(model, ids, coefficients) - plain).abs().max().item() <= 1e-6 and calls == []
    only_second = dict(coefficients, **{"blocks.1.gate": coefficients["blocks.1.gate"][::-1].copy()})
    assert (fca.replay(model, ids, only_second) - plain).abs().max().item() > 1e-4  # block 1 is frozen too


def test_a_site_that_runs_twice_in_a_pass_is_refused_when_recorded(ids):
    """A controller used twice in one forward would be recorded once (its last call) and replayed into both."""

    class TwiceGated(TinyUserModel):
        def forward(self, input_ids):
            x = self.embed(input_ids)
            x = self.blocks[0](self.blocks[0](x))  # the same block, so the same gate, twice
            return self.head(x)

    model = TwiceGated(flat=False).eval()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    with pytest.raises(ValueError, match=r"site 'blocks\.0\.gate' ran twice in one forward pass") as err:
        fca.capture(model, ids)
    assert "\n" not in str(err.value)


def test_a_shared_parent_cannot_hold_two_sites(ids):
    model = TinyUserModel(flat=False).eval()
    model.blocks[1] = model.blocks[0]  # both paths lead to one block's one `gate` attribute
    with pytest.raises(SiteDeclarationError, match=r"blocks\.1\.gate and blocks\.0\.gate are one attribute"):
        attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    assert not find_sites(model)  # nothing swapped


class HeadGate(nn.Module):
    """Gates per head as [B, T, H, 1], the shape a head-gated attention multiplies by."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(x)).unsqueeze(-1)  # [B, T, H, 1]


class HeadGatedModel(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.gate = HeadGate(d, heads)
        self.head = nn.Linear(d, VOCAB)
        self.heads = heads

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # [B, T, D]
        Bx, Tx, D = x.shape
        x = (x.view(Bx, Tx, self.heads, D // self.heads) * self.gate(x)).view(Bx, Tx, D)
        return self.head(x)


def test_coefficient_dims_must_be_the_declared_axes_not_just_their_product(ids):
    """[B, T, H, 1] declared as (("head", H),) holds K values but would be replayed as [B, T, H]: refused
    when recorded, with the dims to declare; declared with both axes it replays exactly."""
    torch.manual_seed(0)
    model = HeadGatedModel().eval()
    plain = model(ids).detach()
    attach_sites(model, [SiteDeclaration(path="gate", axes=(("head", 4),), family="gate")])
    with pytest.raises(
        SiteDeclarationError, match=r"trailing dims \[4\]\) \(declare axes for each of its dims \[4, 1\]\)"
    ):
        fca.capture(model, ids)
    detach_sites(model)
    attach_sites(model, [SiteDeclaration(path="gate", axes=(("head", 4), ("one", 1)), family="gate")])
    coefficients = fca.capture(model, ids)
    assert coefficients["gate"].shape == (B, T, 4)
    assert (fca.replay(model, ids, coefficients) - plain).abs().max().item() == 0


def test_bad_replay_coefficients_and_inputs_are_one_line_errors(ids):
    model = TinyUserModel(flat=False).eval()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    coefficients = fca.capture(model, ids)
    for wrong, shape in [({k: v[:1, :3] for k, v in coefficients.items()}, r"\[1, 3, 4\]"),
                         ({k: v[..., :3] for k, v in coefficients.items()}, r"\[2, 8, 3\]")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"site 'blocks\.0\.gate': replay coefficients of shape {shape}"):
            fca.replay(model, ids, wrong)
    with pytest.raises(ValueError, match="integer token ids, got float32"):
        fca.capture(model, torch.rand(2, 8))
    with pytest.raises(ValueError, match="not None"):
        fca.replay(model, None, coefficients)
    beyond = ids.clone()
    beyond[0, 0] = VOCAB  # a plain module: no get_input_embeddings() nor config, so found inside the pass
    for run in (lambda: fca.capture(model, beyond), lambda: fca.replay(model, beyond, coefficients)):
        with pytest.raises(
            ValueError,
            match=rf"TinyUserModel raised IndexError \(index out of range in self\) on input ids from \d+ to {VOCAB}: ",
        ):
            run()
    misdeclared = TinyUserModel(flat=False)  # 4 gates declared as 2 x 2: the consumer expects [B, T, 4]
    misdeclared.blocks = nn.ModuleList(InPlaceGatedBlock(16, 4, False) for _ in range(2))
    misdeclared.eval()
    attach_sites(misdeclared, [SiteDeclaration(path="blocks.*.gate", axes=(("a", 2), ("b", 2)), family="gate")])
    with pytest.raises(ValueError, match=r"TinyUserModel failed on the replayed coefficients \(The size of tensor"):
        fca.replay(misdeclared, ids, coefficients)  # before any capture, which would have refused the axes
    poisoned = {name: values.copy() for name, values in coefficients.items()}
    poisoned["blocks.1.gate"][0, 3, :2] = [np.nan, np.inf]
    with pytest.raises(ValueError, match=r"NaN or infinity at site\(s\) blocks\.1\.gate \(2 of 64 values\)"):
        fca.replay(model, ids, poisoned)


@pytest.mark.parametrize(
    "axes", [2, (2,), (("group", "4"),), (("group", 0),), None, (("group", 4, 1),), (("group", True),)]
)
def test_axes_are_checked_when_declared(axes):
    with pytest.raises(SiteDeclarationError, match=r"blocks\.\*\.gate: axes must be \(name, size\) pairs"):
        SiteDeclaration(path="blocks.*.gate", axes=axes, family="gate")
    with pytest.raises(SiteDeclarationError, match="family must be a non-empty name"):
        SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family=3)
    assert SiteDeclaration(path="g", axes=[["group", np.int64(4)]], family="gate")  # lists and numpy sizes are fine


def test_token_ids_outside_the_vocabulary_are_one_line(ids):
    model = adapt_moe(transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).eval())
    with pytest.raises(
        ValueError, match=rf"input_ids must lie in \[0, {VOCAB}\) for MixtralForCausalLM, got ids from 0 to {VOCAB}"
    ):
        fca.capture(model, torch.tensor([[0, 1, VOCAB]]))


def test_a_checkpoint_missing_or_adding_weights_is_refused(tmp_path):
    """transformers would initialise a missing weight afresh (a router, even) and drop an unexpected one,
    saying so in a multi-line report only: the model audited would not be the checkpoint."""
    from safetensors.torch import load_file, save_file

    transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).save_pretrained(tmp_path / "ok")
    fca.load_model(tmp_path / "ok")  # the checkpoint as written loads
    weights = load_file(tmp_path / "ok" / "model.safetensors")
    for name, change in [
        ("missing", lambda w: w.pop("model.layers.0.mlp.gate.weight", None) or w.pop("model.norm.weight")),
        ("extra", lambda w: w.__setitem__("model.extra.weight", torch.zeros(2))),
    ]:
        broken = dict(weights)
        change(broken)
        shutil.copytree(tmp_path / "ok", tmp_path / name)
        save_file(broken, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=rf"{name}: the checkpoint (lacks|has unexpected) weights \(") as err:
            fca.load_model(tmp_path / name)
        assert "\n" not in str(err.value)
    # An expert's weight missing, or a weight of another shape, made transformers fail outright, "look at
    # the above report" (a report nobody saw): the report's rows name the weights instead.
    for name, change, said in [
        ("expert", lambda w: w.pop("model.layers.0.block_sparse_moe.experts.1.w1.weight"), ".experts."),
        ("shape", lambda w: w.__setitem__("model.norm.weight", torch.ones(33)), "model.norm.weight MISMATCH"),
    ]:
        broken = dict(weights)
        change(broken)
        shutil.copytree(tmp_path / "ok", tmp_path / name)
        save_file(broken, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(
            ModelLoadError, match=rf"{name}: transformers could not load it \(the checkpoint's weights"
        ) as err:
            fca.load_model(tmp_path / name)
        assert said in str(err.value) and "above report" not in str(err.value) and "\n" not in str(err.value)
    # A truncated checkpoint: transformers' SafetensorError ("incomplete metadata") was a traceback.
    shutil.copytree(tmp_path / "ok", tmp_path / "cut")
    whole = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelLoadError, match=r"cut/model.safetensors: unreadable weights \(.*incomplete metadata"):
        fca.load_model(tmp_path / "cut")
    # More experts per token than there are: refused from the config (the first forward died in the router).
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    shutil.copytree(tmp_path / "ok", tmp_path / "topk")
    (tmp_path / "topk" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": E + 1}))
    with pytest.raises(ModelLoadError, match=rf"topk/config.json: num_experts_per_tok {E + 1} does not fit the {E} "):
        fca.load_model(tmp_path / "topk")


class UpcastGate(nn.Module):
    """A controller that computes in float32 whatever the model's dtype, as many routers do."""

    def __init__(self, d: int, groups: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(x).float())  # [B, T, G] float32


class UpcastBlock(GatedBlock):
    def __init__(self, d: int, groups: int) -> None:
        super().__init__(d, groups, flat=False)
        self.gate = UpcastGate(d, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Bx, Tx, D = x.shape
        y = self.mlp(x).view(Bx, Tx, self.groups, D // self.groups)  # [B, T, G, D/G]
        scaled = y * self.gate(x).unsqueeze(-1)  # float32: the float32 gate promotes the product
        return x + scaled.to(x.dtype).view(Bx, Tx, D)


def test_a_float32_controller_in_a_bfloat16_model_is_replayed_in_float32(ids, tmp_path):
    """Replay feeds each site in the dtype its controller produced: fed rounded to the model's bfloat16
    (as before), this model's Correct replay differed from its live run (max |logit diff| ~0.03)."""
    torch.manual_seed(0)
    model = TinyUserModel(flat=False)
    model.blocks = nn.ModuleList(UpcastBlock(16, 4) for _ in range(2))
    model = model.to(torch.bfloat16).eval()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")], blocks="blocks")
    with torch.no_grad():
        live = model(ids)
    assert (fca.replay(model, ids, fca.capture(model, ids)) - live).abs().max().item() == 0
    windows = torch.randint(3, VOCAB, (8, T + 1), generator=torch.Generator().manual_seed(1))
    cache = fca.build_cache(model, windows, tmp_path / "eval", batch_size=4)
    results = Experiment.open(model, cache, None).run(["correct"], batch_size=4)
    assert results.max_abs_logit_diff == 0 and results.exactness["fidelity"]["verdict"] == "bit-identical"
    recorded = fca.capture(model, ids)
    model.cpu().to(torch.bfloat16)  # moves that change nothing keep what the controllers produced
    assert all(site._produced_dtype == torch.float32 for site in find_sites(model).values())
    assert (fca.replay(model, ids, recorded) - live).abs().max().item() == 0
    model.to(torch.float32)  # what the controller produced before says nothing of what it produces now
    assert all(site._produced_dtype is None for site in find_sites(model).values())


def test_a_model_declaring_other_sites_than_its_cache_is_refused(ids, tmp_path):
    """A cached site the model does not declare would run live in every condition, its controller never
    removed; the audit said nothing and reported the run as a replay."""
    torch.manual_seed(0)
    model = TinyUserModel(flat=False).eval()
    weights = model.state_dict()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    windows = torch.randint(3, VOCAB, (8, T + 1), generator=torch.Generator().manual_seed(1))
    cache = fca.build_cache(model, windows, tmp_path / "eval", batch_size=4)
    partial = TinyUserModel(flat=False).eval()
    partial.load_state_dict(weights)  # the same weights, so the same fingerprint
    attach_sites(partial, [SiteDeclaration(path="blocks.0.gate", axes=(("group", 4),), family="gate")])
    with pytest.raises(CacheError, match=r"the model lacks \['blocks\.1\.gate'\] and has none beyond"):
        Experiment.open(partial, cache, None)
    wider = TinyUserModel(flat=False).eval()
    wider.load_state_dict(weights)
    attach_sites(wider, [SiteDeclaration(path="blocks.*.gate", axes=(("half", 2), ("pair", 2)), family="gate")])
    Experiment.open(wider, cache, None)  # the same channels, in other axes: the cache's values fit
    with pytest.raises(KeyError, match=r"site\(s\) \['blocks\.7\.gate'\] that the model lacks"):
        fca.replay(model, ids, {**fca.capture(model, ids), "blocks.7.gate": np.zeros((B, T, 4), np.float32)})


class ScalarGate(nn.Module):
    """One gate value per token, [B, T]: the commonest gate of all."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(x)).squeeze(-1)  # [B, T]


class ScalarGatedBlock(GatedBlock):
    def __init__(self, d: int) -> None:
        super().__init__(d, 1, flat=False)
        self.gate = ScalarGate(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x) * self.gate(x).unsqueeze(-1)


def test_a_controller_giving_one_scalar_per_token_is_declared_with_no_axes(ids, tmp_path):
    torch.manual_seed(0)
    model = TinyUserModel(flat=False)
    model.blocks = nn.ModuleList(ScalarGatedBlock(16) for _ in range(2))
    model.eval()
    with pytest.raises(SiteDeclarationError, match=r"one scalar per token: declare axes=\(\)"):
        attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("one", 1),), family="gate")])
        fca.capture(model, ids)
    detach_sites(model)
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(), family="gate")], blocks="blocks")
    with torch.no_grad():
        live = model(ids)
    coefficients = fca.capture(model, ids)
    assert coefficients["blocks.0.gate"].shape == (B, T, 1)
    assert (fca.replay(model, ids, coefficients) - live).abs().max().item() == 0
    windows = torch.randint(3, VOCAB, (8, T + 1), generator=torch.Generator().manual_seed(1))
    cache = fca.build_cache(model, windows, tmp_path / "eval", batch_size=4)
    assert fca.open_cache(cache).manifest.sites["blocks.1.gate"].num_channels == 1
    assert Experiment.open(model, cache, None).run(["correct"], batch_size=4).max_abs_logit_diff == 0


class UngatedBlock(GatedBlock):
    """GatedBlock's Dense twin: the same MLP, no gate."""

    def __init__(self, d: int, groups: int) -> None:
        super().__init__(d, groups, flat=False)
        del self.gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def test_a_dense_twin_held_in_memory_must_be_the_model_without_its_controllers(ids, tmp_path):
    """The CLI refuses a wrong twin by its family's config; a model in memory was timed against anything
    (a 35-times larger model gave 0.25x)."""
    torch.manual_seed(0)
    model = TinyUserModel(flat=False).eval()
    attach_sites(model, [SiteDeclaration(path="blocks.*.gate", axes=(("group", 4),), family="gate")])
    windows = torch.randint(3, VOCAB, (8, T + 1), generator=torch.Generator().manual_seed(1))
    cache = fca.build_cache(model, windows, tmp_path / "eval", batch_size=4)
    twin = TinyUserModel(flat=False)
    twin.blocks = nn.ModuleList(UngatedBlock(16, 4) for _ in range(2))
    assert Experiment.open(model, cache, None, dense=twin.eval()).dense is twin
    with pytest.raises(ModelLoadError, match="TinyUserModel: is in training mode; call .eval"):
        _ = Experiment.open(model, cache, None, dense=twin.train()).dense
    larger = TinyUserModel(flat=False)
    larger.blocks = nn.ModuleList(UngatedBlock(16, 4) for _ in range(3))
    with pytest.raises(ModelLoadError, match=r"has 6,516 parameters, and TinyUserModel without its controllers 5,444"):
        _ = Experiment.open(model, cache, None, dense=larger.eval()).dense


def test_expert_paths_that_name_no_called_experts_module_are_refused(ids):
    """A user's family naming a list of experts (indexed, never called) reported 0 MoE layers without a
    word, and a module of another call convention failed with a bare KeyError."""
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).eval()
    model.model.layers[0].mlp.expert_list = nn.ModuleList([nn.Linear(4, 4)])  # never called
    with pytest.raises(ValueError, match=r"no module matching \['model\.layers\.\*\.mlp\.expert_list'\] was called"):
        expert_execution(model, ids, ("model.layers.*.mlp.expert_list",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp: not an experts module of the kind expert_paths"):
        expert_execution(model, ids, ("model.layers.*.mlp",))


def test_a_replay_run_reports_how_much_routing_each_condition_keeps(moe, tmp_path):
    """A saved run of an MoE model carries each condition's routing agreement: Correct keeps every token's
    experts, a condition on one router leaves the other's routing alone, and every figure is that of the
    experts the replay really dispatched to."""
    from fca.jobs.runs import run_replay
    from fca.tables.profiles import calibration_profiles
    from fca.tables.runs import condition_rows, list_runs
    from fca.tables.store import open_cache

    rng = np.random.default_rng(0)
    windows = rng.integers(3, VOCAB, size=(8, T + 1))  # [N, T + 1]
    evaluated = fca.build_cache(moe, windows[:4], tmp_path / "eval", split="eval", batch_size=2)
    calibration = fca.build_cache(moe, windows[4:], tmp_path / "cal", split="calibration", batch_size=2)
    first, second = (f"model.layers.{i}.mlp.gate" for i in range(2))
    record = run_replay(
        moe, evaluated, calibration, ["global_mean", f"token_shuffle@{first}"], num_seqs=4, batch_size=2, device="cpu"
    )
    routing = record["results"]["routing"]
    assert routing["routers"] == {first: TOP_K, second: TOP_K}  # (not Qwen2-MoE's shared-expert gate)
    conditions = routing["conditions"]
    assert conditions["correct"]["same_experts"] == 1.0 == conditions["correct"]["expert_overlap"]
    assert conditions["correct"]["weight_kept"] == 1.0 and 0 < conditions["global_mean"]["weight_kept"] < 1
    shuffled = conditions[f"token_shuffle@{first}"]
    assert shuffled["same_experts_per_router"][0] < 1.0 and shuffled["same_experts_per_router"][1] == 1.0
    # its figures are the shuffled router's: the untouched one keeps every token's experts by construction
    assert shuffled["routers_changed"] == [first] and conditions["global_mean"]["routers_changed"] == [first, second]
    assert shuffled["same_experts"] == shuffled["same_experts_per_router"][0]
    assert "not_reported" not in routing and all("tied" not in row for row in conditions.values())
    rows = {r["condition"]: r for r in condition_rows(list_runs(evaluated)[0])}
    assert rows["global_mean"]["same experts"] == conditions["global_mean"]["same_experts"]
    assert rows["global_mean"]["experts kept"] == conditions["global_mean"]["expert_overlap"]
    assert rows["global_mean"]["weight kept"] == conditions["global_mean"]["weight_kept"]
    assert "tied choices" not in rows["global_mean"]
    # Run alone (a cache rounded to float16 is not the recorded pass, so the checks replay a Correct of
    # their own): only what was asked is reported, and only the routers the cache holds.
    from fca.engine.replay import run_conditions
    from fca.tables.conditions import Condition

    rounded = fca.build_cache(
        moe, windows[:4], tmp_path / "f16", split="eval", batch_size=2, coefficient_dtype="float16"
    )
    profiles = calibration_profiles(open_cache(calibration))
    routers = {first: TOP_K, "model.layers.9.mlp.gate": TOP_K}
    alone = run_conditions(
        moe, open_cache(rounded), [Condition("static_layer")], profiles, batch_size=2, routers=routers
    )
    assert list(alone.routing) == ["static_layer"] and alone.routers == {first: TOP_K}
    # Without the checks (no live pass), a Correct is replayed for the tokens' own selection even unasked.
    unchecked = run_conditions(
        moe, open_cache(rounded), [Condition("static_layer")], profiles, batch_size=2, check_exactness=False
    )
    assert list(unchecked.routing) == ["static_layer"] and list(unchecked.per_seq_nll) == ["static_layer"]
    np.testing.assert_array_equal(
        unchecked.routing["static_layer"]["same_experts"][:, 0], alone.routing["static_layer"]["same_experts"][:, 0]
    )
    # Even where ties decide (global_mean: one value for every expert), the figures are those of the experts
    # the replay really dispatched to: read from the experts modules' inputs, live and under global_mean,
    # batch by batch as the run replayed.
    from fca.tables.conditions import condition_coefficients

    cache = open_cache(evaluated)
    handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(layer, module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [N, k]
        weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]  # [N, k]
        # as dense [N, E]: the weight each expert is handed (0: not run)
        handed[layer] = torch.zeros(len(index), E).scatter_add_(1, index.long(), weights.float())

    experts = [moe.get_submodule(f"model.layers.{i}.mlp.experts") for i in range(2)]
    hooks = [
        m.register_forward_pre_hook(lambda m, a, kw, i=i: record(i, m, a, kw), with_kwargs=True)
        for i, m in enumerate(experts)
    ]
    same, weight = np.zeros(2), np.zeros(2)
    try:
        for batch in ([0, 1], [2, 3]):
            own = cache.read_seqs(batch)
            moe(torch.from_numpy(own["token"]).long())
            live = dict(handed)
            fed = condition_coefficients(Condition("global_mean"), {s: own[s] for s in cache.sites}, batch, profiles)
            fca.replay(moe, own["token"], fed)
            for i in range(2):
                same[i] += ((live[i] > 0) == (handed[i] > 0)).all(-1).sum().item()
                weight[i] += (torch.minimum(live[i], handed[i]).sum(-1) / live[i].sum(-1)).sum().item()
    finally:
        for hook in hooks:
            hook.remove()
    assert conditions["global_mean"]["same_experts_per_router"] == pytest.approx(same / (4 * T), abs=1e-12)
    assert conditions["global_mean"]["weight_kept_per_router"] == pytest.approx(weight / (4 * T), rel=1e-6)


def test_routing_agreement_compares_the_selections_the_experts_were_handed():
    """The figures compare two selections (expert index and weights [N, k]) token by token: the set of experts,
    the share of the token's own experts kept, the share of its own weight left on them; an index >= E is an
    empty slot, and tokens are sequence-major."""
    from fca.engine.routing import Selection, routing_agreement

    def one(index, weights=None):  # one token
        return Selection(torch.tensor([index]), None if weights is None else torch.tensor([weights]))

    own = one([0, 1], [0.75, 0.25])
    for chosen, figures in (
        (one([2, 3], [0.5, 0.5]), (0.0, 0.0, 0.0)),
        (one([2, 0], [0.5, 0.5]), (0.0, 0.5, 0.5)),  # expert 0 kept, with 0.5 of its 0.75
        (one([1, 0], [0.25, 0.75]), (1.0, 1.0, 1.0)),  # the same set in another order
        (one([1, 0], [0.5, 0.5]), (1.0, 1.0, 0.75)),  # the same experts, weighed otherwise
        (one([0, 4], [0.75, 0.0]), (0.0, 0.5, 0.75)),  # 4 = E: an empty slot, no expert
    ):
        got = routing_agreement(own, chosen, 4, 1)
        assert tuple(got[f].item() for f in ("same_experts", "expert_overlap", "weight_kept")) == figures, chosen
    # no weights handed: no weight figure
    assert np.isnan(routing_agreement(one([0, 1]), one([0, 1]), 4, 1)["weight_kept"].item())
    # an empty own selection: kept only by an empty one
    assert routing_agreement(one([4, 4], [0.0, 0.0]), one([4, 4], [0.0, 0.0]), 4, 1)["expert_overlap"].item() == 1.0
    assert routing_agreement(one([4, 4], [0.0, 0.0]), one([0, 4], [1.0, 0.0]), 4, 1)["expert_overlap"].item() == 0.0
    # per sequence: [N = 2 sequences * 2 tokens, k = 1], sequence-major
    index = torch.tensor([[0], [1], [2], [3]])
    other = torch.tensor([[0], [0], [2], [2]])
    got = routing_agreement(Selection(index, None), Selection(other, None), 4, 2)["same_experts"]
    assert got.tolist() == [0.5, 0.5] and got.dtype == torch.float64


def test_the_gpu_checks_routing_step_holds_on_the_cpu(monkeypatch):
    """bench.moe_routing_check, which bench/gpu_checks.sh runs on CUDA, passes here in both dtypes: the
    figures, read at the experts, equal its NumPy count (within the tied share in bfloat16, where NumPy breaks
    ties otherwise)."""
    from bench.moe_routing_check import check

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for dtype in ("float32", "bfloat16"):
        result = check("cpu", dtype)
        assert result["failures"] == [] and result["max_abs_logit_diff"] == 0.0, dtype
