"""Mixture of depths: a pre-norm causal Transformer whose blocks run only for the tokens their router picks,
and its Dense twin.

Every block has a controller, a router: a linear map from the block input to one score per token. The block
runs for token t when its score is above 0, and then adds `sigmoid(score) * update` to the residual stream
(the weight carries the gradient to the router); a token whose score is at most 0 passes the block
unchanged. The score of token t is a function of the residual stream at t, which the earlier blocks built
from tokens <= t only, so the decision is causal: it never waits for later tokens (a top-k over the
sequence would).

Skipped tokens are not computed: the selected tokens are gathered, and the block's layer norms, attention
projections and MLP run on them alone ([N, D], N = selected tokens of the batch). Attention runs among the
selected tokens of each sequence: skipped tokens are neither queries nor keys or values in that block, and
a selected token attends to the selected tokens at positions <= its own (causal over the original
positions). For one batched attention call the selected tokens of each sequence are laid out left-aligned
in a [B, M, D] buffer (M = most tokens any sequence of the batch runs); the padded slots' outputs are
discarded.

Training respects a capacity with an auxiliary loss (`capacity_loss`): binary cross-entropy between each
score, as a logit, and whether the token is among the `capacity` share of highest scores in the training
batch. The target looks at the whole batch, so it exists only in training; it pulls the fixed threshold 0
to the batch's quantile, so that about `capacity` of the tokens run, while the decision itself stays the
causal rule above.

The Dense twin (`routed=False`) has no router: every block runs for every token and adds its whole update.
For a given seed it starts from the same weights for everything the two share.

Shape legend: B = batch, T = positions, D = d_model, H = heads, N = tokens a block runs (all sequences),
M = most tokens one sequence runs in a block, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutput

from fca.engine.family import Family, whole_sequences
from fca.engine.models.small_gpt import MLP, CausalSelfAttention, SmallGPT, check_sizes
from fca.engine.sites import Site, SiteSpec
from fca.tables.catalog import DENSE_TWINS

ROUTE_FAMILY = "route"
THRESHOLD = 0.0  # a block runs for a token whose score is above this


class MixtureOfDepthsConfig(PretrainedConfig):
    model_type = "mixture_of_depths"

    def __init__(
        self,
        vocab_size: int = 2048,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        max_seq_len: int = 128,
        routed: bool = True,
        capacity: float = 0.5,  # the share of tokens each block is trained to run
        capacity_loss_weight: float = 0.1,
        init_seed: int = 0,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.mlp_ratio = mlp_ratio
        self.max_seq_len = max_seq_len
        self.routed = routed
        self.capacity = capacity
        self.capacity_loss_weight = capacity_loss_weight
        self.init_seed = init_seed
        super().__init__(**kwargs)
        self.validate_shapes()

    def validate_shapes(self) -> None:
        check_sizes(self, ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_ratio", "max_seq_len"))
        if not isinstance(self.capacity, (int, float)) or not 0 < self.capacity <= 1:
            raise ValueError(f"capacity must be a share of tokens in (0, 1], not {self.capacity!r}")


@dataclass(frozen=True)
class Selection:
    """The tokens one block runs, from its decisions `run` [B, T]: their sequence (`rows` [N]), position
    (`positions` [N]) and slot among their sequence's selected tokens (`slots` [N]), in row-major order, so
    each sequence's tokens keep their order. `width` = M, the most tokens any sequence runs."""

    rows: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    batch: int
    width: int

    @classmethod
    def of(cls, run: torch.Tensor) -> Selection:
        rows, positions = run.nonzero(as_tuple=True)  # [N], [N]
        slots = (run.cumsum(1) - 1)[rows, positions]  # [N]
        width = int(run.sum(1).max()) if run.numel() else 0
        return cls(rows, positions, slots, run.shape[0], width)

    @property
    def tokens(self) -> int:
        return int(self.rows.numel())

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """packed [N, C] -> [B, M, C], each sequence's tokens left-aligned in position order, zeros after."""
        padded = packed.new_zeros(self.batch, self.width, packed.shape[-1])
        return padded.index_put((self.rows, self.slots), packed)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, M, C] -> packed [N, C]: the selected tokens' slots only."""
        return padded[self.rows, self.slots]

    def tokens_per_sequence(self) -> torch.Tensor:
        """[B] how many tokens of each sequence the block runs."""
        return torch.bincount(self.rows, minlength=self.batch)


class BlockBody(nn.Module):
    """What a block computes for the tokens it runs: x [N, D] (or [B, T, D], every token) -> its update,
    attention's and the MLP's, of the same shape. The execution audit counts the tokens this is called with."""

    def __init__(self, cfg: MixtureOfDepthsConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, selection: Selection | None = None) -> torch.Tensor:
        attended = self.attn(self.ln_attn(x), selection)
        return attended + self.mlp(self.ln_mlp(x + attended))


class RouterScore(nn.Module):
    """Block input [B, T, D] -> router scores [B, T, 1]."""

    def __init__(self, cfg: MixtureOfDepthsConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)  # [B, T, 1]


class Block(nn.Module):
    def __init__(self, cfg: MixtureOfDepthsConfig) -> None:
        super().__init__()
        self.body = BlockBody(cfg)
        self.router: Site | None = None
        if cfg.routed:
            spec = SiteSpec(
                axes=(("score", 1),),
                family=ROUTE_FAMILY,
                channel_labels=("score",),
                coefficient=f"router score; the block runs for the token when it is above {THRESHOLD:g}, "
                "and adds sigmoid(score) times its update",
            )
            self.router = Site(RouterScore(cfg), spec)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, D] -> (x after the block [B, T, D], router scores [B, T, 1] or None for the Dense twin)."""
        if self.router is None:
            return x + self.body(x), None
        scores = self.router(x)  # [B, T, 1]; under replay, the fed scores
        selection = Selection.of(scores[..., 0] > THRESHOLD)  # the decisions: a fixed rule of the scores
        if selection.tokens == 0:  # no token runs this block, so the block is not called
            return x, scores
        picked = (selection.rows, selection.positions)
        chosen = x[picked]  # [N, D]
        update = self.body(chosen, selection)  # [N, D]
        weight = torch.sigmoid(scores[picked])  # [N, 1]
        return x.index_put(picked, chosen + weight * update), scores


def capacity_loss(scores: torch.Tensor, capacity: float) -> torch.Tensor:
    """Binary cross-entropy between scores [B, T, 1] (logits) and whether each token is among the `capacity`
    share of highest scores of the batch: with the threshold at 0, about that share runs."""
    flat = scores.float().flatten()  # [B * T]
    k = max(1, round(capacity * flat.numel()))
    cut = flat.detach().topk(k).values[-1]
    return F.binary_cross_entropy_with_logits(flat, (flat.detach() >= cut).float())


class MixtureOfDepthsModel(SmallGPT):
    """Router biases start at 0 and their weights small (`init_weights_seeded`), so that about half the tokens
    run at first."""

    config_class = MixtureOfDepthsConfig
    base_model_prefix = "mixture_of_depths"
    block_class = Block
    controller_name = "router"

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_) -> CausalLMOutput:
        """Logits [B, T, V]; with `labels`, the loss is the next-token cross-entropy plus, for a routed model
        in training, `capacity_loss_weight` times the blocks' mean capacity loss."""
        x = self.embed(input_ids)  # [B, T, D]
        scores = []
        for block in self.blocks:
            x, block_scores = block(x)
            if block_scores is not None:
                scores.append(block_scores)
        capacity = None
        if labels is not None and scores and self.training:
            mean = sum(capacity_loss(s, self.config.capacity) for s in scores) / len(scores)
            capacity = self.config.capacity_loss_weight * mean
        return self.head(x, labels, capacity)


build_mixture_of_depths = MixtureOfDepthsModel.build


def tokens_per_sequence(body: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The tokens of each sequence a block body is called with: [B]. Called with every token ([B, T, D]) in
    the Dense twin, or with the selected tokens and their `Selection`."""
    selection = args[1] if len(args) > 1 else kwargs.get("selection")
    return whole_sequences(body, args, kwargs) if selection is None else selection.tokens_per_sequence()


FAMILY = Family(
    MixtureOfDepthsConfig.model_type,
    load=MixtureOfDepthsModel.load,
    dense_twin=DENSE_TWINS[MixtureOfDepthsConfig.model_type],  # `routed: false`
    blocks=lambda model: [block.body for block in model.blocks],  # called with the tokens that run only
    coefficient_kind="router scores, one per token and block; the block runs where the score is above 0",
    execution_note="A block runs for a token when its router score is above 0; the blocks' bodies are called "
    "with the selected tokens only, so the tokens counted are those computed.",
    tokens_per_sequence=tokens_per_sequence,
)
