"""Routing agreement: how much of a top-k router's choice a replay condition keeps.

A condition's penalty says what reassigning a mixture of experts' router coefficients costs in NLL; it
does not say how much routing changed. Under replay the router is removed, and each MoE layer runs the
top-k experts of the coefficients it is fed, so which experts run under a condition follows from its
coefficients alone: compared with the experts the token's own (cached) coefficients select.

Selection repeats the routers' (`fca.engine.models.hf_moe.TopKRouting`) on the very tensors the replay
fed them, on the replay's device: the coefficients cast to the dtype the site is fed in, a float32
softmax over the tokens flattened to [N, E], `torch.topk`. A condition that gives every expert the same
value (a global mean) leaves the choice to `torch.topk`'s tie-breaking (every such token then runs the
same k experts, whichever come first); a token whose choice, its own or the condition's, was a tie is
counted as tied, so an agreement decided by tie order is not read as the coefficients'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# Per-sequence figures of `routing_agreement`, in the order reports give them.
ROUTING_FIGURES = ("same_experts", "expert_overlap", "weight_kept", "tied")


@dataclass(frozen=True)
class TopKRouter:
    """How a router chooses: the top `k` experts of a softmax over its logits, their probabilities
    renormalised to sum to 1 when `renormalize` (Mixtral always; OLMoE and Qwen by `norm_topk_prob`), and
    cast back to the logits' dtype when `weights_in_logit_dtype` (OLMoE and Qwen; Mixtral keeps float32)."""

    k: int
    renormalize: bool = True
    weights_in_logit_dtype: bool = False


def as_router(spec: int | TopKRouter) -> TopKRouter:
    """A family's router entry: k alone means renormalised top-k weights."""
    return spec if isinstance(spec, TopKRouter) else TopKRouter(int(spec))


class Choice(NamedTuple):
    """A router's choice for each token: the experts selected [..., E] (bool), whether a tie decided it
    [...], and the mixing weights [..., E] (float32, zero outside the selected experts)."""

    selected: torch.Tensor
    tied: torch.Tensor
    weights: torch.Tensor


def top_k_choice(logits: torch.Tensor, router: TopKRouter) -> Choice:
    """Router coefficients [..., E] -> the router's `Choice`, computed on the tokens flattened to [N, E],
    as the routers see them."""
    E = logits.shape[-1]
    probs = torch.softmax(logits.reshape(-1, E), dim=-1, dtype=torch.float32)  # [N, E]
    values, index = torch.topk(probs, router.k, dim=-1)  # [N, k]: the router's own call, so its tie-breaking
    selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index, True)
    best_left_out = probs.masked_fill(selected, float("-inf")).amax(-1)  # [N] (-inf when k = E: no tie)
    tied = best_left_out == values[:, -1]
    if router.renormalize:
        values = values / values.sum(-1, keepdim=True)
    if router.weights_in_logit_dtype:  # (the weights the experts are handed: rounded in a bfloat16 model)
        values = values.to(logits.dtype).float()
    weights = torch.zeros_like(probs).scatter_(-1, index, values)  # [N, E]
    return Choice(selected.reshape(logits.shape), tied.reshape(logits.shape[:-1]), weights.reshape(logits.shape))


def _agreement(own: Choice, chosen: Choice, k: int) -> dict[str, torch.Tensor]:
    """The token's own choice and a condition's, [b, T, ...] each -> the per-sequence figures [b] (float64).
    A tie on either side counts as tied: which of the tied experts ran was tie order."""
    kept = (own.selected & chosen.selected).sum(-1)  # [b, T] experts in both selections
    # the token's own routed weight still given to the same experts, at most as much as before: the share of
    # its mixture left in place (for weightings that sum to 1, one minus half their L1 distance)
    weight = torch.minimum(own.weights, chosen.weights).sum(-1) / own.weights.sum(-1)  # [b, T]
    return {
        "same_experts": (kept == k).double().mean(1),
        "expert_overlap": (kept.double() / k).mean(1),
        "weight_kept": weight.double().mean(1),
        "tied": (own.tied | chosen.tied).double().mean(1),
    }


def routing_agreement(
    own: np.ndarray, assigned: np.ndarray, router: int | TopKRouter, dtype: torch.dtype
) -> dict[str, np.ndarray]:
    """Per sequence [b]: `same_experts`, the share of tokens whose k experts under `assigned` are the set
    their own coefficients select; `expert_overlap`, the mean share of those k experts kept; `weight_kept`,
    the mean share of the token's own mixing weight left on the same experts (sum of the smaller weight of
    each expert, over the token's own total); `tied`, the share of tokens whose choice, their own or under
    `assigned`, was decided by a tie.

    own: [b, T, E] the tokens' cached coefficients; assigned: a condition's, broadcastable to [b, T, E];
    router: k, or the `TopKRouter`; dtype: the dtype the site is fed in replay (a bfloat16 model's router
    sees its values rounded)."""
    router = as_router(router)
    # (copies: cached arrays may be read-only, and torch wants writable memory)
    own_t = torch.from_numpy(np.array(own, dtype=np.float32)).to(dtype)
    given = torch.from_numpy(np.array(assigned, dtype=np.float32)).to(dtype).expand(own_t.shape)
    scores = _agreement(top_k_choice(own_t, router), top_k_choice(given, router), router.k)
    return {figure: values.numpy() for figure, values in scores.items()}


class RoutingTally:
    """Routing agreement of each condition of a run, per sequence and router, batch by batch, computed on
    the device the replay ran on from the very tensors fed to the routers (so ties fall as they fell there).

    routers: site -> k or `TopKRouter` (the family's `routers`); names: the run's conditions; n: its
    sequences. `figures()`: condition -> figure -> [n, S], S the routers in `routers`' order."""

    def __init__(self, routers: Mapping[str, int | TopKRouter], names: Sequence[str], n: int) -> None:
        self.routers = {site: as_router(spec) for site, spec in routers.items()}
        self.names, self.n = list(names), n
        self._pending: list[tuple[str, list[int], dict[str, torch.Tensor]]] = []  # (condition, rows, figures)
        self._own: dict[str, Choice] = {}
        self._index: list[int] = []
        self._dtypes: Mapping[str, torch.dtype] = {}

    def start_batch(self, index: list[int], own: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]):
        """The batch at positions `index`: own, site -> its cached coefficients [b, T, E] on the replay's
        device; dtypes, site -> the dtype replay feeds it."""
        self._index, self._dtypes = index, dtypes
        self._own = {site: top_k_choice(own[site].to(dtypes[site]), r) for site, r in self.routers.items()}

    def add_own(self, name: str) -> None:
        """Condition `name` fed the tokens' own coefficients (Correct, not replayed again)."""
        self._add(name, {site: (own, own) for site, own in self._own.items()})

    def add_fed(self, names: Sequence[str | None], fed: Mapping[str, torch.Tensor]) -> None:
        """Conditions replayed in one forward: fed, site -> [g * b, T, E] the coefficients the routers were
        fed, condition-major; names: the g conditions (None for one not reported)."""
        b = len(self._index)
        chosen = {
            site: top_k_choice(fed[site].to(self._dtypes[site]).unflatten(0, (len(names), b)), r)
            for site, r in self.routers.items()
        }  # site -> Choice of [g, b, T, ...]
        for i, name in enumerate(names):
            if name is not None:
                self._add(name, {site: (self._own[site], Choice(*(t[i] for t in chosen[site]))) for site in chosen})

    def _add(self, name: str, choices: Mapping[str, tuple[Choice, Choice]]) -> None:
        """Condition `name`'s figures on this batch; choices: site -> (the tokens' own, the condition's)."""
        per_router = [_agreement(*choices[site], r.k) for site, r in self.routers.items()]
        figures = {figure: torch.stack([r[figure] for r in per_router], dim=1) for figure in ROUTING_FIGURES}
        self._pending.append((name, self._index, figures))  # [b, S] each, still on the device

    def figures(self) -> dict[str, dict[str, np.ndarray]]:
        """condition -> figure -> [n, S] (zero at positions not scored: another shard's)."""
        out = {
            name: {figure: np.zeros((self.n, len(self.routers))) for figure in ROUTING_FIGURES} for name in self.names
        }
        for name, index, figures in self._pending:  # (one copy to the host per entry, after the run)
            for figure, values in figures.items():
                out[name][figure][index] = values.cpu().numpy()
        return out
