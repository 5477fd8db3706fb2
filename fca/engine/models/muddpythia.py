"""MUDDPythia: a Pythia-style Transformer with multiway dynamic dense (MUDD) connections, and its Dense twin.

Our own implementation of the architecture published with MUDDFormer (public code: Caiyun-AI/MUDDFormer,
`pytorch/muddpythia/`). It reads that release's `config.json` fields and state-dict key names, so a local
download of e.g. MUDDPythia-1.4B loads without `trust_remote_code`.

How a MUDD model computes. Let X_0 be the token embeddings and X_{i+1} the output of layer i. After
layer i, a small controller (the dynamic-dense MLP `dynamic_dense.i`) reads X_{i+1} and gives, per
token, `C x (i+2)` weights; adding the learned static weights `dense_bs.i` gives the coefficients that
mix X_0 .. X_{i+1} into the C streams the next layer consumes:
- q, k, v: the inputs of the next attention's query, key and value projections (each stream has its
  own pre-norm when `sepln`),
- r: the residual stream, which is also the input of the next MLP.
The last layer is followed by no attention, so it mixes a single stream: the final hidden state that
goes to the final LayerNorm and the LM head. It plays the role of the residual, so its family is "r".
Layer 0 reads X_0 directly, for all of q, k, v and r.

The coefficients of layer i, flattened row-major `k = c * (i + 2) + j` (stream c in q, k, v, r order,
source j: 0 = embeddings, j >= 1 = output of layer j - 1), form the controller site `dense.i`.

Details that decide numerical agreement with the public implementation:
- `head_dim` is always `dim // n_head`; a `head_dim` in config.json is ignored.
- Rotary embeddings touch the first `int(head_dim * rotary_pct)` features of each head; feature `m`
  pairs with `m + R/2` (GPT-NeoX "rotate half"). The cos/sin table is computed in float32 and then
  rounded to float16; the rotation itself runs in float32. The rotated pairs are written back
  interleaved (m, m + R/2, m + 1, ...), as the release does: q and k share the layout, so only the
  summation order of the scores depends on it, but keeping it makes float32 logits bit-identical.
- Attention is an explicit masked softmax in the model's dtype, scores scaled after the product, as
  in the release (a fused kernel changes the rounding; in bfloat16 that is visible).
- qk-norm: RMSNorm with a learned scale over each head's features, in float32, before the rotation.
- Pre-norms are LayerNorms (per-stream when `sepln`); the controller input is normalised by an RMS
  norm without a scale; the final norm is a LayerNorm.
- The MLP width grows with depth: `round(intermediate_size * (i / (n_layer - 1) + 0.5) / 128) * 128`.
- The controller's hidden width is `C * (i + 2)` (times 4 in the last layer if `expand_last`), and with
  `round64` it becomes `(width // 64 + 1) * 64`, which adds 64 even to a multiple of 64.
- Parallel residual: attention and MLP both read the r stream (`h = r + attn(...)`,
  `out = h + mlp(ffn_norm(r))`); without it the MLP reads `h`.

Dense twin: `dense: false` in config.json (the public config's own switch) gives a Pythia-style model
of the same sizes with no dense connections and no controller: every layer reads and writes one
residual stream, attention uses one fused `wqkv` projection and one `attention_norm` (the public
code's key names for this case).

Shape legend: B = batch, T = positions, D = dim, H = heads, E = head_dim, R = rotary features,
F = MLP width of a layer, L = i + 2 sources of layer i, C = streams (4; 1 in the last layer),
K = C * L coefficients of layer i, V = vocabulary.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fca.engine.checkpoints import load_strict, read_config, read_state_dict
from fca.engine.family import Family
from fca.engine.sites import Site, SiteSpec, assign_site_names
from fca.tables.catalog import DENSE_TWINS, weights_path
from fca.tables.errors import ModelLoadError

MODEL_TYPE = "muddpythia"
STREAMS = ("q", "k", "v", "r")
# The last layer's single stream feeds the final norm and the LM head: it is the residual stream.
LAST_STREAM = "r"
FAMILY_DEFINITION = (
    "MUDDPythia coefficients form four families, one per stream: q, k, v, r (the last layer's single "
    "output stream counts as r). The global-mean profile of a family is the mean of all its "
    "coefficients (dynamic weights plus dense_bs) over every calibration token, layer and source, each "
    "coefficient weighted equally; it is used for every layer, source and token, so it carries no layer "
    "or source identity."
)
# config.json keys of the public release that do not change the computation.
_IGNORED_KEYS = {
    "model_type",
    "architectures",
    "auto_map",
    "torch_dtype",
    "transformers_version",
    "head_dim",
    "is_training",
    "use_gradient_checkpointing",
    "stack_hidden",
    "use_layer_cache",
    "tie_word_embeddings",
}


# ----------------------------------------------------------------------------------------------- config


def _check_type(name: str, value: object, annotation: str) -> None:
    """ValueError unless a config.json value has its field's type: "false" as a string would be true, and
    "64" as a size fails far from the cause. Whole numbers pass for floats; None where the field allows it."""
    allowed = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}
    kinds = [k.strip() for k in str(annotation).split("|")]
    if value is None and "None" in kinds:
        return
    ok = any(
        isinstance(value, allowed[k]) and (k == "bool" or not isinstance(value, bool)) for k in kinds if k in allowed
    )
    if not ok and any(k in allowed for k in kinds):
        raise ValueError(f"{name!r} must be {' or '.join(kinds)}, not {value!r}")


@dataclass(frozen=True)
class MUDDPythiaConfig:
    """The public release's config fields with the public defaults, plus derived per-layer sizes."""

    model_type: ClassVar[str] = MODEL_TYPE
    vocab_size: int = 32000
    dim: int = 2560
    n_layer: int = 32
    n_head: int = 32
    intermediate_size: int | None = None  # None: 4 * dim
    n_local_heads: int = -1  # -1: n_head (grouped-query attention is not supported by the release)
    block_size: int = 2048
    rope_base: float = 10000
    rotary_pct: float = 0.25
    norm_eps: float = 1e-5
    use_qk_norm: bool = False
    use_parallel_residual: bool = True
    use_linear_bias: bool = True  # MLP biases; attention projections always have biases
    dense: bool = True  # False: the Dense twin
    dynamic_dense: bool = True
    dense_type: str = "qkvr"
    sepln: bool = True
    expand_last: bool = False
    round64: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None

    # Derived once in __post_init__.
    head_dim: int = field(init=False)
    rotary_ndims: int = field(init=False)
    ffn_widths: tuple[int, ...] = field(init=False)  # F of each layer
    dense_streams: tuple[int, ...] = field(init=False)  # C of each layer (empty for the Dense twin)
    dense_hidden: tuple[int, ...] = field(init=False)  # controller hidden width of each layer

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        if self.intermediate_size is None:
            set_("intermediate_size", 4 * self.dim)
        if self.n_local_heads == -1:
            set_("n_local_heads", self.n_head)
        if self.n_layer < 2:
            raise ValueError(f"n_layer must be at least 2, not {self.n_layer}")
        if self.dim % self.n_head:
            raise ValueError(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        if self.n_local_heads != self.n_head:
            raise ValueError(f"n_local_heads {self.n_local_heads} != n_head {self.n_head} is not supported")
        if self.dense and not self.dynamic_dense:
            raise ValueError("dense connections without dynamic_dense are not supported (the release cannot run them)")
        if self.dense and self.dense_type != "qkvr":
            raise ValueError(f"dense_type must be 'qkvr', not {self.dense_type!r}")
        head_dim = self.dim // self.n_head
        rotary = int(head_dim * self.rotary_pct)
        if rotary % 2:
            raise ValueError(f"rotary features int({head_dim} * {self.rotary_pct}) = {rotary} must be even")
        set_("head_dim", head_dim)
        set_("rotary_ndims", rotary)
        # The float expression and Python's round() follow the release exactly (banker's rounding).
        widths = tuple(
            round(self.intermediate_size * (i / (self.n_layer - 1) + 0.5) / 128) * 128 for i in range(self.n_layer)
        )
        if min(widths) <= 0:
            raise ValueError(f"intermediate_size {self.intermediate_size} gives an empty MLP (widths {widths})")
        set_("ffn_widths", widths)
        streams = tuple(1 if i == self.n_layer - 1 else len(STREAMS) for i in range(self.n_layer)) if self.dense else ()
        hidden = []
        for i, c in enumerate(streams):
            width = c * (i + 2) * (4 if i == self.n_layer - 1 and self.expand_last else 1)
            hidden.append((width // 64 + 1) * 64 if self.round64 else width)
        set_("dense_streams", streams)
        set_("dense_hidden", tuple(hidden))

    def coefficients_per_layer(self) -> tuple[int, ...]:
        """K of each layer's site: C * (i + 2)."""
        return tuple(c * (i + 2) for i, c in enumerate(self.dense_streams))

    @classmethod
    def from_dict(cls, values: dict) -> MUDDPythiaConfig:
        """From a public-format config.json; keys that do not change the computation are ignored."""
        if values.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type {values.get('model_type')!r} is not {MODEL_TYPE!r}")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known - _IGNORED_KEYS)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}")
        for f in fields(cls):
            if f.init and f.name in values:
                _check_type(f.name, values[f.name], f.type)
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict:
        """The public config.json format (with the derived `head_dim`, as the release writes it)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return {
            "architectures": ["MUDDPythia"],
            "model_type": MODEL_TYPE,
            **values,
            "head_dim": self.head_dim,
            "tie_word_embeddings": False,
        }

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def dense_twin_config(config: MUDDPythiaConfig) -> MUDDPythiaConfig:
    """The Pythia-style Dense twin: the same sizes, no dense connections, no controller."""
    twin = DENSE_TWINS[MODEL_TYPE]  # dense=False, dynamic_dense=False
    return replace(config, **{key: False for key in (twin.switch, *twin.also_off)})


# ------------------------------------------------------------------------------------------------ parts


class Positions(NamedTuple):
    """What every layer needs about positions: the rotary table and the causal mask."""

    cos: torch.Tensor  # [T, R/2] float16
    sin: torch.Tensor  # [T, R/2] float16
    causal: torch.Tensor  # [T, T] bool, True where a query may attend


def rotary_table(T: int, R: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R/2], float16 (the release keeps its table in float16, which changes the logits)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, R, 2, device=device)[: R // 2].float() / R))  # [R/2]
    angles = torch.outer(torch.arange(T, device=device).float(), inv_freq)  # [T, R/2]
    # torch.polar rather than cos/sin: its float32 values round to the release's float16 table exactly.
    unit = torch.polar(torch.ones_like(angles), angles)  # [T, R/2] complex
    return unit.real.half(), unit.imag.half()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R features of each head, pairing m with m + R/2. x: [B, T, H, E]."""
    R = 2 * cos.shape[-1]
    if R == 0:
        return x
    a, b = x[..., :R].float().chunk(2, dim=-1)  # 2 x [B, T, H, R/2]
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()  # [T, 1, R/2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1)  # [B, T, H, R/2, 2]
    rotated = rotated.flatten(-2).to(x.dtype)  # [B, T, H, R], pairs interleaved
    return torch.cat((rotated, x[..., R:]), dim=-1)  # [B, T, H, E]


class HeadRMSNorm(nn.Module):
    """RMSNorm with a learned scale over each head's features, computed in float32 (the qk-norm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Causal self-attention whose query, key and value may read different streams.

    `fused` (the Dense twin) keeps the three projections in one `wqkv`, as the release names them.
    """

    def __init__(self, cfg: MUDDPythiaConfig, fused: bool) -> None:
        super().__init__()
        D = cfg.dim
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.scale = 1 / math.sqrt(cfg.head_dim)
        if fused:
            self.wqkv = nn.Linear(D, 3 * D)
        else:
            self.wq, self.wk, self.wv = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.wo = nn.Linear(D, D)
        self.fused = fused
        if cfg.use_qk_norm:
            self.q_norm = HeadRMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = HeadRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.use_qk_norm = cfg.use_qk_norm

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, pos: Positions) -> torch.Tensor:
        B, T, D = xq.shape
        if self.fused:
            q, k, v = self.wqkv(xq).split(D, dim=-1)  # 3 x [B, T, D]
        else:
            q, k, v = self.wq(xq), self.wk(xk), self.wv(xv)  # 3 x [B, T, D]
        q, k, v = (t.view(B, T, self.n_head, self.head_dim) for t in (q, k, v))  # [B, T, H, E]
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, pos.cos, pos.sin), apply_rotary(k, pos.cos, pos.sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, E]
        scores = (q @ k.transpose(-2, -1)) * self.scale  # [B, H, T, T]
        y = scores.masked_fill(~pos.causal, float("-inf")).softmax(-1) @ v  # [B, H, T, E]
        return self.wo(y.transpose(1, 2).reshape(B, T, D))  # [B, T, D]


class FeedForward(nn.Module):
    def __init__(self, cfg: MUDDPythiaConfig, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, width, bias=cfg.use_linear_bias)
        self.w2 = nn.Linear(width, cfg.dim, bias=cfg.use_linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))  # [B, T, F] -> [B, T, D]


class DynamicDense(nn.Module):
    """The dynamic-dense MLP of layer i: its output X_{i+1} [B, T, D] -> dynamic weights [B, T, K].

    The input is RMS-normalised without a scale, in its own dtype; the MLP has no biases.
    """

    def __init__(self, cfg: MUDDPythiaConfig, i: int) -> None:
        super().__init__()
        self.eps = cfg.norm_eps
        self.w1 = nn.Linear(cfg.dim, cfg.dense_hidden[i], bias=False)
        self.w2 = nn.Linear(cfg.dense_hidden[i], cfg.dense_streams[i] * (i + 2), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # [B, T, D]
        return self.w2(F.gelu(self.w1(x)))  # [B, T, hidden] -> [B, T, K]


class MixCoefficients:
    """Controller of site `dense.i`: the coefficients layer i's mix consumes, `dynamic_dense.i(x) + dense_bs.i`.

    Legend: x [B, T, D] is layer i's output X_{i+1}; the result is [B, T, K], K = C * (i + 2),
    `k = c * (i + 2) + j`. A plain callable, not a module, so the parameters it uses keep their public
    names (`dynamic_dense.i.*`, `dense_bs.i`) and appear once in the state dict. It looks the static
    weights up at call time because loading with `assign=True` replaces the Parameter objects.
    """

    def __init__(self, mlp: DynamicDense, static: nn.ParameterList, i: int) -> None:
        self.mlp, self.static, self.i = mlp, static, i

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + self.static[self.i].flatten()  # [B, T, K] + [K]

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this controller computes with (counted as the controller's by the audit)."""
        yield from self.mlp.parameters()
        yield self.static[self.i]


def mix_streams(hiddens: list[torch.Tensor], coefficients: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each stream c = sum_j coefficients[..., c, j] * hiddens[j]. hiddens: L x [B, T, D];
    coefficients: [B, T, C, L]; returns C x [B, T, D]. Summed in source order, in the hiddens' dtype."""
    streams = []
    for c in range(coefficients.shape[-2]):
        total = coefficients[..., c, 0, None] * hiddens[0]  # [B, T, D]
        for j in range(1, len(hiddens)):
            total = total + coefficients[..., c, j, None] * hiddens[j]
        streams.append(total)
    return tuple(streams)


# ------------------------------------------------------------------------------------------------ block


class Block(nn.Module):
    """One layer. `x` [B, T, D] is the residual stream (r); `qkv` the q, k, v streams of a MUDD layer
    after layer 0 (None: attention reads `x` too). The residual comes first so that hooks on blocks
    see one tensor [B, T, D] as the first argument in every family."""

    def __init__(self, cfg: MUDDPythiaConfig, i: int) -> None:
        super().__init__()
        self.multi_stream = cfg.dense and i > 0
        if self.multi_stream and cfg.sepln:
            self.attention_norms = nn.ModuleList(nn.LayerNorm(cfg.dim, eps=cfg.norm_eps) for _ in range(3))
        else:
            self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg, fused=not cfg.dense)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg, cfg.ffn_widths[i])
        self.parallel = cfg.use_parallel_residual

    def forward(self, x: torch.Tensor, pos: Positions, qkv: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        if qkv is None:
            hq = hk = hv = self.attention_norm(x)  # [B, T, D]
        else:
            norms = self.attention_norms if hasattr(self, "attention_norms") else (self.attention_norm,) * 3
            hq, hk, hv = (norm(s) for norm, s in zip(norms, qkv))  # 3 x [B, T, D]
        h = x + self.attention(hq, hk, hv, pos)
        return h + self.feed_forward(self.ffn_norm(x if self.parallel else h))  # [B, T, D]


# ------------------------------------------------------------------------------------------------ model


class MUDDPythia(nn.Module):
    """`model(input_ids [B, T])` -> logits [B, T, V]. Sites `dense.0` .. `dense.{n_layer-1}`."""

    def __init__(self, config: MUDDPythiaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.dense:
            C, L = config.dense_streams, range(2, config.n_layer + 2)
            self.dense_bs = nn.ParameterList(nn.Parameter(torch.zeros(c, l)) for c, l in zip(C, L))
            self.dynamic_dense = nn.ModuleList(DynamicDense(config, i) for i in range(config.n_layer))
            self.dense = nn.ModuleList(
                Site(MixCoefficients(self.dynamic_dense[i], self.dense_bs, i), site_spec(config, i))
                for i in range(config.n_layer)
            )
            assign_site_names(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        cos, sin = rotary_table(T, self.config.rotary_ndims, self.config.rope_base, input_ids.device)  # 2 x [T, R/2]
        pos = Positions(cos, sin, torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril())
        x = self.tok_embeddings(input_ids)  # [B, T, D]
        if not self.config.dense:
            for layer in self.layers:
                x = layer(x, pos)
            return self.output(self.norm(x))  # [B, T, V]
        hiddens, qkv = [x], None
        for i, layer in enumerate(self.layers):
            hiddens.append(layer(x, pos, qkv))  # X_{i+1}: [B, T, D]
            coefficients = self.dense[i](hiddens[-1])  # [B, T, K]
            streams = mix_streams(
                hiddens,
                coefficients.unflatten(-1, (self.config.dense_streams[i], i + 2)),  # [B, T, C, i + 2]
            )  # C x [B, T, D]
            qkv, x = streams[:-1], streams[-1]  # q, k, v for the next attention; r (the last layer mixes only r)
        return self.output(self.norm(x))  # [B, T, V]


def site_spec(config: MUDDPythiaConfig, i: int) -> SiteSpec:
    """Site `dense.i`: axes (stream C, source i + 2); one family per stream."""
    names = STREAMS if config.dense_streams[i] == len(STREAMS) else (LAST_STREAM,)
    sources = ["emb"] + [f"L{j}" for j in range(i + 1)]  # source j >= 1 is the output of layer j - 1
    return SiteSpec(
        axes=(("stream", len(names)), ("source", i + 2)),
        family="dense",
        channel_labels=tuple(f"{s}:{src}" for s in names for src in sources),
        channel_families=tuple(s for s in names for _ in sources),
    )


# ---------------------------------------------------------------------------------- loading and writing

_RUNTIME_KEYS = (".kv_cache.", "layer_cache.")  # decoding caches a release checkpoint may carry


def load_muddpythia(path: Path) -> MUDDPythia:
    """A model directory in the public format -> MUDDPythia (or its Dense twin) on CPU in float32."""
    try:
        config = MUDDPythiaConfig.from_dict(read_config(path))
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{path / 'config.json'}: {err}") from None
    state = {k: v for k, v in read_state_dict(path).items() if not any(r in k for r in _RUNTIME_KEYS)}
    if not config.dense:
        # A release model saved with dense=False still carries its unused dense parameters.
        state = {k: v for k, v in state.items() if not k.startswith(("dense_bs.", "dynamic_dense."))}
    with torch.device("meta"):  # no allocation before the weights arrive
        model = MUDDPythia(config)
    return load_strict(model, state, weights_path(path), assign=True)


def _definitions(model: MUDDPythia) -> dict[str, str]:
    """Definitions an audit report should carry: the per-stream global-mean families (none for the twin)."""
    return {"global_mean_families": FAMILY_DEFINITION} if model.config.dense else {}


FAMILY = Family(
    MODEL_TYPE,
    load=load_muddpythia,
    dense_twin=DENSE_TWINS[MODEL_TYPE],
    blocks=lambda model: list(model.layers),  # in execution order; the execution audit hooks them
    definitions=_definitions,
    coefficient_kind="dense-connection weights: the dynamic dw plus the static dense_bs, per stream and source",
)
