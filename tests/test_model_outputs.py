"""Custom models: outputs that are tuples or dicts (with a declared selector), and wrong site paths that
are answered with the modules nearest in structure."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fca
from fca.engine.adapters import (
    SiteDeclaration,
    SiteDeclarationError,
    attach_sites,
    candidate_paths,
    detach_sites,
)
from fca.engine.sites import capture_tensors, model_logits, site_modes, tensor_provider

V, D, K = 11, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.controller = nn.Linear(D, K)  # [B, T, D] -> [B, T, K]
        self.attn = nn.Linear(D, D)
        self.mlp = nn.Linear(K, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.controller(x))  # [B, T, K]
        return x + self.attn(x) * self.mlp(gate)


class TupleModel(nn.Module):
    """Returns `(logits, extras)` like many research models; `kind` picks a dict or an object instead."""

    def __init__(self, kind: str = "tuple", layers: int = 2) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor):
        h = self.embed(ids)  # [B, T, D]
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)  # [B, T, V]
        if self.kind == "dict":
            return {"logits": logits, "hidden": h}
        return logits, {"hidden": h}


CONTROLLERS = [SiteDeclaration("blocks.*.controller", axes=(("gate", K),), family="gate")]


def _model(kind: str = "tuple", output=0) -> nn.Module:
    torch.manual_seed(0)
    return attach_sites(TupleModel(kind), CONTROLLERS, output=output).eval()


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind,output", [("tuple", 0), ("dict", "logits"), ("tuple", lambda out: out[0])])
def test_declared_output_replays_exactly(ids, kind, output) -> None:
    model = _model(kind, output)
    live, coefficients = capture_tensors(model, ids)
    assert live.shape == (2, 6, V)
    with site_modes(model, "replay", provider=tensor_provider(coefficients)):
        replayed = model_logits(model(ids), model)
    assert torch.equal(replayed, live)


def test_declared_output_through_the_public_replay(ids) -> None:
    model = _model()
    live = model_logits(model(ids), model)
    assert torch.equal(fca.replay(model, ids, fca.capture(model, ids)), live)


def test_undeclared_tuple_says_how_to_declare(ids) -> None:
    model = attach_sites(TupleModel(), CONTROLLERS).eval()
    with pytest.raises(TypeError, match=r"attach_sites\(model, \.\.\., output=0\)") as err:
        capture_tensors(model, ids)
    assert "\n" not in str(err.value)


def test_a_selector_that_does_not_fit_is_named(ids) -> None:
    model = _model("tuple", output="logits")
    with pytest.raises(TypeError, match="selector 'logits'"):
        capture_tensors(model, ids)


def test_detach_forgets_the_selector() -> None:
    model = _model()
    assert model.fca_output == 0
    assert not hasattr(detach_sites(model), "fca_output")


def test_a_wrong_path_lists_the_real_controller() -> None:
    model = TupleModel(layers=12)
    with pytest.raises(SiteDeclarationError, match=r"blocks\.0\.controller") as err:
        attach_sites(model, [SiteDeclaration("blocks.*.gate", axes=(("gate", K),), family="gate")])
    assert "\n" not in str(err.value)
    assert "blocks.11.controller" not in str(err.value)  # one path per name, not one per layer


def test_modules_of_the_patterns_shape_are_never_cut() -> None:
    model = TupleModel()
    for i in range(10):  # near spellings that would have filled every slot
        for block in model.blocks:
            block.add_module(f"gate{i}", nn.Identity())
    found = candidate_paths(model, "blocks.*.gate", limit=8)
    assert "blocks.0.controller" in found and "blocks.0.gate9" in found
    assert "blocks.0.controller" in candidate_paths(model, "blocks.*.mlp.gate")  # a sibling of the failing parent
    assert "blocks.0.controller" in candidate_paths(model, "layers.*.controller")
