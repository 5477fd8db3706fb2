"""FeatureGate: a pre-norm causal Transformer whose blocks gate their own branches, and its Dense twin.

Every block has a controller: a map from the normalised block input to gate logits,
`gate = 2 * sigmoid(logits)`, so that gates start near 1. One gate per attention head scales that
head's group of attention-output features, one gate per feature group scales the MLP output, both
before the residual add. The block's gates form one site of `K = heads + groups` channels (or
`2 * d_model` with per-feature granularity). The Dense twin (`gated=False`) has no controller at all
and, for a given seed, the same initial weights for everything the two share.

Shape legend: B = batch, T = positions, D = d_model, H = heads, G = MLP feature groups,
K = gate channels of a block, V = vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutput

from fca.engine.family import Family
from fca.engine.models.small_gpt import MLP, CausalSelfAttention, SmallGPT, check_sizes
from fca.engine.sites import Site, SiteSpec
from fca.tables.catalog import DENSE_TWINS

GATE_FAMILY = "gate"


class FeatureGateConfig(PretrainedConfig):
    model_type = "featuregate"

    def __init__(
        self,
        vocab_size: int = 2048,
        d_model: int = 192,
        n_layers: int = 6,
        n_heads: int = 6,
        mlp_groups: int = 6,
        mlp_ratio: int = 4,
        max_seq_len: int = 128,
        gated: bool = True,
        controller: str = "linear",  # "linear" or "mlp"
        controller_hidden: int = 64,
        granularity: str = "group",  # "group": per head / MLP group; "feature": per output feature
        init_seed: int = 0,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.mlp_groups = mlp_groups
        self.mlp_ratio = mlp_ratio
        self.max_seq_len = max_seq_len
        self.gated = gated
        self.controller = controller
        self.controller_hidden = controller_hidden
        self.granularity = granularity
        self.init_seed = init_seed
        super().__init__(**kwargs)
        self.validate_shapes()

    def validate_shapes(self) -> None:
        sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_groups", "mlp_ratio", "max_seq_len")
        check_sizes(self, (*sizes, "controller_hidden"))
        if self.d_model % self.mlp_groups:
            raise ValueError(f"d_model {self.d_model} is not divisible by mlp_groups {self.mlp_groups}")
        if self.controller not in ("linear", "mlp"):
            raise ValueError(f"controller must be 'linear' or 'mlp', not {self.controller!r}")
        if self.granularity not in ("group", "feature"):
            raise ValueError(f"granularity must be 'group' or 'feature', not {self.granularity!r}")

    @property
    def attn_gates(self) -> int:
        return self.n_heads if self.granularity == "group" else self.d_model

    @property
    def mlp_gates(self) -> int:
        return self.mlp_groups if self.granularity == "group" else self.d_model

    @property
    def gates_per_block(self) -> int:
        return self.attn_gates + self.mlp_gates


class GateController(nn.Module):
    """Normalised block input [B, T, D] -> gates [B, T, K] in (0, 2)."""

    def __init__(self, cfg: FeatureGateConfig) -> None:
        super().__init__()
        K = cfg.gates_per_block
        if cfg.controller == "linear":
            self.net = nn.Linear(cfg.d_model, K)
        else:
            self.net = nn.Sequential(
                nn.Linear(cfg.d_model, cfg.controller_hidden), nn.GELU(), nn.Linear(cfg.controller_hidden, K)
            )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.sigmoid(self.net(h))  # [B, T, K]


def scale_groups(y: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Scale each of the `G` equal groups of y's features by its gate. y: [B, T, D], gates: [B, T, G]."""
    B, T, D = y.shape
    G = gates.shape[-1]
    return (y.view(B, T, G, D // G) * gates.unsqueeze(-1)).view(B, T, D)


class Block(nn.Module):
    def __init__(self, cfg: FeatureGateConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.attn_gates = cfg.attn_gates
        self.gate: Site | None = None
        if cfg.gated:
            labels = tuple(f"attn.{i}" for i in range(cfg.attn_gates)) + tuple(f"mlp.{i}" for i in range(cfg.mlp_gates))
            spec = SiteSpec(
                axes=(("gate", cfg.gates_per_block),),
                family=GATE_FAMILY,
                channel_labels=labels,
                coefficient="gate value 2 * sigmoid(logits) in (0, 2), scaling a head's or feature group's output",
            )
            self.gate = Site(GateController(cfg), spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_attn(x)  # [B, T, D]
        if self.gate is None:
            x = x + self.attn(h)
            return x + self.mlp(self.ln_mlp(x))
        gates = self.gate(h)  # [B, T, K]
        x = x + scale_groups(self.attn(h), gates[..., : self.attn_gates])
        return x + scale_groups(self.mlp(self.ln_mlp(x)), gates[..., self.attn_gates :])


class FeatureGateModel(SmallGPT):
    config_class = FeatureGateConfig
    base_model_prefix = "featuregate"
    block_class = Block
    controller_name = "gate"

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_) -> CausalLMOutput:
        x = self.embed(input_ids)  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        return self.head(x, labels)


build_featuregate = FeatureGateModel.build


FAMILY = Family(
    FeatureGateConfig.model_type,
    load=FeatureGateModel.load,
    dense_twin=DENSE_TWINS[FeatureGateConfig.model_type],  # `gated: false`
    blocks=lambda model: list(model.blocks),  # in execution order; the execution audit hooks them
    coefficient_kind="gate values 2 * sigmoid(logits), scaling attention heads and MLP feature groups",
)
