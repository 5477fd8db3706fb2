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

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from fca.engine.checkpoints import load_strict, read_config, read_state_dict
from fca.engine.family import Family
from fca.engine.sites import Site, SiteSpec, assign_site_names
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
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_ratio", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: MixtureOfDepthsConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, h: torch.Tensor, selection: Selection | None) -> torch.Tensor:
        """h: [B, T, D] (every token) or [N, D] (the selected tokens of `selection`) -> the same shape."""
        qkv = self.qkv(h)  # [B, T, 3D] or [N, 3D]
        if selection is not None:
            qkv = selection.pad(qkv)  # [B, M, 3D]
        B, T, D3 = qkv.shape
        D = D3 // 3
        q, k, v = qkv.split(D, dim=2)  # 3 x [B, T, D]
        q, k, v = (t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D/H]
        # Causal over slots is causal over positions: a sequence's selected tokens sit in position order, and a
        # real slot never looks past itself into the padding.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        y = y.transpose(1, 2).reshape(B, T, D)  # [B, T, D]
        if selection is not None:
            y = selection.unpad(y)  # [N, D]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: MixtureOfDepthsConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


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


class MixtureOfDepthsModel(PreTrainedModel):
    config_class = MixtureOfDepthsConfig
    base_model_prefix = "mixture_of_depths"
    _no_split_modules = ["Block"]

    def __init__(self, config: MixtureOfDepthsConfig) -> None:
        super().__init__(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        assign_site_names(self)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Real initialisation happens in `init_weights_seeded`; from_pretrained overwrites everything anyway.
        pass

    def init_weights_seeded(self, seed: int) -> None:
        """GPT-2 style init. Shared parameters draw from one generator in name order and the routers from
        another, so the routed model and its Dense twin start from the same weights. Router biases start at
        0 and their weights small, so that about half the tokens run at first."""
        shared = torch.Generator().manual_seed(seed)
        routers = torch.Generator().manual_seed(seed + 1_000_003)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, module in self.named_modules():
                gen = routers if ".router." in f"{name}." else shared
                if isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    std = residual_std if name.endswith(("attn.proj", "mlp.down")) else 0.02
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_) -> CausalLMOutput:
        """Logits [B, T, V]; with `labels`, the loss is the next-token cross-entropy plus, for a routed model,
        `capacity_loss_weight` times the blocks' mean capacity loss."""
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)  # [B, T, D]
        scores = []
        for block in self.blocks:
            x, block_scores = block(x)
            if block_scores is not None:
                scores.append(block_scores)
        logits = self.lm_head(self.ln_f(x))  # [B, T, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            if scores and self.training:
                capacity = sum(capacity_loss(s, self.config.capacity) for s in scores) / len(scores)
                loss = loss + self.config.capacity_loss_weight * capacity
        return CausalLMOutput(loss=loss, logits=logits)


def build_mixture_of_depths(config: MixtureOfDepthsConfig) -> MixtureOfDepthsModel:
    """A freshly initialised model, deterministic in `config.init_seed`."""
    model = MixtureOfDepthsModel(config)
    model.init_weights_seeded(config.init_seed)
    return model


def load_mixture_of_depths(path: Path) -> MixtureOfDepthsModel:
    """A mixture-of-depths (or Dense twin) directory -> the model on CPU in float32."""
    config = MixtureOfDepthsConfig.from_dict(read_config(path))
    return load_strict(MixtureOfDepthsModel(config), read_state_dict(path), path)


def tokens_per_sequence(body: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The tokens of each sequence a block body is called with: [B]. Called with every token ([B, T, D]) in
    the Dense twin, or with the selected tokens and their `Selection`."""
    x = args[0] if args else kwargs["x"]
    selection = args[1] if len(args) > 1 else kwargs.get("selection")
    if selection is None:
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    return selection.tokens_per_sequence()


FAMILY = Family(
    MixtureOfDepthsConfig.model_type,
    load=load_mixture_of_depths,
    dense_twin=DENSE_TWINS[MixtureOfDepthsConfig.model_type],  # `routed: false`
    blocks=lambda model: [block.body for block in model.blocks],  # called with the tokens that run only
    coefficient_kind="router scores, one per token and block; the block runs where the score is above 0",
    execution_note="A block runs for a token when its router score is above 0; the blocks' bodies are called "
    "with the selected tokens only, so the tokens counted are those computed.",
    tokens_per_sequence=tokens_per_sequence,
)
