"""What FeatureGate and mixture of depths share: a GPT-2-style pre-norm causal Transformer with learned
positions, whose blocks each architecture defines; its attention and MLP, its seeded initialisation, and
loading. Not a family of its own.

Shape legend: B = batch, T = positions, D = d_model, H = heads, V = vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from fca.engine.checkpoints import load_strict, read_config, read_state_dict
from fca.engine.sites import assign_site_names


def check_sizes(config: PretrainedConfig, names: tuple[str, ...]) -> None:
    """ValueError unless each named size is a whole number of at least 1 (a size given as "192" would fail
    far from the cause) and d_model splits into n_heads."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")
    if config.d_model % config.n_heads:
        raise ValueError(f"d_model {config.d_model} is not divisible by n_heads {config.n_heads}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, h: torch.Tensor, selection=None) -> torch.Tensor:
        """h: [B, T, D] (every token), or [N, D], the tokens of a `selection` (`mixture_of_depths.Selection`),
        which lays them out as [B, M, ...] for attention and back -> the same shape as h."""
        qkv = self.qkv(h)  # [B, T, 3D] or [N, 3D]
        if selection is not None:
            qkv = selection.pad(qkv)  # [B, M, 3D]
        B, T, D3 = qkv.shape
        D = D3 // 3
        q, k, v = qkv.split(D, dim=2)  # 3 x [B, T, D]
        q, k, v = (t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D/H]
        # With a selection, causal over slots is causal over positions: a sequence's selected tokens sit in
        # position order, and a real slot never looks past itself into the padding.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        y = y.transpose(1, 2).reshape(B, T, D)  # [B, T, D]
        if selection is not None:
            y = selection.unpad(y)  # [N, D]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SmallGPT(PreTrainedModel):
    """Token and position embeddings, `config.n_layers` blocks of the subclass's `block_class`, a final
    LayerNorm and the LM head. A block's controller lives under `.{controller_name}.` in its module path."""

    _no_split_modules = ["Block"]
    block_class: type[nn.Module]
    controller_name: str

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(self.block_class(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        assign_site_names(self)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Real initialisation happens in `init_weights_seeded`, which is deterministic per seed and
        # identical for the Dense twin; from_pretrained overwrites everything anyway.
        pass

    def init_weights_seeded(self, seed: int) -> None:
        """GPT-2 style init, biases at 0. Shared parameters draw from one generator in name order and the
        controllers' from another, so a model and its Dense twin (no controllers) start from the same weights."""
        shared = torch.Generator().manual_seed(seed)
        controllers = torch.Generator().manual_seed(seed + 1_000_003)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        marker = f".{self.controller_name}."
        with torch.no_grad():
            for name, module in self.named_modules():
                gen = controllers if marker in f"{name}." else shared
                if isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    std = residual_std if name.endswith(("attn.proj", "mlp.down")) else 0.02
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> token plus position embeddings [B, T, D]."""
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        return self.tok_emb(input_ids) + self.pos_emb(torch.arange(T, device=input_ids.device))

    def head(
        self, x: torch.Tensor, labels: torch.Tensor | None, extra_loss: torch.Tensor | None = None
    ) -> CausalLMOutput:
        """x [B, T, D] -> logits [B, T, V]; with `labels`, the loss: the next-token cross-entropy plus
        `extra_loss` if given."""
        logits = self.lm_head(self.ln_f(x))  # [B, T, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            if extra_loss is not None:
                loss = loss + extra_loss
        return CausalLMOutput(loss=loss, logits=logits)

    @classmethod
    def build(cls, config: PretrainedConfig) -> SmallGPT:
        """A freshly initialised model, deterministic in `config.init_seed`."""
        model = cls(config)
        model.init_weights_seeded(config.init_seed)
        return model

    @classmethod
    def load(cls, path: Path) -> SmallGPT:
        """A model directory (of this architecture or its Dense twin) -> the model on CPU in float32."""
        config = cls.config_class.from_dict(read_config(path))
        return load_strict(cls(config), read_state_dict(path), path)
